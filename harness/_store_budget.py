"""`StoreBudgetMeter`: escalation budgets shared by every worker through a LangGraph store.

A `BaseStore` has get/put/search/delete but no atomic increment or conditional put
(PostgresStore's put is an upsert), so the meter never updates a counter. Each wanted
escalation is an *intent*: an item with a unique key (`uuid4`) and a wall-clock stamp,
put under the budget's namespace (and under the thread's, for per-thread caps). Then:

1. write: put my intents (one per escalation asked for), state `pending`;
2. read: list every intent in the namespace; count the *others* (all intents not mine,
   pending or granted) stamped within `window_s` of mine;
3. decide: keep `max_per_window - others` of mine (and likewise for the thread cap),
   mark them `granted`, delete the rest. If only pending intents stood in the way,
   back off (jittered) and try again for the rest; if granted ones did, refuse.

Guarantee: in any stretch of intent stamps shorter than `window_s`, at most
`max_per_window` granted escalations exist, however many workers share the store.
Proof: order the granted intents of such a stretch by when their put committed. The last
one read after its own put, so after every other put of the set had committed: it saw
them all (deletes come only from refunds, i.e. escalations that did not happen) and
counted each as an other. It kept only `max - others` of its own, so the set holds at
most `max`. Counting pending intents of others (which may yet be withdrawn) is what
makes this safe; the price is under-use under contention, which the retries reduce.
The same argument bounds each thread's total. Stamps are `time.time()` of the worker
that wrote them: the window is as exact as the workers' clocks agree.

A refund deletes the newest intents this process granted for that thread, in both
namespaces, so every worker sees the freed capacity on its next read. Intents older
than two windows are swept by whichever worker reads them.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

from langgraph.store.base import BaseStore, Item, PutOp

from canvasroute.router import EscalationBudget

K = TypeVar("K")
V = TypeVar("V")
_PAGE = 10_000
_ATTEMPTS = 8
_NO_THREAD = ""


class StoreBudgetMeter:
    """A `canvasroute.router.BudgetMeter` whose counts live in a LangGraph `BaseStore` (e.g. `PostgresStore`).

    Args:
        store: the store every worker shares (sync or async implementation).
        budget: the caps (`max_per_window`, `window_s`, `max_per_thread`).
        scope: names this budget in the store, so models with their own budgets keep
            their own counts: `("canvasroute", "budget", scope, ...)`.
        attempts: tries when only other workers' pending intents stand in the way.
        backoff: first retry delay in seconds (doubled per try, jittered).

    Example:
        ```python
        with PostgresStore.from_conn_string(DSN) as store:
            store.setup()
            meter = StoreBudgetMeter(store, EscalationBudget(max_per_window=100, window_s=60))
            model = CanvasDecisionModel(engine=..., escalate_to=Escalation(target, budget=meter.budget, meter=meter))
        ```
    """

    def __init__(self, store: BaseStore, budget: EscalationBudget, *, scope: str = "default",
                 attempts: int = _ATTEMPTS, backoff: float = 0.01) -> None:
        if not isinstance(store, BaseStore):
            raise TypeError(f"store must be a langgraph BaseStore, not {type(store).__name__}")
        if not isinstance(budget, EscalationBudget):
            raise TypeError(f"budget must be an EscalationBudget, not {type(budget).__name__}")
        if attempts < 1 or backoff < 0:
            raise ValueError("attempts must be >= 1 and backoff >= 0")
        self.store = store
        self.budget = budget
        self.namespace = ("canvasroute", "budget", scope)
        self.attempts = attempts
        self.backoff = backoff
        self._mine: dict[str, list[str]] = defaultdict(list)
        """Keys of intents granted by this process, per thread, oldest first (for refunds)."""
        self.granted = self.refused = self.refunded = 0
        self.in_window = 0
        """Intents in the window at this process's last read (all workers)."""

    def __repr__(self) -> str:
        return f"StoreBudgetMeter({type(self.store).__name__}, {self.budget!r}, namespace={self.namespace!r})"

    # -- BudgetMeter --------------------------------------------------------------------

    async def take(self, n: int, thread: str | None) -> int:
        """Reserve up to `n` escalations for `thread`; returns how many were granted."""
        if n <= 0:
            return 0
        got = 0
        for attempt in range(self.attempts):
            kept, contended = await self._try(n - got, thread)
            got += kept
            if got == n or not contended:
                break
            await asyncio.sleep(self.backoff * 2 ** attempt * (0.5 + random.random()))
        self.granted += got
        self.refused += n - got
        return got

    async def refund(self, n: int, thread: str | None) -> None:
        """Give back `n` grants of `thread` taken by this process: delete its newest intents."""
        if n <= 0:
            return
        mine = self._mine[thread or _NO_THREAD]
        keys = [mine.pop() for _ in range(min(n, len(mine)))]
        await self._delete(keys, thread)
        self.granted -= n
        self.refunded += n

    def snapshot(self) -> dict[str, int]:
        """This process's granted, refused and refunded counts; `in_window` as last read (all workers)."""
        return {"granted": self.granted, "refused": self.refused, "refunded": self.refunded,
                "in_window": self.in_window}

    # -- one round: write, read, decide ---------------------------------------------------

    def _thread_ns(self, thread: str | None) -> tuple[str, ...] | None:
        if thread is None or self.budget.max_per_thread is None:
            return None
        return (*self.namespace, "thread", thread)

    async def _try(self, n: int, thread: str | None) -> tuple[int, bool]:
        """One round for `n` intents: (how many were kept, whether pending intents blocked any)."""
        window_ns, thread_ns = (*self.namespace, "window"), self._thread_ns(thread)
        stamp = time.time()
        keys = [uuid.uuid4().hex for _ in range(n)]
        value = {"ts": stamp, "state": "pending", "thread": thread}
        await self._put(keys, value, thread_ns)
        allowed, contended, in_window = n, False, None
        if self.budget.max_per_window is not None:
            others = await self._others(window_ns, keys, stamp, self.budget.window_s, sweep=True)
            allowed, contended = self._fit(allowed, others, self.budget.max_per_window, contended)
            in_window = len(others)
        if thread_ns is not None:
            others = await self._others(thread_ns, keys, stamp, None, sweep=False)
            allowed, contended = self._fit(allowed, others, self.budget.max_per_thread, contended)
        kept, dropped = keys[:allowed], keys[allowed:]
        if in_window is not None:
            self.in_window = in_window + len(kept)
        if kept:
            await self._put(kept, {**value, "state": "granted"}, thread_ns)
            self._mine[thread or _NO_THREAD].extend(kept)
        await self._delete(dropped, thread)
        return len(kept), contended and allowed < n

    @staticmethod
    def _fit(wanted: int, others: list[dict[str, Any]], cap: int | None, contended: bool) -> tuple[int, bool]:
        if cap is None:
            return wanted, contended
        room = max(0, cap - len(others))
        if room < wanted and sum(o.get("state") == "granted" for o in others) < cap:
            contended = True  # pending intents of other workers may yet be withdrawn
        return min(wanted, room), contended

    async def _others(self, ns: tuple[str, ...], mine: list[str], stamp: float, window: float | None,
                      *, sweep: bool) -> list[dict[str, Any]]:
        """Values of every other intent in `ns` (within `window` of `stamp`, when given)."""
        own, out, stale = set(mine), [], []
        async for item in search_all(self.store, ns):
            if item.key in own:
                continue
            ts = float(item.value.get("ts", 0.0))
            if window is None or abs(ts - stamp) < window:
                out.append(item.value)
            elif sweep and ts < stamp - 2 * window:
                stale.append(item.key)
        if stale:
            await self.store.abatch([PutOp(ns, key, None) for key in stale])
        return out

    async def _put(self, keys: list[str], value: dict[str, Any], thread_ns: tuple[str, ...] | None) -> None:
        ops = [PutOp((*self.namespace, "window"), key, value, index=False) for key in keys]
        if thread_ns is not None:
            ops += [PutOp(thread_ns, key, value, index=False) for key in keys]
        await self.store.abatch(ops)

    async def _delete(self, keys: list[str], thread: str | None) -> None:
        if not keys:
            return
        ops = [PutOp((*self.namespace, "window"), key, None) for key in keys]
        if (thread_ns := self._thread_ns(thread)) is not None:
            ops += [PutOp(thread_ns, key, None) for key in keys]
        await self.store.abatch(ops)


