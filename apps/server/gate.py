"""Load control: admission (running + waiting <= capacity), running slots, a request-rate bucket, the shutdown drain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from .wire import Refusal

__all__ = ["Drain", "Gate", "RateLimit"]


class Gate:
    """Admission (running + waiting <= capacity) and a semaphore for running work."""

    def __init__(self, max_in_flight: int, max_queue: int) -> None:
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.admitted = 0
        """Requests holding a place: running or waiting for a slot."""
        self.running = 0
        self.peak_admitted = 0
        self.peak_running = 0
        self.rejected = 0
        self._slots: asyncio.Semaphore | None = None

    def snapshot(self) -> dict[str, int]:
        return {"in_flight": self.running, "queued": self.admitted - self.running,
                "max_in_flight": self.max_in_flight, "max_queue": self.max_queue,
                "peak_in_flight": self.peak_running, "peak_admitted": self.peak_admitted,
                "rejected": self.rejected}

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Hold a place, or raise 529 at once when every place is taken."""
        if self.admitted >= self.max_in_flight + self.max_queue:
            self.rejected += 1
            raise Refusal(529, "overloaded", f"the server is at capacity ({self.max_in_flight} running, "
                      f"{self.max_queue} queued); retry later", headers={"retry-after": "1"})
        self.admitted += 1
        self.peak_admitted = max(self.peak_admitted, self.admitted)
        try:
            yield
        finally:
            self.admitted -= 1

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for one of `max_in_flight` slots."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        async with self._slots:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            try:
                yield
            finally:
                self.running -= 1


class RateLimit:
    """A token bucket: `rate` requests per second, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            wait = (1 - self.tokens) / self.rate
            raise Refusal(429, "rate_limit_exceeded", f"over {self.rate:g} requests per second",
                      headers={"retry-after": str(max(1, round(wait)))})
        self.tokens -= 1



class Drain:
    """Graceful shutdown: once `begin(grace)` is called, new requests are refused (503) and
    those running have `grace` seconds before they are cancelled and answered 503."""

    def __init__(self) -> None:
        self.draining = False
        self._expired: asyncio.Event | None = None

    def begin(self, grace: float) -> None:
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(grace, self._event().set)

    @property
    def expired(self) -> bool:
        return self._expired is not None and self._expired.is_set()

    async def wait(self) -> None:
        """Returns when the grace period is over."""
        await self._event().wait()

    def refusal(self) -> Refusal:
        return Refusal(503, "shutting_down", "the server is shutting down; retry on another replica",
                       headers={"retry-after": "1", "connection": "close"})

    def _event(self) -> asyncio.Event:
        if self._expired is None:
            self._expired = asyncio.Event()
        return self._expired
