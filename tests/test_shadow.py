"""Shadow mode: a real LangGraph graph keeps routing by its existing router (a chat-model
Runnable, a function, an async function) while the canvas reads beside it; agreement,
would-escalate and both latencies land in the record, the span and the stream event.

The scripted router is langchain-core's `GenericFakeChatModel` (a real chat model class
replying from a script) behind a real prompt-to-parser chain; the `smollm` test routes
with `ChatOpenAI` against tests/ar_server.py (SmolLM2 over real HTTP)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Annotated, Any

import pytest
from conftest import fixed_engine, smollm2_ar_server
from deadlines import patience
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from canvasroute.engine import EngineUnavailable, FunctionEngine
from canvasroute.harness import DECISION_EVENT, decision_node, merge_decisions
from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy
from canvasroute.router import telemetry as tm

TEAM = Choice(instructions="Which team should handle the ticket?", criteria={"billing": "payments", "tech": "bugs"})
URGENT = Noul(instructions="Is the ticket urgent?")
QUESTIONS = {"team": TEAM, "urgent": URGENT}
SURE_TECH = {"A": -6.0, "B": -0.01, "yes": -0.01, "no": -6.0}
UNSURE = {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70}


class State(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def failing_engine() -> FunctionEngine:
    def rows(read):
        raise EngineUnavailable("engine down")

    return FunctionEngine(rows)


class CountingTarget(GenericFakeChatModel):
    """An escalation target that counts calls: shadow reads must never reach it."""

    calls: int = 0

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super()._generate(*args, **kwargs)


def llm_router(*replies: str):
    """The user's existing LLM router: prompt | chat model | str parser (scripted replies)."""
    prompt = ChatPromptTemplate.from_messages([("system", "Answer billing or tech."), ("human", "{ticket}")])
    chat = GenericFakeChatModel(messages=iter([AIMessage(r) for r in replies]))
    return prompt | chat | StrOutputParser()


def graph(model: CanvasDecisionModel, shadow: Any):
    node = decision_node(model, QUESTIONS, inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}),
                         shadow=shadow)
    builder = StateGraph(State)
    builder.add_node("triage", node)
    builder.add_edge(START, "triage")
    for lane in ("billing", "tech"):
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    return builder.compile()


def _events(chunks):
    return [c for mode, c in chunks if mode == "custom" and c.get("type") == DECISION_EVENT]


def _final(chunks):
    return [c for mode, c in chunks if mode == "values"][-1]


def test_the_graph_follows_the_existing_llm_router_and_records_the_canvas_beside_it(spans):
    target = CountingTarget(messages=itertools.repeat(AIMessage('{"team": "billing"}')))
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH), escalate_to=target)
    g = graph(model, llm_router("billing", "tech"))
    assert g.get_graph().to_json()  # still draws: the router did not change the node's edges
    first = list(g.stream({"ticket": "charged twice"}, stream_mode=["values", "custom"]))
    second = list(g.stream({"ticket": "500 on every page"}, stream_mode=["values", "custom"]))

    out = _final(first)
    assert out["lane"] == "billing"  # the existing router decided, though the canvas said tech
    team = out["decisions"]["team"]
    assert team["answer"] == "tech" and team["path"] == "canvas"  # the canvas's own answer, unescalated
    shadow = team["shadow"]
    assert shadow["destination"] == "billing" and shadow["canvas_destination"] == "tech"
    assert shadow["agrees"] is False and shadow["would_escalate"] is False and shadow["canvas_alone"] is True
    assert shadow["latency_s"]["router"] > 0 and shadow["latency_s"]["canvas"] > 0
    (event,) = _events(first)
    assert event["goto"] == "billing" and event["shadow"]["agrees"] is False
    assert event["shadow"]["would_escalate"] == []

    assert _final(second)["lane"] == "tech" and _final(second)["decisions"]["team"]["shadow"]["agrees"] is True
    assert target.calls == 0

    finished = spans.get_finished_spans()
    shadows = [s for s in finished if s.name == "shadow triage"]
    assert [s.attributes[tm.SHADOW_AGREES] for s in shadows] == [False, True]
    assert shadows[0].attributes[tm.SHADOW_DESTINATION] == "billing"
    assert shadows[0].attributes[tm.SHADOW_CANVAS_DESTINATION] == "tech"
    assert shadows[0].attributes[tm.SHADOW_CANVAS_ALONE] is True
    assert shadows[0].attributes[tm.GRAPH_NODE] == "triage"
    decides = [s for s in finished if s.name.startswith("decide ")]
    assert [d.parent.span_id for d in decides] == [s.context.span_id for s in shadows]  # the read under it
    routes = [s.attributes[tm.ROUTE_DESTINATION] for s in finished if s.name == "route triage"]
    assert routes == ["billing", "tech"]


