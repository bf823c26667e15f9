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
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _portal() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="canvasroute-sync", daemon=True).start()
        return _loop


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
