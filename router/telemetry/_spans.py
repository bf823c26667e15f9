"""Spans and metrics over the global OpenTelemetry providers (looked up when used, not at import).

A decision set's figures go on its `decide` span: per question, one `canvasroute.question` span
event carries them under fixed keys (`canvasroute.question.id` holds the id as a value), so the
attribute key set stays bounded however many question ids an application uses.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from ._names import (
    AUDIT,
    AUDIT_EVENT,
    AUDIT_FAULT,
    AUDIT_OUTCOME,
    CONTROLLER_FAULT,
    DECISION_SET,
    ERROR_TYPE,
    ESCALATED_QUESTIONS,
    FAULT,
    FAULT_EVENT,
    FAULT_MESSAGE,
    FAULT_PATHS,
    FAULT_QUESTIONS,
    FIGURE_KEYS,
    GEN_AI_CONVERSATION_ID,
    GEN_AI_INPUT_MESSAGES,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_MODEL,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_SEED,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_TOKEN_TYPE,
    GRAPH_NODE,
    GUARD,
    GUARD_EVENT,
    GUARD_WHAT,
    HEDGE,
    HEDGE_EVENT,
    HEDGE_RAN_ON,
    INPUT_MIME,
    INPUT_VALUE,
    JSON_MIME,
    LLM_COMPLETION_TOKENS,
    LLM_MODEL_NAME,
    LLM_PROMPT_TOKENS,
    LLM_PROVIDER,
    LLM_SYSTEM,
    LLM_TOTAL_TOKENS,
    METRIC_CAUSE,
    METRIC_KIND,
    METRIC_PATH,
    METRIC_QUESTION,
    OI_CHAIN,
    OI_LLM,
    OI_SPAN_KIND,
    OPERATION_CANVAS_READ,
    OPERATION_CHAT,
    OPERATION_ESCALATE,
    OUTPUT_MIME,
    OUTPUT_VALUE,
    PROMPTS_CONTENT,
    QUESTION_EVENT,
    QUESTION_ID,
    QUESTION_KIND,
    READ_BATCH,
    READ_KIND,
    REMOTE_PROVIDERS,
    SCOPE,
    SERVER_ADDRESS,
    SERVER_PORT,
    SESSION_ID,
    STATE_CONTENT,
    TARGET_CALLS,
)

__all__ = ["Call", "engine_call", "escalation_call", "genai_attributes", "mark_error", "model_call", "provider_of",
           "record_audit", "record_audit_fault", "record_controller_fault", "record_fault", "record_guard",
           "record_hedge", "record_reports", "set_io", "set_usage", "span"]

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
        self.faults = meter.create_counter(
            "canvasroute.faults", unit="{question}", description="Questions an engine fault hit, by what answered")
        self.hedges = meter.create_counter(
            "canvasroute.hedges", unit="{call}", description="Hedged target calls, by how they ended")
        self.hedges_ran_on = meter.create_counter(
            "canvasroute.hedges.ran_on", unit="{call}",
            description="Cancelled hedge calls to a sync target that ran on to their end in a thread")
        self.guards = meter.create_counter(
            "canvasroute.guards", unit="{event}",
            description="Escalation guard events: changes of state, and decisions kept from the target")
        self.audits = meter.create_counter(
            "canvasroute.audits", unit="{question}",
            description="Answers the gate passed sent to live certification's labeller, by outcome")
        self.audit_faults = meter.create_counter(
            "canvasroute.audit.faults", unit="{decision}",
            description="Decisions whose live certification state could not be read or written")
        self.controller_faults = meter.create_counter(
            "canvasroute.controller.faults", unit="{decision}",
            description="Decisions whose escalation-rate controller state could not be recorded")
        self.operation_duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="GenAI operation duration")
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Measures number of input and output tokens used")


_cache: dict[str, tuple[Any, Any]] = {}
_CONVERSATION: ContextVar[str | None] = ContextVar("canvasroute_conversation", default=None)
"""The thread of the span being recorded, for the model calls under it (`gen_ai.conversation.id`)."""


def _tracer() -> trace.Tracer | None:
    """The global provider's tracer, or None while the API's own proxy or no-op provider
    stands in (no SDK installed): its spans record nothing and leave the context as it was."""
    provider = trace.get_tracer_provider()
    cached = _cache.get("tracer")
    if cached is None or cached[0] is not provider:
        off = isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
        cached = _cache["tracer"] = (provider, None if off else provider.get_tracer(SCOPE))
    return cached[1]


def _instruments() -> _Instruments | None:
    """The global meter provider's instruments, or None while the API's own proxy or no-op
    provider stands in (no SDK installed: every point would be dropped)."""
    provider = metrics.get_meter_provider()
    cached = _cache.get("meter")
    if cached is None or cached[0] is not provider:
        off = type(provider).__module__.startswith("opentelemetry.metrics")  # the API's proxy or no-op
        cached = _cache["meter"] = (provider, None if off else _Instruments(provider.get_meter(SCOPE)))
    return cached[1]


def record_content() -> bool:
    """Whether state and prompt content may be recorded (`CANVASROUTE_RECORD_CONTENT=1`)."""
    return os.environ.get("CANVASROUTE_RECORD_CONTENT", "") == "1"


def _idle_span() -> Span:
    """What a no-op tracer's span would be: the current span context, not recording."""
    return trace.NonRecordingSpan(trace.get_current_span().get_span_context())


