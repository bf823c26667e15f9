"""The escalation guards' state: one `BreakerState` per model, in this process (`Escalation.breaker`).

Two guards keep the escalation target's traffic bounded when something fails (`Breaker` holds
their settings):

- The target's circuit breaker. `failures` failed calls within `window_s`, with no call answering
  in between, open it. While it is open no decision calls the target: `admit` raises `BreakerOpen`
  (a short circuit) and the questions that wanted the target take `OutcomePolicy.target_fault`.
  After `cooldown_s` it is half open: the next call is a probe, the others still short-circuit; the
  probe's answer closes the breaker, its failure opens it for another `cooldown_s`. A call failed
  when the network or the target failed (`EscalationError.failure` `network` or `target`, a timeout
  included); a call that answered (a refusal, or a reply outside the options: the target is up)
  succeeded; a call cancelled (a hedge the re-reads beat, a decision cancelled) is neither.
- The engine-fault cap. Engine faults may escalate at most `fault_escalations` questions per
  `window_s` (a rolling window, counted as `InMemoryBudgetMeter` counts a budget); past it a
  question is over budget (`OutcomePolicy.over_budget`), never a cheap answer.

Every change of state is logged once (WARNING, logger `canvasroute.router`), marked on the decide
span of the decision during which it happened and counted (`canvasroute.guard` event,
`canvasroute.guards` metric, `telemetry.record_guard`); so is every decision a guard kept from the
target (`short_circuit`, `refused`), which is not logged: the change of state that began it was.

Per process and per model, on purpose, where a graph store shares a budget's counts and a
controller's offsets between workers (`canvasroute.harness.StoreBudgetMeter`,
`StoreControllerState`):

- a breaker is about what this process can reach: a worker cut off from the target (its network
  path, its connection pool) must not open the breaker of workers that reach it;
- the breaker is asked on every escalation: a store round trip there would add latency, and make
  the breaker depend on the store (a store outage would become a breaker fault);
- the bound stays known: N workers send a dead target at most N x `failures` calls per
  `cooldown_s` (plus one probe each), and an engine outage adds at most N x `fault_escalations`
  questions per `window_s`. A cap on the total is what a shared `EscalationBudget` is for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

from canvasroute.engine import BreakerOpen, EscalationError

from . import telemetry as tm
from ._policy import Breaker

__all__ = ["BreakerState", "watched"]

logger = logging.getLogger("canvasroute.router")

State = Literal["closed", "open", "half_open"]


class BreakerState:
    """A breaker's state and counts for one model in this process (thread-safe).

    `admit` before a target call (raises `BreakerOpen` when the call must not be made), then
    exactly one of `answered`, `failed` or `abandoned`; `take_faults`/`refund_faults` around the
    engine faults a decision escalates.
    """

    def __init__(self, breaker: Breaker, target: str = "the escalation target") -> None:
        self.breaker = breaker
        self.target = target
        self._lock = threading.Lock()
        self._state: State = "closed"
        self._failed: deque[float] = deque()
        """When each failure of the current run failed (monotonic seconds)."""
        self._opened = 0.0
        self._probing = False
        self._last = ""
        """The last failure, in words."""
        self._failure: Literal["network", "target", "format"] = "network"
        self._faults: deque[float] = deque()
        """When each engine-fault escalation in the window was granted."""
        self._capped = False
        self.counts: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"BreakerState({self.breaker!r}, state={self._state!r})"

    @property
    def state(self) -> State:
        """`closed`, `open` or `half_open` (an open breaker past its cooldown reads `open` until a call probes)."""
        return self._state

    # -- the target's breaker ---------------------------------------------------------------

    def allows(self) -> bool:
        """Whether a call now would be made (closed, or a probe's turn); changes nothing."""
        with self._lock:
            if self._state == "closed":
                return True
            if self._state == "open":
                return time.monotonic() - self._opened >= self.breaker.cooldown_s
            return not self._probing

    def admit(self, question_ids: Sequence[str]) -> bool:
        """Let a call for `question_ids` through: True when it is the half-open probe.

        Raises:
            BreakerOpen: the breaker is open (or a probe is in flight): no call may be made.
        """
        now = time.monotonic()
        with self._lock:
            if self._state == "closed":
                return False
            if self._state == "open" and now - self._opened >= self.breaker.cooldown_s:
                self._state, self._probing = "half_open", True
                self.counts["half_open"] += 1
                change = True
            elif self._state == "half_open" and not self._probing:
                self._probing, change = True, False
            else:
                self.counts["short_circuits"] += 1
                wait = max(0.0, self.breaker.cooldown_s - (now - self._opened)) if self._state == "open" else 0.0
                last, failure = self._last, self._failure
                change = None
        if change is None:
            when = f"it is probed again in {wait:.1f} s" if wait else "a probe call is in flight"
            message = (f"the circuit breaker of escalation target {self.target} is open ({last}); the target was "
                       f"not called; {when}")
            tm.record_guard("breaker", "short_circuit", message, question_ids)
            raise BreakerOpen(message, failure=failure,
                              hint="check the escalation target; until it answers, the questions that want it take "
                                   "OutcomePolicy.target_fault (Escalation(breaker=Breaker(...)) tunes the breaker)")
        if change:
            self._changed("half_open", f"escalation target {self.target}: circuit breaker half open after "
                                       f"{self.breaker.cooldown_s:g} s: one call probes the target")
        return True

    def answered(self, probe: bool) -> None:
        """An admitted call the target answered: the run of failures ends; an open breaker closes."""
        with self._lock:
            self._failed.clear()
            if probe:
                self._probing = False
            closes = self._state != "closed"
            if closes:
                self._state = "closed"
                self.counts["closed"] += 1
        if closes:
            self._changed("closed", f"escalation target {self.target} answered again: circuit breaker closed")

    def failed(self, probe: bool, exc: EscalationError) -> None:
        """An admitted call that failed; a reply outside the options counts as answered (the target is up)."""
        if exc.failure == "format":
            self.answered(probe)
            return
        now = time.monotonic()
        with self._lock:
            self.counts["failures"] += 1
            self._last, self._failure = f"{type(exc).__name__}: {exc.message}", exc.failure
            if probe:
                self._probing = False
            opens = False
            if self._state == "half_open":
                opens, why = True, f"the probe failed ({self._last})"
            elif self._state == "closed":
                window = self.breaker.window_s
                while self._failed and now - self._failed[0] > window:
                    self._failed.popleft()
                self._failed.append(now)
                if len(self._failed) >= self.breaker.failures:
                    opens, why = True, f"{len(self._failed)} failed calls within {window:g} s (last: {self._last})"
            if opens:
                self._state, self._opened = "open", now
                self._failed.clear()
                self.counts["open"] += 1
        if opens:
            self._changed("open", f"escalation target {self.target}: circuit breaker open after {why}; for "
                                  f"{self.breaker.cooldown_s:g} s no decision calls it, and the questions that want it "
                                  "take OutcomePolicy.target_fault")

    def abandoned(self, probe: bool) -> None:
        """An admitted call that ended with no verdict (cancelled, or never sent): a probe's turn is free again."""
        if probe:
            with self._lock:
                self._probing = False

    @contextmanager
    def watching(self, probe: bool) -> Iterator[None]:
        """Around an admitted call: the breaker learns how it ended (`answered`; `failed` on an
        `EscalationError`; `abandoned` on anything else, a cancellation among them)."""
        try:
            yield
        except EscalationError as exc:
            self.failed(probe, exc)
            raise
        except BaseException:
            self.abandoned(probe)
            raise
        self.answered(probe)

    # -- the engine-fault cap ---------------------------------------------------------------

    def take_faults(self, question_ids: Sequence[str]) -> int:
        """Grant up to `len(question_ids)` engine-fault escalations (the first ones); the rest are refused."""
        n, cap = len(question_ids), self.breaker.fault_escalations
        if cap is None or not n:
            return n
        window = self.breaker.window_s
        now = time.monotonic()
        with self._lock:
            while self._faults and now - self._faults[0] >= window:
                self._faults.popleft()
            granted = min(n, max(0, cap - len(self._faults)))
            self._faults.extend([now] * granted)
            refused = n - granted
            change: str | None = None
            if refused:
                self.counts["fault_refused"] += refused
                if not self._capped:
                    self._capped, change = True, "capped"
            elif self._capped:
                self._capped, change = False, "uncapped"
            if change is not None:
                self.counts[change] += 1
        if change == "capped":
            self._changed("capped", f"engine faults' escalations to {self.target} capped: {cap} questions within "
                                    f"{window:g} s (Breaker.fault_escalations); engine faults past it are over budget "
                                    "(OutcomePolicy.over_budget: their fallback, or BudgetExhausted) until the window "
                                    "has room", guard="fault_cap")
        elif change == "uncapped":
            self._changed("uncapped", f"engine faults escalate to {self.target} again: the cap's window has room",
                          guard="fault_cap")
        if refused:
            tm.record_guard("fault_cap", "refused", f"{refused} engine fault(s) past the cap of {cap} per {window:g} s "
                                                    "were not escalated", question_ids[granted:])
        return granted

    def refund_faults(self, n: int) -> None:
        """Give back `n` engine-fault grants that did not become escalations (the newest)."""
        if n <= 0 or self.breaker.fault_escalations is None:
            return
        with self._lock:
            for _ in range(min(n, len(self._faults))):
                self._faults.pop()

    # -- reporting --------------------------------------------------------------------------

    def _changed(self, what: str, message: str, guard: str = "breaker") -> None:
        """A change of state: logged once, marked on the current decide span, counted."""
        logger.warning("%s", message)
        tm.record_guard(guard, what, message)

    def snapshot(self) -> dict[str, Any]:
        """For dashboards and `/metrics`: the breaker's `state`; its changes of state (`open`,
        `half_open`, `closed`), `short_circuits` (calls not made) and `failures` (failed calls); the
        cap's `fault_cap` (None: uncapped), `fault_escalations` granted in the window now,
        `fault_refused` (questions past it), `capped` and `uncapped` (its changes)."""
        cap = self.breaker.fault_escalations
        with self._lock:
            now = time.monotonic()
            while self._faults and now - self._faults[0] >= self.breaker.window_s:
                self._faults.popleft()
            counts = {k: self.counts[k] for k in ("open", "half_open", "closed", "short_circuits", "failures",
                                                  "fault_refused", "capped", "uncapped")}
            return {"state": self._state, **counts, "fault_cap": cap, "fault_escalations": len(self._faults)}


def watched(breaker: BreakerState | None, probe: bool) -> AbstractContextManager[None]:
    """`breaker.watching(probe)`, or nothing to watch without a breaker."""
    return breaker.watching(probe) if breaker is not None else nullcontext()
