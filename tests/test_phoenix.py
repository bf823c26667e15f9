"""Traces in a real Phoenix: span kinds, inputs and outputs, status, sessions, nesting.

The suite starts Phoenix (tests/services.py); the spans go there the way a user sends
them: the standard `OTEL_EXPORTER_OTLP_ENDPOINT` read by `router.telemetry.add_otlp_exporter`
(OTLP/HTTP, batching). The checks read Phoenix's own REST API.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import pytest
from conftest import fresh_tracer_provider
from deadlines import run
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from opentelemetry import trace
from services import Phoenix
from typing_extensions import TypedDict

from canvasroute.engine import EngineUnavailable, FunctionEngine
from canvasroute.harness import decision_node, merge_decisions
from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy
from canvasroute.router import telemetry as tm

TICKET = "Charged twice for my subscription, customer 4711-secret"


class State(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]


def _graph(fail: bool = False) -> Any:
    def rows(read):  # team: billing for sure; urgent: a toss-up (escalated)
        if fail:
            raise EngineUnavailable("engine down (injected)")
        ids = {engine.token_id(t): t for t in ("A", "B", "yes", "no")}
        row = {i: {"A": -0.01, "B": -6.0, "yes": -0.7, "no": -0.7}[t] for i, t in ids.items()}
        return [row] * len(read.slots)

    engine = FunctionEngine(rows, model="fn-phoenix")
    reply = AIMessage('{"urgent": "yes"}', usage_metadata={"input_tokens": 50, "output_tokens": 5, "total_tokens": 55})
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                                escalate_to=GenericFakeChatModel(messages=iter([reply])),
                                outcomes=OutcomePolicy(engine_fault="raise" if fail else "escalate"))
    team = decision_node(model, {"team": Choice(instructions="Which team?",
                                                criteria={"billing": None, "technical": None})},
                         inputs="ticket", name="team")
    urgent = decision_node(model, {"urgent": Noul(instructions="Urgent?")}, inputs="ticket", name="urgent")
    builder = StateGraph(State)
    builder.add_node("team", team)
    builder.add_node("urgent", urgent)
    builder.add_edge(START, "team")
    builder.add_edge("team", "urgent")
    builder.add_edge("urgent", END)
    return builder.compile(checkpointer=InMemorySaver())


def _run(monkeypatch: pytest.MonkeyPatch, phoenix: Phoenix, project: str, thread: str, *, fail: bool = False,
         content: bool = False) -> str:
    """One graph run inside an application span, exported over OTLP; returns its trace id."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", phoenix.url)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"openinference.project.name={project}")
    monkeypatch.setenv("CANVASROUTE_RECORD_CONTENT", "1" if content else "0")
    with fresh_tracer_provider() as provider:
        assert tm.add_otlp_exporter(provider)
        tracer = trace.get_tracer("app")
        with tracer.start_as_current_span("ticket run", attributes={tm.OI_SPAN_KIND: "CHAIN"}) as root:
            try:
                _graph(fail).invoke({"ticket": TICKET}, {"configurable": {"thread_id": thread}})
            except EngineUnavailable:
                assert fail
        return format(root.get_span_context().trace_id, "032x")


def _spans(phoenix: Phoenix, project: str, ready: Callable[[list[dict]], bool]) -> list[dict]:
    """The project's spans once `ready` holds of them, or as they are once Phoenix's `Watch` says it
    is stuck (it runs at nice 19 beside the suite: its ingestion may lag the exporter by minutes)."""
    limit = phoenix.watch()
    while True:
        spans = phoenix.spans(project)
        if ready(spans):
            return spans
        if why := limit.overdue():
            print(f"waiting for the spans of {project}: {why}")
            return spans
        time.sleep(0.3)


def _trace(phoenix: Phoenix, project: str, trace_id: str, expected: int) -> list[dict]:
    """The spans of one trace, once `expected` of them arrived."""
    def of_trace(spans: list[dict]) -> list[dict]:
        return [s for s in spans if s["context"]["trace_id"] == trace_id]

    return of_trace(_spans(phoenix, project, lambda spans: len(of_trace(spans)) >= expected))


