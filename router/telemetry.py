"""OpenTelemetry spans and metrics (API only: the application installs the SDK).

Every attribute name the library writes is defined here. Spans:

```
decide <model>                      INTERNAL  one decision set; per-question figures
├── canvas_read <model>             CLIENT    one engine call (first reads, then re-reads)
└── escalate <target model>         CLIENT    one escalation call for the uncertain questions
```

Engine reads and escalations carry the GenAI semantic conventions
(`gen_ai.operation.name`, `gen_ai.provider.name`, the older `gen_ai.system`,
`gen_ai.request.model`, `gen_ai.usage.*`, `server.*`, `error.type`) and record the
GenAI client metrics (`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`).
A canvas read uses the operation name `canvas_read`: no well-known operation fits one
denoising pass that returns distributions. Routing figures live under `canvasroute.*`,
never under `gen_ai.*`. The decide span carries no `gen_ai.*`, so token counts are
never double-counted by backends that sum them over a trace.

State and prompt content are recorded only when `CANVASROUTE_RECORD_CONTENT=1`;
secrets (API keys, headers) never.

The tracer and meter are looked up from the global providers when used (not at import),
so an SDK installed after `import router` is honoured.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

# -- GenAI semantic conventions ---------------------------------------------------------
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_SYSTEM = "gen_ai.system"
"""Older name of `gen_ai.provider.name`, still mapped by LangSmith; written alongside."""
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
"""Opt-in content: the prompt of a canvas read (only with CANVASROUTE_RECORD_CONTENT=1)."""
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
OPERATION_CANVAS_READ = "canvas_read"
OPERATION_CHAT = "chat"
REMOTE_PROVIDERS = frozenset({"vllm"})
"""Engine providers reached over the network (their read spans are CLIENT spans)."""

# -- canvasroute's own namespace -------------------------------------------------------
DECISION_SET = "canvasroute.decision_set"
QUESTIONS = "canvasroute.questions"
CANVAS_READS = "canvasroute.canvas_reads"
GRAPH_NODE = "canvasroute.graph.node"
GRAPH_THREAD = "canvasroute.graph.thread_id"
READ_BATCH = "canvasroute.read.batch_size"
READ_KIND = "canvasroute.read.kind"
"""`first` or `reread`."""
ESCALATED_QUESTIONS = "canvasroute.escalation.questions"
STATE_CONTENT = "canvasroute.content.state"
"""Opt-in content: the rendered state (only with CANVASROUTE_RECORD_CONTENT=1)."""
PROMPTS_CONTENT = "canvasroute.content.prompts"
"""Opt-in content: every distinct prompt of a read batch that holds more than one."""
DECISION_PREFIX = "canvasroute.decision"
"""Per-question figures on the decide span: `canvasroute.decision.<question id>.<figure>`."""
FIGURES = ("answer", "canvas_answer", "options", "canvas_probabilities", "temperature", "entropy",
           "normalized_entropy", "confidence", "margin", "label_mass", "path", "escalated",
           "escalation_model", "over_budget", "reads", "agreement", "kind")
"""Figures recorded per question (`canvas_*`: the canvas read before escalation, with
`canvas_probabilities` in `options` order, at `temperature`)."""
# metric attributes (low cardinality: developer-defined names only)
METRIC_PATH = "canvasroute.path"
METRIC_KIND = "canvasroute.question.kind"
METRIC_QUESTION = "canvasroute.question.id"

SCOPE = "canvasroute"


def record_content() -> bool:
    """Whether state and prompt content may be recorded (`CANVASROUTE_RECORD_CONTENT=1`)."""
    return os.environ.get("CANVASROUTE_RECORD_CONTENT", "") == "1"


# -- providers, looked up lazily -------------------------------------------------------


class _Instruments:
    """The metric instruments of one meter provider."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.decision_duration = meter.create_histogram(
            "canvasroute.decision.duration", unit="s", description="Time to answer one decision set")
        self.decisions = meter.create_counter(
            "canvasroute.decisions", unit="{question}", description="Answered questions, by path")
        self.entropy = meter.create_histogram(
            "canvasroute.decision.normalized_entropy", unit="1",
            description="Canvas normalized entropy per question")
        self.escalations = meter.create_counter(
            "canvasroute.escalations", unit="{question}", description="Questions escalated to the AR model")
        self.operation_duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="GenAI operation duration")
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Measures number of input and output tokens used")


