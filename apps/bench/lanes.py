"""The HTTP clients `canvasroute bench` measures beside the engine's own lane (issue #23).

Each is a lane in `Connection`'s sense (`exchange(origin, method, path, headers, content)`
-> `Answer`, `aclose()`), one keep-alive connection per replica, so the same engine, the
same retries and the same reads run through each and only the HTTP client differs:

- `llhttp`: the engine's `SocketLane` (asyncio protocol, llhttp via `httptools`): the choice.
- `h11`: h11's state machine (pure Python, what httpcore uses) over asyncio streams.
- `aiohttp`: one `aiohttp.ClientSession` per lane (its llhttp C parser), if installed.
- `httpx`: one `httpx.AsyncClient` per lane (httpcore + h11 + anyio), what the engine used before #15.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import h11
import httpx

from canvasroute.engine import Connection
from canvasroute.engine.transport._connection import Answer, HttpxLane

__all__ = ["CLIENTS", "available", "use"]

CLIENTS = ("llhttp", "h11", "aiohttp", "httpx")
_SENT = {"user-agent": "canvasroute", "accept-encoding": "identity"}


class H11Lane:
    """h11 over asyncio streams, one connection per origin."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._conns: dict[Any, tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection]] = {}

    async def exchange(self, origin: Any, method: str, path: str, headers: Mapping[str, str],
                       content: bytes | None) -> Any:
        entry = self._conns.pop(origin, None)
        if entry is None:
            reader, writer = await asyncio.open_connection(origin.host, origin.port)
            entry = reader, writer, h11.Connection(h11.CLIENT)
        reader, writer, conn = entry
        sent = [("host", origin.host_header), *_SENT.items(), *headers.items()]
        if content is not None:
            sent.append(("content-length", str(len(content))))
        async with asyncio.timeout(self._timeout):
            writer.write(conn.send(h11.Request(method=method, target=origin.base_path + path, headers=sent)))
            if content:
                writer.write(conn.send(h11.Data(data=content)))
            writer.write(conn.send(h11.EndOfMessage()))
            status, got, body = 0, {}, []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status, got = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("closed mid-reply")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self._conns[origin] = entry
        else:
            writer.close()
        return Answer(status, got, b"".join(body))

    async def aclose(self) -> None:
        for _, writer, _ in self._conns.values():
            writer.close()
        self._conns.clear()


class AiohttpLane:
    """One `aiohttp.ClientSession` holding one connection per origin."""

    def __init__(self, timeout: float) -> None:
        import aiohttp

        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit_per_host=1),
                                              timeout=self._timeout, auto_decompress=False)

    async def exchange(self, origin: Any, method: str, path: str, headers: Mapping[str, str],
                       content: bytes | None) -> Any:
        async with self._session.request(method, origin.url + path, data=content,
                                         headers={**_SENT, **headers}) as resp:
            return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read())

    async def aclose(self) -> None:
        await self._session.close()


def available(client: str) -> str | None:
    """Why `client` cannot be measured here, or None."""
    if client == "aiohttp" and importlib.util.find_spec("aiohttp") is None:
        return "aiohttp is not installed (pip install aiohttp)"
    return None


def use(connection: Connection, client: str) -> None:
    """Make every new lane of `connection` speak through `client`."""
    timeout = connection.timeout.total
    factories: dict[str, Callable[[], Any] | None] = {
        "llhttp": None,
        "h11": lambda: H11Lane(timeout),
        "aiohttp": lambda: AiohttpLane(timeout),
        "httpx": lambda: _httpx_lane(connection),
    }
    connection._lane_factory = factories[client]


def _httpx_lane(connection: Connection) -> Any:
    client = httpx.AsyncClient(timeout=connection.timeout.total, trust_env=False,
                               limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
    return HttpxLane(client, connection.timeout.total, connection.limits.max_response_bytes)
