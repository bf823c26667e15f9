"""`Connection`: the HTTP client part shared by `VLLMServerEngine` and `SystemOneDecisionModel`.

One place for replicas with cool-down, per-request lanes, retries with exponential
backoff and jitter (408, 429, 5xx, 529, connection errors, timeouts), `Retry-After`
(capped), a whole-attempt deadline, `traceparent` injection and the mapping of HTTP
statuses to the errors in `canvasroute.engine.errors`. The callers speak their wire on top of it
(the model/provider split of pydantic-ai). Requests go out through lanes (engine/_lanes.py):
HTTP/1.1 over asyncio streams, or httpx when a custom transport is given.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from opentelemetry import context as otel_context
from opentelemetry import propagate

from ._lanes import Answer, HttpxLane, Origin, SocketLane
from .errors import (
    CanvasRouteError,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
)

try:  # optional: decodes the large read responses ~3x faster than the json module
    from orjson import OPT_NON_STR_KEYS
    from orjson import dumps as _fast_dumps
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_dumps = _fast_loads = None

Lane = HttpxLane | SocketLane

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504, 529})
"""Transient statuses. 501 (the server cannot do this at all) is not among them."""
OVERLOAD_STATUS = frozenset({429, 503, 529})
MAX_RETRY_AFTER = 30.0
"""Longest `Retry-After` honoured, in seconds."""


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

    __slots__ = ("slots", "idle", "open")

    def __init__(self, max_concurrency: int) -> None:
        self.slots = asyncio.Semaphore(max_concurrency)
        self.idle: list[Lane] = []
        self.open: list[Lane] = []


class _Replica:
    """One base URL and when it may be tried again after a connection failure."""

    __slots__ = ("url", "origin", "down_until")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.origin = Origin.parse(self.url)
        self.down_until = 0.0


class Connection:
    """HTTP to one service served by one or more replicas, with retries and typed errors.

    Args:
        base_urls: replica roots; requests go round-robin over those not cooling down, or,
            with an `affinity` key, to the key's rendezvous replica (`rendezvous`).
        api_key: sent as `Authorization: Bearer <key>`.
        timeout: seconds per HTTP operation (read, write, pool).
        connect_timeout: seconds to connect (default `timeout`). One attempt as a whole
            is bounded by `timeout + connect_timeout` (a trickling reply or a custom
            transport could outlast httpx's per-operation timeouts).
        max_concurrency: requests in flight per event loop.
        max_retries: retries after the first attempt on transient faults.
        backoff: first retry delay, doubled per retry, with jitter (x0.5-1.5).
        replica_cooldown: seconds a replica that failed to connect or timed out is skipped.
        transport: an `httpx.AsyncBaseTransport` (e.g. `httpx.MockTransport` in tests, or
            `httpx.AsyncHTTPTransport(proxy=...)`): requests then go through httpx. Without
            one they go straight to the replicas (env proxies are not used).
        service: what the URLs serve, for error hints ("vLLM server").
    """

    def __init__(self, base_urls: str | Sequence[str], *, api_key: str | None = None, timeout: float = 30.0,
                 connect_timeout: float | None = None, max_concurrency: int = 64, max_retries: int = 3,
                 backoff: float = 0.2, replica_cooldown: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None, service: str = "server") -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("a connection needs at least one base URL")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"base URLs must be http(s) URLs, got {url!r}")
        if max_concurrency < 1 or max_retries < 0 or backoff < 0 or timeout <= 0:
            raise ValueError("max_concurrency must be >= 1, max_retries >= 0, backoff >= 0 and timeout > 0")
        connect = timeout if connect_timeout is None else connect_timeout
        self._replicas = [_Replica(u) for u in urls]
        self._next = 0
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=connect)
        self.deadline = timeout + connect
        """Seconds one attempt may take as a whole."""
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff = backoff
        self.replica_cooldown = replica_cooldown
        self._transport = transport
        self._service = service
        self._loops: dict[asyncio.AbstractEventLoop, _Lanes] = {}
        self._ssl: Any = None

    def __repr__(self) -> str:
        return f"Connection({self.urls!r}, max_retries={self.max_retries}, max_concurrency={self.max_concurrency})"

    @property
    def urls(self) -> tuple[str, ...]:
        """The replica base URLs."""
        return tuple(r.url for r in self._replicas)

    @property
    def in_flight(self) -> int:
        """Requests holding a slot on the current event loop (0 when idle)."""
        lanes = self._loops.get(asyncio.get_running_loop())
        return self.max_concurrency - lanes.slots._value if lanes else 0

    @property
    def lanes(self) -> tuple[int, int]:
        """(idle, open) lanes on the current event loop; open never exceeds `max_concurrency`."""
        lanes = self._loops.get(asyncio.get_running_loop())
        return (len(lanes.idle), len(lanes.open)) if lanes else (0, 0)

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                      on_attempt: Callable[[], None] | None = None, affinity: str | None = None,
                      headers: Mapping[str, str] | None = None) -> Reply:
        """One JSON request with retries; a 2xx JSON reply or a typed error.

        `on_attempt` is called before every attempt (retries included), e.g. to count.
        `affinity` routes by rendezvous hashing instead of round-robin (see `rendezvous`);
        `headers` are sent with every attempt.
        """
        content = None if body is None else dumps(body)
        lanes = self._lanes()
        async with lanes.slots:
            lane = lanes.idle.pop() if lanes.idle else self._new_lane(lanes)
            try:
                return await self._send(lane, method, path, content, on_attempt, affinity, headers)
            finally:
                lanes.idle.append(lane)

    async def aclose(self) -> None:
        """Close every lane's connections."""
        loops, self._loops = self._loops, {}
        for lanes in loops.values():
            for lane in lanes.open:
                try:
                    await lane.aclose()
                except RuntimeError:  # client bound to a loop that is already closed
                    pass

    # -- internals ------------------------------------------------------------------

    def _lanes(self) -> _Lanes:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            for dead in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[dead]
            self._loops[loop] = _Lanes(self.max_concurrency)
        return self._loops[loop]

    def _new_lane(self, lanes: _Lanes) -> Lane:
        if self._ssl is None and any(r.origin.tls for r in self._replicas):
            self._ssl = httpx.create_ssl_context()  # one TLS context for every lane (each costs ~20 ms)
        lane: Lane
        if self._transport is None:
            lane = SocketLane(connect_timeout=self._timeout.connect, timeout=self._timeout.read,
                              ssl_context=self._ssl)
        else:
            n = len(self._replicas)
            lane = HttpxLane(httpx.AsyncClient(timeout=self._timeout, verify=self._ssl or True,
                                               limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                                               transport=self._transport), self.deadline)
        lanes.open.append(lane)
        return lane

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

    def rendezvous(self, key: str) -> list[str]:
        """The replica URLs in `key`'s rendezvous order (highest random weight first).

        Every client with the same replica list sends a key to the same first replica, and
        removing a replica moves only the keys it held (each to its next in order).
        """
        return [r.url for r in self._ranked(key)]

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
        headers = dict(self._headers)
        if content is not None:
            headers["content-type"] = "application/json"
        if extra:
            headers.update(extra)
        if otel_context.get_current():  # traceparent, baggage: nothing to inject from an empty context
            propagate.inject(headers)
        tried: set[str] = set()
        last: CanvasRouteError | None = None
        wait = 0.0
        for attempt in range(self.max_retries + 1):
            if attempt:
                backoff = self.backoff * 2 ** (attempt - 1) * (0.5 + random.random())
                await asyncio.sleep(max(wait, backoff))
            wait = 0.0
            replica = self._pick() if affinity is None else self._pick_for(affinity, tried)
            tried.add(replica.url)
            where = f"{method} {replica.url}{path}"
            if on_attempt is not None:
                on_attempt()
            try:
                resp = await lane.exchange(replica.origin, method, path, headers, content)
            except (httpx.TimeoutException, TimeoutError) as exc:
                last = EngineTimeout(f"{where} timed out ({type(exc).__name__})",
                                     hint="raise timeout= or check the server's load")
                replica.down_until = time.monotonic() + self.replica_cooldown
                continue
            except httpx.TransportError as exc:
                last = EngineUnavailable(f"{where} failed: {exc!r}", hint=f"is the {self._service} running at this URL?")
                replica.down_until = time.monotonic() + self.replica_cooldown
                continue
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
                raise EngineResponseError(f"{replica.url}{path} answered non-JSON: {text(resp)[:200]!r}") from exc
            return Reply(data, replica.url, resp.headers)
        assert last is not None
        last.attempts = self.max_retries + 1  # retried here: `retry_on` leaves it to this layer
        raise last


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


def text(resp: Answer) -> str:
    """The body as text (UTF-8, undecodable bytes replaced)."""
    return resp.content.decode("utf-8", "replace")


def error_message(resp: Answer) -> str:
    """The server's error message: OpenAI's `{"error": {"message"}}`, `message`, `detail`, or the text."""
    try:
        body = loads(resp.content)
    except ValueError:
        return text(resp)[:500] or f"HTTP {resp.status}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for value in (err, body.get("message"), body.get("detail")):
            if isinstance(value, str):
                return value
    return json.dumps(body)[:500]


def retry_after(resp: Answer) -> float:
    """Seconds the server asked us to wait (capped at `MAX_RETRY_AFTER`), 0 when it did not say."""
    raw = resp.headers.get("retry-after")
    try:
        return min(MAX_RETRY_AFTER, max(0.0, float(raw))) if raw else 0.0
    except ValueError:
        return 0.0