@pytest.mark.asyncio
async def test_async_router_and_unsure_canvas_record_what_would_escalate(spans):
    target = CountingTarget(messages=itertools.repeat(AIMessage('{"team": "billing", "urgent": "no"}')))
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=target,
                                policy=GatePolicy(max_normalized_entropy=0.5, rereads=0))
    started = []

    async def rules(state: State) -> str:
        started.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)
        return "billing" if "charge" in state["ticket"] else "tech"

    out = await graph(model, rules).ainvoke({"ticket": "charged twice"})
    assert out["lane"] == "billing" and target.calls == 0  # unsure, yet nothing was escalated
    for qid in ("team", "urgent"):
        s = out["decisions"][qid]["shadow"]
        assert s["would_escalate"] is True and s["canvas_alone"] is False
        assert out["decisions"][qid]["read"]["confident"] is False
    assert out["decisions"]["team"]["shadow"]["latency_s"]["router"] >= 0.05
    (span,) = [s for s in spans.get_finished_spans() if s.name == "shadow triage"]
    assert span.attributes[tm.SHADOW_WOULD_ESCALATE] == "team,urgent"
    assert span.attributes[tm.SHADOW_CANVAS_ALONE] is False
    assert span.attributes[tm.SHADOW_ROUTER_LATENCY] >= 0.05


def test_a_failing_canvas_never_fails_the_node(spans):
    model = CanvasDecisionModel(engine=failing_engine(), outcomes=OutcomePolicy(engine_fault="raise"))
    out = graph(model, lambda state: "tech").invoke({"ticket": "500 on every page"})
    assert out["lane"] == "tech" and not out.get("decisions")  # nothing read, nothing written
    (span,) = [s for s in spans.get_finished_spans() if s.name == "shadow triage"]
    assert span.attributes[tm.SHADOW_CANVAS_ERROR] == "EngineUnavailable"
    assert span.attributes[tm.SHADOW_AGREES] is False and tm.SHADOW_CANVAS_DESTINATION not in span.attributes


def test_the_router_must_return_a_declared_destination_and_shadow_needs_a_route():
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    with pytest.raises(ValueError, match="not one of the declared destinations"):
        graph(model, lambda state: "sales").invoke({"ticket": "x"})
    with pytest.raises(ValueError, match="needs a routing decision node"):
        decision_node(model, QUESTIONS, shadow=lambda state: "tech")
    with pytest.raises(TypeError, match="shadow must be"):
        decision_node(model, QUESTIONS, route=("team", {"billing": "b", "tech": "t"}), shadow=42)


# -- a real AR model as the existing router ------------------------------------------------------


@pytest.fixture(scope="module")
def ar_server(smol):
    with smollm2_ar_server(smol, max_new_tokens=4) as server:
        yield server


@pytest.mark.smollm
def test_shadowing_a_chat_openai_router_on_the_ar_server(ar_server, spans):
    from langchain_core.runnables import RunnableLambda
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=ar_server.url + "/v1", model="smollm2", api_key="x", max_tokens=4, max_retries=0,
                      timeout=patience(120))
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Route the support ticket. Reply with one word: billing or tech."), ("human", "{ticket}")])
    # SmolLM2 is near chance: whatever it says, map it onto a lane so the graph can go on
    lane = RunnableLambda(lambda text: "billing" if "bill" in text.lower() else "tech")
    router = prompt | chat | StrOutputParser() | lane
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    before = len(ar_server.requests)
    out = graph(model, router).invoke({"ticket": "I was charged twice, please refund"})
    assert len(ar_server.requests) == before + 1  # the router really called the server
    shadow = out["decisions"]["team"]["shadow"]
    assert out["lane"] == shadow["destination"] and shadow["canvas_destination"] == "tech"
    assert shadow["agrees"] is (shadow["destination"] == "tech")
    (span,) = [s for s in spans.get_finished_spans() if s.name == "shadow triage"]
    assert span.attributes[tm.SHADOW_ROUTER_LATENCY] > 0