class _Idle:
    """The context of a span (or model call) nothing records: a plain object, not a
    generator, since it runs on every decision of an app without an OTel SDK."""

    __slots__ = ("call",)

    def __init__(self, call: bool) -> None:
        self.call = call

    def __enter__(self) -> Any:
        s = _idle_span()
        return Call(s, {}, idle=True) if self.call else s

    def __exit__(self, *exc: object) -> None:
        return None


# -- spans -----------------------------------------------------------------------------


def span(name: str, attributes: Mapping[str, Any],
         kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span]:
    """A span under the current one that records exceptions, `error.type` and an ERROR
    status on failure, and an OK status otherwise (unless the body marked an error).

    Spans are OpenInference CHAIN spans unless `attributes` say otherwise; a
    `gen_ai.conversation.id` (the LangGraph thread) is mirrored to `session.id` and passed
    on to the model calls under the span. Without an SDK nothing is built: the body gets the
    non-recording span a no-op tracer would give it.
    """
    tracer = _tracer()
    return _IDLE_SPAN if tracer is None else _recording_span(tracer, name, attributes, kind)


@contextmanager
def _recording_span(tracer: trace.Tracer, name: str, attributes: Mapping[str, Any],
                    kind: SpanKind) -> Iterator[Span]:
    attrs = {OI_SPAN_KIND: OI_CHAIN, **attributes}
    conversation = attrs.get(GEN_AI_CONVERSATION_ID) or _CONVERSATION.get()  # the thread, for spans under it
    if conversation is not None:
        attrs.setdefault(GEN_AI_CONVERSATION_ID, conversation)
        attrs.setdefault(SESSION_ID, conversation)
    if DECISION_SET in attrs and INPUT_VALUE not in attrs:  # a decide span: what it was asked, even if it fails
        state = attrs.get(STATE_CONTENT)
        attrs[INPUT_VALUE] = json.dumps({"questions": str(attrs[DECISION_SET]).split(","),
                                         **({"state": state} if state is not None else {})}, ensure_ascii=False)
        attrs[INPUT_MIME] = JSON_MIME
    token = _CONVERSATION.set(conversation)
    with tracer.start_as_current_span(name, kind=kind, attributes=attrs,
                                         record_exception=True, set_status_on_exception=True) as s:
        try:
            yield s
        except BaseException as exc:
            s.set_attribute(ERROR_TYPE, type(exc).__qualname__)
            raise
        finally:
            _CONVERSATION.reset(token)
        status = getattr(s, "status", None)  # SDK spans: keep an ERROR set by mark_error
        if status is not None and status.status_code is StatusCode.UNSET:
            s.set_status(Status(StatusCode.OK))


