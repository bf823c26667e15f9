"""`Connection` over real sockets (engine/transport/_connection.py `SocketLane`, llhttp parsing): HTTP/1.1
framing, keep-alive reuse, connections closed by either side, cancellation and timeouts,
against a raw TCP server that answers each request with scripted bytes (tests/rawserver.py).
The hostile cases (out of step, caps, proxies, lenient framing, TLS) are in test_lanes_hostile.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import ssl
import subprocess

import httpx
import pytest
from rawserver import CLOSE, SILENT, RawServer, closes, ok

from canvasroute.engine import (
    Connection,
    EngineTimeout,
    EngineUnavailable,
    Limits,
    Retries,
    Timeout,
    forward_headers,
)


def connection(url: str, *, retries: int = 0, backoff: float = 0.0, cooldown: float = 0.0, **kwargs) -> Connection:
    """A `Connection` that sends each request once and retries at once (unless told otherwise)."""
    return Connection(url, retries=Retries(max_retries=retries, backoff=backoff, replica_cooldown=cooldown), **kwargs)


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
        await conn.aclose()
        retrying = connection(server.url, retries=1)
        server.replies[:0] = [reply]
        assert (await retrying.request("GET", "/")).data == {"ok": 1}
        await retrying.aclose()


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
        conn = connection(server.url, timeout=Timeout(read=0.2, connect=1.0))
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


async def test_a_connections_own_headers_go_with_every_request_and_cannot_touch_the_framing():
    async with RawServer(ok(), ok()) as server:
        conn = connection(server.url, headers={"X-Team": "triage", "X-Tenant": "eu"})
        await conn.request("GET", "/")
        await conn.request("GET", "/", headers={"x-team": "billing"})  # a request's own header comes last
        await conn.aclose()
    first, second = (h.decode().lower() for h in server.heads)
    assert "x-team: triage\r\n" in first and "x-tenant: eu\r\n" in first
    assert second.count("x-team:") == 1 and "x-team: billing\r\n" in second and "x-tenant: eu\r\n" in second
    for forged in ({"Content-Length": "0"}, {"host": "elsewhere"}, {"x-a": "1\r\nx-b: 2"}):
        with pytest.raises(ValueError, match=r"content-length|host|invalid header"):
            Connection("http://127.0.0.1:1", headers=forged)
    with pytest.raises(ValueError, match="either api_key or an authorization header"):
        Connection("http://127.0.0.1:1", api_key="k", headers={"Authorization": "Bearer j"})
    assert repr(Connection("http://a.test")) == "Connection('http://a.test')"
    assert repr(Connection(["http://a.test", "http://b.test"], timeout=9, retries=0)) == (
        "Connection(['http://a.test', 'http://b.test'], timeout=Timeout(read=9.0, connect=5.0), "
        "retries=Retries(max_retries=0, backoff=0.2, replica_cooldown=5.0))")
    with pytest.raises(ValueError, match="retries must be"):
        Connection("http://a.test", retries=True)
    with pytest.raises(ValueError, match="Limits: max_concurrency"):
        Limits(max_concurrency=0)


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


CHAT = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "billing"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()


async def test_openai_clients_take_the_connections_settings():
    """`openai_options()`: langchain-openai's `ChatOpenAI` and the `openai` SDK reach the server
    with the connection's URL (its userinfo as the one Authorization header, its query on every
    request), headers, timeouts, retries, and the forwarded headers of the block they run in."""
    import openai
    from langchain_openai import ChatOpenAI

    async with RawServer(ok(CHAT), ok(CHAT)) as server:
        url = server.url.replace("http://", "http://ann:s3cret@") + "/v1?api-version=2"
        conn = Connection(url, headers={"X-Team": "triage"}, timeout=Timeout(read=7, connect=2), retries=1,
                          limits=Limits(max_concurrency=3))
        options = conn.openai_options()
        assert options["base_url"] == server.url + "/v1" and options["max_retries"] == 1
        assert options["timeout"] == httpx.Timeout(7, connect=2) and options["default_query"] == {"api-version": "2"}
        assert isinstance(options["http_client"], httpx.Client)
        assert isinstance(options["http_async_client"], httpx.AsyncClient)
        with forward_headers({"x-request-id": "req-7"}):
            reply = await ChatOpenAI(model="m", **options).ainvoke("hi")
        sdk = openai.AsyncOpenAI(**conn.openai_options(client="async"))
        done = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await sdk.close()
    assert reply.content == "billing" and done.choices[0].message.content == "billing"
    assert len(server.heads) == 2
    for head in server.heads:
        text = head.decode().lower()
        assert text.startswith("post /v1/chat/completions?api-version=2 http/1.1\r\n")
        assert text.count("authorization:") == 1 and "authorization: basic " in text  # userinfo replaced the key
        assert "x-team: triage" in text
    assert b"x-request-id: req-7" in server.heads[0].lower() and b"x-request-id" not in server.heads[1].lower()
    keyed = Connection("http://127.0.0.1:1", api_key="k").openai_options(client="sync")
    assert keyed["api_key"] == "k" and isinstance(keyed["http_client"], httpx.Client)
    assert "api_key" not in Connection("http://127.0.0.1:1").openai_options()  # the client's own default applies
    with pytest.raises(ValueError, match="one base URL"):
        Connection(["http://a.test", "http://b.test"]).openai_options()

