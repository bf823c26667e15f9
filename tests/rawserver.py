"""A raw TCP server for client tests: answers the n-th request with the n-th scripted entry.

Its own request reading is llhttp's (`httptools`), so what a test scripts is exactly the
bytes the client gets back: well-formed, malformed, hostile.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import httptools


def ok(body: bytes = b'{"ok": 1}', *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), head.encode(), body)


def closes(reply: bytes) -> bool:
    """Whether the server hangs up after this reply."""
    return b"connection: close" in reply.lower() or reply.startswith(b"HTTP/1.0")


async def loopback_delivered() -> None:
    """Return once the client's protocols have read what the server already wrote to them.

    Bytes written on a loopback socket are in the peer's receive buffer when `write` returns;
    the event loop reports them on its next pass and runs their read callback in that pass,
    after what was already queued (this task's own wake-up): two passes at most, no clock involved."""
    for _ in range(2):
        await asyncio.sleep(0)


CLOSE = None
"""Script entry: close the connection without answering."""
SILENT = b""
"""Script entry: answer nothing, wait for the client to hang up."""


@dataclass(frozen=True)
class Later:
    """Script entry: `reply`, then `stray` bytes on the idle connection `delay` seconds later."""

    reply: bytes
    stray: bytes
    delay: float = 0.05


@dataclass(frozen=True)
class Hold:
    """Script entry: hold the request (read whole) `delay` seconds, then close without answering."""

    delay: float = 0.05


@dataclass(frozen=True)
class Flood:
    """Script entry: `head`, then `chunk` again and again until the client hangs up."""

    head: bytes
    chunk: bytes = b"x" * 65536


class _Requests:
    """llhttp callbacks: complete request heads and bodies, in order."""

    def __init__(self) -> None:
        self.done: list[tuple[bytes, bytes]] = []
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._head: list[bytes] = []
        self._body: list[bytes] = []

    def on_message_begin(self) -> None:
        self._url, self._head, self._body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head.append(name + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        line = b"%s %s HTTP/%s\r\n" % (self.parser.get_method(), self._url, self.parser.get_http_version().encode())
        self._head.insert(0, line)
        self._head.append(b"\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append((b"".join(self._head), b"".join(self._body)))


class RawServer:
    """Serves the script; keeps every request (`heads`: request line and headers as received,
    `bodies`), counts connections, hang-ups, connections it is done with (`closed`), stray
    bytes sent (`strays`) and bytes flooded. `until` waits for any of them, on the event
    each change signals: tests order themselves on what the server did, never on a sleep."""

    def __init__(self, *replies: bytes | Later | Flood | Hold | None, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.replies = list(replies)
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.hangups = 0
        self.closed = 0
        self.strays = 0
        self.flooded = 0
        self._changed = asyncio.Condition()

    async def until(self, check: Callable[[], bool], within: float = 10.0) -> None:
        """Wait until `check()` holds, re-checked after each request read, stray write or closed
        connection; `TimeoutError` after `within` seconds."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(check)

    async def _changed_now(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        scheme = "https" if self.tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _request(self, reader: asyncio.StreamReader, seen: _Requests) -> bool:
        while not seen.done:
            data = await reader.read(65536)
            if not data:
                return False
            seen.parser.feed_data(data)
        head, body = seen.done.pop(0)
        self.heads.append(head)
        self.bodies.append(body)
        await self._changed_now()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        seen = _Requests()
        try:
            while await self._request(reader, seen):
                reply = self.replies.pop(0)
                if reply is CLOSE:
                    return
                if isinstance(reply, Hold):
                    await asyncio.sleep(reply.delay)
                    self.hangups += 1
                    return
                if reply == SILENT:
                    await reader.read()
                    self.hangups += 1
                    return
                if isinstance(reply, Flood):
                    writer.write(reply.head)
                    while True:
                        writer.write(reply.chunk)
                        await writer.drain()
                        self.flooded += len(reply.chunk)
                if isinstance(reply, Later):
                    writer.write(reply.reply)
                    await writer.drain()
                    await asyncio.sleep(reply.delay)
                    writer.write(reply.stray)
                    await writer.drain()
                    self.strays += 1
                    await self._changed_now()
                    continue
                writer.write(reply)
                await writer.drain()
                if closes(reply):
                    return
            self.hangups += 1
        except (ConnectionError, httptools.HttpParserError):
            self.hangups += 1
        finally:
            writer.close()
            self.closed += 1
            await self._changed_now()
