"""Budget meters: count escalations against an `EscalationBudget`, exactly.

A meter is a small async interface so a shared store (e.g. a LangGraph `BaseStore`)
can back it; `InMemoryBudgetMeter` is the default. The model takes what it wants to
escalate, and refunds every grant that did not become an escalation (the decision
raised instead, or the escalation call failed), so refused work never spends budget.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol, runtime_checkable

from ._policy import EscalationBudget


@runtime_checkable
class BudgetMeter(Protocol):
    """Counts escalations against a budget; `take` and `refund` must be safe under concurrency."""

    async def take(self, n: int, thread: str | None) -> int:
        """Reserve up to `n` escalations for `thread`; returns how many were granted (0..n)."""
        ...

    async def refund(self, n: int, thread: str | None) -> None:
        """Give back `n` escalations granted by `take` that did not happen."""
        ...

    def snapshot(self) -> dict[str, int]:
        """Counters for dashboards: at least `granted` and `refused`."""
        ...


class InMemoryBudgetMeter:
    """A `BudgetMeter` in this process (thread-safe): a rolling window and per-thread counts.

    `granted` counts escalations net of refunds, `refused` the questions the budget
    turned away, `refunded` the grants given back; granted + refused + refunded is
    every question that asked.
    """

    def __init__(self, budget: EscalationBudget) -> None:
        self.budget = budget
        self._window: deque[float] = deque()
        self._threads: dict[str, int] = {}
        self._lock = threading.Lock()
        self.granted = 0
        self.refused = 0
        self.refunded = 0

    def __repr__(self) -> str:
        return f"InMemoryBudgetMeter({self.budget!r})"

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0] >= self.budget.window_s:
            self._window.popleft()

    async def take(self, n: int, thread: str | None) -> int:
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            allowed = n
            if self.budget.max_per_window is not None:
                allowed = min(allowed, max(0, self.budget.max_per_window - len(self._window)))
            if self.budget.max_per_thread is not None and thread is not None:
                allowed = min(allowed, max(0, self.budget.max_per_thread - self._threads.get(thread, 0)))
            self._window.extend([now] * allowed)
            if thread is not None and allowed:
                self._threads[thread] = self._threads.get(thread, 0) + allowed
                while len(self._threads) > 100_000:  # bounded memory
                    self._threads.pop(next(iter(self._threads)))
            self.granted += allowed
            self.refused += n - allowed
            return allowed

    async def refund(self, n: int, thread: str | None) -> None:
        """Give back `n` grants: the newest `n` window entries and the thread's count."""
        if n <= 0:
            return
        with self._lock:
            for _ in range(min(n, len(self._window))):
                self._window.pop()
            if thread is not None and thread in self._threads:
                self._threads[thread] = max(0, self._threads[thread] - n)
            self.granted -= n
            self.refunded += n

    def snapshot(self) -> dict[str, int]:
        """Counters for dashboards: granted, refused, refunded and used in the current window."""
        with self._lock:
            self._trim(time.monotonic())
            return {"granted": self.granted, "refused": self.refused, "refunded": self.refunded,
                    "in_window": len(self._window)}