async def search_all(store: BaseStore, ns: tuple[str, ...]) -> AsyncIterator[Item]:
    """Every item in `ns`, a page of `_PAGE` at a time."""
    offset = 0
    while True:
        page = await store.asearch(ns, limit=_PAGE, offset=offset)
        for item in page:
            yield item
        if len(page) < _PAGE:
            return
        offset += _PAGE


class PerStore(Generic[K, V]):
    """One value per graph store and key, made on first use (thread-safe); a store's values go
    with it (weakly keyed). Every worker running the same model shares one meter or controller
    state this way, and two models with settings of their own keep their own."""

    def __init__(self) -> None:
        self._values: weakref.WeakKeyDictionary[Any, dict[K, V]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, store: BaseStore, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            values = self._values.setdefault(store, {})
            if key not in values:
                values[key] = make()
            return values[key]


_METERS: PerStore[tuple[EscalationBudget, str], StoreBudgetMeter] = PerStore()


def store_meter(model: Any, store: BaseStore | None) -> StoreBudgetMeter | None:
    """The meter that counts `model`'s budget in the graph's `store`, or None when there is no
    store, no budget, or the model's escalation brings its own meter.

    One meter per store and budget scope (`CanvasDecisionModel.budget_scope`: the escalation's
    `name`, else the model's name, its target and its budget), so every worker running the same
    model shares one count, and two models with budgets of their own keep their own.
    """
    scope = model.budget_scope
    if store is None or scope is None:
        return None
    budget = model.escalation.budget
    return _METERS.get(store, (budget, scope), lambda: StoreBudgetMeter(store, budget, scope=scope))


__all__ = ["PerStore", "StoreBudgetMeter", "store_meter"]
