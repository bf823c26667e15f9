"""`Connection` over real sockets (engine/_lanes.py `SocketLane`, llhttp parsing): HTTP/1.1
framing, keep-alive reuse, connections closed by either side, cancellation and timeouts,
against a raw TCP server that answers each request with scripted bytes (tests/rawserver.py).
The hostile cases (out of step, caps, proxies, lenient framing, TLS) are in test_lanes_hostile.py."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import ssl
import subprocess

import pytest
from rawserver import CLOSE, SILENT, RawServer, closes, ok

from canvasroute.engine import Connection, EngineTimeout, EngineUnavailable


def connection(url: str, **kwargs) -> Connection:
    return Connection(url, **{"backoff": 0, "replica_cooldown": 0, "max_retries": 0, **kwargs})


async def test_keep_alive_reuses_one_connection_and_sends_a_json_post():
    async with RawServer(ok(), ok(b'{"n": 2}', "x-request-id: r2")) as server:
        conn = connection(server.url + "/prefix/", api_key="k")
        assert (await conn.request("POST", "/v1/x", {"a": "é"}, headers={"x-session-id": "s"})).data == {"ok": 1}
        reply = await conn.request("GET", "/v1/models")
        assert reply.data == {"n": 2} and reply.headers["x-request-id"] == "r2"
        await conn.aclose()
    assert server.connections == 1
    post = server.heads[0].decode().lower()
    assert post.startswith("post /prefix/v1/x http/1.1\r\n")
    for header in ("host: 127.0.0.1:", "authorization: bearer k", "content-type: application/json",
                   "x-session-id: s", f"content-length: {len(server.bodies[0])}"):
        assert header in post
    assert server.bodies[0] == '{"a":"é"}'.encode()
    get = server.heads[1]
    assert get.startswith(b"GET /prefix/v1/models HTTP/1.1\r\n") and b"content-length" not in get


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"3;ext=1\r\n{\"o\r\n5\r\nk\": 1\r\n1\r\n}\r\n0\r\nx-trailer: t\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" + ok(),
    ok(gzip.compress(b'{"ok": 1}'), "content-encoding: gzip"),
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 9\r\n\r\n{\"ok\": 1}",
    b"HTTP/1.0 200 OK\r\n\r\n{\"ok\": 1}",
], ids=["chunked", "interim-100", "gzip", "connection-close", "until-eof"])
async def test_reply_framings(reply):
    async with RawServer(reply, ok()) as server:
        conn = connection(server.url)
        assert (await conn.request("GET", "/")).data == {"ok": 1}
        assert (await conn.request("GET", "/")).data == {"ok": 1}
        await conn.aclose()
    assert server.connections == (2 if closes(reply) else 1)


@pytest.mark.parametrize("reply", [CLOSE, b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                                   b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 50\r\n\r\n{}"],
                         ids=["hang-up", "status-line", "header-line", "truncated"])
async def test_broken_replies_are_unavailable_and_retried_on_a_new_connection(reply):
    async with RawServer(reply, ok()) as server:
        conn = connection(server.url)
        with pytest.raises(EngineUnavailable) as info:
            await conn.request("GET", "/")
        assert not isinstance(info.value, EngineTimeout)
        conn.max_retries = 1
        server.replies[:0] = [reply]
        assert (await conn.request("GET", "/")).data == {"ok": 1}
        await conn.aclose()


async def test_a_connection_the_server_closed_while_idle_is_replaced():
    async with RawServer(ok(), ok(b'{"ok": 1}', "connection: close"), ok()) as server:
        conn = connection(server.url)
        await conn.request("GET", "/")
        await conn.request("GET", "/")  # the server closes after this reply
        await server.until(lambda: server.closed == 1)
        assert (await conn.request("GET", "/")).data == {"ok": 1}
        await conn.aclose()
    assert server.connections == 2


async def test_read_timeout_and_cancellation_close_the_connection():
    async with RawServer(SILENT, SILENT, ok()) as server:
        conn = connection(server.url, timeout=0.2, connect_timeout=1.0)
        with pytest.raises(EngineTimeout, match="ReplyTimedOut"):
            await conn.request("GET", "/")
        task = asyncio.create_task(conn.request("GET", "/"))
        await server.until(lambda: len(server.heads) == 2)  # the request is at the (silent) server
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await conn.request("GET", "/")).data == {"ok": 1}
        assert conn.in_flight == 0
        await conn.aclose()
    assert server.connections == 3 and server.hangups == 2


async def test_connection_refused_is_unavailable():
    async with RawServer() as server:
        url = server.url
    with pytest.raises(EngineUnavailable, match="ConnectFailed"):
        await connection(url).request("GET", "/")


async def test_a_header_that_could_split_the_request_is_refused():
    async with RawServer(ok()) as server:
        conn = connection(server.url)
        with pytest.raises(ValueError, match="invalid HTTP header"):
            await conn.request("GET", "/", headers={"x-a": "1\r\nx-injected: 2"})
        assert server.heads == []
        await conn.aclose()


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made by the openssl CLI."""
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
async def test_https_verifies_the_server_and_reuses_the_tls_connection(tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with RawServer(ok(), ok(b'{"n": 2}'), tls=tls) as server:
        untrusted = connection(server.url)  # the default trust store does not know this certificate
        with pytest.raises(EngineUnavailable, match="certificate was refused"):
            await untrusted.request("GET", "/v1/models")
        await untrusted.aclose()
        monkeypatch.setenv("SSL_CERT_FILE", cert)  # trusted the way httpx trusts a private CA
        conn = connection(server.url)
        assert (await conn.request("GET", "/v1/models")).data == {"ok": 1}
        assert (await conn.request("POST", "/v1/x", {"a": 1})).data == {"n": 2}
        assert server.connections == 1  # one kept-alive TLS connection (the refused handshake never got one)
        assert server.heads[0].startswith(b"GET /v1/models HTTP/1.1\r\n")
        await conn.aclose()
