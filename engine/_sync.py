"""The sync path: run a coroutine to completion from synchronous code.

One daemon thread owns an event loop for all sync calls, so pooled async clients and
locks created by a sync call live on a loop that stays open between calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Portal:
    """The shared loop, started on first use (and again if it was closed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="canvasroute-sync", daemon=True).start()
            return self._loop


_portal = _Portal()


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coro` on the shared background loop and wait for its result."""
    loop = _portal()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("run_sync called from the canvasroute sync loop itself; await instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