def set_io(s: Span, *, input: Any = None, output: Any = None) -> None:
    """`input.value` / `output.value` as JSON (OpenInference), when given."""
    for key, mime, value in ((INPUT_VALUE, INPUT_MIME, input), (OUTPUT_VALUE, OUTPUT_MIME, output)):
        if value is not None and s.is_recording():
            s.set_attribute(key, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                                                default=str))
            s.set_attribute(mime, "text/plain" if isinstance(value, str) else JSON_MIME)


@dataclass(slots=True)
class Call:
    """One model call in flight: its span and the metric attributes it reports under."""

    span: Span
    metric_attributes: dict[str, Any]
    outer: Span | None = None
    """The enclosing `escalate` span of an escalation's `chat` call (None for reads)."""
    idle: bool = False
    """Nothing records this call (no SDK): `usage` returns without looking up the meter provider."""

    def usage(self, input_tokens: int, output_tokens: int, results: Sequence[Any] = ()) -> None:
        """Record token usage (span attributes and `gen_ai.client.token.usage`) and the server."""
        if self.idle:
            return
        inst, recording = _instruments(), self.span.is_recording()
        if not (inst or recording):
            return
        set_usage(self.span, input_tokens, output_tokens)
        server = _server(results)
        self.span.set_attributes(server)
        self.metric_attributes.update(server)
        if inst is not None:
            inst.token_usage.record(input_tokens, {**self.metric_attributes, GEN_AI_TOKEN_TYPE: "input"})
            inst.token_usage.record(output_tokens, {**self.metric_attributes, GEN_AI_TOKEN_TYPE: "output"})

    def read(self, input_tokens: int, output_tokens: int, chunks: Sequence[Any], results: Sequence[Any],
             specs: Mapping[str, Any]) -> None:
        """What one canvas read answered: its usage, the model that answered, and as
        `output.value`, per canvas, each question's distribution over its options (softmax of
        the slot row over the question's labels, temperature 1; keyed by label where a slot
        reads groups of options rather than the options)."""
        if self.idle:
            return
        self.usage(input_tokens, output_tokens, results)
        if not self.span.is_recording():
            return
        out = []
        for chunk, result in zip(chunks, results):
            canvas = {}
            for slot, row in zip(chunk.slots, result.rows):
                lps = [row.get(i, -math.inf) for i in slot.label_ids]
                top = max(lps)
                if top == -math.inf:
                    continue
                ps = [math.exp(lp - top) for lp in lps]
                options = specs[slot.question_id].options if slot.question_id in specs else ()
                if len(options) != len(ps):
                    options = slot.labels
                shift = getattr(slot, "shift", 0)  # an order-bias view lists the options rotated
                key = f"{slot.question_id}~{shift}" if shift else slot.question_id
                options = tuple(options[shift:]) + tuple(options[:shift])
                canvas[key] = {o: round(p / sum(ps), 4) for o, p in zip(options, ps)}
            out.append(canvas)
        self.output(out, self.metric_attributes.get(GEN_AI_MODEL))

    def output(self, value: Any, response_model: str | None = None) -> None:
        """What the call answered, as `output.value` (on `escalate` too for an escalation),
        and the model that answered (`gen_ai.response.model`), when known."""
        set_io(self.span, output=value)
        if self.outer is not None:
            set_io(self.outer, output=value)
        self.response_model(response_model)

    def response_model(self, model: str | None) -> None:
        """`gen_ai.response.model`: the model that answered."""
        if model and self.span.is_recording():
            self.span.set_attribute(GEN_AI_RESPONSE_MODEL, model)


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
            inst = _instruments()
            if inst is not None:
                inst.operation_duration.record(time.perf_counter() - start, metric_attributes)


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
    s.set_attributes({GEN_AI_INPUT_TOKENS: input_tokens, GEN_AI_OUTPUT_TOKENS: output_tokens,
                      LLM_PROMPT_TOKENS: input_tokens, LLM_COMPLETION_TOKENS: output_tokens,
                      LLM_TOTAL_TOKENS: input_tokens + output_tokens})


