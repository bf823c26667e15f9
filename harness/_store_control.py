"""`StoreControllerState`: an escalation-rate controller shared by every worker through a LangGraph store.

A `BaseStore` has no atomic increment, so no worker ever updates a value another writes. Each
worker (one `StoreControllerState` per process, store and scope) owns ONE item, keyed by its own
id under `("canvasroute", "controller", scope)`: per question, its share of the offset (the sum
of the steps its own decisions took), its decayed rate and its decision count. A worker's offset
for a question is its own share (always current) plus the other workers' shares as it last read
them; the shared offset is the sum over every item.

At the start of a decision the worker reads every other item (one search), at its end it
writes its own (one put): each at the first decision, then after `Controller.sync_every`
decisions or `sync_s` seconds, whichever comes first. `sync_every=1` reads before and writes
after every decision, so workers taking turns take exactly the steps one controller would;
larger values trade that for fewer store calls (workers then see each other's steps late by up
to that many decisions; the bench's figure shows 4 workers on one store holding the target). A
worker never waits for a busy read: it steers with the shares as last read. A read or write
that fails is due again at the next decision, and nothing is lost (the item is rewritten whole).

Anti-windup is per worker: a step that would take the offset (as the worker sees it) past its
bounds stops there. Staleness can carry the true sum past a bound by the steps not yet seen; the
threshold applied is clamped to the bounds anyway (`canvasroute.router._control.steer`).

The items persist: a worker that stops leaves its share in the sum (it is part of the integral),
and a new process adds an item of its own. One small item per worker process ever started in
this scope; prune the namespace when the fleet is replaced if that grows.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from langgraph.store.base import BaseStore

from canvasroute.router import Controller, InMemoryControllerState
from canvasroute.router._control import Observation

from ._store_budget import PerStore, search_all


class StoreControllerState(InMemoryControllerState):
    """A `canvasroute.router.ControllerState` whose offsets live in a LangGraph `BaseStore` (e.g. `PostgresStore`).

    Args:
        store: the store every worker shares (sync or async implementation).
        controller: the controller whose offsets it keeps.
        scope: names this controller in the store, so models with controllers of their own keep
            their own offsets: `("canvasroute", "controller", scope)`.

    Example:
        ```python
        with PostgresStore.from_conn_string(DSN) as store:
            store.setup()
            state = StoreControllerState(store, Controller(target=0.2), scope="triage")
            model = CanvasDecisionModel(engine=..., escalate_to=Escalation(
                target, controller=state.controller, controller_state=state))
        ```
    """

    def __init__(self, store: BaseStore, controller: Controller, *, scope: str = "default") -> None:
        if not isinstance(store, BaseStore):
            raise TypeError(f"store must be a langgraph BaseStore, not {type(store).__name__}")
        super().__init__(controller)
        self.store = store
        self.namespace = ("canvasroute", "controller", scope)
        self.worker = uuid.uuid4().hex
        """This worker's item key."""
        self.workers = 1
        """Workers with an item in this scope, at the last sync (this one included)."""
        self.syncs = 0
        """Reads of the other workers' shares so far."""
        self._due = {"read": -1, "write": -1}
        """Decisions since the last read and the last write (-1: never: due now)."""
        self._at = {"read": -float("inf"), "write": -float("inf")}
        self._busy: set[str] = set()
        self._sync_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"StoreControllerState({type(self.store).__name__}, {self.controller!r}, namespace={self.namespace!r})"

    def _take(self, what: str) -> bool:
        """Whether a read (or write) is due now and not already running; if so, it is this caller's."""
        c = self.controller
        with self._sync_lock:
            since = self._due[what]
            due = what not in self._busy and (since < 0 or since >= c.sync_every
                                              or time.monotonic() - self._at[what] >= c.sync_s)
            if due:
                self._busy.add(what)
                self._due[what] = 0
            return due

    def _done(self, what: str, ok: bool) -> None:
        with self._sync_lock:
            self._busy.discard(what)
            if ok:
                self._at[what] = time.monotonic()
            else:
                self._due[what] = -1  # due again at the next decision

    async def _when_due(self, what: str, work: Callable[[], Awaitable[None]]) -> None:
        if not self._take(what):
            return
        ok = False
        try:
            await work()
            ok = True
        finally:
            self._done(what, ok)

    async def refresh(self) -> None:
        """Read the other workers' shares when due (the start of a decision)."""
        await self._when_due("read", self._read)

    async def observe(self, outcomes: Mapping[str, Observation]) -> None:
        """Record one decision's outcomes here, then write this worker's shares when due."""
        self._update(outcomes)
        with self._sync_lock:
            for what in ("read", "write"):
                if self._due[what] >= 0:
                    self._due[what] += 1
        await self._when_due("write", self._write)

    async def sync(self) -> None:
        """Write this worker's shares and read every other worker's, now."""
        await self._write()
        await self._read()

    async def _write(self) -> None:
        with self._lock:
            mine = {qid: {"share": q.mine, "rate": q.rate, "decisions": q.decisions}
                    for qid, q in self._questions.items()}
        await self.store.aput(self.namespace, self.worker, {"ts": time.time(), "questions": mine}, index=False)

    async def _read(self) -> None:
        others: dict[str, float] = {}
        workers = 1
        async for item in search_all(self.store, self.namespace):
            if item.key == self.worker:
                continue
            workers += 1
            for qid, value in (item.value.get("questions") or {}).items():
                others[qid] = others.get(qid, 0.0) + float(value.get("share", 0.0))
        with self._lock:
            self._others = others  # (apart from this worker's own questions: reading never evicts them)
        self.workers = workers
        self.syncs += 1

    def snapshot(self) -> dict[str, Any]:
        """`InMemoryControllerState.snapshot` (offsets as this worker sees them; its own rates), and
        `workers` and `syncs`."""
        return {**super().snapshot(), "workers": self.workers, "syncs": self.syncs}


_STATES: PerStore[tuple[Controller, str], StoreControllerState] = PerStore()


def store_controller(model: Any, store: BaseStore | None) -> StoreControllerState | None:
    """The state that keeps `model`'s controller in the graph's `store`, or None when there is no
    store, no controller, or the model's escalation brings its own state.

    One state per store and scope (`CanvasDecisionModel.controller_scope`), so every decision of
    this process running the same model shares one worker item, and two models with controllers
    of their own keep their own offsets.
    """
    scope = model.controller_scope
    if store is None or scope is None:
        return None
    controller = model.escalation.controller
    return _STATES.get(store, (controller, scope), lambda: StoreControllerState(store, controller, scope=scope))


__all__ = ["StoreControllerState", "store_controller"]
