"""The examples end to end against the REAL vLLM server, and their graph drawings.

The tiny random DiffusionGemma answers near chance: these tests check plumbing (one
read per node, routes that follow the answers, replay-stable branches), never accuracy.
"""

from __future__ import annotations

import pytest
from conftest import assert_snapshot
from langgraph.checkpoint.memory import InMemorySaver

from canvasroute.engine import FunctionEngine, VLLMServerEngine
from canvasroute.harness import retry_on
from canvasroute.router import CanvasDecisionModel, GatePolicy
from examples import rag_relevance, tool_routing, triage


def offline_model() -> CanvasDecisionModel:
    """A model for building graphs without reading (drawings only)."""
    return CanvasDecisionModel(engine=FunctionEngine(lambda read: []))


@pytest.mark.parametrize("name, build", [
    ("triage.mmd", lambda m: triage.build_graph(m)),
    ("triage_team_only.mmd", lambda m: triage.build_graph(m, on_call=False)),
    ("rag_relevance.mmd", rag_relevance.build_graph),
    ("tool_routing.mmd", tool_routing.build_graph),
])
def test_example_drawings_show_only_declared_targets(name, build):
    assert_snapshot(name, build(offline_model()).get_graph().draw_mermaid())


@pytest.mark.parametrize("build, node", [
    (triage.build_graph, "triage"),
    (rag_relevance.build_graph, "grade"),
    (tool_routing.build_graph, "pick_tool"),
])
def test_example_decision_nodes_retry_only_transient_faults(build, node):
    policy = build(offline_model()).builder.nodes[node].retry_policy
    assert policy.retry_on is retry_on


# -- against the real vLLM server -------------------------------------------------------


@pytest.mark.vllm
def test_triage_runs_end_to_end(vllm_url):
    results = triage.main(vllm_url)
    assert [r["ticket"] for r in results] == list(triage.SAMPLE_TICKETS)
    for r in results:
        assert r["handled_by"] in (*triage.TEAMS, "on_call")
        assert set(r["decisions"]) == {"team", "urgent", "severity"}
        team = r["decisions"]["team"]
        assert team["answer"] in triage.TEAMS and set(team["probabilities"]) == set(triage.TEAMS)
        expected = triage.route({q: {"answer": d["answer"]} for q, d in r["decisions"].items()})
        assert r["handled_by"] == expected  # the lane follows the answers


@pytest.mark.vllm
def test_rag_relevance_runs_end_to_end(vllm_url):
    results = rag_relevance.main(vllm_url)
    for r in results:
        assert sorted(r["grades"]) == ["doc0", "doc1", "doc2"]
        relevant = [g for g in r["grades"].values() if g == "yes"]
        assert (r["answer"] == "No retrieved document answers this question.") == (not relevant)


@pytest.mark.vllm
def test_tool_routing_runs_end_to_end(vllm_url):
    results = tool_routing.main(vllm_url)
    assert [r["message"] for r in results] == list(tool_routing.SAMPLE_MESSAGES)
    for r in results:
        assert r["tool"] in tool_routing.TOOLS and r["reply"]


@pytest.mark.vllm
def test_a_node_with_three_questions_sends_one_read_request(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    graph = triage.build_graph(CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)))
    for ticket in triage.SAMPLE_TICKETS:
        before = engine.requests_sent
        out = graph.invoke({"ticket": ticket})
        assert engine.requests_sent - before == 1
        assert {q: d["read"]["reads"] for q, d in out["decisions"].items()} == {"team": 1, "urgent": 1, "severity": 1}


@pytest.mark.vllm
async def test_replays_and_fresh_threads_take_the_same_branches_on_vllm(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    graph = triage.build_graph(model, checkpointer=InMemorySaver())
    for i, ticket in enumerate(triage.SAMPLE_TICKETS):
        first = await graph.ainvoke({"ticket": ticket}, {"configurable": {"thread_id": f"vllm-{i}"}})
        history = [s async for s in graph.aget_state_history({"configurable": {"thread_id": f"vllm-{i}"}})]
        before = next(s for s in history if s.next == ("triage",))
        sent = engine.requests_sent
        replayed = await graph.ainvoke(None, before.config)
        assert engine.requests_sent == sent + 1  # the decision was read again, not copied
        fresh = await graph.ainvoke({"ticket": ticket}, {"configurable": {"thread_id": f"vllm-fresh-{i}"}})
        for run in (replayed, fresh):
            assert run["handled_by"] == first["handled_by"]
            for qid, d in first["decisions"].items():
                assert run["decisions"][qid]["answer"] == d["answer"]
                assert run["decisions"][qid]["read"]["probabilities"] == pytest.approx(d["read"]["probabilities"],
                                                                                      abs=1e-6)