@pytest.mark.services
def test_a_graph_run_reads_well_in_phoenix(monkeypatch: pytest.MonkeyPatch, phoenix: Phoenix) -> None:
    project, thread = f"canvasroute-{uuid.uuid4().hex[:6]}", f"thread-{uuid.uuid4().hex[:6]}"
    trace_id = _run(monkeypatch, phoenix, project, thread)
    # ticket run > 2 x (decide > canvas_read), the second decide also > escalate > chat
    spans = _trace(phoenix, project, trace_id, 7)
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == ["canvas_read fn-phoenix", "chat GenericFakeChatModel", "decide fn-phoenix",
                               "escalate GenericFakeChatModel", "ticket run"] and len(spans) == 7, \
        sorted(s["name"] for s in spans)
    root = by_name["ticket run"]
    decides = [s for s in spans if s["name"] == "decide fn-phoenix"]
    reads = [s for s in spans if s["name"] == "canvas_read fn-phoenix"]
    # both decisions of the run sit under the run's span, in its trace
    assert len(decides) == 2 and all(d["parent_id"] == root["context"]["span_id"] for d in decides)
    assert {r["parent_id"] for r in reads} == {d["context"]["span_id"] for d in decides}
    esc, chat = by_name["escalate GenericFakeChatModel"], by_name["chat GenericFakeChatModel"]
    urgent = next(d for d in decides if "urgent" in json.loads(d["attributes"]["output.value"]))
    assert esc["parent_id"] == urgent["context"]["span_id"] and chat["parent_id"] == esc["context"]["span_id"]

    # OpenInference kinds, as Phoenix classified them
    assert {d["span_kind"] for d in decides} == {"CHAIN"} and esc["span_kind"] == "CHAIN"
    assert {r["span_kind"] for r in reads} == {"LLM"} and chat["span_kind"] == "LLM"
    # GenAI attributes beside them
    assert all(r["attributes"]["gen_ai.operation.name"] == "canvas_read" for r in reads)
    assert chat["attributes"]["gen_ai.operation.name"] == "chat"
    assert chat["attributes"]["llm.token_count.prompt"] == 50 and chat["attributes"]["llm.token_count.completion"] == 5
    # inputs and outputs show the questions and answers
    team = next(d for d in decides if d is not urgent)
    assert json.loads(team["attributes"]["output.value"]) == {
        "team": {"answer": "billing", "path": "canvas", "confidence": pytest.approx(1.0, abs=0.01)}}
    assert json.loads(team["attributes"]["input.value"])["questions"]["team"]["options"] == ["billing", "technical"]
    assert json.loads(urgent["attributes"]["output.value"])["urgent"]["path"] == "escalated"
    assert json.loads(esc["attributes"]["output.value"]) == {"urgent": "yes"}
    read_out = [json.loads(r["attributes"]["output.value"]) for r in reads]
    assert {"team": {"billing": pytest.approx(1.0, abs=0.01), "technical": pytest.approx(0.0, abs=0.01)}} in \
        [o[0] for o in read_out]
    # state text only behind the content switch (off here): the ticket is nowhere
    assert TICKET not in json.dumps(spans) and "4711" not in json.dumps(spans)
    # status as it happened; session = the LangGraph thread
    assert all(s["status_code"] == "OK" for s in spans if s["name"] != "ticket run")
    assert {d["attributes"]["session.id"] for d in decides} == {thread}
    assert {s["attributes"]["gen_ai.conversation.id"] for s in spans if s is not root} == {thread}
    # a bounded key set: per-question figures are events with the id as a value, never in a key
    keys = {k for s in spans for k in s["attributes"]}
    assert not [k for k in keys if "team" in k or "urgent" in k] and "gen_ai.system" not in keys
    questions = [e for d in decides for e in d.get("events") or [] if e["name"] == tm.QUESTION_EVENT]
    assert sorted(e["attributes"][tm.QUESTION_ID] for e in questions) == ["team", "urgent"]
    assert {e["attributes"][tm.QUESTION_ID]: e["attributes"][tm.FIGURE_KEYS["path"]] for e in questions} == {
        "team": "canvas", "urgent": "escalated"}
    sessions = {s["session_id"]: s for s in phoenix.sessions(project)}
    assert trace_id in {t["trace_id"] for t in sessions[thread]["traces"]}


@pytest.mark.services
def test_errors_and_recorded_content_in_phoenix(monkeypatch: pytest.MonkeyPatch, phoenix: Phoenix) -> None:
    project, thread = f"canvasroute-{uuid.uuid4().hex[:6]}", f"thread-{uuid.uuid4().hex[:6]}"
    trace_id = _run(monkeypatch, phoenix, project, thread, fail=True, content=True)
    spans = _trace(phoenix, project, trace_id, 3)
    by_name = {s["name"]: s for s in spans}
    decide, read = by_name["decide fn-phoenix"], by_name["canvas_read fn-phoenix"]
    assert decide["status_code"] == read["status_code"] == "ERROR"
    assert read["attributes"]["error.type"] == "EngineUnavailable"
    assert "engine down" in read["status_message"]
    # with CANVASROUTE_RECORD_CONTENT=1 the state is the decision's input, and the prompt the read's
    assert TICKET in json.loads(decide["attributes"]["input.value"])["state"]
    assert TICKET in read["attributes"]["input.value"]


@pytest.mark.vllm
@pytest.mark.services
def test_demo_exports_to_phoenix_over_standard_otlp_env(vllm_url: str, phoenix: Phoenix, tmp_path) -> None:
    """`OTEL_EXPORTER_OTLP_ENDPOINT=... canvasroute demo --engine-url ...` (docs/scale-out.md):
    the demo's decisions on the real vLLM server arrive in Phoenix as CHAIN/LLM spans."""
    from services import PYTHON, child_env

    project = f"demo-{uuid.uuid4().hex[:6]}"
    env = child_env(OTEL_EXPORTER_OTLP_ENDPOINT=phoenix.url,
                    OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={project}")
    done = run([PYTHON, "-m", "canvasroute.apps.cli", "demo", "--engine-url", vllm_url,
                "--trace", str(tmp_path / "demo.jsonl")], env=env, cpu_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exporting spans over OTLP to {phoenix.url}" in done.stdout
    spans = _spans(phoenix, project, lambda spans: sum(s["name"].startswith("decide ") for s in spans) >= 3)
    decides = [s for s in spans if s["name"].startswith("decide ")]
    reads = [s for s in spans if s["name"].startswith("canvas_read ")]
    assert len(decides) == 3, "one decision set per sample ticket"
    assert {s["span_kind"] for s in decides} == {"CHAIN"} and {s["span_kind"] for s in reads} == {"LLM"}
    assert all(r["attributes"]["llm.provider"] == "vllm" and r["attributes"]["llm.token_count.prompt"] > 0
               for r in reads)
    assert all(set(json.loads(d["attributes"]["output.value"])) == {"team", "urgent", "severity"} for d in decides)
