"""The escalation-rate controller: each question's threshold moves so its escalation rate holds a target.

A `Controller` (on `Escalation(controller=...)`) is a set point, beside the budget's cap. Per
question it controls, it keeps an offset that moves the gate's `max_normalized_entropy`:

    threshold = base + offset, the offset rounded to `Controller.resolution` (the base never is)
    offset   <- clamp(offset + step * (escalated - target), low, high)   after each decision

This is adaptive conformal inference (ACI: Gibbs & Candès, "Adaptive Conformal Inference Under
Distribution Shift", NeurIPS 2021) with the escalation indicator as its miscoverage, i.e. the
integral term of conformal PID control (Angelopoulos, Candès & Tibshirani, "Conformal PID Control
for Time Series Prediction", NeurIPS 2023); the proportional and derivative terms are left out: on
a 0/1 signal they only jitter the threshold. Too many escalations loosen the threshold, too few
tighten it; each step is at most `step * max(target, 1 - target)`.

What it holds, and what not: ACI's bound is deterministic, for any stream: over a stretch of T
decisions of a question in which no update was clamped, the offset moved by exactly
`step * sum(escalated - target)`, so the realised rate is within `(high - low) / (step * T)` of
the target; how fast it settles after a drift depends on the stream (`canvasroute bench --only
controller`). It holds a rate, not an error bound: a looser threshold passes more answers the
canvas is unsure of.

Bounds (anti-windup): `low`/`high` are `-max_offset`/`max_offset`, narrowed so the threshold stays
within [0, 1], and `high` is 0 for a certified gate (`Certificate.certified`) unless `loosen_certified`: a
certified gate is only tightened, so it never passes an answer its certified threshold would
not. A gate the controller moved drops its certificate for that decision (as any override does:
the bound was proved on the certified threshold, and Learn then Test's sequence does not cover
every stricter one), so its `gate` text claims nothing it was not proved for; held at its
certified threshold it keeps it. An update that would leave the bounds stops at them (it is not
integrated), so the offset never winds up past what it can apply. Only the offset is rounded to the
resolution, never the base: a gate at offset 0 is gated at its own threshold exactly (a calibrated
0.431518 stays 0.431518, certificate and all), a moved one at the base plus whole grid steps.
Under live certification (`Escalation.audit`) the base is the live certified threshold, set
before the controller steers (`canvasroute.router._audit`), and a live certificate is a
certificate: only tightened, unless told.

An uncertified gate that passes nothing (`Certificate.passes_nothing`) does so whatever its
threshold: the controller leaves it alone, as it does a gate without an entropy threshold; one
that gates on its own threshold, uncertified (`fallback="threshold"`), claims no bound, and the
controller moves it either way like any gate.

What counts as escalated: a question the gate did not pass: cause `uncertain` or `abstained`,
`over_budget` (the budget refused its escalation, but the gate did not pass it either: the
set point is about the gate, the cap about calls, so a spent budget does not wind the controller
up) and `target_fault` (the target failed or its breaker was open: the gate did not pass it all the
same, so an outage of the target leaves the rate the controller sees as it was). What does not
count: engine faults (not a gate outcome), skipped questions, cache hits (nothing was gated again)
and canvas-only reads (shadow mode, eval: no escalation). Every other question is one observation,
once per decision, whatever its action then did: a decision that raised its outcome
(`OutcomePolicy(over_budget="raise")` past a spent budget, `uncertain="raise"`, an escalation that
failed for good) is observed for every question it gated before it raised, as the same decision
answering would be (else only the answers the gate passed reach the controller, and a spent budget
tightens it). A decision that failed with a fault that may pass by itself (a `retryable` error: a
target that timed out, an engine that is down), or with an exception that is not canvasroute's (an
`interrupt()` inside the target), is not: a retry, or the resume, decides it again and is observed
then.

When: the effective thresholds are applied to the request once, at the start of its run
(`steer`: the state refreshed, then a `replace` of the request's gates, so every stage, the
cache key and the records see them; each question's `gate` text says its threshold), and the
outcomes are observed once, at the end (`observe`). The state lives outside the frozen values
(`ControllerState`): one in this process (`InMemoryControllerState`), or a graph store's, shared
by every worker (`canvasroute.harness.StoreControllerState`, which a decision node in a graph
with a store uses).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from . import telemetry as tm
from ._policy import Controller, ControlSetting, GatePolicy

if TYPE_CHECKING:
    from ._request import DecisionRequest

__all__ = ["ControllerState", "InMemoryControllerState", "Observation", "controls", "observe", "steer", "steered"]

logger = logging.getLogger("canvasroute.router")

KEEP = 4096
"""Questions a state keeps (least recently decided dropped first): a server's clients name them."""


