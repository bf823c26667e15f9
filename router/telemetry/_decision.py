"""The decision set's figures on its `decide` span and in the metrics.

Per question, one `canvasroute.question` span event carries the figures under fixed keys
(`canvasroute.question.id` holds the id as a value), so the attribute key set stays
bounded however many question ids an application uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from ._names import (
    ERROR_TYPE,
    FIGURE_KEYS,
    GEN_AI_MODEL,
    GRAPH_NODE,
    METRIC_KIND,
    METRIC_PATH,
    METRIC_QUESTION,
    QUESTION_EVENT,
    QUESTION_ID,
    QUESTION_KIND,
    STATE_CONTENT,
)
from ._spans import _instruments, set_io

__all__ = ["mark_error", "record_reports"]


def record_reports(s: Span, reports: Sequence[Any], duration_s: float, model: str, policy: Any = None,
                   attributes: Mapping[str, Any] | None = None) -> None:
    """One `canvasroute.question` event per question on the decision-set span, and the metric points.

    `policy` (a `GatePolicy`) supplies each question's temperature; a `canvasroute.graph.node`
    in `attributes` labels the metric points too.
    """
    inst = _instruments()
    recording = s.is_recording()  # without an SDK, skip building attributes nobody keeps
    if inst is None and not recording:
        return
    node = (attributes or {}).get(GRAPH_NODE)
    base = {GEN_AI_MODEL: model, **({GRAPH_NODE: node} if node is not None else {})}
    asked: dict[str, Any] = {}
    answered: dict[str, Any] = {}
    for r in reports:
        canvas = r.canvas_probabilities
        values = {} if not recording else {
            "answer": r.answer, "path": r.path, "escalated": r.escalation_model is not None,
            "reads": r.reads, "entropy": r.entropy, "normalized_entropy": r.normalized_entropy,
            "confidence": r.confidence, "margin": r.margin, "label_mass": r.label_mass, "agreement": r.agreement,
            "escalation_model": r.escalation_model, "over_budget": r.over_budget or None,
            "options": list(canvas) if canvas else None,
            "canvas_probabilities": [float(p) for p in canvas.values()] if canvas else None,
            "canvas_answer": max(canvas, key=canvas.__getitem__) if canvas else None,
            "temperature": policy.for_question(r.question_id).temperature if policy is not None and canvas else None,
            "crossed": list(r.crossed) or None, "gate": r.gate,
        }
        if recording:
            s.add_event(QUESTION_EVENT, {QUESTION_ID: r.question_id, QUESTION_KIND: r.kind,
                                         **{FIGURE_KEYS[k]: v for k, v in values.items() if v is not None}})
            asked[r.question_id] = {"kind": r.kind, "options": list(canvas) if canvas else None}
            answered[r.question_id] = {"answer": r.answer, "path": r.path, "confidence": r.confidence}
        if inst is None:
            continue
        labels = {**base, METRIC_QUESTION: r.question_id, METRIC_KIND: r.kind}
        inst.decisions.add(1, {**labels, METRIC_PATH: r.path})
        if r.normalized_entropy is not None:
            inst.entropy.record(r.normalized_entropy, labels)
        if r.escalation_model is not None:  # escalated, or abstained and escalated
            inst.escalations.add(1, labels)
    if inst is not None:
        inst.decision_duration.record(duration_s, base)
    if recording:
        state = (attributes or {}).get(STATE_CONTENT)  # present only under CANVASROUTE_RECORD_CONTENT=1
        set_io(s, input={"questions": asked, **({"state": state} if state is not None else {})}, output=answered)


def mark_error(s: Span, exc: BaseException) -> None:
    """Set an error status and `error.type` on a span that handled `exc`."""
    s.set_attribute(ERROR_TYPE, type(exc).__qualname__)
    s.set_status(Status(StatusCode.ERROR, str(exc)))