_cache: dict[str, tuple[Any, Any]] = {}


def _tracer() -> trace.Tracer:
    provider = trace.get_tracer_provider()
    cached = _cache.get("tracer")
    if cached is None or cached[0] is not provider:
        cached = _cache["tracer"] = (provider, provider.get_tracer(SCOPE))
    return cached[1]


def _instruments() -> _Instruments:
    provider = metrics.get_meter_provider()
    cached = _cache.get("meter")
    if cached is None or cached[0] is not provider:
        cached = _cache["meter"] = (provider, _Instruments(provider.get_meter(SCOPE)))
    return cached[1]


# -- spans -----------------------------------------------------------------------------


@contextmanager
def span(name: str, attributes: Mapping[str, Any], kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """A span that records exceptions, `error.type` and an error status on failure."""
    with _tracer().start_as_current_span(name, kind=kind, attributes=dict(attributes),
                                         record_exception=True, set_status_on_exception=True) as s:
        try:
            yield s
        except BaseException as exc:
            s.set_attribute(ERROR_TYPE, type(exc).__qualname__)
            raise


@dataclass(slots=True)
class Call:
    """One model call in flight: its span and the metric attributes it reports under."""

    span: Span
    metric_attributes: dict[str, Any]

    def usage(self, input_tokens: int, output_tokens: int, results: Sequence[Any] = ()) -> None:
        """Record token usage (span attributes and `gen_ai.client.token.usage`) and the server."""
        self.span.set_attribute(GEN_AI_INPUT_TOKENS, input_tokens)
        self.span.set_attribute(GEN_AI_OUTPUT_TOKENS, output_tokens)
        server = _server(results)
        self.span.set_attributes(server)
        self.metric_attributes.update(server)
        histogram = _instruments().token_usage
        histogram.record(input_tokens, {**self.metric_attributes, GEN_AI_TOKEN_TYPE: "input"})
        histogram.record(output_tokens, {**self.metric_attributes, GEN_AI_TOKEN_TYPE: "output"})


@contextmanager
def _call(name: str, attributes: dict[str, Any], kind: SpanKind) -> Iterator[Call]:
    metric_attributes = {k: attributes[k] for k in (GEN_AI_OPERATION, GEN_AI_PROVIDER, GEN_AI_MODEL)}
    start = time.perf_counter()
    with span(name, attributes, kind) as s:
        call = Call(s, metric_attributes)
        try:
            yield call
        except BaseException as exc:
            metric_attributes[ERROR_TYPE] = type(exc).__qualname__
            raise
        finally:
            _instruments().operation_duration.record(time.perf_counter() - start, metric_attributes)


def model_call(operation: str, provider: str, model: str, attributes: Mapping[str, Any] | None = None,
               kind: SpanKind = SpanKind.CLIENT) -> Any:
    """Span `<operation> <model>` with GenAI attributes and metrics around any model call.

    Example:
        ```python
        with model_call("chat", "openai", "gpt-4o") as call:
            reply = await chat.ainvoke(messages)
            call.usage(reply.usage_metadata["input_tokens"], reply.usage_metadata["output_tokens"])
        ```
    """
    return _call(f"{operation} {model}", {**genai_attributes(operation, provider, model), **(attributes or {})}, kind)


def set_usage(s: Span, input_tokens: int, output_tokens: int) -> None:
    """Token usage as span attributes only (`Call.usage` also records the metric)."""
    s.set_attribute(GEN_AI_INPUT_TOKENS, input_tokens)
    s.set_attribute(GEN_AI_OUTPUT_TOKENS, output_tokens)


def genai_attributes(operation: str, provider: str, model: str) -> dict[str, Any]:
    """The GenAI attributes of one model call (`gen_ai.system` mirrors the provider)."""
    return {GEN_AI_OPERATION: operation, GEN_AI_PROVIDER: provider, GEN_AI_SYSTEM: provider, GEN_AI_MODEL: model}


def engine_call(info: Any, batch: Sequence[Any], kind: str) -> Any:
    """Span `canvas_read <model>` around one engine call (`kind`: first or reread)."""
    attrs = {**genai_attributes(OPERATION_CANVAS_READ, info.provider, info.model),
             READ_BATCH: len(batch), READ_KIND: kind}
    if record_content():
        prompts = list({json.dumps(_semconv_messages(r.messages), ensure_ascii=False): None for r in batch})
        if len(prompts) == 1:
            attrs[GEN_AI_INPUT_MESSAGES] = prompts[0]
        else:
            attrs[PROMPTS_CONTENT] = prompts
    span_kind = SpanKind.CLIENT if info.provider in REMOTE_PROVIDERS else SpanKind.INTERNAL
    return _call(f"{OPERATION_CANVAS_READ} {info.model}", attrs, span_kind)


def escalation_call(target: Any, name: str, question_ids: Sequence[str]) -> Any:
    """Span `escalate <model>` around one escalation call (GenAI `chat` attributes)."""
    attrs = {**genai_attributes(OPERATION_CHAT, provider_of(target), name),
             ESCALATED_QUESTIONS: ",".join(question_ids)}
    return _call(f"escalate {name}", attrs, SpanKind.CLIENT)


def provider_of(target: Any) -> str:
    """The escalation target's provider as LangChain reports it (`openai`, ...).

    Chat models report `ls_provider`; a decision model its `_provider`; anything else
    is `langchain`.
    """
    try:
        provider = target._get_ls_params().get("ls_provider")
    except Exception:  # not a LangChain model, or one that needs call arguments
        provider = getattr(target, "_provider", None)
    return provider if isinstance(provider, str) and provider else "langchain"


def _semconv_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, Any]]:
    return [{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]} for m in messages]


