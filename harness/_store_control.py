"""`StoreControllerState` and `StoreLiveState`: an escalation-rate controller and live certification's
rows, shared by every worker through a LangGraph store, by one mechanism (`WorkerItems`).

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

Live certification (`StoreLiveState`) shares its rows the same way, under `("canvasroute",
"audit", scope)`: each worker's item holds, per question, its epoch and its counts per candidate
threshold; a worker pools its own with the others' of the same epoch (the test depends on the
counts only: `canvasroute.router._audit`). A stopped worker's rows stay counted: they were
labelled, and the sum is the merged sample.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from langgraph.store.base import BaseStore

from canvasroute.router import Audit, Controller, InMemoryControllerState, InMemoryLiveState
from canvasroute.router._control import Observation

from ._store_budget import PerStore, search_all


class WorkerItems:
    """One item per worker under `namespace`, read and written when due: the sharing mechanism of
    `StoreControllerState` and `StoreLiveState`.

    A read (`read`: every other worker's item, one search) is due at the first decision, then
    after `every` decisions or `seconds` seconds, whichever comes first; so is a write (`write`:
    this worker's item, one put). A read or write already running is not waited for, and one that
    fails is due again at the next decision (nothing is lost: the item is rewritten whole).
    """

    def __init__(self, store: BaseStore, namespace: tuple[str, ...], every: int, seconds: float) -> None:
        self.store = store
        self.namespace = namespace
        self.every, self.seconds = every, seconds
        self.worker = uuid.uuid4().hex
        """This worker's item key."""
        self.workers = 1
        """Workers with an item in this namespace, at the last read (this one included)."""
        self.syncs = 0
        """Reads of the other workers' items so far."""
        self._due = {"read": -1, "write": -1}
        """Decisions since the last read and the last write (-1: never: due now)."""
        self._at = {"read": -float("inf"), "write": -float("inf")}
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def _take(self, what: str) -> bool:
        """Whether a read (or write) is due now and not already running; if so, it is this caller's."""
        with self._lock:
            since = self._due[what]
            due = what not in self._busy and (since < 0 or since >= self.every
                                              or time.monotonic() - self._at[what] >= self.seconds)
            if due:
                self._busy.add(what)
                self._due[what] = 0
            return due

    def _done(self, what: str, ok: bool) -> None:
        with self._lock:
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

    def decided(self) -> None:
        """One decision more since the last read and write."""
        with self._lock:
            for what in ("read", "write"):
                if self._due[what] >= 0:
                    self._due[what] += 1

    def write_now(self) -> None:
        """Make the next write due at once (the next decision's end)."""
        with self._lock:
            self._due["write"] = -1

    async def read(self, apply: Callable[[list[dict[str, Any]]], None], *, now: bool = False) -> None:
        """When due (or `now`): every other worker's item value, handed to `apply`."""
        async def work() -> None:
            values, workers = [], 1
            async for item in search_all(self.store, self.namespace):
                if item.key != self.worker:
                    workers += 1
                    values.append(item.value)
            apply(values)
            self.workers = workers
            self.syncs += 1

        await (work() if now else self._when_due("read", work))

    async def write(self, value: Callable[[], dict[str, Any]], *, now: bool = False) -> None:
        """When due (or `now`): this worker's item, `value()` with a time stamp."""
        async def work() -> None:
            await self.store.aput(self.namespace, self.worker, {"ts": time.time(), **value()}, index=False)

        await (work() if now else self._when_due("write", work))


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
        self.items = WorkerItems(store, ("canvasroute", "controller", scope), controller.sync_every,
                                 controller.sync_s)

    @property
    def store(self) -> BaseStore:
        return self.items.store

    @property
    def namespace(self) -> tuple[str, ...]:
        return self.items.namespace

    @property
    def worker(self) -> str:
        """This worker's item key."""
        return self.items.worker

    @property
    def workers(self) -> int:
        """Workers with an item in this scope, at the last sync (this one included)."""
        return self.items.workers

    @property
    def syncs(self) -> int:
        """Reads of the other workers' shares so far."""
        return self.items.syncs

    def __repr__(self) -> str:
        return f"StoreControllerState({type(self.store).__name__}, {self.controller!r}, namespace={self.namespace!r})"

    async def refresh(self) -> None:
        """Read the other workers' shares when due (the start of a decision)."""
        await self.items.read(self._others_from)

    async def observe(self, outcomes: Mapping[str, Observation]) -> None:
        """Record one decision's outcomes here, then write this worker's shares when due."""
        self._update(outcomes)
        self.items.decided()
        await self.items.write(self._mine)

    async def sync(self) -> None:
        """Write this worker's shares and read every other worker's, now."""
        await self.items.write(self._mine, now=True)
        await self.items.read(self._others_from, now=True)

    def _mine(self) -> dict[str, Any]:
        with self._lock:
            return {"questions": {qid: {"share": q.mine, "rate": q.rate, "decisions": q.decisions}
                                  for qid, q in self._questions.items()}}

    def _others_from(self, values: list[dict[str, Any]]) -> None:
        others: dict[str, float] = {}
        for value in values:
            for qid, entry in (value.get("questions") or {}).items():
                others[qid] = others.get(qid, 0.0) + float(entry.get("share", 0.0))
        with self._lock:
            self._others = others  # (apart from this worker's own questions: reading never evicts them)

    def snapshot(self) -> dict[str, Any]:
        """`InMemoryControllerState.snapshot` (offsets as this worker sees them; its own rates), and
        `workers` and `syncs`."""
        return {**super().snapshot(), "workers": self.workers, "syncs": self.syncs}


class StoreLiveState(InMemoryLiveState):
    """Live certification's rows shared by every worker through a LangGraph `BaseStore` (e.g. `PostgresStore`).

    Each worker owns one item under `("canvasroute", "audit", scope)` (`WorkerItems`, as the
    controller's): per question, its epoch, its rows and disagreements per candidate threshold and
    the audits it sent. A worker tests its own counts plus the others' of the same epoch as last
    read (the e-value depends on the counts only, so pooling them is testing the merged rows;
    `canvasroute.router._audit` says why that is valid); it adopts a later epoch it reads (another
    worker's drift alarm), and writes its own at once after an alarm of its own.

    Args:
        store: the store every worker shares (sync or async implementation).
        audit: the audit whose rows it keeps.
        scope: names this audit in the store: `("canvasroute", "audit", scope)`.

    Example:
        ```python
        with PostgresStore.from_conn_string(DSN) as store:
            store.setup()
            state = StoreLiveState(store, Audit(rate=0.02), scope="triage")
            model = CanvasDecisionModel(engine=..., policy=GatePolicy(rereads=0), escalate_to=Escalation(
                target, audit=state.audit, audit_state=state))
        ```
    """

    def __init__(self, store: BaseStore, audit: Audit, *, scope: str = "default") -> None:
        if not isinstance(store, BaseStore):
            raise TypeError(f"store must be a langgraph BaseStore, not {type(store).__name__}")
        super().__init__(audit)
        self.items = WorkerItems(store, ("canvasroute", "audit", scope), audit.sync_every, audit.sync_s)
        self._fired = False
        """A drift alarm was raised here since the last write."""

    def __repr__(self) -> str:
        return (f"StoreLiveState({type(self.items.store).__name__}, {self.audit!r}, "
                f"namespace={self.items.namespace!r})")

    async def refresh(self) -> None:
        """Read the other workers' rows when due (the start of a decision)."""
        await self.items.read(self._merged)

    async def decided(self) -> None:
        """Write this worker's rows when due (the end of a decision)."""
        self.items.decided()
        await self.items.write(self._mine)

    async def sync(self) -> None:
        """Write this worker's rows and read every other worker's, now (and write again when what it
        read raised an alarm here)."""
        await self.items.write(self._mine, now=True)
        self._fired = False
        await self.items.read(self._merged, now=True)
        if self._fired:
            await self.items.write(self._mine, now=True)

    def _alarmed(self) -> None:
        self._fired = True
        self.items.write_now()

    def _mine(self) -> dict[str, Any]:
        return {"questions": self.mine()}

    def _merged(self, values: list[dict[str, Any]]) -> None:
        self.merge(value.get("questions") or {} for value in values)

    def snapshot(self) -> dict[str, Any]:
        """`InMemoryLiveState.snapshot` (pooled as this worker last read), and `workers` and `syncs`."""
        return {**super().snapshot(), "workers": self.items.workers, "syncs": self.items.syncs}


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


_LIVE: PerStore[tuple[Audit, str], StoreLiveState] = PerStore()


def store_live(model: Any, store: BaseStore | None) -> StoreLiveState | None:
    """The state that keeps `model`'s live certification rows in the graph's `store`, or None when
    there is no store, no audit, or the model's escalation brings its own state (one per store and
    scope, `CanvasDecisionModel.live_scope`, as `store_controller`)."""
    scope = model.live_scope
    if store is None or scope is None:
        return None
    audit = model.escalation.audit
    return _LIVE.get(store, (audit, scope), lambda: StoreLiveState(store, audit, scope=scope))


__all__ = ["StoreControllerState", "StoreLiveState", "WorkerItems", "store_controller", "store_live"]
