"""`BudgetMeter`: counts escalations against an `EscalationBudget`."""

from __future__ import annotations

import threading
import time
from collections import deque

from ._policy import EscalationBudget


class BudgetMeter:
    """Counts escalations against an `EscalationBudget` (thread-safe)."""

    def __init__(self, budget: EscalationBudget) -> None:
        self.budget = budget
        self._window: deque[float] = deque()
        self._threads: dict[str, int] = {}
        self._lock = threading.Lock()
        self.granted = 0
        self.refused = 0

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0] >= self.budget.window_s:
            self._window.popleft()

    def take(self, n: int, thread: str | None) -> int:
        """Reserve up to n escalations; returns how many were granted."""
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            allowed = n
            if self.budget.max_per_window is not None:
                allowed = min(allowed, max(0, self.budget.max_per_window - len(self._window)))
            if self.budget.max_per_thread is not None and thread is not None:
                used = self._threads.get(thread, 0)
                allowed = min(allowed, max(0, self.budget.max_per_thread - used))
            self._window.extend([now] * allowed)
            if thread is not None:
                self._threads[thread] = self._threads.get(thread, 0) + allowed
                while len(self._threads) > 100_000:  # bounded memory
                    self._threads.pop(next(iter(self._threads)))
            self.granted += allowed
            self.refused += n - allowed
            return allowed

    def snapshot(self) -> dict[str, int]:
        """Counters for dashboards: granted, refused and used in the current window."""
        with self._lock:
            self._trim(time.monotonic())
            return {"granted": self.granted, "refused": self.refused, "in_window": len(self._window)}
