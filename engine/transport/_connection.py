"""`Connection`: HTTP to a service on one or more replicas, shared by every canvasroute client.

`VLLMServerEngine` (its reads), `SystemOneDecisionModel` (`/v1/systemone`) and the escalation
clients (`Connection.openai_options()`: the same settings for an `openai` or langchain-openai
client) take one: the model/provider split of pydantic-ai. This module is the whole way of a
request, from the JSON body out to the JSON reply in, so a read runs through it alone:

- **Connection**: replicas with cool-down, round-robin or rendezvous routing, retries with
  exponential backoff and jitter (408, 429, 5xx, 529, connection errors, timeouts),
  `Retry-After` (capped), a whole-attempt deadline, `traceparent` and `forward_headers`
  injection, and the mapping of HTTP statuses to the errors in `canvasroute.engine.errors`.
- **Lanes**: each request borrows one (one keep-alive connection per replica). `SocketLane`
  opens its connections itself: an `HttpConnection` is an `asyncio.Protocol` whose every
  received byte llhttp (`httptools`) parses, a fraction of httpx's CPU per request.
  `HttpxLane` sends through an `httpx.AsyncClient`, for a custom transport
  (`httpx.MockTransport` in tests) and for an origin the environment sends through a proxy.
- **Bodies**: JSON both ways (orjson when installed), a refusal's message, `Retry-After`.

A request is sent again only when the server cannot have acted on it (the kept-alive
connection was found closed as the request went out; or a GET, which changes nothing), or
by a retry that `Retries.max_retries` counts: with `max_retries=0` a POST the server received
is never sent twice. `aclose()` is final. What a connection is told (`Timeout`, `Limits`,
`Retries`) lives in `_config.py`; where it goes (URLs, proxies, TLS) in `_origin.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import ssl
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from types import MappingProxyType
from typing import Any, Literal, TypeVar, cast

import httptools
import httpx
from opentelemetry import context as otel_context
from opentelemetry import propagate

from ..errors import (
    CanvasRouteError,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
)
from ._config import Limits, Retries, Timeout
from ._origin import Cert, Origin, Verify, check_proxy, shown, tls_context

try:  # optional: decodes the large read responses ~3x faster than the json module
    from orjson import OPT_NON_STR_KEYS
    from orjson import dumps as _fast_dumps
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_dumps = _fast_loads = None  # type: ignore[assignment]

__all__ = ["Answer", "Connection", "HttpxLane", "Reply", "SocketLane", "forward_headers"]

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504, 529})
"""Transient statuses. 501 (the server cannot do this at all) is not among them."""
OVERLOAD_STATUS = frozenset({429, 503, 529})
MAX_RETRY_AFTER = 30.0
"""Longest `Retry-After` honoured, in seconds."""
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
"""Methods a lane sends (HEAD is not among them: llhttp cannot be told a reply has no body)."""

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_PATH = re.compile(r"/[!-~]*")
_FIXED_HEADERS = "user-agent: canvasroute\r\naccept: */*\r\naccept-encoding: identity\r\n"
_IDENTITY = {"accept-encoding": "identity", "user-agent": "canvasroute"}
_T = TypeVar("_T")
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Headers a lane writes itself: a connection's `headers=` may not set them."""


# -- forwarded headers -------------------------------------------------------------------

_FORWARDED: ContextVar[Mapping[str, str]] = ContextVar("canvasroute_forwarded_headers", default=MappingProxyType({}))


@contextmanager
def forward_headers(headers: Mapping[str, str]) -> Iterator[None]:
    """Send `headers` with every HTTP request an engine or client makes inside the block,
    in this task and the tasks it starts (a context variable). Nested blocks add to the outer.

    `canvasroute serve` uses it to pass the caller's `X-Request-ID` to vLLM on every read.

    Example:
        ```python
        with forward_headers({"x-request-id": "req-42"}):
            await model.adecide(state, questions)
        ```
    """
    _check_headers(headers, "header to forward")
    token = _FORWARDED.set({**_FORWARDED.get(), **{k.lower(): v for k, v in headers.items()}})
    try:
        yield
    finally:
        _FORWARDED.reset(token)


def _check_headers(headers: Mapping[str, str], what: str) -> None:
    for name, value in headers.items():
        if not (isinstance(name, str) and isinstance(value, str)
                and _TOKEN.fullmatch(name) and _VALUE.fullmatch(value)):
            raise ValueError(f"invalid {what} {str(name)[:100]!r}: a name must be a token and a value may hold no "
                             "control character")


