"""`DecisionCache`: identical decision sets about an identical state are not read twice.

An in-process LRU with an optional time to live, for `CanvasDecisionModel(cache=...)`
outside graphs (inside a LangGraph graph, prefer the node's `cache_policy()`, which
uses LangGraph's own cache). The key is the request's (`DecisionRequest.key`: a SHA-256 of
everything that decides the answer: questions and dependencies, read options, the rendered
state with its images, the gate, the outcome policy, the noise seed) with the engine's served
model and whether reads are constrained.
Two distinct states never share an entry. A response that any engine fault, budget
refusal or failed escalation (cause `target_fault`: the canvas answer standing in for the
target's) touched is never stored: it is decided again on the next call, not replayed.
The cache keeps its own copy of a response and hands out copies, so a caller editing
its response changes no later hit; a hit reports no token usage (nothing was spent).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["DecisionCache"]


class DecisionCache:
    """A thread-safe LRU of decision responses with an optional time to live.

    Args:
        maxsize: Entries kept (least recently used evicted first).
        ttl_s: Seconds an entry stays valid (None: until evicted).
        clock: Monotonic clock (tests pass their own).

    Example:
        ```python
        model = CanvasDecisionModel(engine=engine, cache=DecisionCache(maxsize=1024, ttl_s=300))
        model.invoke(request); model.invoke(request)   # the second makes no engine read
        model.cache.hits, model.cache.misses
        ```
    """

    def __init__(self, maxsize: int = 1024, ttl_s: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.maxsize = maxsize
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"DecisionCache(maxsize={self.maxsize}, ttl_s={self.ttl_s}, size={len(self)})"

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        """The stored value, or None (missing or expired; an expired entry is dropped)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self.ttl_s is not None and self._clock() - entry[0] >= self.ttl_s:
                del self._entries[key]
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[1]

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._entries[key] = (self._clock(), value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
