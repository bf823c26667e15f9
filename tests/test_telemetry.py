"""OpenTelemetry: spans, attributes and metric points of a decision set; traceparent to vLLM; no secrets.

The OTel SDK is real (InMemorySpanExporter, InMemoryMetricReader); engines are doubles
(FunctionEngine, an httpx.MockTransport vLLM) so faults and headers can be observed.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once

from canvasroute.engine import Connection, EngineUnavailable, FunctionEngine, Retries, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy
from canvasroute.router import telemetry as tm

QUESTIONS = {
    "team": Choice(instructions="Which team should handle this?",
                   criteria={"billing": "invoices", "tech": "bugs", "sales": "pricing"}),
    "urgent": Noul(instructions="Is it urgent?"),
}
STATE = "My invoice is wrong and production is down"


@contextmanager
def fresh_otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    """Install fresh global SDK providers (as opentelemetry-test-utils does) and restore the old ones."""
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE,
             metrics_internal._METER_PROVIDER, metrics_internal._METER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    metrics_internal._METER_PROVIDER, metrics_internal._METER_PROVIDER_SET_ONCE = None, Once()
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    try:
        yield exporter, reader
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
        (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE,
         metrics_internal._METER_PROVIDER, metrics_internal._METER_PROVIDER_SET_ONCE) = saved


@pytest.fixture
def otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    with fresh_otel() as pair:
        yield pair


def _engine() -> FunctionEngine:
    """`team` stays uncertain on every read (tech slightly ahead); `urgent` is a confident yes."""

    def rows(read):
        team = {engine.token_id("A"): -1.15, engine.token_id("B"): -1.0, engine.token_id("C"): -1.2}
        urgent = {engine.token_id("yes"): -0.01, engine.token_id("no"): -5.0}
        return [team, urgent]

    engine = FunctionEngine(rows, model="fn-canvas")
    return engine


def _escalation() -> GenericFakeChatModel:
    reply = AIMessage('{"team": "billing"}',
                      usage_metadata={"input_tokens": 120, "output_tokens": 9, "total_tokens": 129})
    return GenericFakeChatModel(messages=iter([reply]))


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


async def test_decision_set_with_reread_and_escalation_spans_and_metrics(otel):
    exporter, reader = otel
    model = CanvasDecisionModel(engine=_engine(), policy=GatePolicy(max_normalized_entropy=0.5, rereads=2),
                                escalate_to=_escalation())
    resp = await model.adecide(STATE, QUESTIONS, seed=1234,
                               attributes={tm.GRAPH_NODE: "triage", tm.GEN_AI_CONVERSATION_ID: "thread-7"})
    assert resp.reads["team"].path == "escalated" and resp.answers["team"].choice == "billing"
    assert resp.reads["urgent"].path == "canvas"

    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(by_name) == ["canvas_read fn-canvas", "chat GenericFakeChatModel", "decide fn-canvas",
                               "escalate GenericFakeChatModel"]
    (decide,) = by_name["decide fn-canvas"]
    reads = by_name["canvas_read fn-canvas"]
    (outer,) = by_name["escalate GenericFakeChatModel"]
    (esc,) = by_name["chat GenericFakeChatModel"]  # the escalation's chat call, under escalate
    assert decide.parent is None
    for child in [*reads, outer]:
        assert child.parent is not None and child.parent.span_id == decide.context.span_id
        assert child.context.trace_id == decide.context.trace_id
    assert esc.parent is not None and esc.parent.span_id == outer.context.span_id
    assert not any(k.startswith("gen_ai.usage") for k in outer.attributes)  # usage counted once, on the chat span
    assert outer.attributes[tm.OI_SPAN_KIND] == "CHAIN" and esc.attributes[tm.OI_SPAN_KIND] == "LLM"

    # engine calls: GenAI attributes, one first read, one batch of two re-reads
    assert sorted((r.attributes[tm.READ_KIND], r.attributes[tm.READ_BATCH]) for r in reads) == [
        ("first", 1), ("reread", 2)]
    for r in reads:
        assert r.attributes[tm.GEN_AI_OPERATION] == "canvas_read"
        assert r.attributes[tm.GEN_AI_PROVIDER] == "function" and tm.GEN_AI_SYSTEM not in r.attributes
        assert r.attributes[tm.GEN_AI_MODEL] == r.attributes[tm.GEN_AI_RESPONSE_MODEL] == "fn-canvas"
        assert r.attributes[tm.GEN_AI_REQUEST_SEED] == 1234
        assert tm.GEN_AI_INPUT_TOKENS in r.attributes and r.attributes[tm.GEN_AI_OUTPUT_TOKENS] > 0
        assert r.kind == SpanKind.INTERNAL  # an in-process engine
    # escalation: a chat call to the target's provider, with its token usage
    assert esc.kind == SpanKind.CLIENT
    assert esc.attributes[tm.GEN_AI_OPERATION] == "chat"
    assert esc.attributes[tm.GEN_AI_PROVIDER] == "genericfakechatmodel"
    assert esc.attributes[tm.GEN_AI_MODEL] == "GenericFakeChatModel"
    assert (esc.attributes[tm.GEN_AI_INPUT_TOKENS], esc.attributes[tm.GEN_AI_OUTPUT_TOKENS]) == (120, 9)
    assert esc.attributes[tm.ESCALATED_QUESTIONS] == "team"
    # the thread on every span of the decision: the conversation (and OpenInference's session)
    assert {(s.attributes[tm.GEN_AI_CONVERSATION_ID], s.attributes[tm.SESSION_ID]) for s in spans} == {
        ("thread-7", "thread-7")}

    # decide span: routing figures under canvasroute.*, no GenAI usage or operation
    a = decide.attributes
    assert not [k for k in a if k.startswith("gen_ai.") and k != tm.GEN_AI_CONVERSATION_ID]
    assert a[tm.GRAPH_NODE] == "triage" and a[tm.DECISION_SET] == "team,urgent" and a[tm.CANVAS_READS] == 3
    # per question: one event with the id as a value, figures under fixed keys
    events = {e.attributes[tm.QUESTION_ID]: e.attributes for e in decide.events if e.name == tm.QUESTION_EVENT}
    assert sorted(events) == ["team", "urgent"]
    f = {figure: events["team"].get(key) for figure, key in tm.FIGURE_KEYS.items()}
    assert f["path"] == "escalated" and f["escalated"] is True and f["answer"] == "billing"
    assert f["canvas_answer"] == "tech" and f["reads"] == 3 and f["temperature"] == 1.0
    assert list(f["options"]) == ["billing", "tech", "sales"]
    assert math.isclose(sum(f["canvas_probabilities"]), 1.0)
    assert f["escalation_model"] == "GenericFakeChatModel"
    assert f["normalized_entropy"] > 0.9 and events["team"][tm.QUESTION_KIND] == "choice"
    urgent = events["urgent"]
    assert urgent[tm.FIGURE_KEYS["path"]] == "canvas" and urgent[tm.FIGURE_KEYS["escalated"]] is False
    # a bounded key set: no attribute or event key names a question
    keys = {k for s in spans for k in s.attributes} | {k for s in spans for e in s.events for k in e.attributes}
    assert not [k for k in keys if "team" in k or "urgent" in k], keys
    assert {k for e in decide.events for k in e.attributes} <= {tm.QUESTION_ID, tm.QUESTION_KIND,
                                                                 *tm.FIGURE_KEYS.values()}
    assert tm.STATE_CONTENT not in a  # content is off by default
    assert not any(STATE in str(v) for s in spans for v in s.attributes.values())

    points = _points(reader)
    decided = {(pt.attributes[tm.METRIC_QUESTION], pt.attributes[tm.METRIC_PATH]): pt.value
               for pt in points["canvasroute.decisions"]}
    assert decided == {("team", "escalated"): 1, ("urgent", "canvas"): 1}
    for pt in points["canvasroute.decisions"]:
        assert pt.attributes[tm.GRAPH_NODE] == "triage" and pt.attributes[tm.GEN_AI_MODEL] == "fn-canvas"
    (escalated,) = points["canvasroute.escalations"]
    assert escalated.value == 1 and escalated.attributes[tm.METRIC_QUESTION] == "team"
    assert sum(pt.count for pt in points["canvasroute.decision.normalized_entropy"]) == 2
    (duration,) = points["canvasroute.decision.duration"]
    assert duration.count == 1 and duration.attributes[tm.GRAPH_NODE] == "triage"
    ops = {pt.attributes[tm.GEN_AI_OPERATION]: pt.count for pt in points["gen_ai.client.operation.duration"]}
    assert ops == {"canvas_read": 2, "chat": 1}
    usage = {(pt.attributes[tm.GEN_AI_OPERATION], pt.attributes[tm.GEN_AI_TOKEN_TYPE]): pt.sum
             for pt in points["gen_ai.client.token.usage"]}
    assert usage[("chat", "input")] == 120 and usage[("chat", "output")] == 9


async def test_failed_engine_call_records_error_type(otel):
    exporter, reader = otel

    def broken(read):
        raise EngineUnavailable("replica down")

    model = CanvasDecisionModel(engine=FunctionEngine(broken, model="fn-canvas"), escalate_to=_escalation())
    resp = await model.adecide(STATE, {"team": QUESTIONS["team"]})
    assert resp.reads["team"].path == "escalated"
    (read,) = [s for s in exporter.get_finished_spans() if s.name.startswith("canvas_read")]
    assert read.status.status_code.name == "ERROR"
    assert read.attributes[tm.ERROR_TYPE] == "EngineUnavailable"
    assert any(e.name == "exception" for e in read.events)
    (pt,) = [pt for pt in _points(reader)["gen_ai.client.operation.duration"]
             if pt.attributes[tm.GEN_AI_OPERATION] == "canvas_read"]
    assert pt.attributes[tm.ERROR_TYPE] == "EngineUnavailable"


async def test_content_is_recorded_only_when_enabled(otel, monkeypatch):
    exporter, _ = otel
    monkeypatch.setenv("CANVASROUTE_RECORD_CONTENT", "1")
    model = CanvasDecisionModel(engine=_engine(), policy=GatePolicy(max_normalized_entropy=None, rereads=0))
    await model.adecide(STATE, QUESTIONS)
    spans = {s.name.split()[0]: s for s in exporter.get_finished_spans()}
    assert spans["decide"].attributes[tm.STATE_CONTENT] == STATE
    messages = json.loads(spans["canvas_read"].attributes[tm.GEN_AI_INPUT_MESSAGES])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["parts"][0] == {"type": "text", "content": STATE}


# -- a vLLM double over httpx.MockTransport ------------------------------------------------------


class MockVLLM:
    """Enough of vLLM's OpenAI server for reads: /v1/models, /tokenize, /v1/chat/completions."""

    def __init__(self, *, fail_reads: int = 0) -> None:
        self.vocab: dict[str, int] = {"<pad>": 0}
        self.requests: list[httpx.Request] = []
        self.fail_reads = fail_reads

    def ids(self, text: str) -> list[int]:
        return [self.vocab.setdefault(p, len(self.vocab)) for p in re.findall(r"<\|?[a-z_]+\|?>|\w+|\s|[^\w\s]", text)]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "mock-dgemma", "max_model_len": 4096}]})
        body = json.loads(request.content)
        if path == "/tokenize":
            text = body["prompt"] if "prompt" in body else "".join(m["content"] for m in body["messages"])
            return httpx.Response(200, json={"tokens": self.ids(text)})
        if path == "/v1/chat/completions":
            if self.fail_reads:
                self.fail_reads -= 1
                return httpx.Response(503, json={"error": {"message": "busy"}})
            canvas = body["vllm_xargs"]["diffusion_seed_canvas"]
            labels = body["logprob_token_ids"]
            row = [{"token": f"token_id:{i}", "logprob": -1.0 - 0.1 * n} for n, i in enumerate(labels)]
            content = [{"token": f"token_id:{c}", "logprob": -0.5, "top_logprobs": row} for c in canvas]
            return httpx.Response(200, json={"choices": [{"logprobs": {"content": content}}],
                                             "usage": {"prompt_tokens": 40, "completion_tokens": len(canvas)}})
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})