# -- faults a lane raises ----------------------------------------------------------------


class LaneFault(Exception):
    """A request that got no usable reply; `Connection` maps each kind to an engine error."""


class ConnectFailed(LaneFault):
    """No connection could be opened (refused, unreachable, DNS, TLS handshake)."""


class ConnectTimedOut(LaneFault):
    """No connection within the connect timeout."""


class CertificateRefused(ConnectFailed):
    """The server's TLS certificate failed verification: not transient, never retried."""


class ReplyTimedOut(LaneFault):
    """The whole reply did not arrive within the timeout."""


class BadReply(LaneFault):
    """The server broke the protocol or hung up mid-reply."""


class StaleConnection(BadReply):
    """A kept-alive connection was found closed as the request went out: the server cannot
    have received it, so it is sent again once, on a new connection."""


class Unanswered(BadReply):
    """A kept-alive connection was closed after the request was written, before any byte of a
    reply: the server may have received it, so only a GET is sent again."""


class ReplyTooLarge(LaneFault):
    """The reply, or its decoded body, is over the cap: not transient, never retried."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP response: status, headers (names in lower case, repeats joined by ", "), body."""

    status: int
    headers: Mapping[str, str]
    content: bytes


# -- one HTTP/1.1 connection, parsed by llhttp ---------------------------------------------


def request_head(origin: Origin, method: str, path: str, headers: Mapping[str, str],
                 content: bytes | None, *, absolute: bool = False) -> bytes:
    """Request line and head from validated parts (`ValueError` for a part that could split
    the head; the message names the header, never its value)."""
    if method not in METHODS:
        raise ValueError(f"unsupported HTTP method {method[:20]!r}; use one of {sorted(METHODS)}")
    if not _PATH.fullmatch(path):
        raise ValueError(f"a request path must start with / and hold visible ASCII only: {path[:100]!r}")
    target = f"{origin.base_path}{path}{origin.query}"
    if absolute:
        target = f"{'https' if origin.tls else 'http'}://{origin.host_header}{target}"
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {origin.host_header}\r\n{_FIXED_HEADERS}"]
    if origin.authorization is not None:
        lines.append(f"authorization: {origin.authorization}\r\n")
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or _CTL.search(value):
            raise ValueError(f"invalid HTTP header {name[:100]!r}: a name must be a token and a value may hold "
                             "no control character")
        lines.append(f"{name}: {value}\r\n")
    if content is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(content or b'')}\r\n")
    lines.append("\r\n")
    try:
        return "".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError("HTTP header values must be latin-1 text") from None


class _Stray(Exception):
    """Bytes after the reply: stop parsing them."""


