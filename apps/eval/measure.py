"""The three arms of `canvasroute eval`: canvas only, the escalation target alone, the cascade.

Each arm reads every labelled row on its own (arms run one after the other, so their
latencies do not mix); per row it keeps the answers and what they cost. Every arm starts
from the row's `DecisionRequest` (`CanvasDecisionModel.request`), built once per row by the
cascade's model, so the three see the same state, questions, read options and gate:

- **canvas**: the request measured on the canvas alone (`model.canvas_only()`) with the gate
  off at the policy's temperatures (`GATE_OFF` over every question's gate: one read per
  question, no re-reads, no escalation; a question whose abstain label wins answers its best real option): its answers
  and normalized entropies.
- **target**: the request's escalation asked directly (`escalate`: the same state, questions
  and instructions the cascade sends, no canvas hint), one call per row, within the
  escalation's `timeout`.
- **cascade**: the request as deployed (`model.arun`): the gate, re-reads and escalation
  (`Escalation(target, timeout=...)`) really run.

A failure of the target (an `EscalationError`) leaves that row's target or cascade answer
empty, which scores as wrong: a fault never becomes an answer. An engine fault stops the
evaluation (the canvas arm raises it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from canvasroute.engine import Engine, EscalationError
from canvasroute.router import (
    Asked,
    CanvasDecisionModel,
    CanvasResponse,
    DecisionRequest,
    Escalated,
    Escalation,
    GatePolicy,
    Tally,
    Totals,
    escalate,
    resolve_gate,
    target_name,
)
from canvasroute.router._escalation import Calls

from ..calibration.rows import Row, check_rows, gold_index
from .metrics import Item

__all__ = ["Arm", "Evaluation", "ask_target", "evaluate", "gate_off", "target_correct"]

GATE_OFF = {"max_normalized_entropy": None, "max_entropy": None, "min_confidence": None, "min_margin": None,
            "min_label_mass": None, "rereads": 0, "reread_above": None}
"""The gate fields the canvas arm turns off, for every question (temperatures stay)."""


def gate_off(policy: GatePolicy) -> GatePolicy:
    """`policy` with every threshold off and no re-reads, per-question fits included, keeping its temperatures."""
    return resolve_gate(policy, GATE_OFF)


@dataclass(slots=True)
class Arm:
    """What one arm cost over all rows."""

    name: str
    decisions: int = 0
    reads: int = 0
    escalations: int = 0
    """Questions sent to the target."""
    target_calls: int = 0
    hedges: int = 0
    """Of the target calls, hedges started beside re-reads (`Escalation.hedge`)."""
    failures: int = 0
    """Rows whose target call failed (alone: their answers score as wrong; in the cascade: a decision
    that raised, or one whose failed questions answered degraded, `target_fault`)."""
    input_tokens: int = 0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    tally: Tally = field(default_factory=lambda: Tally.of(()))
    """The arm's answers by path and cause (the cascade's; empty for the target alone)."""

    def add(self, latency: float, usage: Mapping[str, Any] | None) -> None:
        self.decisions += 1
        self.latencies.append(latency)
        self.input_tokens += int((usage or {}).get("input_tokens", 0))
        self.output_tokens += int((usage or {}).get("output_tokens", 0))

    def add_response(self, latency: float, response: Any) -> None:
        """One decision's `CanvasResponse`: its reads, escalations and tokens (`Totals`), paths and causes."""
        totals = Totals.of(response)
        self.add(latency, response.usage)
        self.reads += totals.reads
        self.escalations += totals.escalations
        self.target_calls += totals.target_calls
        self.hedges += totals.hedges
        self.tally += Tally.of(response.reads.values())

    def summary(self, correct: int, questions: int) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"accuracy": correct / questions if questions else None, "questions": questions,
                "decisions": self.decisions, "reads": self.reads, "escalations": self.escalations,
                "target_calls": self.target_calls, "hedges": self.hedges, "failures": self.failures,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "latency_mean_s": sum(lat) / len(lat) if lat else None,
                "latency_p50_s": _quantile(lat, 0.5), "latency_p95_s": _quantile(lat, 0.95),
                "paths": {p: k for p, k in self.tally.paths.items() if k},
                "causes": {c: k for c, k in self.tally.causes.items() if k}}


@dataclass(slots=True)
class Evaluation:
    items: list[Item]
    canvas: Arm
    target: Arm | None
    cascade: Arm | None
    target_name: str | None