def _vllm(mock: MockVLLM, *, api_key: str | None = None, retries: int = 3) -> VLLMServerEngine:
    connection = Connection("http://vllm.mock:8000", api_key=api_key, transport=httpx.MockTransport(mock),
                            retries=Retries(max_retries=retries, backoff=0.0))
    return VLLMServerEngine(connection, canvas_width=64, vocab_size=32000)


async def test_traceparent_sent_to_vllm_carries_the_canvas_read_span(otel):
    exporter, _ = otel
    mock = MockVLLM()
    engine = _vllm(mock)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=None, rereads=0))
    await model.adecide(STATE, QUESTIONS)
    await engine.aclose()
    (read_span,) = [s for s in exporter.get_finished_spans() if s.name == "canvas_read mock-dgemma"]
    (read_request,) = [r for r in mock.requests if r.url.path == "/v1/chat/completions"]
    version, trace_id, parent_id, flags = read_request.headers["traceparent"].split("-")
    assert trace_id == format(read_span.context.trace_id, "032x")
    assert parent_id == format(read_span.context.span_id, "016x")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert read_span.kind == SpanKind.CLIENT  # vLLM is reached over the network
    assert read_span.attributes[tm.GEN_AI_PROVIDER] == "vllm"
    assert (read_span.attributes[tm.SERVER_ADDRESS], read_span.attributes[tm.SERVER_PORT]) == ("vllm.mock", 8000)


