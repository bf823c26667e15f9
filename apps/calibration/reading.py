"""Reading labelled rows with the gate off, and labelled rows from exported spans."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from canvasroute.engine import Engine
from canvasroute.router import CanvasDecisionModel, GatePolicy, Labelled, QuestionSpec
from canvasroute.router import calibration as cm

from ..observability.traces import SpanRecord, decision_figures
from .rows import Row, check_rows, gold_index

__all__ = ["GATE_OFF", "collect", "labelled_from_spans"]


GATE_OFF = GatePolicy(max_normalized_entropy=None, rereads=0)
"""Read every question once and trust it: calibration needs the raw canvas distributions."""


async def collect(engine: Engine, rows: Sequence[Row], *, concurrency: int = 4,
                  progress: Callable[[int], None] | None = None) -> list[Labelled]:
    """Read every row once with the gate off; one `Labelled` per question with a gold option.

    `progress(1)` is called after each row (e.g. the `advance` of `canvasroute.apps._console.progress`).
    """
    model = CanvasDecisionModel(engine=engine, policy=GATE_OFF).canvas_only()  # never escalates; a fault raises
    slots = asyncio.Semaphore(max(1, concurrency))
    specs = check_rows(rows)

    async def one(row: Row, spec: Mapping[str, QuestionSpec]) -> list[Labelled]:
        async with slots:
            resp = await model.arun(model.request(row.state, row.questions))
        if progress is not None:
            progress(1)
        out = []
        for qid, value in row.gold.items():
            canvas = resp.reads[qid].canvas_probabilities or {}
            out.append(Labelled(question_id=qid, probabilities=tuple(canvas[o] for o in spec[qid].options),
                                gold=gold_index(spec[qid], value)))
        return out

    batches = await asyncio.gather(*(one(r, s) for r, s in zip(rows, specs, strict=True)))
    return [x for b in batches for x in b]


def labelled_from_spans(spans: Sequence[SpanRecord]) -> list[Labelled]:
    """Escalated questions in decide spans as labelled rows (the escalation's answer is gold):
    path `escalated`, whatever the cause (older traces' escalated `abstained` questions too,
    as `decision_figures` maps them).

    The recorded canvas distribution is at the policy's temperature; it is mapped back
    to temperature 1. Re-read questions contribute their mean distribution.
    """
    out = []
    for s in spans:
        if not s.name.startswith("decide "):
            continue
        for qid, f in decision_figures(s).items():
            options, probs, answer = f.get("options"), f.get("canvas_probabilities"), f.get("answer")
            if f.get("path") != "escalated" or not options or not probs or answer not in options:
                continue
            t = float(f.get("temperature") or 1.0)
            raw = cm.tempered([float(p) for p in probs], 1.0 / t) if t != 1.0 else tuple(float(p) for p in probs)
            out.append(Labelled(question_id=qid, probabilities=tuple(raw), gold=list(options).index(answer)))
    return out