def _server(results: Sequence[Any]) -> dict[str, Any]:
    """`server.address`/`server.port` from the first result's replica URL (credentials dropped)."""
    for r in results:
        url = (getattr(r, "attrs", None) or {}).get("server.address")
        if url:
            parts = urlsplit(str(url))
            out: dict[str, Any] = {SERVER_ADDRESS: parts.hostname or str(url)}
            if parts.port:
                out[SERVER_PORT] = parts.port
            return out
    return {}


# -- the decision set ------------------------------------------------------------------


def record_reports(s: Span, reports: Sequence[Any], duration_s: float, model: str, policy: Any = None,
                   attributes: Mapping[str, Any] | None = None) -> None:
    """Per-question attributes on the decision-set span, and the metric points.

    `policy` (a `GatePolicy`) supplies each question's temperature; a `canvasroute.graph.node`
    in `attributes` labels the metric points too.
    """
    node = (attributes or {}).get(GRAPH_NODE)
    base = {GEN_AI_MODEL: model, **({GRAPH_NODE: node} if node is not None else {})}
    inst = _instruments()
    recording = s.is_recording()  # without an SDK, skip building attributes nobody keeps
    for r in reports:
        prefix = f"{DECISION_PREFIX}.{r.question_id}"
        canvas = r.canvas_probabilities
        values = {} if not recording else {
            "answer": r.answer, "path": r.path, "escalated": r.path == "escalated", "kind": r.kind,
            "reads": r.reads, "entropy": r.entropy, "normalized_entropy": r.normalized_entropy,
            "confidence": r.confidence, "margin": r.margin, "label_mass": r.label_mass, "agreement": r.agreement,
            "escalation_model": r.escalation_model, "over_budget": r.over_budget or None,
            "options": list(canvas) if canvas else None,
            "canvas_probabilities": [float(p) for p in canvas.values()] if canvas else None,
            "canvas_answer": max(canvas, key=canvas.__getitem__) if canvas else None,
            "temperature": policy.for_question(r.question_id).temperature if policy is not None and canvas else None,
        }
        for key, value in values.items():
            if value is not None:
                s.set_attribute(f"{prefix}.{key}", value)
        labels = {**base, METRIC_QUESTION: r.question_id, METRIC_KIND: r.kind}
        inst.decisions.add(1, {**labels, METRIC_PATH: r.path})
        if r.normalized_entropy is not None:
            inst.entropy.record(r.normalized_entropy, labels)
        if r.path == "escalated":
            inst.escalations.add(1, labels)
    inst.decision_duration.record(duration_s, base)


def mark_error(s: Span, exc: BaseException) -> None:
    """Set an error status and `error.type` on a span that handled `exc`."""
    s.set_attribute(ERROR_TYPE, type(exc).__qualname__)
    s.set_status(Status(StatusCode.ERROR, str(exc)))
