"""`MicroBatcher`: merge concurrent reads into one forward pass on a worker thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

from .errors import EngineOverloaded, EngineRequestError, EngineResponseError, EngineUnavailable

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """Run `fn(items) -> results` on one worker thread, over batches of queued items.

    Items submitted by concurrent callers within `window_s` of the oldest queued item
    share one call of at most `max_batch` items; an item never waits longer than
    `window_s` for company. Results go back to each caller in its own order; an
    exception raised by `fn` goes to every caller in that batch. The queue holds at most
    `max_queue` items: a submission that does not fit raises `EngineOverloaded`.
    The worker thread is the only thread that calls `fn`, so `fn` needs no locking.

    Example:
        ```python
        batcher = MicroBatcher(lambda xs: [x * 2 for x in xs], max_batch=8)
        assert await batcher.submit([1, 2]) == [2, 4]
        ```
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], *, max_batch: int = 16,
                 window_s: float = 0.002, max_queue: int = 1024, name: str = "canvasroute-batcher") -> None:
        if max_batch < 1 or max_queue < 1 or window_s < 0:
            raise ValueError("max_batch and max_queue must be >= 1 and window_s >= 0")
        self._fn = fn
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_queue = max_queue
        self._name = name
        self._queue: deque[tuple[float, T, Future[R]]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0
        """Calls of `fn` so far (one per forward pass)."""

    def __repr__(self) -> str:
        return f"MicroBatcher(max_batch={self.max_batch}, window_s={self.window_s}, max_queue={self.max_queue})"

    async def submit(self, items: Sequence[T]) -> list[R]:
        """Queue `items` and wait for their results, in order."""
        if not items:
            return []
        if len(items) > self.max_queue:
            raise EngineRequestError(f"{len(items)} canvases in one read; the queue holds {self.max_queue}",
                                     hint="split the batch or raise max_queue")
        futures: list[Future[R]] = [Future() for _ in items]
        with self._cond:
            if self._closed:
                raise EngineUnavailable("the engine is closed", hint="create a new engine")
            if len(self._queue) + len(items) > self.max_queue:
                raise EngineOverloaded(f"{len(self._queue)} canvases already queued (max_queue={self.max_queue})",
                                       hint="retry later, or raise max_queue / max_batch")
            now = time.monotonic()
            self._queue.extend((now, item, fut) for item, fut in zip(items, futures, strict=True))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        outcomes = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes  # type: ignore[return-value]

    async def aclose(self) -> None:
        """Fail queued items with `EngineUnavailable`, finish the running batch, stop the thread."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        for _, _, fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineUnavailable("the engine was closed before this read ran"))
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join)

    def _take(self) -> list[tuple[float, T, Future[R]]] | None:
        """The next batch: wait for a first item, then for company until its window ends."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = self._queue[0][0] + self.window_s
            while len(self._queue) < self.max_batch and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            n = min(len(self._queue), self.max_batch)
            return [self._queue.popleft() for _ in range(n)]

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            live = [(item, fut) for _, item, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            self.batches += 1
            try:
                results = list(self._fn([item for item, _ in live]))
                if len(results) != len(live):
                    raise EngineResponseError(f"the forward pass returned {len(results)} results for {len(live)} items")
            except Exception as exc:  # every caller in the batch gets the fault
                for _, fut in live:
                    fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                fut.set_result(result)