class HttpConnection(asyncio.Protocol):
    """One HTTP/1.1 client connection, one exchange at a time (`send`), reusable while `reusable()`.

    It writes a request head built from validated parts (`request_head`) and hands what the
    server sends to llhttp, Node.js's parser, which refuses lenient framing (signed or
    underscored lengths, `0x` chunk sizes, bad status lines, obs-folds, Content-Length beside
    chunked, bare LF). On top of llhttp it refuses what a client must not accept: a reply
    nobody asked for (bytes while idle, or after the reply: the connection is then never
    reused, so it cannot fall out of step), a transfer coding other than `chunked`, a `101`
    upgrade, an HTTP version other than 1.0/1.1, and a reply (or its decoded body) over
    `max_bytes`, which stops reading at once.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.transport: asyncio.Transport | None = None
        self.broken = False
        """Never reuse: the server closed, broke the protocol, or sent bytes nobody asked for."""
        self.idle_since = 0.0
        self.exchanges = 0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Answer] | None = None
        self._received = 0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._head_done = self._interim = False

    def reusable(self, now: float, expiry: float) -> bool:
        """Open, in step, and idle for less than `expiry` seconds."""
        return not self.broken and self.transport is not None and not self.transport.is_closing() and (
            now - self.idle_since < expiry)

    def close(self) -> None:
        self.broken = True
        if self.transport is not None:
            self.transport.close()

    async def send(self, request: bytes,
                   timeout: float) -> Answer:  # noqa: ASYNC109 - on the deadline the reply fails as ReplyTimedOut
        """Write one request and wait for its whole reply (`LaneFault` subclasses on failure;
        the connection is closed on any failure or cancellation). `StaleConnection` means the
        request never left: the write failed at once. (A kept-alive connection found closing
        is not sent on at all: `reusable()`.)"""
        transport = self.transport
        assert transport is not None and self._waiter is None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Answer] = loop.create_future()
        self._waiter = waiter
        self._received, self._headers, self._body = 0, {}, []
        self._head_done = self._interim = False
        self.exchanges += 1
        timer = loop.call_later(timeout, self._fail, ReplyTimedOut(f"no full reply within {timeout:g} s"))
        try:
            transport.write(request)
            if transport.is_closing():  # the write failed at once (a reset): no byte reached the server
                raise StaleConnection("the connection broke as the request was written")
            return await waiter
        except BaseException:
            self.close()
            raise
        finally:
            timer.cancel()
            self._waiter = None
            self.idle_since = loop.time()

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # nobody asked: this connection is out of step
            self.close()
            return
        self._received += len(data)
        if self._received > self.max_bytes:
            self._fail(ReplyTooLarge(f"the reply is over {self.max_bytes:,} bytes"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadReply("the server switched protocols (101) without being asked"))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, LaneFault) else BadReply(f"unreadable reply: {exc}"))
        except httptools.HttpParserError as exc:
            self._fail(BadReply(f"not a valid HTTP/1.1 reply: {exc}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost decides what the reply was

    def connection_lost(self, exc: Exception | None) -> None:
        self.broken = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._head_done and not self._interim and self._until_eof():
            self._complete()  # a close-delimited body ends here
        elif self._received == 0 and self.exchanges > 1:
            waiter.set_exception(Unanswered("the server closed the kept-alive connection without answering"))
        else:
            waiter.set_exception(BadReply(f"the server hung up mid-reply ({exc or 'end of stream'})"))

    # -- llhttp callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            raise _Stray
        self._headers, self._body, self._head_done = {}, [], False

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        self._head_done = True
        status = self._parser.get_status_code()
        if self._parser.get_http_version() not in ("1.1", "1.0"):
            raise BadReply(f"not an HTTP/1 reply (HTTP/{self._parser.get_http_version()})")
        coding = self._headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            raise BadReply(f"unsupported transfer-encoding {coding[:60]!r}")
        self._interim = 100 <= status < 200

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._interim:  # 100 Continue, 103 Early Hints: the reply follows
            self._interim = False
            return
        self._complete()

    # -- internals ----------------------------------------------------------------------

    def _until_eof(self) -> bool:
        status = self._parser.get_status_code()
        return ("content-length" not in self._headers and "transfer-encoding" not in self._headers
                and status not in (204, 304))

    def _complete(self) -> None:
        waiter = self._waiter
        assert waiter is not None
        if not self._parser.should_keep_alive():
            self.broken = True  # closed once this reply is taken (Connection: close, HTTP/1.0)
        try:
            body = decoded(b"".join(self._body), self._headers.get("content-encoding", ""), self.max_bytes)
        except LaneFault as exc:
            waiter.set_exception(exc)
            return
        waiter.set_result(Answer(self._parser.get_status_code(), self._headers, body))
        if self.broken:
            self.close()

    def _fail(self, exc: LaneFault) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()


def decoded(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """The body without its content coding (identity is asked for; gzip and deflate are
    undone for a server that compresses anyway, never past `max_bytes`)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS if body[:1] == b"\x78" else -zlib.MAX_WBITS
    else:
        raise BadReply(f"unsupported content-encoding {encoding[:60]!r}")
    inflate = zlib.decompressobj(wbits)
    try:
        out = inflate.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise BadReply(f"the {encoding} body does not decode: {exc}") from None
    if len(out) > max_bytes:
        raise ReplyTooLarge(f"the {encoding} body decodes to over {max_bytes:,} bytes")
    if not inflate.eof:
        raise BadReply(f"the {encoding} body is truncated")
    return out


# -- lanes ---------------------------------------------------------------------------------