async def test_api_key_never_reaches_spans_or_logs(otel, monkeypatch, caplog):
    exporter, reader = otel
    secret = "sk-canvasroute-SECRET-4242"
    monkeypatch.setenv("CANVASROUTE_RECORD_CONTENT", "1")  # even with content on
    caplog.set_level(logging.DEBUG)
    mock = MockVLLM(fail_reads=1)  # one 503, retried
    engine = _vllm(mock, api_key=secret)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.01, rereads=1),
                                escalate_to=GenericFakeChatModel(messages=iter(
                                    [AIMessage('{"team": "tech", "urgent": "yes"}')])))
    await model.adecide(STATE, QUESTIONS)
    down = _vllm(MockVLLM(fail_reads=99), api_key=secret, retries=1)
    with pytest.raises(EngineUnavailable):
        await CanvasDecisionModel(engine=down).adecide(STATE, QUESTIONS)
    await engine.aclose()
    await down.aclose()

    assert mock.requests and all(r.headers["authorization"] == f"Bearer {secret}" for r in mock.requests)
    spans = exporter.get_finished_spans()
    assert any(s.status.status_code.name == "ERROR" for s in spans)
    dumped = [json.dumps(s.to_json()) for s in spans]  # attributes, events, status, resource, links
    assert dumped and not [d for d in dumped if secret in d]
    assert secret not in reader.get_metrics_data().to_json()
    assert caplog.records
    for record in caplog.records:
        assert secret not in record.getMessage() and secret not in str(record.__dict__)
    assert secret not in repr(engine)