def genai_attributes(operation: str, provider: str, model: str) -> dict[str, Any]:
    """The GenAI attributes of one model call and their OpenInference twins (an LLM span)."""
    return {GEN_AI_OPERATION: operation, GEN_AI_PROVIDER: provider, GEN_AI_MODEL: model,
            OI_SPAN_KIND: OI_LLM, LLM_MODEL_NAME: model, LLM_PROVIDER: provider, LLM_SYSTEM: provider}


def engine_call(info: Any, batch: Sequence[Any], kind: str, seed: int | None = None) -> Any:
    """Span `canvas_read <model>` around one engine call (`kind`: first or reread; `seed`:
    the decision's noise seed)."""
    if _tracer() is None and _instruments() is None:  # no SDK: nothing to build
        return _IDLE_CALL
    attrs = {**genai_attributes(OPERATION_CANVAS_READ, info.provider, info.model),
             READ_BATCH: len(batch), READ_KIND: kind}
    if seed is not None:
        attrs[GEN_AI_REQUEST_SEED] = seed
    if record_content():
        prompts = list({json.dumps(_semconv_messages(r.messages), ensure_ascii=False): None for r in batch})
        if len(prompts) == 1:
            attrs[GEN_AI_INPUT_MESSAGES] = prompts[0]
        else:
            attrs[PROMPTS_CONTENT] = prompts
        attrs[INPUT_VALUE] = prompts[0] if len(prompts) == 1 else json.dumps([json.loads(p) for p in prompts])
    else:  # no prompt text (it holds the state): say what was read
        attrs[INPUT_VALUE] = json.dumps({"kind": kind, "canvases": len(batch),
                                         "slots": sum(len(r.slots) for r in batch)})
    attrs[INPUT_MIME] = JSON_MIME
    span_kind = SpanKind.CLIENT if info.provider in REMOTE_PROVIDERS else SpanKind.INTERNAL
    return _call(f"{OPERATION_CANVAS_READ} {info.model}", attrs, span_kind)


@contextmanager
def escalation_call(target: Any, name: str, question_ids: Sequence[str], *, hedge: bool = False,
                    calls: Any = None, audit: bool = False) -> Iterator[Call]:
    """Spans `escalate <model>` (CHAIN) and, under it, `chat <model>` (LLM, GenAI `chat`
    attributes and metrics) around one escalation call; `Call.usage`/`output` write the chat span.
    `calls` (a `Calls`): what went out, written when the call ends (`canvasroute.escalation.calls`).

    A hedge's `escalate` span carries `canvasroute.hedge`: `won` (it answered), `failed`, or
    `cancelled`, when the re-reads settled its questions first: no fault, so both spans end
    without an error and the cancellation goes on once they have ended. A cancelled one whose
    sync target ran on in its thread also carries `canvasroute.hedge.ran_on` and is counted
    (`canvasroute.hedges.ran_on`). An audit's (live certification's labeller asked in the
    background) carries `canvasroute.audit`.
    """
    cancelled: asyncio.CancelledError | None = None
    attributes: dict[str, Any] = {ESCALATED_QUESTIONS: ",".join(question_ids), **({AUDIT: True} if audit else {})}
    with span(f"{OPERATION_ESCALATE} {name}", attributes) as outer:
        set_io(outer, input={"questions": list(question_ids)})
        attrs = {**genai_attributes(OPERATION_CHAT, provider_of(target), name),
                 ESCALATED_QUESTIONS: ",".join(question_ids)}
        try:
            with _call(f"{OPERATION_CHAT} {name}", attrs, SpanKind.CLIENT) as call:
                call.outer = outer
                try:
                    yield call
                except asyncio.CancelledError as exc:
                    if not hedge:
                        raise
                    cancelled = exc
                except BaseException:
                    if hedge:
                        outer.set_attribute(HEDGE, "failed")
                    raise
            if hedge:
                outer.set_attribute(HEDGE, "cancelled" if cancelled is not None else "won")
        finally:
            if calls is not None:
                _calls_made(outer, calls)
    if cancelled is not None:
        raise cancelled


