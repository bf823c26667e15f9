"""One HTTP/1.1 client connection whose every received byte is parsed by llhttp (`httptools`).

`HttpConnection` is an `asyncio.Protocol`: it writes a request head built from validated
parts (`request_head`) and hands what the server sends to llhttp, Node.js's parser, which
refuses lenient framing (signed or underscored lengths, `0x` chunk sizes, bad status lines,
obs-folds, Content-Length beside chunked, bare LF). On top of llhttp it refuses what a
client must not accept: a reply nobody asked for (bytes while idle, or after the reply:
the connection is then never reused, so it cannot fall out of step), a transfer coding
other than `chunked`, a `101` upgrade, an HTTP version other than 1.0/1.1, and a reply
(or its decoded body) over `max_bytes`, which stops reading at once.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import httptools

from ._origin import Origin

__all__ = ["Answer", "BadReply", "CertificateRefused", "ConnectFailed", "ConnectTimedOut", "HttpConnection",
           "LaneFault", "ReplyTimedOut", "ReplyTooLarge", "StaleConnection", "decoded", "request_head"]

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_PATH = re.compile(r"/[!-~]*")
_FIXED_HEADERS = "user-agent: canvasroute\r\naccept: */*\r\naccept-encoding: identity\r\n"
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
"""Methods a lane sends (HEAD is not among them: llhttp cannot be told a reply has no body)."""


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
    """A reused connection was closed before any byte of the reply came: safe to resend once."""


class ReplyTooLarge(LaneFault):
    """The reply, or its decoded body, is over the cap: not transient, never retried."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP response: status, headers (names in lower case, repeats joined by ", "), body."""

    status: int
    headers: Mapping[str, str]
    content: bytes


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
    """One connection, one exchange at a time (`send`), reusable while `reusable()`."""

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

    async def send(self, request: bytes, timeout: float) -> Answer:
        """Write one request and wait for its whole reply (`LaneFault` subclasses on failure;
        the connection is closed on any failure or cancellation)."""
        assert self.transport is not None and self._waiter is None
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._received, self._headers, self._body = 0, {}, []
        self._head_done = self._interim = False
        self.exchanges += 1
        timer = loop.call_later(timeout, self._fail, ReplyTimedOut(f"no full reply within {timeout:g} s"))
        try:
            self.transport.write(request)
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
        self.transport = transport  # type: ignore[assignment]

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
            waiter.set_exception(StaleConnection("the server closed the kept-alive connection"))
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