class Observation(NamedTuple):
    """One question's outcome in one decision, with the bounds its offset had there."""

    escalated: bool
    """The gate did not pass it (uncertain, abstained, over budget, or its escalation failed)."""
    low: float
    high: float


@runtime_checkable
class ControllerState(Protocol):
    """Where a controller's offsets live. `offsets` must not wait on I/O; a shared state reads the
    other workers' in `refresh` (the start of a decision) and writes its own in `observe` (the end)."""

    def offsets(self, questions: Iterable[str]) -> dict[str, float]:
        """Each question's offset as this process holds it now (0 for a question never seen)."""
        ...

    async def refresh(self) -> None:
        """Bring `offsets` up to date when due (a state in one process: nothing to do)."""
        ...

    async def observe(self, outcomes: Mapping[str, Observation]) -> None:
        """One decision's outcomes, by question id."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """For dashboards: `target` and, per question, `offset`, `rate` (realised, decayed) and `decisions`."""
        ...


class _Question:
    __slots__ = ("decisions", "mine", "rate")

    def __init__(self, target: float) -> None:
        self.mine = 0.0
        """This state's share of the offset (all of it, in one process)."""
        self.rate = target
        self.decisions = 0


class InMemoryControllerState:
    """A `ControllerState` in this process (thread-safe), for one model's controller.

    Example:
        ```python
        state = InMemoryControllerState(Controller(target=0.2))
        Escalation(target, controller=state.controller, controller_state=state)
        ```
    """

    def __init__(self, controller: Controller) -> None:
        if not isinstance(controller, Controller):
            raise TypeError(f"controller must be a Controller, not {type(controller).__name__}")
        self.controller = controller
        self._questions: OrderedDict[str, _Question] = OrderedDict()
        """This worker's questions, most recently decided last (at most `KEEP`)."""
        self._others: dict[str, float] = {}
        """The other workers' shares by question, as last read (a shared state replaces it whole)."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.controller!r})"

    def offsets(self, questions: Iterable[str]) -> dict[str, float]:
        with self._lock:
            found, others = self._questions, self._others
            return {qid: (q.mine if (q := found.get(qid)) is not None else 0.0) + others.get(qid, 0.0)
                    for qid in questions}

    async def refresh(self) -> None:
        return None

    async def observe(self, outcomes: Mapping[str, Observation]) -> None:
        self._update(outcomes)

    def _update(self, outcomes: Mapping[str, Observation]) -> None:
        """ACI's step per question, stopped at the bounds (conditional integration: anti-windup)."""
        c = self.controller
        with self._lock:
            for qid, (escalated, low, high) in outcomes.items():
                q = self._question(qid)
                view = q.mine + self._others.get(qid, 0.0)
                moved = min(max(view + c.step * (float(escalated) - c.target), min(low, view)), max(high, view))
                q.mine += moved - view
                q.rate += c.decay * (float(escalated) - q.rate)
                q.decisions += 1

    def _question(self, qid: str) -> _Question:
        """The question's entry, most recent last (the caller holds the lock)."""
        found = self._questions
        q = found.get(qid)
        if q is None:
            q = found[qid] = _Question(self.controller.target)
            while len(found) > KEEP:
                found.popitem(last=False)
        else:
            found.move_to_end(qid)
        return q

    def snapshot(self) -> dict[str, Any]:
        target = self.controller.target
        with self._lock:
            others = self._others
            questions = {qid: {"offset": share, "rate": target, "decisions": 0}  # only other workers decided them
                         for qid, share in others.items() if qid not in self._questions}
            questions.update({qid: {"offset": q.mine + others.get(qid, 0.0), "rate": q.rate, "decisions": q.decisions}
                              for qid, q in self._questions.items()})
            return {"target": target, "questions": questions}


def controls(gate: GatePolicy) -> bool:
    """Whether a controller moves this question's gate: it has an entropy threshold and does not
    pass nothing (an uncertified gate that escalates everything does whatever its threshold)."""
    return gate.max_normalized_entropy is not None and (gate.certificate is None
                                                        or not gate.certificate.passes_nothing)