@contextmanager
def no_otel_sdk() -> Iterator[None]:
    """The API's own proxy providers, as in an app without the SDK."""
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE,
             metrics_internal._METER_PROVIDER, metrics_internal._METER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    metrics_internal._METER_PROVIDER, metrics_internal._METER_PROVIDER_SET_ONCE = None, Once()
    try:
        yield
    finally:
        (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE,
         metrics_internal._METER_PROVIDER, metrics_internal._METER_PROVIDER_SET_ONCE) = saved


async def test_without_an_sdk_spans_keep_the_context_and_an_sdk_installed_later_records():
    parent = trace.SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    seen = []

    def rows(read):
        seen.append(trace.get_current_span().get_span_context())  # what a traceparent header carries
        return [{i: -0.1 - 3.0 * k for k, i in enumerate(read.label_ids)}] * len(read.slots)

    model = CanvasDecisionModel(engine=FunctionEngine(rows, model="m", canvas_width=64), policy=GatePolicy())
    with no_otel_sdk():
        with trace.use_span(trace.NonRecordingSpan(parent)):
            resp = await model.adecide(STATE, QUESTIONS)
        assert seen == [parent] and set(resp.reads) == set(QUESTIONS)
        with fresh_otel() as (exporter, reader):  # the SDK arrives after decisions ran without it
            await model.adecide(STATE, QUESTIONS)
            names = [s.name for s in exporter.get_finished_spans()]
            assert names == ["canvas_read m", "decide m"] and "canvasroute.decisions" in _points(reader)