def _calls_made(outer: Span, calls: Any) -> None:
    """What one escalation handed its target, on its `escalate` span (and a ran-on hedge counted)."""
    outer.set_attribute(TARGET_CALLS, calls.sent)
    if calls.ran_on:
        outer.set_attribute(HEDGE_RAN_ON, True)
        inst = _instruments()
        if inst is not None:
            inst.hedges_ran_on.add(1)


def provider_of(target: Any) -> str:
    """The escalation target's provider as LangChain reports it (`openai`, ...).

    Chat models report `ls_provider`; a decision model its `_provider`; anything else
    is `langchain`.
    """
    try:
        provider = target._get_ls_params().get("ls_provider")
    except Exception:  # noqa: BLE001 - not a LangChain model, or one that needs call arguments
        provider = getattr(target, "_provider", None)
    return provider if isinstance(provider, str) and provider else "langchain"


_IDLE_SPAN, _IDLE_CALL = _Idle(call=False), _Idle(call=True)


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


# -- a decision's figures ---------------------------------------------------------------


def record_reports(s: Span, reports: Sequence[Any], duration_s: float, model: str,
                   gates: Mapping[str, Any] | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """One `canvasroute.question` event per question on the decision-set span, and the metric points.

    `gates` (each question's `GatePolicy`) supply each question's temperature; a
    `canvasroute.graph.node` in `attributes` labels the metric points too.
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
            "escalation_model": r.escalation_model, "cause": r.cause,
            "options": list(canvas) if canvas else None,
            "canvas_probabilities": [float(p) for p in canvas.values()] if canvas else None,
            "canvas_answer": max(canvas, key=canvas.__getitem__) if canvas else None,
            "temperature": gates[r.question_id].temperature if gates is not None and canvas else None,
            "crossed": list(r.crossed) or None, "gate": r.gate, "hedged": r.hedged or None,
            "escalation_error": r.escalation_error,
        }
        cert = gates[r.question_id].certificate if recording and gates is not None else None
        if cert is not None and cert.live is not None:
            gate = gates[r.question_id]  # type: ignore[index]
            values.update(live_threshold=gate.max_normalized_entropy if cert.certified else None,
                          live_bound=cert.live.bound, live_rows=cert.live.rows, live_audits=cert.live.audits)
        if recording:
            s.add_event(QUESTION_EVENT, {QUESTION_ID: r.question_id, QUESTION_KIND: r.kind,
                                         **{FIGURE_KEYS[k]: v for k, v in values.items() if v is not None}})
            asked[r.question_id] = {"kind": r.kind, "options": list(canvas) if canvas else None}
            answered[r.question_id] = {"answer": r.answer, "path": r.path, "confidence": r.confidence}
        if inst is None:
            continue
        labels = {**base, METRIC_QUESTION: r.question_id, METRIC_KIND: r.kind}
        inst.decisions.add(1, {**labels, METRIC_PATH: r.path, **({METRIC_CAUSE: r.cause} if r.cause else {})})
        if r.normalized_entropy is not None:
            inst.entropy.record(r.normalized_entropy, labels)
        if r.path == "escalated":
            inst.escalations.add(1, {**labels, **({METRIC_CAUSE: r.cause} if r.cause else {})})
    if inst is not None:
        inst.decision_duration.record(duration_s, base)
    if recording:
        state = (attributes or {}).get(STATE_CONTENT)  # present only under CANVASROUTE_RECORD_CONTENT=1
        set_io(s, input={"questions": asked, **({"state": state} if state is not None else {})}, output=answered)


def mark_error(s: Span, exc: BaseException) -> None:
    """Set an error status and `error.type` on a span that handled `exc`."""
    s.set_attribute(ERROR_TYPE, type(exc).__qualname__)
    s.set_status(Status(StatusCode.ERROR, str(exc)))


def record_hedge(outcome: str, question_ids: Sequence[str]) -> None:
    """How one hedge ended: a `canvasroute.hedge` event on the current (decide) span and a point of
    the `canvasroute.hedges` counter."""
    s = trace.get_current_span()
    if s.is_recording():
        s.add_event(HEDGE_EVENT, {HEDGE: outcome, ESCALATED_QUESTIONS: ",".join(question_ids)})
    inst = _instruments()
    if inst is not None:
        inst.hedges.add(1, {HEDGE: outcome})


def record_guard(guard: str, what: str, message: str, question_ids: Sequence[str] = ()) -> None:
    """What an escalation guard did (`guard`: `breaker` or `fault_cap`; `what`: `GUARD_WHAT`'s values):
    a `canvasroute.guard` event on the current (decide) span and a point of `canvasroute.guards`."""
    s = trace.get_current_span()
    if s.is_recording():
        attrs: dict[str, Any] = {GUARD: guard, GUARD_WHAT: what, FAULT_MESSAGE: message}
        if question_ids:
            attrs[ESCALATED_QUESTIONS] = ",".join(question_ids)
        s.add_event(GUARD_EVENT, attrs)
    inst = _instruments()
    if inst is not None:
        inst.guards.add(1, {GUARD: guard, GUARD_WHAT: what})


def record_fault(s: Span, error: str, questions: Sequence[str], paths: Sequence[str]) -> None:
    """An engine (or escalation target) fault a decision absorbed: a `canvasroute.fault` event on its span (and the
    span's `canvasroute.fault` attribute) and a point of the `canvasroute.faults` counter."""
    kind = error.split(":", 1)[0]
    if s.is_recording():
        s.set_attribute(FAULT, kind)
        s.add_event(FAULT_EVENT, {ERROR_TYPE: kind, FAULT_MESSAGE: error, FAULT_QUESTIONS: list(questions),
                                  FAULT_PATHS: list(paths)})
    inst = _instruments()
    if inst is not None:
        inst.faults.add(len(questions), {ERROR_TYPE: kind, METRIC_PATH: ",".join(paths)})


def record_controller_fault(s: Span, exc: BaseException) -> None:
    """An escalation-rate controller state that could not record a decision (its answers stand):
    the span's `canvasroute.controller.fault` attribute and a point of `canvasroute.controller.faults`."""
    kind = type(exc).__qualname__
    if s.is_recording():
        s.set_attribute(CONTROLLER_FAULT, kind)
    inst = _instruments()
    if inst is not None:
        inst.controller_faults.add(1, {ERROR_TYPE: kind})


def record_audit(s: Span | None, outcome: str, question_ids: Sequence[str]) -> None:
    """Answers sent to (or dropped before) live certification's labeller, or what it did with them:
    a `canvasroute.audit` event on `s` (the decide span; None: none) and points of `canvasroute.audits`."""
    if s is not None and s.is_recording():
        s.add_event(AUDIT_EVENT, {AUDIT_OUTCOME: outcome, ESCALATED_QUESTIONS: ",".join(question_ids)})
    inst = _instruments()
    if inst is not None:
        inst.audits.add(len(question_ids), {AUDIT_OUTCOME: outcome})


def record_audit_fault(s: Span, exc: BaseException) -> None:
    """A live certification state that could not be read or written (its answers stand): the span's
    `canvasroute.audit.fault` attribute and a point of `canvasroute.audit.faults`."""
    kind = type(exc).__qualname__
    if s.is_recording():
        s.set_attribute(AUDIT_FAULT, kind)
    inst = _instruments()
    if inst is not None:
        inst.audit_faults.add(1, {ERROR_TYPE: kind})