async def evaluate(engine: Engine, rows: Sequence[Row], *, policy: GatePolicy, target: Any = None,
                   concurrency: int = 1, progress: Callable[[int], None] | None = None) -> Evaluation:
    """Run the arms over `rows` at the gate `policy` (the target and cascade arms only with a
    `target`: a chat model, Runnable or decision model, or an `Escalation` naming its
    `timeout`, output mode and prompt)."""
    specs = check_rows(rows)
    slots = asyncio.Semaphore(max(1, concurrency))
    model = CanvasDecisionModel(engine=engine, policy=policy, escalate_to=target)
    reader = model.canvas_only()  # no escalation; abstain: the best real option; a fault raises
    requests = [reader.request(row.state, row.questions, gate=GATE_OFF) for row in rows]  # all checked first
    canvas = Arm("canvas")

    async def read(request: DecisionRequest) -> Any:
        async with slots:
            start = time.perf_counter()
            resp = await reader.arun(request)
            canvas.add(time.perf_counter() - start, resp.usage)
            canvas.reads += resp.canvas_reads
        _tick(progress)
        return resp

    canvas_resps = await asyncio.gather(*(read(r) for r in requests))
    items = {(n, qid): Item(row=n, question_id=qid, gold=spec[qid].options[gold_index(spec[qid], g)],
                            canvas_answer=resp.reads[qid].answer,
                            normalized_entropy=_finite(resp.reads[qid].normalized_entropy))
             for n, (row, spec, resp) in enumerate(zip(rows, specs, canvas_resps, strict=True))
             for qid, g in row.gold.items()}
    escalation = model.escalation
    if escalation is None:
        return Evaluation(list(items.values()), canvas, None, None, None)
    deployed = [model.request(row.state, row.questions) for row in rows]

    alone = Arm("target")

    async def ask(n: int, request: DecisionRequest) -> None:
        async with slots:
            start = time.perf_counter()
            calls = Calls()
            got = await ask_target(request, calls=calls)
            alone.add(time.perf_counter() - start, got.usage if got is not None else None)
            alone.failures += got is None
            alone.target_calls += calls.sent  # (a malformed reply asked again: two, as the cascade counts)
            alone.escalations += len(request.questions.specs)
        for qid in rows[n].gold:
            if (n, qid) in items and got is not None:
                items[n, qid] = replace(items[n, qid], target_answer=got.answers.get(qid))
        _tick(progress)

    await asyncio.gather(*(ask(n, r) for n, r in enumerate(deployed)))

    cascade = Arm("cascade")

    async def decide(n: int, request: DecisionRequest) -> None:
        async with slots:
            start = time.perf_counter()
            resp: CanvasResponse | None = None
            try:
                resp = await model.arun(request)
            except EscalationError:
                cascade.failures += 1
                cascade.add(time.perf_counter() - start, None)
            else:
                cascade.add_response(time.perf_counter() - start, resp)
                # the target failed (or its breaker was open) and the decision answered degraded, as served
                # (`OutcomePolicy.target_fault`): an answer, the canvas's, but a failure of the cascade all the same
                cascade.failures += any(r.cause == "target_fault" for r in resp.reads.values())
        for qid in rows[n].gold:
            if resp is not None:
                items[n, qid] = replace(items[n, qid], cascade_answer=resp.reads[qid].answer,
                                        cascade_path=resp.reads[qid].path)
        _tick(progress)

    await asyncio.gather(*(decide(n, r) for n, r in enumerate(deployed)))
    return Evaluation(list(items.values()), canvas, alone, cascade, target_name(escalation.target))


async def ask_target(request: DecisionRequest, escalation: Escalation | None = None, *,
                     calls: Calls | None = None) -> Escalated | None:
    """The escalation target's answers to a request on its own (no canvas hint), within its
    timeout; None when it failed (an `EscalationError` or a timeout: its answers then score as
    wrong, never as an answer). `escalation`: the request's own unless given; `calls` counts
    the calls it handed the target."""
    escalation = escalation or request.escalation
    if escalation is None:
        raise ValueError("ask_target needs a request with an escalation (escalate_to=), or escalation=")
    state = request.state
    asked = Asked(specs=tuple(request.questions.specs.values()), state=state.value, text=state.text,
                  instructions=request.read.instructions, images=state.images)
    try:
        return await asyncio.wait_for(escalate(escalation, asked, calls), escalation.timeout)
    except (EscalationError, TimeoutError):
        return None


async def target_correct(model: CanvasDecisionModel, rows: Sequence[Row], *, concurrency: int = 4) -> list[bool]:
    """Whether `model`'s escalation target alone answers each labelled question right, in
    `collect`'s order (row by row, each row's gold questions in order): the measured
    escalation answers."""
    specs = check_rows(rows)
    slots = asyncio.Semaphore(max(1, concurrency))

    async def one(row: Row) -> Escalated | None:
        async with slots:
            return await ask_target(model.request(row.state, row.questions))

    got = await asyncio.gather(*(one(r) for r in rows))
    return [g is not None and g.answers.get(qid) == spec[qid].options[gold_index(spec[qid], value)]
            for row, spec, g in zip(rows, specs, got, strict=True) for qid, value in row.gold.items()]


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else 1.0


def _tick(progress: Callable[[int], None] | None) -> None:
    if progress is not None:
        progress(1)


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return values[k]