class SocketLane:
    """A lane of `HttpConnection`s, one keep-alive connection per replica.

    `timeout.connect` bounds opening a connection (TCP and TLS), `timeout.read` the exchange
    (writing the request and reading the whole reply). A connection is reused only while it
    is in step and idle for less than `keepalive_expiry` seconds; one that fails, times out,
    is cancelled, or receives bytes nobody asked for is closed. A request on a kept-alive
    connection the server closed is sent again once, on a new one, only if the server cannot
    have acted on it (`StaleConnection`; or a GET). Origins the environment sends through a
    proxy go through an `httpx.AsyncClient` for that proxy.
    """

    __slots__ = ("_busy", "_closed", "_conns", "_expiry", "_max_bytes", "_proxied", "_ssl", "_timeout")

    def __init__(self, *, timeout: Timeout, ssl_context: ssl.SSLContext | None, keepalive_expiry: float,
                 max_bytes: int) -> None:
        self._conns: dict[Origin, HttpConnection] = {}
        self._busy: HttpConnection | None = None
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
                answer = await conn.send(request, self._timeout.read)
            except StaleConnection:
                conn = None  # the request never reached the server: once more, on a new connection
                continue
            except Unanswered:
                if method != "GET":  # the server may have acted on it: only a counted retry sends it again
                    raise
                conn = None
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
            async with asyncio.timeout(self._timeout.connect):
                await loop.create_connection(lambda: conn, origin.host, origin.port,
                                             ssl=self._tls() if origin.tls else None)
        except TimeoutError as exc:
            raise ConnectTimedOut(f"no connection within {self._timeout.connect:g} s") from exc
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
            timeout = httpx.Timeout(self._timeout.read, connect=self._timeout.connect)
            client = httpx.AsyncClient(proxy=origin.proxy, trust_env=False, timeout=timeout,
                                       verify=self._tls() if origin.tls else True)
            lane = self._proxied[origin.proxy] = HttpxLane(client, self._timeout.total, self._max_bytes)
        return lane


class HttpxLane:
    """A lane through an `httpx.AsyncClient` (one connection per replica), each attempt
    bounded as a whole by `deadline` (a custom transport may ignore httpx's timeouts) and
    its reply by `max_bytes` (read raw, decoded by the same capped decoder as `SocketLane`).
    httpx never sends a request twice by itself."""

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


