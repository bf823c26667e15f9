"""CanvasDecisionModel as the classifier of LangChain's ModelRouterMiddleware in create_agent.

A real `create_agent` run (langchain v1) with fake chat models: one canvas read picks the
agent's model before the run, the complete `ChoiceAnswer` lands in agent state, and every
model call of the run goes to the chosen model.
"""

from __future__ import annotations

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ModelChoice, ModelRouterMiddleware
from langchain_core.decisions import ChoiceAnswer
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage

from canvasroute.engine import FunctionEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy

TASK = "Prove that there are infinitely many primes, step by step."


class _Unused(GenericFakeChatModel):
    """The agent's default model: the router must never let it answer."""

    def _generate(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the agent's default model was called instead of the routed one")


def _agent(classifier: CanvasDecisionModel):
    fast = GenericFakeChatModel(messages=iter([AIMessage("fast: 2, 3, 5, ... (short answer)")]))
    powerful = GenericFakeChatModel(messages=iter([AIMessage("powerful: assume finitely many primes p1..pn; "
                                                             "p1*...*pn + 1 has a prime factor not in the list.")]))
    router = ModelRouterMiddleware(
        choices={"fast": ModelChoice(model=fast, criteria="Simple, well-scoped tasks."),
                 "powerful": ModelChoice(model=powerful, criteria="Proofs and multi-step reasoning.")},
        instructions="Choose the least costly model suited to the task.",
        classifier=classifier,
    )
    return create_agent(_Unused(messages=iter([])), middleware=[router])


def _engine(pick: str) -> FunctionEngine:
    def rows(read):  # route labels A (fast) / B (powerful): `pick` gets nearly all the mass
        a, b = engine.token_id("A"), engine.token_id("B")
        return [{a: -0.02 if pick == "A" else -5.0, b: -0.02 if pick == "B" else -5.0}] * len(read.slots)

    engine = FunctionEngine(rows, model="fn-router")
    return engine


@pytest.mark.parametrize("pick, route", [("B", "powerful"), ("A", "fast")])
def test_one_read_picks_the_agents_model(pick: str, route: str) -> None:
    engine = _engine(pick)
    agent = _agent(CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5)))
    out = agent.invoke({"messages": [HumanMessage(TASK)]})
    assert engine.calls == 1 and len(engine.reads) == 1, "one canvas read per agent run"
    assert TASK in engine.reads[0].messages[-1]["content"], "the read is about the latest human message"
    answer = out["model_route"]
    assert isinstance(answer, ChoiceAnswer) and answer.choice == route
    assert answer.probabilities[route] > 0.99 and set(answer.probabilities) == {"fast", "powerful"}
    assert out["messages"][-1].content.startswith(f"{route}:")


async def test_async_agent_run_routes_with_ainvoke() -> None:
    engine = _engine("B")
    agent = _agent(CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5)))
    out = await agent.ainvoke({"messages": [HumanMessage(TASK)]})
    assert engine.calls == 1 and out["model_route"].choice == "powerful"
    assert out["messages"][-1].content.startswith("powerful:")


def test_an_unsure_read_escalates_before_the_agent_runs() -> None:
    engine = FunctionEngine(lambda read: [{}] * len(read.slots), model="fn-flat")  # no mass on any label
    judge = GenericFakeChatModel(messages=iter([AIMessage('{"model_route": "powerful"}')]))
    classifier = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                                     escalate_to=judge)
    out = _agent(classifier).invoke({"messages": [HumanMessage("What is 2 + 2?")]})
    assert next(judge.messages, None) is None, "the escalation model was not asked"
    assert out["model_route"].choice == "powerful"  # the escalation's answer, not the flat canvas' first option
    assert out["messages"][-1].content.startswith("powerful:")
