"""OpenTelemetry spans and metrics (API only: the application installs the SDK).

Every attribute name the library writes is defined here. Engine reads and escalations
follow the GenAI semantic conventions; routing figures live under `canvasroute.*`,
never under `gen_ai.*`. State and prompt content are recorded only when
`CANVASROUTE_RECORD_CONTENT=1` (or `record_content=True`); secrets never.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode

# GenAI semantic conventions
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_SYSTEM = "gen_ai.system"  # older name, still mapped by LangSmith
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# canvasroute's own namespace
DECISION_SET = "canvasroute.decision_set"
QUESTIONS = "canvasroute.questions"
CANVAS_READS = "canvasroute.canvas_reads"
GRAPH_NODE = "canvasroute.graph.node"
GRAPH_THREAD = "canvasroute.graph.thread_id"
READ_BATCH = "canvasroute.read.batch_size"
READ_KIND = "canvasroute.read.kind"
ESCALATED_QUESTIONS = "canvasroute.escalation.questions"
STATE_CONTENT = "canvasroute.content.state"
DECISION_PREFIX = "canvasroute.decision"
"""Per-question figures: `canvasroute.decision.<question id>.<figure>`."""
FIGURES = ("answer", "entropy", "normalized_entropy", "confidence", "margin", "label_mass",
           "path", "escalated", "reads", "agreement", "kind")

_tracer = trace.get_tracer("canvasroute")
_meter = metrics.get_meter("canvasroute")
decision_duration = _meter.create_histogram(
    "canvasroute.decision.duration", unit="s", description="Time to answer one decision set")
decisions = _meter.create_counter(
    "canvasroute.decisions", unit="{question}", description="Answered questions, by path")
entropy_histogram = _meter.create_histogram(
    "canvasroute.decision.normalized_entropy", unit="1", description="Canvas normalized entropy per question")
escalations = _meter.create_counter(
    "canvasroute.escalations", unit="{question}", description="Questions escalated to the AR model")


def record_content() -> bool:
    return os.environ.get("CANVASROUTE_RECORD_CONTENT", "") == "1"


@contextmanager
def span(name: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
    """A span that records exceptions and sets an error status on failure."""
    with _tracer.start_as_current_span(name, attributes=dict(attributes),
                                       record_exception=True, set_status_on_exception=True) as s:
        yield s


def genai_attributes(operation: str, provider: str, model: str) -> dict[str, Any]:
    return {GEN_AI_OPERATION: operation, GEN_AI_PROVIDER: provider, GEN_AI_SYSTEM: provider, GEN_AI_MODEL: model}


def set_usage(s: Span, input_tokens: int, output_tokens: int) -> None:
    s.set_attribute(GEN_AI_INPUT_TOKENS, input_tokens)
    s.set_attribute(GEN_AI_OUTPUT_TOKENS, output_tokens)


def record_reports(s: Span, reports: Sequence[Any], duration_s: float, model: str) -> None:
    """Per-question attributes on the decision-set span, and the metric points."""
    for r in reports:
        prefix = f"{DECISION_PREFIX}.{r.question_id}"
        values = {"answer": r.answer, "entropy": r.entropy, "normalized_entropy": r.normalized_entropy,
                  "confidence": r.confidence, "margin": r.margin, "label_mass": r.label_mass, "path": r.path,
                  "escalated": r.path == "escalated", "reads": r.reads, "agreement": r.agreement, "kind": r.kind}
        for key, value in values.items():
            if value is not None:
                s.set_attribute(f"{prefix}.{key}", value)
        labels = {"path": r.path, "kind": r.kind, "model": model}
        decisions.add(1, labels)
        if r.normalized_entropy is not None:
            entropy_histogram.record(r.normalized_entropy, {"kind": r.kind, "model": model})
        if r.path == "escalated":
            escalations.add(1, {"model": model})
    decision_duration.record(duration_s, {"model": model})


def mark_error(s: Span, exc: BaseException) -> None:
    s.set_status(Status(StatusCode.ERROR, str(exc)))