def _certificate_failure(exc: BaseException) -> bool:
    """Whether a connect error was a refused certificate (httpx wraps the `ssl` error)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


Lane = HttpxLane | SocketLane


# -- bodies --------------------------------------------------------------------------------


def dumps(body: Any) -> bytes:
    """Compact UTF-8 JSON of a request body (orjson when installed)."""
    if _fast_dumps is not None:
        return _fast_dumps(body, option=OPT_NON_STR_KEYS)  # int keys become strings, as with json
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def loads(content: bytes) -> Any:
    """JSON from bytes: orjson when installed, the json module otherwise (and for the
    NaN/Infinity literals orjson refuses, so both decode exactly the same documents)."""
    if _fast_loads is not None:
        try:
            return _fast_loads(content)
        except ValueError:
            pass
    return json.loads(content)


def _text(resp: Answer) -> str:
    """The body as text (UTF-8, undecodable bytes replaced)."""
    return resp.content.decode("utf-8", "replace")


def error_message(resp: Answer) -> str:
    """The server's error message: OpenAI's `{"error": {"message"}}`, `message`, `detail`, or the text."""
    try:
        body = loads(resp.content)
    except ValueError:
        return _text(resp)[:500] or f"HTTP {resp.status}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        for value in (err, body.get("message"), body.get("detail")):
            if isinstance(value, str):
                return value
    return json.dumps(body)[:500]


def retry_after(resp: Answer) -> float:
    """Seconds the server asked us to wait, as a number or an HTTP date (capped at
    `MAX_RETRY_AFTER`); 0 when it did not say or said something unreadable."""
    raw = (resp.headers.get("retry-after") or "").strip()
    if not raw:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return 0.0
    return 0.0 if math.isnan(seconds) else min(MAX_RETRY_AFTER, max(0.0, seconds))


# -- the connection ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """A 2xx JSON answer and where it came from."""

    data: Any
    url: str
    """Replica base URL that answered."""
    headers: Mapping[str, str]
    """Response headers, names in lower case."""


class _Lanes:
    """Per event loop: the bound on requests in flight and the idle lanes.

    Each request borrows one lane (one keep-alive connection per replica) instead of
    sharing one big pool, so finding a connection costs O(1) whatever the concurrency.
    Lanes are reused last-in first-out, so a light load keeps few connections open.
    """

    __slots__ = ("idle", "open", "slots")

    def __init__(self, max_concurrency: int) -> None:
        self.slots = asyncio.Semaphore(max_concurrency)
        self.idle: list[Lane] = []
        self.open: list[Lane] = []


class _Replica:
    """One base URL and when it may be tried again after a connection failure."""

    __slots__ = ("down_until", "origin", "url")

    def __init__(self, url: str, trust_env: bool) -> None:
        self.origin = Origin.parse(url.rstrip("/"), trust_env=trust_env)
        self.url = self.origin.url
        """The base URL as messages show it (no userinfo, no query)."""
        self.down_until = 0.0


_TIMEOUT, _LIMITS, _RETRIES = Timeout(), Limits(), Retries()


class Connection:
    """HTTP to one service served by one or more replicas, with retries and typed errors.

    Args:
        url: the service root (an OpenAI-style base ending in `/v1` names the same root), or
            several replica roots; requests go round-robin over those
            not cooling down, or, with an `affinity` key, to the key's rendezvous replica
            (`rendezvous`). A URL's userinfo (`http://user:pass@host`) is sent as Basic auth,
            its query string with every request.
        api_key: sent as `Authorization: Bearer <key>` (not together with URL userinfo).
        headers: sent with every request (after `forward_headers`, before a request's own).
        timeout: a `Timeout`, or seconds for the reply (`Timeout(read=...)`).
        limits: a `Limits`: requests in flight, keep-alive expiry, reply size cap.
        retries: a `Retries`, or the number of retries after the first attempt.
        verify: TLS verification: True (certifi, or `SSL_CERT_FILE`/`SSL_CERT_DIR`), False
            (none), a CA bundle file or folder, or an `ssl.SSLContext`.
        cert: a client certificate: a PEM file holding certificate and key, or
            (certificate file, key file), or (certificate file, key file, password).
        trust_env: follow `HTTP(S)_PROXY`, `ALL_PROXY` and `NO_PROXY` (a proxied replica is
            reached through httpx).
        transport: an `httpx.AsyncBaseTransport` (e.g. `httpx.MockTransport` in tests):
            every request then goes through httpx and that transport.

    A connection is shared by whoever holds it (an engine and a client may share one);
    `aclose()`, by any of them, closes it for all.

    Example:
        ```python
        conn = Connection("http://127.0.0.1:8000", api_key="k", timeout=120, retries=Retries(max_retries=1))
        engine = VLLMServerEngine(conn)
        chat = ChatOpenAI(model="gpt-4.1", **Connection("https://api.openai.com/v1", api_key="k").openai_options())
        ```
    """

    def __init__(self, url: str | Sequence[str], *, api_key: str | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float | Timeout = _TIMEOUT,
                 limits: Limits = _LIMITS, retries: int | Retries = _RETRIES, verify: Verify = True,
                 cert: Cert | None = None, trust_env: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("a connection needs at least one base URL")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"base URLs must be http(s) URLs, got {shown(u) if isinstance(u, str) else u!r}")
        self.timeout = _timeout(timeout)
        """How long one attempt may take."""
        self.limits = _value(limits, Limits, "limits")
        """Requests in flight, keep-alive expiry, reply size cap."""
        self.retries = _retries(retries)
        """What follows a transient fault."""
        if api_key is not None and (not isinstance(api_key, str) or any(c < " " or c == "\x7f" for c in api_key)):
            raise ValueError("api_key must be text without control characters (a newline?); the key is not shown")
        static = {k.lower(): v for k, v in (headers or {}).items()}
        _check_headers(static, "header")
        if own := sorted(_OWN_HEADERS & static.keys()):
            raise ValueError(f"headers= may not set {', '.join(own)}: the connection writes them itself")
        if api_key and "authorization" in static:
            raise ValueError("pass either api_key or an authorization header, not both")
        self._replicas = [_Replica(u, trust_env and transport is None) for u in urls]
        if (api_key or "authorization" in static) and any(r.origin.authorization for r in self._replicas):
            raise ValueError("pass either api_key or credentials in the URL (user:password@), not both")
        for replica in self._replicas:
            if replica.origin.proxy is not None:
                check_proxy(replica.origin.proxy)
        self.headers: Mapping[str, str] = MappingProxyType(static)
        """Headers sent with every request (the key is not among them)."""
        self.verify, self.cert, self.trust_env, self.transport = verify, cert, trust_env, transport
        self._api_key = api_key or None
        self._headers = {**static, **({"authorization": f"Bearer {api_key}"} if api_key else {})}
        self._deadline = self.timeout.total
        self._next = 0
        self._loops: dict[asyncio.AbstractEventLoop, _Lanes] = {}
        needs_tls = any(r.origin.tls for r in self._replicas)
        # one TLS context for every lane (each costs ~20 ms), built now: a bad CA file fails here
        self._ssl = tls_context(verify, cert) if needs_tls or verify is not True or cert else None
        self._closed = False
        self._lane_factory: Callable[[], Any] | None = None  # `canvasroute bench` measures other clients here

    def __repr__(self) -> str:
        urls = self.urls[0] if len(self.urls) == 1 else list(self.urls)
        shown_config = [f"{name}={value!r}" for name, value, default in (
            ("timeout", self.timeout, _TIMEOUT), ("limits", self.limits, _LIMITS), ("retries", self.retries, _RETRIES))
            if value != default]
        return f"Connection({', '.join([repr(urls), *shown_config])})"

    @property
    def urls(self) -> tuple[str, ...]:
        """The replica base URLs (as messages show them: no userinfo, no query)."""
        return tuple(r.url for r in self._replicas)

    @property
    def in_flight(self) -> int:
        """Requests holding a slot on the current event loop (0 when idle)."""
        lanes = self._loops.get(asyncio.get_running_loop())
        return self.limits.max_concurrency - lanes.slots._value if lanes else 0

    @property
    def lanes(self) -> tuple[int, int]:
        """(idle, open) lanes on the current event loop; open never exceeds `max_concurrency`."""
        lanes = self._loops.get(asyncio.get_running_loop())
        return (len(lanes.idle), len(lanes.open)) if lanes else (0, 0)

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called: no request is sent after it."""
        return self._closed

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                      on_attempt: Callable[[], None] | None = None, affinity: str | None = None,
                      headers: Mapping[str, str] | None = None) -> Reply:
        """One JSON request with retries; a 2xx JSON reply or a typed error.

        `on_attempt` is called before every attempt (retries included), e.g. to count.
        `affinity` routes by rendezvous hashing instead of round-robin (see `rendezvous`);
        `headers` are sent with every attempt, after the connection's own.
        """
        if self._closed:
            raise self._closed_error()
        content = None if body is None else dumps(body)
        lanes = self._lanes()
        async with lanes.slots:
            lane = lanes.idle.pop() if lanes.idle else self._new_lane(lanes)
            try:
                return await self._send(lane, method, path, content, on_attempt, affinity, headers)
            finally:
                if self._closed:  # closed meanwhile: this lane's connections go, not back
                    await lane.aclose()
                else:
                    lanes.idle.append(lane)

    def rendezvous(self, key: str) -> list[str]:
        """The replica URLs in `key`'s rendezvous order (highest random weight first).

        Every client with the same replica list sends a key to the same first replica, and
        removing a replica moves only the keys it held (each to its next in order).
        """
        return [r.url for r in self._ranked(key)]

    def openai_options(self, *, client: Literal["langchain", "async", "sync"] = "langchain") -> dict[str, Any]:
        """Keyword arguments that give an OpenAI client this connection's settings.

        `ChatOpenAI(model=..., **conn.openai_options())` (langchain-openai; its
        `OpenAIDecisions` too), `openai.AsyncOpenAI(**conn.openai_options(client="async"))`,
        `openai.OpenAI(**conn.openai_options(client="sync"))`. They hold `base_url` (the one
        replica: an OpenAI client has no replicas), `api_key` (when the connection has one;
        else the client's own default, `OPENAI_API_KEY`, applies), `timeout`, `max_retries`
        (the client backs off in its own way), `default_headers` (the connection's headers,
        and Basic auth from URL userinfo), `default_query` (the URL's query), and new httpx
        clients carrying `verify`, `cert`, `trust_env`, `limits` (concurrency, keep-alive)
        and, on every request, `forward_headers` and `traceparent`: `http_client` and
        `http_async_client` for langchain-openai, `http_client` for the SDK. A `transport=`
        reaches the async client only. The reply size cap is not enforced there.
        """
        if len(self._replicas) != 1:
            raise ValueError(f"an OpenAI client takes one base URL; this connection has {len(self._replicas)}")
        if client not in ("langchain", "async", "sync"):
            raise ValueError(f"client must be 'langchain', 'async' or 'sync', not {client!r}")
        origin = self._replicas[0].origin
        default_headers = dict(self.headers)
        authorization = default_headers.pop("authorization", None) or origin.authorization
        if authorization:  # it replaces the client's own `Bearer <api_key>`
            default_headers["Authorization"] = authorization
        options: dict[str, Any] = {"base_url": origin.api_url, "max_retries": self.retries.max_retries,
                                   "timeout": httpx.Timeout(self.timeout.read, connect=self.timeout.connect)}
        if self._api_key or authorization:  # the client insists on a key; an Authorization header replaces it
            options["api_key"] = self._api_key or "unused"
        if default_headers:
            options["default_headers"] = default_headers
        if origin.query:
            options["default_query"] = dict(httpx.QueryParams(origin.query[1:]))
        if client in ("langchain", "sync"):
            options["http_client"] = self._httpx_client(sync=True)
        if client in ("langchain", "async"):
            options["http_async_client" if client == "langchain" else "http_client"] = self._httpx_client(sync=False)
        return options

    async def aclose(self) -> None:
        """Close every lane's connections, for good: requests in flight fail, later ones are refused."""
        self._closed = True
        loops, self._loops = self._loops, {}
        for lanes in loops.values():
            for lane in lanes.open:
                with suppress(RuntimeError):  # client bound to a loop that is already closed
                    await lane.aclose()

    # -- internals ------------------------------------------------------------------

    def _closed_error(self) -> EngineUnavailable:
        return EngineUnavailable(f"the connection to {', '.join(self.urls)} was closed (aclose)",
                                 hint="make a new engine or client; a closed one stays closed", retryable=False)

    def _lanes(self) -> _Lanes:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            for dead in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[dead]
            self._loops[loop] = _Lanes(self.limits.max_concurrency)
        return self._loops[loop]

    def _new_lane(self, lanes: _Lanes) -> Lane:
        lane: Lane
        limits = self.limits
        if self._lane_factory is not None:
            lane = self._lane_factory()
        elif self.transport is None:
            lane = SocketLane(timeout=self.timeout, ssl_context=self._ssl, keepalive_expiry=limits.keepalive_expiry,
                              max_bytes=limits.max_response_bytes)
        else:
            n = len(self._replicas)
            pool = httpx.Limits(max_connections=n, max_keepalive_connections=n,
                                keepalive_expiry=limits.keepalive_expiry)
            timeout = httpx.Timeout(self.timeout.read, connect=self.timeout.connect)
            lane = HttpxLane(httpx.AsyncClient(timeout=timeout, verify=self._ssl or True, limits=pool,
                                               transport=self.transport, trust_env=False),
                             self._deadline, limits.max_response_bytes)
        lanes.open.append(lane)
        return lane

    def _httpx_client(self, *, sync: bool) -> httpx.Client | httpx.AsyncClient:
        """An httpx client with this connection's TLS, proxies, pool and headers hook (for `openai_options`)."""
        limits = httpx.Limits(max_connections=self.limits.max_concurrency,
                              max_keepalive_connections=self.limits.max_concurrency,
                              keepalive_expiry=self.limits.keepalive_expiry)
        timeout = httpx.Timeout(self.timeout.read, connect=self.timeout.connect)
        verify = self._ssl or True
        if sync:
            return httpx.Client(timeout=timeout, verify=verify, limits=limits, trust_env=self.trust_env,
                                follow_redirects=True, event_hooks={"request": [_carry]})

        async def carry(request: httpx.Request) -> None:
            _carry(request)

        return httpx.AsyncClient(timeout=timeout, verify=verify, limits=limits, trust_env=self.trust_env,
                                 transport=self.transport, follow_redirects=True, event_hooks={"request": [carry]})

    def _pick(self) -> _Replica:
        """Round-robin over replicas that are not cooling down (the soonest back if none is)."""
        now = time.monotonic()
        n = len(self._replicas)
        for i in range(n):
            replica = self._replicas[(self._next + i) % n]
            if replica.down_until <= now:
                self._next = (self._next + i + 1) % n
                return replica
        return min(self._replicas, key=lambda r: r.down_until)

    def _ranked(self, key: str) -> list[_Replica]:
        if len(self._replicas) == 1:
            return self._replicas

        def weight(replica: _Replica) -> bytes:
            return hashlib.blake2b(f"{replica.url}\n{key}".encode(), digest_size=8).digest()

        return sorted(self._replicas, key=weight, reverse=True)

    def _pick_for(self, key: str, tried: set[str]) -> _Replica:
        """`key`'s first replica in rendezvous order that is not cooling down and was not
        tried by this request (failover); the soonest back if every one is."""
        now = time.monotonic()
        ranked = self._ranked(key)
        for replica in ranked:
            if replica.down_until <= now and replica.url not in tried:
                return replica
        for replica in ranked:
            if replica.down_until <= now:
                return replica
        return min(ranked, key=lambda r: r.down_until)

    async def _send(self, lane: Lane, method: str, path: str, content: bytes | None,
                    on_attempt: Callable[[], None] | None, affinity: str | None = None,
                    extra: Mapping[str, str] | None = None) -> Reply:
        headers = {**_FORWARDED.get(), **self._headers}
        if content is not None:
            headers["content-type"] = "application/json"
        if extra:
            headers.update(extra)
        if otel_context.get_current():  # traceparent, baggage: nothing to inject from an empty context
            propagate.inject(headers)
        retries = self.retries
        tried: set[str] = set()
        last: CanvasRouteError | None = None
        wait = 0.0
        for attempt in range(retries.max_retries + 1):
            if attempt:
                backoff = retries.backoff * 2 ** (attempt - 1) * (0.5 + random.random())
                await asyncio.sleep(max(wait, backoff))
            if self._closed:
                raise self._closed_error()
            wait = 0.0
            replica = self._pick() if affinity is None else self._pick_for(affinity, tried)
            tried.add(replica.url)
            where = f"{method} {replica.url}{path}"
            if on_attempt is not None:
                on_attempt()
            try:
                resp = await lane.exchange(replica.origin, method, path, headers, content)
            except (ConnectTimedOut, ReplyTimedOut) as exc:
                last = EngineTimeout(f"{where} timed out ({type(exc).__name__}: {exc})",
                                     hint="raise the connection's timeout= or check the server's load")
                replica.down_until = time.monotonic() + retries.replica_cooldown
                continue
            except CertificateRefused as exc:  # not transient: no retry, no cool-down
                raise EngineUnavailable(
                    f"{where}: {exc}", retryable=False,
                    hint="the server's TLS certificate is not trusted: pass verify= a CA bundle (or set "
                         "SSL_CERT_FILE), or a client certificate with cert= if the server asks for one") from exc
            except ReplyTooLarge as exc:
                raise EngineResponseError(f"{where}: {exc}", hint="raise Limits(max_response_bytes=) if such replies "
                                                                  "are expected") from exc
            except LaneFault as exc:
                last = EngineUnavailable(f"{where} failed: {type(exc).__name__}: {exc}", hint=self._hint(exc))
                replica.down_until = time.monotonic() + retries.replica_cooldown
                continue
            if self._closed:
                raise self._closed_error()
            status = resp.status
            if status in RETRY_STATUS:
                kind = EngineOverloaded if status in OVERLOAD_STATUS else EngineUnavailable
                last = kind(f"{where} -> HTTP {status}: {error_message(resp)}")
                wait = retry_after(resp)
                continue
            if status >= 400:
                hint = "check api_key" if status in (401, 403) else f"{where} was refused"
                raise EngineRequestError(error_message(resp), status=status, hint=hint)
            try:
                data = loads(resp.content)
            except ValueError as exc:
                raise EngineResponseError(f"{replica.url}{path} answered non-JSON: {_text(resp)[:200]!r}") from exc
            return Reply(data, replica.url, resp.headers)
        assert last is not None
        last.attempts = retries.max_retries + 1  # retried here: `retry_on` leaves it to this layer
        raise last

    @staticmethod
    def _hint(fault: LaneFault) -> str:
        if isinstance(fault, ConnectFailed):
            return "is the server running at this URL?"
        if isinstance(fault, Unanswered):
            return ("the server closed the connection after receiving the request; it was not sent again (the "
                    "server may have acted on it): allow that with retries=")
        return "the server hung up or broke HTTP/1.1; is it what listens at this URL?"


def _carry(request: httpx.Request) -> None:
    """What a `Connection` adds to every request, for an httpx client's request hook."""
    for name, value in _FORWARDED.get().items():
        request.headers.setdefault(name, value)
    if otel_context.get_current():
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        request.headers.update(carrier)


def _timeout(value: float | Timeout) -> Timeout:
    if isinstance(value, Timeout):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Timeout(read=float(value))
    raise ValueError(f"timeout must be seconds or a Timeout(read=..., connect=...), not {type(value).__name__}")


def _retries(value: int | Retries) -> Retries:
    if isinstance(value, Retries):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Retries(max_retries=value)
    raise ValueError(f"retries must be a count or a Retries(max_retries=..., ...), not {type(value).__name__}")


def _value(value: object, kind: type[_T], name: str) -> _T:
    if isinstance(value, kind):
        return value
    raise ValueError(f"{name} must be a {kind.__name__}(...), not {type(value).__name__}")
