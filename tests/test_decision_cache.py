"""Decision cache: the in-model LRU with TTL, and the node's LangGraph CachePolicy."""

from __future__ import annotations

from typing import TypedDict

import pytest
from conftest import fixed_engine
from langchain_core.decisions import Choice, Noul
from langgraph.cache.memory import InMemoryCache
from langgraph.graph import END, START, StateGraph

from canvasroute.engine import EngineUnavailable, FunctionEngine
from canvasroute.harness import decision_node
from canvasroute.router import CanvasDecisionModel, DecisionCache, GatePolicy, OutcomePolicy
from canvasroute.router.telemetry import CACHE_HIT

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Is it urgent?")


def _engine() -> FunctionEngine:
    return fixed_engine({"A": -0.05, "B": -4.0, "yes": -0.05, "no": -4.0})  # confident: one read per question


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_second_identical_invoke_makes_no_engine_read():
    engine = _engine()
    model = CanvasDecisionModel(engine=engine, cache=DecisionCache(maxsize=8))
    request = {"state": "Refund me", "questions": {"team": TEAM, "urgent": URGENT}}
    first = model.invoke(request)
    reads = len(engine.reads)
    assert reads >= 1 and first.canvas_reads >= 1
    second = model.invoke(request)
    assert len(engine.reads) == reads  # no read
    assert second.canvas_reads == 0
    assert second.answers == first.answers and second.reads == first.reads
    assert (model.cache.hits, model.cache.misses) == (1, 1)


def test_a_different_state_seed_or_policy_reads_again():
    engine = _engine()
    model = CanvasDecisionModel(engine=engine, cache=DecisionCache())
    q = {"team": TEAM}
    model.invoke({"state": "Refund me", "questions": q})
    n = len(engine.reads)
    model.invoke({"state": "Refund me!", "questions": q})
    assert len(engine.reads) == n + 1
    model.invoke({"state": "Refund me", "questions": q, "seed": 7})
    assert len(engine.reads) == n + 2
    model.invoke({"state": "Refund me", "questions": q, "gate": GatePolicy(max_normalized_entropy=0.9)})
    assert len(engine.reads) == n + 3
    model.invoke({"state": "Refund me", "questions": {"urgent": URGENT}})
    assert len(engine.reads) == n + 4
    assert model.cache.hits == 0


def test_ttl_expiry_reads_again_and_lru_evicts():
    clock = Clock()
    engine = _engine()
    model = CanvasDecisionModel(engine=engine, cache=DecisionCache(maxsize=2, ttl_s=10, clock=clock))
    a = {"state": "a", "questions": {"team": TEAM}}
    model.invoke(a)
    clock.now = 9.9
    model.invoke(a)
    assert len(engine.reads) == 1
    clock.now = 10.0
    model.invoke(a)
    assert len(engine.reads) == 2  # expired: re-read
    model.invoke({"state": "b", "questions": {"team": TEAM}})
    model.invoke({"state": "c", "questions": {"team": TEAM}})  # evicts "a"
    model.invoke(a)
    assert len(engine.reads) == 5


def test_a_faulted_decision_is_never_cached():
    calls = []

    def rows(read):
        calls.append(read)
        raise EngineUnavailable("down")

    model = CanvasDecisionModel(engine=FunctionEngine(rows), cache=DecisionCache(),
                                outcomes=OutcomePolicy(engine_fault="fallback", fallback={"team": "tech"}))
    request = {"state": "x", "questions": {"team": TEAM}}
    assert model.invoke(request).reads["team"].path == "fallback"
    model.invoke(request)
    assert len(calls) == 2 and len(model.cache) == 0


def test_cache_must_be_a_decision_cache():
    with pytest.raises(TypeError, match="DecisionCache"):
        CanvasDecisionModel(engine=_engine(), cache={})
    with pytest.raises(ValueError):
        DecisionCache(maxsize=0)


def test_hits_are_marked_on_the_decide_span(spans):
    model = CanvasDecisionModel(engine=_engine(), cache=DecisionCache())
    request = {"state": "Refund me", "questions": {"team": TEAM}}
    model.invoke(request)
    model.invoke(request)
    decided = [s for s in spans.get_finished_spans() if s.name.startswith("decide ")]
    assert [s.attributes.get(CACHE_HIT) for s in decided] == [False, True]


class S(TypedDict, total=False):
    ticket: str
    other: int
    decisions: dict
    lane: str


async def test_a_graph_node_with_cache_policy_is_not_rerun():
    engine = _engine()
    model = CanvasDecisionModel(engine=engine)
    node = decision_node(model, {"team": TEAM}, inputs="ticket",
                         route=("team", {"billing": "billing", "tech": "tech"}))
    builder = StateGraph(S)
    builder.add_node("triage", node, cache_policy=node.cache_policy(ttl=60))
    builder.add_node("billing", lambda s: {"lane": "billing"})
    builder.add_node("tech", lambda s: {"lane": "tech"})
    builder.add_edge(START, "triage")
    builder.add_edge("billing", END)
    builder.add_edge("tech", END)
    graph = builder.compile(cache=InMemoryCache())

    first = await graph.ainvoke({"ticket": "Refund me", "other": 1})
    assert len(engine.reads) == 1 and first["lane"] == "billing"
    chunks = [c async for c in graph.astream({"ticket": "Refund me", "other": 2}, stream_mode="updates")]
    assert len(engine.reads) == 1  # the node was not re-run: the other key is not part of the decision
    assert any(c.get("__metadata__", {}).get("cached") for c in chunks if "triage" in c)
    again = await graph.ainvoke({"ticket": "Refund me", "other": 3})
    assert again["decisions"] == first["decisions"] and again["lane"] == "billing"
    await graph.ainvoke({"ticket": "The app crashes", "other": 1})
    assert len(engine.reads) == 2  # a different decision state reads
