"""Lanes: how `Connection` sends one HTTP request to one replica.

A lane holds one keep-alive connection per replica and serves one request at a time.
`SocketLane` opens its connections itself (`HttpConnection`: llhttp parses every byte the
server sends), which costs a fraction of httpx's CPU per request (no anyio or pool
bookkeeping) and bounds a client's reads per second. `HttpxLane` sends through an
`httpx.AsyncClient`: for a custom transport (`httpx.MockTransport` in tests) and for an
origin the environment sends through a proxy. Both raise the `LaneFault` kinds of
engine/_protocol.py, so `Connection` maps faults to engine errors the same way for either.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping

import httpx

from ._origin import Origin
from ._protocol import (
    Answer,
    BadReply,
    CertificateRefused,
    ConnectFailed,
    ConnectTimedOut,
    HttpConnection,
    ReplyTimedOut,
    ReplyTooLarge,
    StaleConnection,
    decoded,
    request_head,
)

__all__ = ["HttpxLane", "SocketLane"]

_IDENTITY = {"accept-encoding": "identity", "user-agent": "canvasroute"}


class HttpxLane:
    """A lane through an `httpx.AsyncClient` (one connection per replica), each attempt
    bounded as a whole by `deadline` (a custom transport may ignore httpx's timeouts) and
    its reply by `max_bytes` (read raw, decoded by the same capped decoder as `SocketLane`)."""

    __slots__ = ("client", "deadline", "max_bytes")

    def __init__(self, client: httpx.AsyncClient, deadline: float, max_bytes: int) -> None:
        self.client = client
        self.deadline = deadline
        self.max_bytes = max_bytes

    async def exchange(self, origin: Origin, method: str, path: str, headers: Mapping[str, str],
                       content: bytes | None) -> Answer:
        request_head(origin, method, path, headers, content)  # the same checks as a socket lane
        sent = {**_IDENTITY, **({"authorization": origin.authorization} if origin.authorization else {}), **headers}
        try:
            async with asyncio.timeout(self.deadline):
                async with self.client.stream(method, origin.url + path + origin.query, content=content,
                                              headers=sent) as resp:
                    body = await self._body(resp)
        except TimeoutError as exc:
            raise ReplyTimedOut(f"no full reply within {self.deadline:g} s") from exc
        except httpx.ConnectTimeout as exc:
            raise ConnectTimedOut(str(exc) or "connect timeout") from exc
        except httpx.TimeoutException as exc:
            raise ReplyTimedOut(str(exc) or type(exc).__name__) from exc
        except httpx.ConnectError as exc:
            if _certificate_failure(exc):
                raise CertificateRefused(str(exc)) from exc
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        except (httpx.TransportError, httpx.DecodingError) as exc:
            raise BadReply(f"{type(exc).__name__}: {exc}") from exc
        if len(body) > self.max_bytes:
            raise ReplyTooLarge(f"the reply is over {self.max_bytes:,} bytes")
        return Answer(resp.status_code, dict(resp.headers.items()), body)

    async def _body(self, resp: httpx.Response) -> bytes:
        """The decoded body, read raw up to the cap and decoded by the capped decoder."""
        if resp.is_stream_consumed:  # a transport that handed over a whole, decoded body (httpx.MockTransport)
            return resp.content
        parts, size = [], 0
        async for part in resp.aiter_raw():
            size += len(part)
            if size > self.max_bytes:
                raise ReplyTooLarge(f"the reply is over {self.max_bytes:,} bytes")
            parts.append(part)
        return decoded(b"".join(parts), resp.headers.get("content-encoding", ""), self.max_bytes)

    async def aclose(self) -> None:
        await self.client.aclose()


class SocketLane:
    """A lane of `HttpConnection`s, one keep-alive connection per replica.

    `connect_timeout` bounds opening a connection (TCP and TLS), `timeout` the exchange
    (writing the request and reading the whole reply). A connection is reused only while it
    is in step and idle for less than `keepalive_expiry` seconds; one that fails, times out,
    is cancelled, or receives bytes nobody asked for is closed. A reused connection the
    server closed before answering is replaced and the request resent once. Origins the
    environment sends through a proxy go through an `httpx.AsyncClient` for that proxy.
    """

    __slots__ = ("_conns", "_busy", "_connect_timeout", "_timeout", "_ssl", "_expiry", "_max_bytes", "_proxied",
                 "_closed")

    def __init__(self, *, connect_timeout: float, timeout: float, ssl_context: ssl.SSLContext | None,
                 keepalive_expiry: float, max_bytes: int) -> None:
        self._conns: dict[Origin, HttpConnection] = {}
        self._busy: HttpConnection | None = None
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._ssl = ssl_context
        self._expiry = keepalive_expiry
        self._max_bytes = max_bytes
        self._proxied: dict[str, HttpxLane] = {}
        self._closed = False

    async def exchange(self, origin: Origin, method: str, path: str, headers: Mapping[str, str],
                       content: bytes | None) -> Answer:
        if origin.proxy is not None:
            return await self._via_proxy(origin).exchange(origin, method, path, headers, content)
        request = request_head(origin, method, path, headers, content) + (content or b"")
        conn = self._conns.pop(origin, None)
        loop = asyncio.get_running_loop()
        if conn is not None and not conn.reusable(loop.time(), self._expiry):
            conn.close()
            conn = None
        for _ in range(2):
            conn = self._busy = conn or await self._connect(origin)
            try:
                answer = await conn.send(request, self._timeout)
            except StaleConnection:
                conn = None  # the server closed it between requests: resend once, on a new one
                continue
            finally:
                self._busy = None
            if conn.broken or self._closed:
                conn.close()
            else:
                self._conns[origin] = conn
            return answer
        raise BadReply("the server closed two connections in a row before answering")

    async def aclose(self) -> None:
        self._closed = True
        conns, self._conns = self._conns, {}
        for conn in [*conns.values(), *([self._busy] if self._busy else [])]:
            conn.close()
        proxied, self._proxied = self._proxied, {}
        for lane in proxied.values():
            await lane.aclose()

    async def _connect(self, origin: Origin) -> HttpConnection:
        loop = asyncio.get_running_loop()
        conn = HttpConnection(self._max_bytes)
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(lambda: conn, origin.host, origin.port,
                                             ssl=self._tls() if origin.tls else None)
        except TimeoutError as exc:
            raise ConnectTimedOut(f"no connection within {self._connect_timeout:g} s") from exc
        except ssl.SSLCertVerificationError as exc:
            raise CertificateRefused(f"the server's certificate was refused: {exc.verify_message or exc}") from exc
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    def _via_proxy(self, origin: Origin) -> HttpxLane:
        assert origin.proxy is not None
        lane = self._proxied.get(origin.proxy)
        if lane is None:
            timeout = httpx.Timeout(self._timeout, connect=self._connect_timeout)
            client = httpx.AsyncClient(proxy=origin.proxy, trust_env=False, timeout=timeout,
                                       verify=self._tls() if origin.tls else True)
            lane = self._proxied[origin.proxy] = HttpxLane(client, self._timeout + self._connect_timeout,
                                                           self._max_bytes)
        return lane


def _certificate_failure(exc: BaseException) -> bool:
    """Whether a connect error was a refused certificate (httpx wraps the `ssl` error)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False

