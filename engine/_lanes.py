"""Lanes: how `Connection` sends one HTTP request to one replica.

A lane holds one keep-alive connection per replica and serves one request at a time.
`SocketLane` speaks HTTP/1.1 itself over asyncio streams: a JSON request and a
`Content-Length` or chunked reply need no more, and it costs a small fraction of httpx's
CPU per request (no anyio, h11 or pool bookkeeping), which bounds a client's reads per
second. `HttpxLane` sends through an `httpx.AsyncClient`, for a custom transport
(`httpx.MockTransport` in tests, a proxy). Both raise httpx's exception types, so
`Connection` maps faults to engine errors the same way for either.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httpx

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_FIXED_HEADERS = "user-agent: canvasroute\r\naccept: */*\r\naccept-encoding: identity\r\n"


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP response: status, headers (names in lower case, repeats joined by ", "), body."""

    status: int
    headers: Mapping[str, str]
    content: bytes


@dataclass(frozen=True, slots=True, eq=False)
class Origin:
    """A replica base URL, parsed once: where to connect and what to put in the request line."""

    url: str
    host: str
    port: int
    tls: bool
    host_header: str
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URLs must be http(s) URLs, got {url!r}")
        tls = parts.scheme == "https"
        return cls(url=url, host=parts.hostname, port=parts.port or (443 if tls else 80), tls=tls,
                   host_header=parts.netloc.rpartition("@")[2].encode("idna").decode(),
                   base_path=quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=~"))


class HttpxLane:
    """A lane through an `httpx.AsyncClient` (one connection per replica), each attempt
    bounded as a whole by `deadline` (a custom transport may ignore httpx's timeouts)."""

    __slots__ = ("client", "deadline")

    def __init__(self, client: httpx.AsyncClient, deadline: float) -> None:
        self.client = client
        self.deadline = deadline

    async def exchange(self, origin: Origin, method: str, path: str, headers: Mapping[str, str],
                       content: bytes | None) -> Answer:
        async with asyncio.timeout(self.deadline):
            resp = await self.client.request(method, origin.url + path, content=content, headers=headers)
        return Answer(resp.status_code, dict(resp.headers.items()), resp.content)

    async def aclose(self) -> None:
        await self.client.aclose()


class SocketLane:
    """A lane speaking HTTP/1.1 over asyncio streams, one keep-alive connection per replica.

    `connect_timeout` bounds opening a connection (TCP and TLS), `timeout` the exchange
    (writing the request and reading the whole reply). A connection that fails, times
    out or is cancelled mid-exchange is closed, never reused. Env proxies are not used:
    pass a transport (`httpx.AsyncHTTPTransport(proxy=...)`) to go through one.
    """

    __slots__ = ("_streams", "_connect_timeout", "_timeout", "_ssl")

    def __init__(self, *, connect_timeout: float, timeout: float, ssl_context: ssl.SSLContext | None) -> None:
        self._streams: dict[Origin, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._ssl = ssl_context

    async def exchange(self, origin: Origin, method: str, path: str, headers: Mapping[str, str],
                       content: bytes | None) -> Answer:
        request = request_head(origin, method, path, headers, content) + (content or b"")
        reader, writer = await self._stream(origin)
        try:
            async with asyncio.timeout(self._timeout):
                writer.write(request)
                await writer.drain()
                answer, keep = await read_answer(reader, method)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, TimeoutError):
                raise httpx.ReadTimeout(f"no full reply within {self._timeout} s") from exc
            if isinstance(exc, (OSError, EOFError, ValueError, asyncio.LimitOverrunError, zlib.error)):
                raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc
            raise
        if keep:
            self._streams[origin] = reader, writer
        else:
            writer.close()
        return answer

    async def aclose(self) -> None:
        streams, self._streams = self._streams, {}
        for _, writer in streams.values():
            writer.close()

    async def _stream(self, origin: Origin) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The replica's idle connection (taken out while in use), or a new one when there is
        none or the server closed it while idle."""
        stream = self._streams.pop(origin, None)
        if stream is not None:
            if not (stream[0].at_eof() or stream[1].is_closing()):
                return stream
            stream[1].close()
        try:
            async with asyncio.timeout(self._connect_timeout):
                return await asyncio.open_connection(origin.host, origin.port,
                                                     ssl=self._tls() if origin.tls else None)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"no connection within {self._connect_timeout} s") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl


def request_head(origin: Origin, method: str, path: str, headers: Mapping[str, str],
                 content: bytes | None) -> bytes:
    """Request line and headers (`ValueError` for a header that could split the head)."""
    lines = [f"{method} {origin.base_path}{path} HTTP/1.1\r\nhost: {origin.host_header}\r\n{_FIXED_HEADERS}"]
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or _CTL.search(value):
            raise ValueError(f"invalid HTTP header {name!r}: {value!r}")
        lines.append(f"{name}: {value}\r\n")
    if content is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(content or b'')}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


async def read_answer(reader: asyncio.StreamReader, method: str) -> tuple[Answer, bool]:
    """One reply (after any 1xx interim ones) and whether the connection may be reused."""
    version, status, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
    while 100 <= status < 200:
        version, status, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
    keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if method == "HEAD" or status in (204, 304):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = await read_chunked(reader)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:  # delimited by the server closing the connection
        body, keep = await reader.read(), False
    return Answer(status, headers, decode(body, headers.get("content-encoding", ""))), keep


def parse_head(head: bytes) -> tuple[str, int, dict[str, str]]:
    """HTTP version, status and headers of a reply head (`ValueError` when malformed)."""
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise ValueError(f"not an HTTP/1 status line: {status_line[:100]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line: {line[:100]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return version, int(rest[:3]), headers


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body (chunk extensions and trailers are read and dropped)."""
    parts = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("a chunk does not end with CRLF")
    while await reader.readuntil(b"\r\n") != b"\r\n":
        pass
    return b"".join(parts)


def decode(body: bytes, encoding: str) -> bytes:
    """The body without its content coding (identity is asked for; gzip and deflate are
    undone for a server that compresses anyway)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompress(body, zlib.MAX_WBITS if body[:1] == b"\x78" else -zlib.MAX_WBITS)
    raise ValueError(f"unsupported content-encoding {encoding!r}")
