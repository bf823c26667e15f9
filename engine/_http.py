"""`Connection`: the HTTP client part shared by `VLLMServerEngine` and `SystemOneDecisionModel`.

One place for replicas with cool-down, per-request lanes, retries with exponential
backoff and jitter (408, 429, 5xx, 529, connection errors, timeouts), `Retry-After`
(capped), a whole-attempt deadline, `traceparent` injection and the mapping of HTTP
statuses to the errors in `canvasroute.engine.errors`. The callers speak their wire on top of it
(the model/provider split of pydantic-ai). Requests go out through lanes (engine/_lanes.py):
keep-alive HTTP/1.1 connections whose replies llhttp parses, or httpx for a custom transport
or a proxy. `aclose()` is final.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from opentelemetry import context as otel_context
from opentelemetry import propagate

from ._headers import forwarded
from ._lanes import HttpxLane, SocketLane
from ._origin import Origin, shown
from ._protocol import (
    CertificateRefused,
    ConnectFailed,
    ConnectTimedOut,
    LaneFault,
    ReplyTimedOut,
    ReplyTooLarge,
)
from ._replies import dumps, error_message, loads, retry_after, text
from ._tls import tls_context
from .errors import (
    CanvasRouteError,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
)

Lane = HttpxLane | SocketLane

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504, 529})
"""Transient statuses. 501 (the server cannot do this at all) is not among them."""
OVERLOAD_STATUS = frozenset({429, 503, 529})
MAX_RESPONSE_BYTES = 32 << 20
"""Default cap on one reply, raw and decoded (32 MiB; a read of 64 rows x 128 labels is ~1 MiB)."""


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

    def __init__(self, url: str, trust_env: bool) -> None:
        self.origin = Origin.parse(url.rstrip("/"), trust_env=trust_env)
        self.url = self.origin.url
        """The base URL as messages show it (no userinfo, no query)."""
        self.down_until = 0.0


class Connection:
    """HTTP to one service served by one or more replicas, with retries and typed errors.

    Args:
        base_urls: replica roots; requests go round-robin over those not cooling down, or,
            with an `affinity` key, to the key's rendezvous replica (`rendezvous`). A URL's
            userinfo (`http://user:pass@host`) is sent as Basic auth, its query string with
            every request.
        api_key: sent as `Authorization: Bearer <key>` (not together with URL userinfo).
        timeout: seconds per HTTP operation (read, write, pool).
        connect_timeout: seconds to connect (default `timeout`). One attempt as a whole
            is bounded by `timeout + connect_timeout` (a trickling reply or a custom
            transport could outlast httpx's per-operation timeouts).
        max_concurrency: requests in flight per event loop.
        max_retries: retries after the first attempt on transient faults.
        backoff: first retry delay, doubled per retry, with jitter (x0.5-1.5).
        replica_cooldown: seconds a replica that failed to connect or timed out is skipped.
        verify: TLS verification: True (certifi, or `SSL_CERT_FILE`/`SSL_CERT_DIR`), False
            (none), a CA bundle file or folder, or an `ssl.SSLContext`.
        cert: a client certificate: a PEM file holding certificate and key, or
            (certificate file, key file), or (certificate file, key file, password).
        keepalive_expiry: seconds an idle connection is kept for reuse (below uvicorn's 5 s
            keep-alive, so the server never closes one as it is reused).
        max_response_bytes: cap on one reply, raw and decoded; past it, `EngineResponseError`.
        trust_env: follow `HTTP(S)_PROXY`, `ALL_PROXY` and `NO_PROXY` (a proxied replica is
            reached through httpx).
        transport: an `httpx.AsyncBaseTransport` (e.g. `httpx.MockTransport` in tests):
            every request then goes through httpx and that transport.
        service: what the URLs serve, for error hints ("vLLM server").
    """

    def __init__(self, base_urls: str | Sequence[str], *, api_key: str | None = None, timeout: float = 30.0,
                 connect_timeout: float | None = None, max_concurrency: int = 64, max_retries: int = 3,
                 backoff: float = 0.2, replica_cooldown: float = 5.0,
                 verify: bool | str | ssl.SSLContext = True, cert: str | tuple[str, ...] | None = None,
                 keepalive_expiry: float = 4.0, max_response_bytes: int = MAX_RESPONSE_BYTES,
                 trust_env: bool = True, transport: httpx.AsyncBaseTransport | None = None,
                 service: str = "server") -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("a connection needs at least one base URL")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"base URLs must be http(s) URLs, got {shown(url) if isinstance(url, str) else url!r}")
        if max_concurrency < 1 or max_retries < 0 or backoff < 0 or timeout <= 0:
            raise ValueError("max_concurrency must be >= 1, max_retries >= 0, backoff >= 0 and timeout > 0")
        if keepalive_expiry < 0 or max_response_bytes < 1:
            raise ValueError("keepalive_expiry must be >= 0 and max_response_bytes >= 1")
        if api_key and any(c < " " or c == "\x7f" for c in api_key):
            raise ValueError("api_key holds a control character (a newline?); the key is not shown")
        connect = timeout if connect_timeout is None else connect_timeout
        self._replicas = [_Replica(u, trust_env and transport is None) for u in urls]
        if api_key and any(r.origin.authorization for r in self._replicas):
            raise ValueError("pass either api_key or credentials in the URL (user:password@), not both")
        for replica in self._replicas:
            if replica.origin.proxy is not None:
                _check_proxy(replica.origin.proxy)
        self._next = 0
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=connect)
        self.deadline = timeout + connect
        """Seconds one attempt may take as a whole."""
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff = backoff
        self.replica_cooldown = replica_cooldown
        self.keepalive_expiry = keepalive_expiry
        self.max_response_bytes = max_response_bytes
        self._transport = transport
        self._service = service
        self._loops: dict[asyncio.AbstractEventLoop, _Lanes] = {}
        needs_tls = any(r.origin.tls for r in self._replicas)
        # one TLS context for every lane (each costs ~20 ms), built now: a bad CA file fails here
        self._ssl = tls_context(verify, cert) if needs_tls or verify is not True or cert else None
        self._closed = False
        self._lane_factory: Callable[[], Any] | None = None  # `canvasroute bench` measures other clients here

    def __repr__(self) -> str:
        return f"Connection({self.urls!r}, max_retries={self.max_retries}, max_concurrency={self.max_concurrency})"

    @property
    def urls(self) -> tuple[str, ...]:
        """The replica base URLs (as messages show them: no userinfo, no query)."""
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
        `headers` are sent with every attempt, after those of `forward_headers`.
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

    async def aclose(self) -> None:
        """Close every lane's connections, for good: requests in flight fail, later ones are refused."""
        self._closed = True
        loops, self._loops = self._loops, {}
        for lanes in loops.values():
            for lane in lanes.open:
                try:
                    await lane.aclose()
                except RuntimeError:  # client bound to a loop that is already closed
                    pass

    # -- internals ------------------------------------------------------------------

    def _closed_error(self) -> EngineUnavailable:
        return EngineUnavailable(f"the connection to {', '.join(self.urls)} was closed (aclose)",
                                 hint="make a new engine or client; a closed one stays closed", retryable=False)

    def _lanes(self) -> _Lanes:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            for dead in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[dead]
            self._loops[loop] = _Lanes(self.max_concurrency)
        return self._loops[loop]

    def _new_lane(self, lanes: _Lanes) -> Lane:
        lane: Lane
        if self._lane_factory is not None:
            lane = self._lane_factory()
        elif self._transport is None:
            lane = SocketLane(connect_timeout=self._timeout.connect, timeout=self._timeout.read,
                              ssl_context=self._ssl, keepalive_expiry=self.keepalive_expiry,
                              max_bytes=self.max_response_bytes)
        else:
            n = len(self._replicas)
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n,
                                  keepalive_expiry=self.keepalive_expiry)
            lane = HttpxLane(httpx.AsyncClient(timeout=self._timeout, verify=self._ssl or True, limits=limits,
                                               transport=self._transport, trust_env=False),
                             self.deadline, self.max_response_bytes)
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
        headers = {**forwarded(), **self._headers}
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
                                     hint="raise timeout= or check the server's load")
                replica.down_until = time.monotonic() + self.replica_cooldown
                continue
            except CertificateRefused as exc:  # not transient: no retry, no cool-down
                raise EngineUnavailable(
                    f"{where}: {exc}", retryable=False,
                    hint="the server's TLS certificate is not trusted: pass verify= a CA bundle (or set "
                         "SSL_CERT_FILE), or a client certificate with cert= if the server asks for one") from exc
            except ReplyTooLarge as exc:
                raise EngineResponseError(f"{where}: {exc}",
                                          hint="raise max_response_bytes= if such replies are expected") from exc
            except LaneFault as exc:
                hint = (f"is the {self._service} running at this URL?" if isinstance(exc, ConnectFailed) else
                        f"the {self._service} hung up or broke HTTP/1.1; is it what listens at this URL?")
                last = EngineUnavailable(f"{where} failed: {type(exc).__name__}: {exc}", hint=hint)
                replica.down_until = time.monotonic() + self.replica_cooldown
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
                raise EngineResponseError(f"{replica.url}{path} answered non-JSON: {text(resp)[:200]!r}") from exc
            return Reply(data, replica.url, resp.headers)
        assert last is not None
        last.attempts = self.max_retries + 1  # retried here: `retry_on` leaves it to this layer
        raise last


def _check_proxy(proxy: str) -> None:
    """Refuse at construction a proxy httpx cannot use (the message shows no credentials)."""
    try:
        url = httpx.URL(proxy)
    except httpx.InvalidURL:
        raise ValueError("the environment's proxy URL is not a URL; fix HTTP(S)_PROXY / ALL_PROXY") from None
    if url.scheme not in ("http", "https", "socks5", "socks5h"):
        raise ValueError(f"unsupported proxy scheme {url.scheme!r} in the environment (HTTP(S)_PROXY / ALL_PROXY); "
                         "use http, https or socks5, set NO_PROXY for this host, or pass trust_env=False")
    if url.scheme.startswith("socks"):
        import importlib.util

        if importlib.util.find_spec("socksio") is None:
            raise ValueError("the environment names a SOCKS proxy: pip install 'httpx[socks]', "
                             "or set NO_PROXY for this host, or pass trust_env=False")