async def steer(request: DecisionRequest) -> tuple[DecisionRequest, Exception | None]:
    """`request` with its controller's effective thresholds (`steered`), the state refreshed first
    (also for a request already steered, as a node cache's pinned one: the other workers' shares
    are read all the same); and the fault that kept a shared state from refreshing (None: none),
    which `observe` marks and counts: the decision goes on with the offsets as last read (logged
    here, WARNING)."""
    escalation = request.escalation
    if escalation is None or escalation.controller_state is None or request.mode == "canvas_only":
        return request, None
    fault = None
    try:
        await escalation.controller_state.refresh()
    except Exception as exc:  # noqa: BLE001 - stale offsets steer; the fault is logged, marked and counted
        fault = exc
        logger.warning("escalation-rate controller could not refresh its offsets (steering with the last read): "
                       "%s: %s", type(exc).__name__, exc)
    return steered(request), fault


def steered(request: DecisionRequest, pinned: Mapping[str, float] | None = None) -> DecisionRequest:
    """`request` with its controller's effective thresholds in its gates, once, from the state's
    offsets as held now (a request already steered, or without a controller, is returned as it is).
    `pinned`: thresholds to apply instead, by question (what a node cache key was computed with)."""
    escalation = request.escalation
    if (escalation is None or escalation.controller is None or escalation.controller_state is None
            or request.controlled is not None or request.mode == "canvas_only"):
        return request
    c: Controller = escalation.controller
    gates = request.gates
    ids = [qid for qid, g in gates.items() if controls(g)]
    pinned = pinned or {}
    offsets = escalation.controller_state.offsets([qid for qid in ids if qid not in pinned])
    settings: dict[str, ControlSetting] = {}
    changed: dict[str, GatePolicy] = {}
    for qid in ids:
        g = gates[qid]
        base = g.max_normalized_entropy
        assert base is not None
        low, high = max(-c.max_offset, -base), min(c.max_offset, 1.0 - base)
        if g.certificate is not None and g.certificate.certified and not c.loosen_certified:
            high = min(high, 0.0)
        threshold = pinned[qid] if qid in pinned else _threshold(base, offsets.get(qid, 0.0), low, high, c.resolution)
        settings[qid] = ControlSetting(base, threshold, low, high)
        if threshold != base:  # a moved gate no longer claims its certificate: it was proved on its own threshold
            kept = g.certificate if g.certificate is not None and not g.certificate.certified else None  # no claim
            changed[qid] = replace(g, per_question={}, max_normalized_entropy=threshold, certificate=kept)
    if not changed:
        return replace(request, controlled=settings)
    gate = replace(request.gate, per_question={**request.gate.per_question, **changed})
    return replace(request, gate=gate, gates={**gates, **changed}, controlled=settings)


def _threshold(base: float, offset: float, low: float, high: float, resolution: float) -> float:
    """The threshold `base` moved by `offset`: the offset clamped to [low, high] and rounded to the
    `resolution` grid, the base itself never rounded (an offset that rounds to 0 leaves `base`, the
    very number a certificate was proved on); the rounding never leaves [low, high] either."""
    step = min(max(offset, low), high)
    if resolution:
        step = min(max(round(step / resolution) * resolution, low), high)
    return base if not step else min(max(round(base + step, 10), 0.0), 1.0)


async def observe(request: DecisionRequest, gated: Mapping[str, bool], span: Any,
                  fault: Exception | None = None) -> None:
    """Feed each controlled question's outcome to the controller's state, once per decision:
    `gated` says, per question the decision gated, whether the gate did not pass it.

    A state that cannot record it (a shared store down) does not fail the decision, whose answers
    stand: the fault is logged (WARNING), marked on the `decide` span (`canvasroute.controller.fault`)
    and counted (`canvasroute.controller.faults`), and the state keeps what it could not write. So
    is `fault`, the refresh that failed at the start (`steer`).
    """
    settings, escalation = request.controlled, request.escalation
    if fault is not None:
        tm.record_controller_fault(span, fault)
    if not settings or escalation is None or escalation.controller_state is None:
        return
    outcomes = {qid: Observation(escalated, s.low, s.high) for qid, escalated in gated.items()
                if (s := settings.get(qid)) is not None}
    if not outcomes:
        return
    try:
        await escalation.controller_state.observe(outcomes)
    except Exception as exc:  # noqa: BLE001 - the answers stand; the fault is logged, marked and counted
        logger.warning("escalation-rate controller could not record a decision (%s): %s: %s",
                       ", ".join(outcomes), type(exc).__name__, exc)
        tm.record_controller_fault(span, exc)
