"""Issue #23: a client that never mis-attributes a reply, against a raw hostile server.

Each test plays one thing a broken, malicious or merely unlucky server (or network) does
to `Connection`'s lanes: bytes out of step, stale keep-alive connections, endless or
exploding replies, lenient framing, proxies, credentials, TLS, `Retry-After` dates,
closing mid-request.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import gzip
import shutil
import ssl
import time

import pytest
from deadlines import patience
from rawserver import CLOSE, SILENT, Flood, Hold, Later, RawServer, loopback_delivered, ok
from test_lanes import connection, self_signed

from canvasroute.engine import EngineResponseError, EngineTimeout, EngineUnavailable, Limits

# -- 1. never out of step ------------------------------------------------------------------------

NEXT = ok(b'{"n": 2}')
"""The second request's own reply."""


@pytest.mark.parametrize("first", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{\"ok\": 1}" + ok(b'{"stale": 1}'),  # a second reply nobody asked for
    b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{\"ok\": 1}, \"extra\": 2}",  # Content-Length shorter than sent
    b"HTTP/1.1 204 No Content\r\n\r\n" + ok(b'{"stale": 1}'),  # a 204 carrying a body
    Later(ok(), ok(b'{"stale": 1}')),  # stray bytes on the idle connection
], ids=["unsolicited-reply", "short-content-length", "204-with-body", "stray-bytes-while-idle"])
async def test_a_connection_with_unread_or_unsolicited_bytes_is_never_reused(first):
    async with RawServer(first, NEXT) as server:
        conn = connection(server.url)
        with contextlib.suppress(EngineResponseError):  # a 204 is not JSON: what matters is the next request
            await conn.request("GET", "/")
        if isinstance(first, Later):
            await server.until(lambda: server.strays == 1)  # the stray bytes are on the wire
            await loopback_delivered()
        assert (await conn.request("GET", "/")).data == {"n": 2}  # its own reply, never the leftover
        await conn.aclose()
    assert server.connections == 2


# -- 2. keep-alive expiry and stale connections --------------------------------------------------

async def test_an_idle_connection_expires_before_reuse():
    async with RawServer(ok(), ok()) as server:
        conn = connection(server.url, limits=Limits(keepalive_expiry=0.05))
        await conn.request("GET", "/")
        await asyncio.sleep(0.15)
        await conn.request("GET", "/")
        await conn.aclose()
    assert server.connections == 2 and server.hangups >= 1  # the client closed the idle one itself


async def test_a_stale_get_is_resent_once_on_a_fresh_one_without_cooling_the_replica():
    """A GET changes nothing on the server (RFC 9110 9.2.1), so a kept-alive connection closed
    before any reply byte is replaced and the GET sent once more, without spending a retry."""
    attempts = []
    async with RawServer(ok(), CLOSE, ok(b'{"n": 2}')) as server:
        conn = connection(server.url, cooldown=60)
        await conn.request("GET", "/")
        # the server hangs up the kept-alive connection as the next request arrives
        reply = await conn.request("GET", "/", on_attempt=lambda: attempts.append(1))
        assert reply.data == {"n": 2}
        assert conn._replicas[0].down_until == 0.0  # not cooled down
        await conn.aclose()
    assert server.connections == 2 and len(attempts) == 1  # one attempt: no retry was spent


@pytest.mark.parametrize("drop", [CLOSE, Hold()], ids=["at-once", "after-holding-it"])
async def test_a_post_the_server_received_then_dropped_unanswered_is_never_sent_twice(drop):
    """Issue #28, defect 10: the server reads the whole POST on a kept-alive connection (and may act on
    it), then closes without answering. With `max_retries=0` it must arrive exactly once and the
    caller gets a typed error; before, the lane took it for a stale connection and sent it again."""
    async with RawServer(ok(), drop, ok(b'{"decided": "twice"}')) as server:
        conn = connection(server.url, cooldown=60)  # retries=0
        assert (await conn.request("POST", "/v1/decide", {"n": 1})).data == {"ok": 1}
        with pytest.raises(EngineUnavailable, match="without answering") as info:
            await conn.request("POST", "/v1/decide", {"n": 2})
        assert info.value.attempts == 1
        assert "retries=" in info.value.hint
        await conn.aclose()
    assert server.bodies == [b'{"n":1}', b'{"n":2}']  # the dropped POST arrived once, and was not sent again
    assert server.connections == 1


async def test_a_dropped_post_goes_out_again_only_as_a_counted_retry():
    attempts = []
    async with RawServer(ok(), CLOSE, ok(b'{"n": 2}')) as server:
        conn = connection(server.url, retries=1)
        await conn.request("POST", "/v1/decide", {"n": 1})
        reply = await conn.request("POST", "/v1/decide", {"n": 2}, on_attempt=lambda: attempts.append(1))
        await conn.aclose()
    assert reply.data == {"n": 2} and len(attempts) == 2  # the retry was spent: the caller allowed it
    assert server.bodies == [b'{"n":1}', b'{"n":2}', b'{"n":2}']


async def test_a_fresh_connection_closed_before_answering_is_a_fault_not_resent():
    async with RawServer(CLOSE, ok()) as server:
        conn = connection(server.url, retries=0)
        with pytest.raises(EngineUnavailable, match="hung up"):
            await conn.request("GET", "/")
        await conn.aclose()
    assert server.connections == 1


# -- 3. caps on replies --------------------------------------------------------------------------

CAP = 64 * 1024


@pytest.mark.parametrize("reply", [
    Flood(b"HTTP/1.1 200 OK\r\ncontent-length: 10000000000\r\n\r\n"),
    Flood(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffff\r\n"),
    Flood(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n"),
    Flood(b"HTTP/1.1 200 OK\r\nx-big: ", b"a" * 65536),
    ok(gzip.compress(b"0" * (4 * CAP)), "content-encoding: gzip"),
], ids=["huge-content-length", "huge-chunk", "close-delimited", "endless-header", "gzip-bomb"])
async def test_replies_and_decoded_bodies_are_capped_with_a_typed_error_and_not_retried(reply):
    async with RawServer(reply, ok()) as server:
        conn = connection(server.url, retries=2, limits=Limits(max_response_bytes=CAP))
        with pytest.raises(EngineResponseError, match=f"over {CAP:,} bytes") as info:
            await conn.request("GET", "/")
        assert "max_response_bytes" in info.value.hint
        await conn.aclose()
        await server.until(lambda: server.closed == server.connections)
    assert server.connections == 1  # not retried
    if isinstance(reply, Flood):  # reading stopped near the cap (what the kernel buffers aside)
        assert server.hangups == 1 and server.flooded < 64 * CAP


async def test_the_default_cap_admits_a_large_read():
    body = b'{"rows": "' + b"x" * (4 << 20) + b'"}'
    async with RawServer(ok(body)) as server:
        conn = connection(server.url)
        assert len((await conn.request("GET", "/")).data["rows"]) == 4 << 20
        await conn.aclose()


# -- 5. strict framing ----------------------------------------------------------------------------

LENIENT = {
    "plus-length": b"HTTP/1.1 200 OK\r\ncontent-length: +9\r\n\r\n{\"ok\": 1}",
    "underscore-length": b"HTTP/1.1 200 OK\r\ncontent-length: 0_9\r\n\r\n{\"ok\": 1}",
    "hex-chunk-size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x9\r\n{\"ok\": 1}\r\n0\r\n\r\n",
    "status-2000": b"HTTP/1.1 2000 OK\r\ncontent-length: 9\r\n\r\n{\"ok\": 1}",
    "length-and-chunked": b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\ntransfer-encoding: chunked\r\n\r\n"
                          b"9\r\n{\"ok\": 1}\r\n0\r\n\r\n",
    "obs-fold": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n x-b: 2\r\ncontent-length: 9\r\n\r\n{\"ok\": 1}",
    "xchunkedx": b"HTTP/1.1 200 OK\r\ntransfer-encoding: xchunkedx\r\n\r\n9\r\n{\"ok\": 1}\r\n0\r\n\r\n",
    "gzip-chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n9\r\n{\"ok\": 1}\r\n0\r\n\r\n",
    "bare-lf": b"HTTP/1.1 200 OK\ncontent-length: 9\n\n{\"ok\": 1}",
    "101-upgrade": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n" + ok(),
    "http-2.0": b"HTTP/2.0 200 OK\r\ncontent-length: 9\r\n\r\n{\"ok\": 1}",
    "unknown-content-encoding": ok(b'{"ok": 1}', "content-encoding: br"),
}


@pytest.mark.parametrize("reply", LENIENT.values(), ids=LENIENT.keys())
async def test_lenient_framing_is_refused_at_once_and_the_connection_dropped(reply):
    async with RawServer(reply, ok(b'{"n": 2}')) as server:
        timeout = patience(10)
        conn = connection(server.url, timeout=timeout)
        started = time.monotonic()
        with pytest.raises(EngineUnavailable) as info:
            await conn.request("GET", "/")
        assert not isinstance(info.value, EngineTimeout) and time.monotonic() - started < timeout / 2
        assert (await conn.request("GET", "/")).data == {"n": 2}
        await conn.aclose()
    assert server.connections == 2


# -- 4. proxies, credentials, query strings --------------------------------------------------------

async def test_environment_proxies_are_followed_and_no_proxy_bypasses_them(monkeypatch):
    async with RawServer(ok(b'{"via": "proxy"}'), ok(b'{"via": "proxy"}')) as proxy, \
            RawServer(ok(b'{"via": "direct"}')) as direct:
        for name in ("HTTP_PROXY", "ALL_PROXY"):
            monkeypatch.delenv("HTTP_PROXY", raising=False)
            monkeypatch.setenv(name, proxy.url)
            conn = connection("http://vllm.internal:8000/base")
            assert (await conn.request("GET", "/v1/models")).data == {"via": "proxy"}
            await conn.aclose()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        conn = connection(direct.url)
        assert (await conn.request("GET", "/v1/models")).data == {"via": "direct"}
        await conn.aclose()
        assert connection("http://vllm.internal:8000", trust_env=False)._replicas[0].origin.proxy is None
        monkeypatch.setenv("HTTPS_PROXY", "http://tls-proxy:3128")  # https origins: HTTPS_PROXY, before ALL_PROXY
        assert connection("https://vllm.internal")._replicas[0].origin.proxy == "http://tls-proxy:3128"
        monkeypatch.setenv("NO_PROXY", ".internal")
        assert connection("https://vllm.internal")._replicas[0].origin.proxy is None
    assert [h.split(b"\r\n")[0] for h in proxy.heads] == [b"GET http://vllm.internal:8000/base/v1/models HTTP/1.1"] * 2
    assert direct.connections == 1


def test_a_socks_proxy_without_its_package_or_an_unknown_scheme_is_refused_clearly(monkeypatch):
    monkeypatch.setenv("ALL_PROXY", "ftp://proxy:21")
    with pytest.raises(ValueError, match="unsupported proxy scheme 'ftp'"):
        connection("http://vllm.internal:8000")


async def test_url_userinfo_is_basic_auth_and_the_query_goes_with_every_request():
    async with RawServer(EngineStatus(401), ok()) as server:
        url = server.url.replace("://", "://ann:s%40cret@") + "/p?api-version=7"
        conn = connection(url)
        with pytest.raises(Exception) as refused:
            await conn.request("GET", "/v1/models")
        assert (await conn.request("POST", "/v1/x", {"a": 1})).data == {"ok": 1}
        await conn.aclose()
    assert "s%40cret" not in str(refused.value) and "s@cret" not in str(refused.value) and "ann" not in repr(conn)
    first = server.heads[0].decode()
    assert first.startswith("GET /p/v1/models?api-version=7 HTTP/1.1\r\n")
    assert "authorization: Basic YW5uOnNAY3JldA==" in first  # base64 of ann:s@cret
    assert server.heads[1].startswith(b"POST /p/v1/x?api-version=7 HTTP/1.1\r\n")
    with pytest.raises(ValueError, match="not both"):
        connection(url, api_key="k")
    with pytest.raises(ValueError, match="fragment"):
        connection(server.url + "/#frag")


def EngineStatus(status: int) -> bytes:  # noqa: N802 - reads as a reply
    body = b'{"error": {"message": "nope"}}'
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


# -- 6. secrets, certificates, Retry-After, aclose -------------------------------------------------

def test_a_bad_api_key_or_header_never_shows_its_value():
    with pytest.raises(ValueError) as info:
        connection("http://127.0.0.1:1", api_key="sk-secret-123\nx-evil: 1")
    assert "sk-secret" not in str(info.value) and "control character" in str(info.value)


async def test_a_header_that_could_split_the_request_is_refused_without_echoing_it():
    async with RawServer(ok()) as server:
        conn = connection(server.url)
        with pytest.raises(ValueError, match="invalid HTTP header 'x-token'") as info:
            await conn.request("GET", "/", headers={"x-token": "sk-live-9\r\nx-injected: 2"})
        assert "sk-live-9" not in str(info.value)
        await conn.aclose()
    assert server.heads == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
async def test_certificates_are_not_retried_and_verify_and_client_certificates_are_configurable(tmp_path):
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with RawServer(ok(b'{"n": 1}'), ok(b'{"n": 2}'), tls=tls) as server:
        attempts = []
        backoff = patience(0.5)
        conn = connection(server.url, retries=3, backoff=backoff, cooldown=60)
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="certificate was refused") as info:
            await conn.request("GET", "/", on_attempt=lambda: attempts.append(1))
        assert len(attempts) == 1 and time.monotonic() - started < backoff  # no retry, no backoff
        assert info.value.retryable is False and "verify=" in info.value.hint
        assert "is the" not in info.value.hint
        for trusted in (connection(server.url, verify=cert), connection(server.url, verify=False)):
            assert (await trusted.request("GET", "/")).data["n"] in (1, 2)
            await trusted.aclose()
    mutual = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    mutual.load_cert_chain(cert, key)
    mutual.verify_mode = ssl.CERT_REQUIRED
    mutual.load_verify_locations(cert)  # the server trusts clients holding this certificate
    async with RawServer(ok(b'{"client": "known"}'), ok(), tls=mutual) as server:
        anonymous = connection(server.url, verify=cert)
        with pytest.raises(EngineUnavailable):
            await anonymous.request("GET", "/")
        await anonymous.aclose()
        known = connection(server.url, verify=cert, cert=(cert, key))
        assert (await known.request("GET", "/")).data == {"client": "known"}
        await known.aclose()
    with pytest.raises(ValueError, match="CA bundle"):
        connection("https://127.0.0.1:1", verify=str(tmp_path / "missing.pem"))


@pytest.mark.parametrize("header", ["date", "seconds"])
async def test_retry_after_as_an_http_date_or_seconds_is_honoured(header, monkeypatch):
    waits = []
    real_sleep = asyncio.sleep

    async def sleep(seconds):
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr("canvasroute.engine.transport._connection.asyncio.sleep", sleep)
    value = email.utils.formatdate(time.time() + 8, usegmt=True) if header == "date" else "8"
    busy = b"HTTP/1.1 503 Busy\r\nretry-after: %s\r\ncontent-length: 2\r\n\r\n{}" % value.encode()
    async with RawServer(busy, ok()) as server:
        conn = connection(server.url, retries=1)
        assert (await conn.request("GET", "/")).data == {"ok": 1}
        await conn.aclose()
    assert len(waits) == 1 and 6 <= waits[0] <= 8


async def test_aclose_is_final_even_for_a_request_in_flight():
    async with RawServer(SILENT, ok()) as server:
        timeout = patience(30)
        conn = connection(server.url, timeout=timeout, retries=3)
        task = asyncio.create_task(conn.request("GET", "/"))
        await server.until(lambda: len(server.heads) == 1)  # in flight at the (silent) server
        started = time.monotonic()
        await conn.aclose()
        with pytest.raises(EngineUnavailable) as info:
            await task
        assert time.monotonic() - started < timeout / 6 and not isinstance(info.value, EngineTimeout)
        assert conn.lanes == (0, 0)  # nothing went back into a lane
        with pytest.raises(EngineUnavailable, match="closed") as later:
            await conn.request("GET", "/")
        assert later.value.retryable is False
        await server.until(lambda: server.closed == server.connections)
    assert server.connections == 1 and server.hangups == 1 and len(server.heads) == 1


async def test_forwarded_headers_go_with_every_attempt_and_stay_in_their_own_task():
    from canvasroute.engine import forward_headers

    busy = b"HTTP/1.1 503 Busy\r\ncontent-length: 2\r\n\r\n{}"
    async with RawServer(busy, ok(), ok()) as server:
        conn = connection(server.url, retries=1)

        async def one(rid: str) -> None:
            with forward_headers({"X-Request-ID": rid}):
                await conn.request("GET", "/")

        await one("first")  # 503, then retried
        await asyncio.gather(asyncio.create_task(one("second")))
        await conn.aclose()
    ids = [line for head in server.heads for line in head.decode().split("\r\n") if line.startswith("x-request-id")]
    assert ids == ["x-request-id: first", "x-request-id: first", "x-request-id: second"]
    with pytest.raises(ValueError, match="invalid header to forward"), forward_headers({"x-request-id": "a\r\nb"}):
        pass
