"""The three arms of `canvasroute eval`: canvas only, the escalation target alone, the cascade.

Each arm reads every labelled row on its own (arms run one after the other, so their
latencies do not mix); per row it keeps the answers and what they cost.

- **canvas**: `CanvasDecisionModel.canvas_only()` with the gate off at the policy's
  temperatures (one read per question, no re-reads, no escalation; a question whose
  abstain label wins answers its best real option): its answers and normalized entropies.
- **target**: the escalation target asked directly with the same request the cascade
  sends (no canvas hint), one call per row.
- **cascade**: `CanvasDecisionModel(policy=..., escalate_to=target)` as deployed: the gate,
  re-reads and escalation really run.

A failure of the target (an `EscalationError`) leaves that row's target or cascade answer
empty, which scores as wrong: a fault never becomes an answer. An engine fault stops the
evaluation (the canvas arm raises it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from canvasroute.engine import Engine, EscalationError
from canvasroute.router import (
    CanvasDecisionModel,
    CanvasResponse,
    Escalated,
    GatePolicy,
    escalate,
    parse_questions,
    render_state,
    target_name,
)

from ..calibration.rows import Row, check_rows, gold_index
from .metrics import Item

__all__ = ["Arm", "Evaluation", "ask_target", "evaluate", "gate_off", "target_correct"]

_OFF = {"max_normalized_entropy": None, "max_entropy": None, "min_confidence": None, "min_margin": None,
        "min_label_mass": None, "rereads": 0}


def gate_off(policy: GatePolicy) -> GatePolicy:
    """`policy` with every threshold off and no re-reads, keeping its temperatures."""
    return policy.with_overrides(**_OFF, per_question={q: p.with_overrides(**_OFF)
                                                       for q, p in policy.per_question.items()})


@dataclass(slots=True)
class Arm:
    """What one arm cost over all rows."""

    name: str
    decisions: int = 0
    reads: int = 0
    escalations: int = 0
    """Questions sent to the target."""
    target_calls: int = 0
    failures: int = 0
    """Rows whose target call failed (their answers score as wrong)."""
    input_tokens: int = 0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, latency: float, usage: Mapping[str, Any] | None) -> None:
        self.decisions += 1
        self.latencies.append(latency)
        self.input_tokens += int((usage or {}).get("input_tokens", 0))
        self.output_tokens += int((usage or {}).get("output_tokens", 0))

    def summary(self, correct: int, questions: int) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"accuracy": correct / questions if questions else None, "questions": questions,
                "decisions": self.decisions, "reads": self.reads, "escalations": self.escalations,
                "target_calls": self.target_calls, "failures": self.failures,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "latency_mean_s": sum(lat) / len(lat) if lat else None,
                "latency_p50_s": _quantile(lat, 0.5), "latency_p95_s": _quantile(lat, 0.95)}


@dataclass(slots=True)
class Evaluation:
    items: list[Item]
    canvas: Arm
    target: Arm | None
    cascade: Arm | None
    target_name: str | None


async def evaluate(engine: Engine, rows: Sequence[Row], *, policy: GatePolicy, target: Any = None,
                   concurrency: int = 1, progress: Callable[[int], None] | None = None,
                   escalation_timeout: float = 60.0) -> Evaluation:
    """Run the arms over `rows` (the target and cascade arms only with a `target`;
    `escalation_timeout` bounds each of the cascade's escalation calls)."""
    specs = check_rows(rows)
    slots = asyncio.Semaphore(max(1, concurrency))
    reader = CanvasDecisionModel(engine=engine, policy=gate_off(policy)).canvas_only()  # abstain: best real option
    canvas = Arm("canvas")

    async def read(row: Row) -> Any:
        async with slots:
            start = time.perf_counter()
            resp = await reader.adecide(row.state, row.questions)
            canvas.add(time.perf_counter() - start, resp.usage)
            canvas.reads += resp.canvas_reads
        _tick(progress)
        return resp

    canvas_resps = await asyncio.gather(*(read(r) for r in rows))
    items = {(n, qid): Item(row=n, question_id=qid, gold=spec[qid].options[gold_index(spec[qid], g)],
                            canvas_answer=resp.reads[qid].answer,
                            normalized_entropy=_finite(resp.reads[qid].normalized_entropy))
             for n, (row, spec, resp) in enumerate(zip(rows, specs, canvas_resps, strict=True))
             for qid, g in row.gold.items()}
    if target is None:
        return Evaluation(list(items.values()), canvas, None, None, None)

    alone = Arm("target")

    async def ask(n: int, row: Row) -> None:
        async with slots:
            start = time.perf_counter()
            got = await ask_target(target, row)
            alone.add(time.perf_counter() - start, got.usage if got is not None else None)
            alone.failures += got is None
            alone.target_calls += 1
            alone.escalations += len(row.questions)
        for qid in row.gold:
            if (n, qid) in items and got is not None:
                items[n, qid] = _with(items[n, qid], target_answer=got.answers.get(qid))
        _tick(progress)

    await asyncio.gather(*(ask(n, r) for n, r in enumerate(rows)))

    cascade = Arm("cascade")
    model = CanvasDecisionModel(engine=engine, policy=policy, escalate_to=target,
                                escalation_timeout=escalation_timeout)

    async def decide(n: int, row: Row) -> None:
        async with slots:
            start = time.perf_counter()
            resp: CanvasResponse | None = None
            try:
                answered = await model.adecide(row.state, row.questions)
            except EscalationError:
                cascade.failures += 1
                cascade.add(time.perf_counter() - start, None)
            else:
                resp = answered
                cascade.add(time.perf_counter() - start, answered.usage)
                cascade.reads += answered.canvas_reads
                escalated = [r for r in answered.reads.values() if r.escalation_model is not None]  # abstained too
                cascade.escalations += len(escalated)
                cascade.target_calls += bool(escalated)
        for qid in row.gold:
            if resp is not None:
                items[n, qid] = _with(items[n, qid], cascade_answer=resp.reads[qid].answer,
                                      cascade_path=resp.reads[qid].path)
        _tick(progress)

    await asyncio.gather(*(decide(n, r) for n, r in enumerate(rows)))
    return Evaluation(list(items.values()), canvas, alone, cascade, target_name(target))


async def ask_target(target: Any, row: Row) -> Escalated | None:
    """The target's answers to one row on its own (no canvas hint); None when it failed
    (an `EscalationError`: its answers then score as wrong, never as an answer)."""
    questions = parse_questions(row.questions)
    try:
        return await escalate(target, render_state(row.state), row.state, list(questions.values()), {})
    except EscalationError:
        return None


async def target_correct(target: Any, rows: Sequence[Row], *, concurrency: int = 4) -> list[bool]:
    """Whether the target alone answers each labelled question right, in `collect`'s order
    (row by row, each row's gold questions in order): the measured escalation answers."""
    specs = check_rows(rows)
    slots = asyncio.Semaphore(max(1, concurrency))

    async def one(row: Row) -> Escalated | None:
        async with slots:
            return await ask_target(target, row)

    got = await asyncio.gather(*(one(r) for r in rows))
    return [g is not None and g.answers.get(qid) == spec[qid].options[gold_index(spec[qid], value)]
            for row, spec, g in zip(rows, specs, got, strict=True) for qid, value in row.gold.items()]


def _with(item: Item, **changes: Any) -> Item:
    from dataclasses import replace

    return replace(item, **changes)


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
