"""The LangGraph harness on real graphs: decision nodes, edges, replay, review, retries.

FunctionEngine gives controlled distributions and faults here; the examples run against
the real vLLM server in test_examples.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
from conftest import assert_snapshot, fixed_engine, label_rows
from deadlines import bounded, patience
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, RetryPolicy, interrupt
from typing_extensions import TypedDict

from canvasroute.engine import (
    BudgetExhausted,
    DecisionError,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    FunctionEngine,
)
from canvasroute.harness import (
    DECISION_EVENT,
    REVIEW_EVENT,
    ReviewPolicy,
    decision_node,
    decision_seed,
    merge_decisions,
    retry_on,
    route_on,
)
from canvasroute.harness._context import strip_task_ids
from canvasroute.router import (
    CanvasDecisionModel,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    ReadOptions,
    render_state,
)
from canvasroute.router.telemetry import FIGURE_KEYS, GEN_AI_CONVERSATION_ID, GRAPH_NODE, QUESTION_ID

TEAM = Choice(instructions="Which team should handle the ticket?", criteria={"billing": "payments", "tech": "bugs"})
URGENT = Noul(instructions="Is the ticket urgent?")
SEVERITY = Score(instructions="How severe is it?", criteria=["low", "medium", "high"])
QUESTIONS = {"team": TEAM, "urgent": URGENT, "severity": SEVERITY}
TEAMS = {"billing": "billing", "tech": "tech"}
# label logprobs: Choice labels A/B (billing/tech), Noul yes/no, Score 1/2/3 (levels 0/1/2)
SURE_TECH = {"A": -6.0, "B": -0.01, "yes": -0.01, "no": -6.0, "1": -6.0, "2": -6.0, "3": -0.01}
UNSURE = {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70, "1": -1.1, "2": -1.1, "3": -1.1}
LEANING = {"A": -0.4, "B": -1.1, "yes": -0.4, "no": -1.1, "1": -1.1, "2": -1.1, "3": -0.4}


class State(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def noise_engine() -> FunctionEngine:
    """A confident answer chosen by the noise at the first slot: the branch follows the seed."""

    def rows(read):
        first = read.canvas[read.slots[0]] % 2 == 0
        row = {engine.token_id("A"): -0.01 if first else -6.0, engine.token_id("B"): -6.0 if first else -0.01}
        return [row] * len(read.slots)

    engine = FunctionEngine(rows)
    return engine


def lane(name: str):
    def handle(state: State) -> dict[str, str]:
        return {"lane": name}

    return handle


def triage_graph(node: Any, *, lanes=("billing", "tech"), checkpointer=None, context_schema=None, **node_kwargs):
    builder = StateGraph(State, context_schema=context_schema)
    builder.add_node("triage", node, **node_kwargs)
    builder.add_edge(START, "triage")
    for name in lanes:
        builder.add_node(name, lane(name))
        builder.add_edge(name, END)
    return builder.compile(checkpointer=checkpointer)


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


# -- one read, Command, plain state -----------------------------------------------------


def test_three_questions_are_one_read_and_the_node_routes_on_the_answer():
    engine = fixed_engine(SURE_TECH)
    node = decision_node(CanvasDecisionModel(engine=engine), QUESTIONS, inputs="ticket", route=("team", TEAMS))
    out = triage_graph(node).invoke({"ticket": "The app crashes on start."})

    assert engine.calls == 1 and len(engine.reads) == 1 and len(engine.reads[0].slots) == 3
    assert engine.reads[0].messages[1]["content"] == "The app crashes on start."  # inputs="ticket"
    assert out["lane"] == "tech"
    decided = out["decisions"]
    assert {q: d["answer"] for q, d in decided.items()} == {"team": "tech", "urgent": "yes", "severity": "2"}
    assert {d["path"] for d in decided.values()} == {"canvas"}
    assert decided["team"]["result"]["type"] == "choice" and decided["team"]["result"]["choice"] == "tech"
    assert decided["urgent"]["result"]["noul"] > 0.99
    assert decided["team"]["read"]["confident"] is True and decided["team"]["read"]["reads"] == 1
    assert json.loads(json.dumps(decided)) == decided  # plain JSON: checkpoint-safe


def test_default_inputs_are_the_state_without_the_output_key():
    engine = fixed_engine(SURE_TECH)
    node = decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, route=("team", TEAMS))
    triage_graph(node).invoke({"ticket": "Refund me", "decisions": {"old": {"answer": "x"}}})
    assert json.loads(engine.reads[0].messages[1]["content"]) == {"ticket": "Refund me"}


def test_a_node_without_route_writes_decisions_and_follows_its_edges():
    engine = fixed_engine(SURE_TECH)
    builder = StateGraph(State)
    builder.add_node("grade", decision_node(CanvasDecisionModel(engine=engine), {"urgent": URGENT}, inputs="ticket"))
    builder.add_node("billing", lane("billing"))
    builder.add_edge(START, "grade")
    builder.add_edge("grade", "billing")
    builder.add_edge("billing", END)
    out = builder.compile().invoke({"ticket": "Now!"})
    assert out["lane"] == "billing" and out["decisions"]["urgent"]["answer"] == "yes"


def test_dynamic_questions_are_still_one_read():
    """Questions made from the state share one canvas (a set of 4 yes/no questions would be read
    one at a time by `isolate="auto"`, so this node reads them jointly: `isolate="none"`)."""
    engine = fixed_engine(SURE_TECH)

    def per_document(state):
        return {f"doc{i}": Noul(instructions=f"Is document {i} relevant?") for i in range(len(state["docs"]))}

    class Docs(TypedDict, total=False):
        docs: list[str]
        decisions: dict

    builder = StateGraph(Docs)
    builder.add_node("grade", decision_node(CanvasDecisionModel(engine=engine), per_document,
                                            read={"isolate": "none"}))
    builder.add_edge(START, "grade")
    out = builder.compile().invoke({"docs": ["a", "b", "c", "d"]})
    assert engine.calls == 1 and len(engine.reads[0].slots) == 4
    assert sorted(out["decisions"]) == ["doc0", "doc1", "doc2", "doc3"]


async def test_sync_invoke_and_async_ainvoke_take_the_same_branch():
    engine = noise_engine()
    graph = triage_graph(decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, inputs="ticket",
                                       route=("team", TEAMS)))
    sync = graph.invoke({"ticket": "Where is my invoice?"})
    asynchronous = await graph.ainvoke({"ticket": "Where is my invoice?"})
    assert engine.calls == 2 and engine.reads[0].canvas == engine.reads[1].canvas  # same seed, same noise
    assert sync["lane"] == asynchronous["lane"]
    assert sync["decisions"]["team"]["read"] == asynchronous["decisions"]["team"]["read"]


async def test_async_nodes_accept_a_timeout_policy():
    node = decision_node(CanvasDecisionModel(engine=fixed_engine(SURE_TECH)), {"team": TEAM}, route=("team", TEAMS))
    graph = triage_graph(node, timeout=patience(30))  # LangGraph refuses them on sync-only nodes at compile time
    assert (await graph.ainvoke({"ticket": "Crash"}))["lane"] == "tech"


# -- drawing ------------------------------------------------------------------------------


def test_drawing_shows_only_the_declared_targets():
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    builder = StateGraph(State)
    builder.add_node("triage", decision_node(model, QUESTIONS, inputs="ticket", route=("team", TEAMS)))
    builder.add_node("billing", lane("billing"))
    builder.add_node("tech", lane("tech"))
    builder.add_node("archive", lane("archive"))  # reachable, but never a target of triage
    builder.add_edge(START, "triage")
    builder.add_edge("billing", "archive")
    builder.add_edge("tech", END)
    builder.add_edge("archive", END)
    drawing = builder.compile().get_graph().draw_mermaid()
    assert "triage -.-> billing;" in drawing and "triage -.-> tech;" in drawing
    assert "triage -.-> archive" not in drawing and "triage -.-> __end__" not in drawing
    assert_snapshot("decision_node.mmd", drawing)


def test_the_nodes_annotation_declares_its_destinations_like_add_node_destinations():
    """Pins the one non-obvious mechanism: a per-node `Command[Literal[...]]` annotation on
    `__call__`, read by `add_node`, draws exactly what LangGraph's `destinations=` draws."""
    from typing import Literal, get_type_hints

    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    node = decision_node(model, QUESTIONS, inputs="ticket", route=("team", TEAMS))
    other = decision_node(model, QUESTIONS, inputs="ticket", route=("urgent", {"yes": "tech", "no": END}))
    assert get_type_hints(node.__call__)["return"] == Command[Literal["billing", "tech"]]
    assert get_type_hints(other.__call__)["return"] == Command[Literal["tech", END]]  # per node, not per class
    implicit = triage_graph(node).get_graph().draw_mermaid()
    explicit = triage_graph(node, destinations=node.destinations).get_graph().draw_mermaid()
    assert implicit == explicit
    assert_snapshot("decision_node_lanes.mmd", implicit)
    labelled = triage_graph(node, destinations={"billing": "team=billing", "tech": "team=tech"})
    assert "team=tech" in labelled.get_graph().draw_mermaid()


def test_drawing_of_a_route_function_shows_its_destinations():
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))

    def route(decisions):
        return END if decisions["urgent"]["answer"] == "no" else decisions["team"]["answer"]

    node = decision_node(model, QUESTIONS, inputs="ticket", route=route, destinations=["billing", "tech", END])
    graph = triage_graph(node, lanes=("billing", "tech", "sales"))
    assert node.destinations == ("billing", "tech", END)
    assert_snapshot("decision_route_function.mmd", graph.get_graph().draw_mermaid())
    assert graph.invoke({"ticket": "Crash"})["lane"] == "tech"


def test_drawing_of_route_on_shows_the_path_map():
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    builder = StateGraph(State)
    builder.add_node("receive", lambda state: {})
    builder.add_node("billing", lane("billing"))
    builder.add_node("tech", lane("tech"))
    builder.add_node("sales", lane("sales"))
    builder.add_edge(START, "receive")
    builder.add_conditional_edges("receive", route_on(model, TEAM, TEAMS, inputs="ticket"), TEAMS)
    for name in ("billing", "tech", "sales"):
        builder.add_edge(name, END)
    assert_snapshot("route_on.mmd", builder.compile().get_graph().draw_mermaid())


# -- misuse gets clear errors -------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"route": ("team", {"billing": "billing"})}, ValueError,
     r"route for 'team' must map every option of the question to a node \(its options: \['billing', 'tech'\]\); "
     r"no node for \['tech'\]$"),
    ({"route": ("team", {**TEAMS, "sales": "sales"})}, ValueError, r"; \['sales'\] is not among its options$"),
    ({"route": ("owner", TEAMS)}, ValueError, "route question 'owner' is not among"),
    ({"route": lambda d: "tech"}, ValueError, "needs destinations="),
    ({"route": ("team", TEAMS), "destinations": ["tech"]}, ValueError, "only for route functions"),
    ({"route": "team"}, TypeError, "route must be"),
    ({"review": True}, TypeError, "ReviewPolicy"),
    ({"inputs": 3}, TypeError, "inputs must be"),
])
def test_bad_node_arguments_raise_typed_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        decision_node(CanvasDecisionModel(engine=fixed_engine(SURE_TECH)), QUESTIONS, **kwargs)


def test_a_model_that_is_not_a_canvas_model_is_refused():
    with pytest.raises(TypeError, match="CanvasDecisionModel"):
        decision_node(GenericFakeChatModel(messages=iter([])), QUESTIONS)


def test_route_function_returning_an_undeclared_node_fails_the_run():
    node = decision_node(CanvasDecisionModel(engine=fixed_engine(SURE_TECH)), {"team": TEAM},
                         route=lambda d: "sales", destinations=["billing", "tech"])
    with pytest.raises(ValueError, match="'sales', which is not one of the declared destinations"):
        triage_graph(node, lanes=("billing", "tech", "sales")).invoke({"ticket": "x"})


def test_route_on_needs_every_option_in_its_path_map():
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    with pytest.raises(ValueError,
                       match=r"path_map for 'route' .*\(its options: \['yes', 'no'\]\); no node for \['no'\]"):
        route_on(model, URGENT, {"yes": "tech"})
    with pytest.raises(TypeError, match="explicit path_map"):
        route_on(model, URGENT, None)
    with pytest.raises(ValueError, match="as strings"):
        route_on(model, SEVERITY, {0: "billing", 1: "billing", 2: "tech"})


# -- replay-stable branches ---------------------------------------------------------------


def test_seeds_ignore_task_ids_and_threads_but_follow_state_and_node():
    assert strip_task_ids("outer:1f2e|triage:9a8b") == "outer|triage"
    assert strip_task_ids("triage:9a8b") == strip_task_ids("triage:ffff") == "triage"
    seed = decision_seed("triage", "node", {"team": TEAM}, "refund please")
    assert seed == decision_seed("triage", "node", {"team": TEAM}, "refund please")
    assert seed != decision_seed("triage", "node", {"team": TEAM}, "the app crashes")
    assert seed != decision_seed("intake", "node", {"team": TEAM}, "refund please")


def test_the_seed_is_the_documented_hash_whatever_form_the_questions_take():
    def formula(ns: str, site: str, questions: dict[str, Any], state: Any) -> int:
        asked = {q: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for q, v in questions.items()}
        blob = json.dumps([ns, site, asked, render_state(state)], sort_keys=True, default=str)
        return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "big")

    as_dicts = {qid: q.model_dump(mode="json") for qid, q in QUESTIONS.items()}
    for questions in (QUESTIONS, as_dicts, {"team": TEAM}):
        for state in ("refund please", {"ticket": "a \"quoted\" ünïcode ticket", "n": 3}):
            assert decision_seed("outer|triage", "node", questions, state) == formula("outer|triage", "node",
                                                                                       questions, state)
    assert decision_seed("t", "node", QUESTIONS, "x") == decision_seed("t", "node", as_dicts, "x")
    edited = Choice(instructions="Which team?", criteria={"billing": "payments", "tech": "bugs"})
    before = decision_seed("t", "node", {"team": edited}, "x")
    edited.criteria["sales"] = "deals"  # questions are mutable: the cached part must follow the edit
    assert decision_seed("t", "node", {"team": edited}, "x") == formula("t", "node", {"team": edited}, "x") != before


def test_a_callback_handler_on_the_graph_sees_the_models_run_and_the_direct_path_answers_alike():
    class Runs(BaseCallbackHandler):
        def __init__(self) -> None:
            self.chains: list[str] = []

        def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
            self.chains.append(kwargs.get("name") or "")

    node = decision_node(CanvasDecisionModel(engine=fixed_engine(SURE_TECH)), QUESTIONS, inputs="ticket",
                         route=("team", TEAMS))
    graph = triage_graph(node)
    seen = Runs()
    watched = asyncio.run(graph.ainvoke({"ticket": "The app crashes."}, {"callbacks": [seen]}))
    assert "CanvasDecisionModel" in seen.chains  # the model's own child run reached the handler
    plain = asyncio.run(graph.ainvoke({"ticket": "The app crashes."}))
    def stable(out: dict[str, Any]) -> dict[str, Any]:
        return {qid: {k: v for k, v in record.items() if k != "timing"} for qid, record in out["decisions"].items()}

    assert stable(plain) == stable(watched)  # the direct path answers the same


def test_replaying_a_checkpoint_and_a_fresh_thread_take_the_same_branch():
    engine = noise_engine()
    graph = triage_graph(decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, inputs="ticket",
                                       route=("team", TEAMS)), checkpointer=InMemorySaver())
    tickets = [f"Ticket number {i}: something is wrong." for i in range(8)]
    lanes = {t: graph.invoke({"ticket": t}, thread(f"first-{i}"))["lane"] for i, t in enumerate(tickets)}
    assert set(lanes.values()) == {"billing", "tech"}  # the branch really depends on the noise

    for i, ticket in enumerate(tickets):
        history = list(graph.get_state_history(thread(f"first-{i}")))
        before = next(s for s in history if s.next == ("triage",))
        calls = engine.calls
        replayed = graph.invoke(None, before.config)
        assert engine.calls == calls + 1  # the node really ran again ...
        assert replayed["lane"] == lanes[ticket]  # ... and took the same branch
        fresh = graph.invoke({"ticket": ticket}, thread(f"fresh-{i}"))
        assert fresh["lane"] == lanes[ticket]
        assert engine.reads[-1].canvas == engine.reads[-2].canvas


class ChainState(TypedDict, total=False):
    ticket: str
    triage: dict
    decisions: dict
    lane: str


def content_engine() -> FunctionEngine:
    """A confident answer picked by a hash of the canvas AND the prompt: any change to what
    a node reads or to its seed can flip the branch."""

    def rows(read):
        digest = hashlib.sha256(json.dumps([read.canvas, read.messages], sort_keys=True).encode()).digest()
        first = digest[0] % 2 == 0
        row = {engine.token_id("A"): -0.01 if first else -6.0, engine.token_id("B"): -6.0 if first else -0.01,
               engine.token_id("yes"): -0.01 if first else -6.0, engine.token_id("no"): -6.0 if first else -0.01}
        return [row] * len(read.slots)

    engine = FunctionEngine(rows)
    return engine


def chain_graph(model: CanvasDecisionModel):
    """triage (team) -> priority (urgent, reads the whole state) -> page | queue."""
    builder = StateGraph(ChainState)
    builder.add_node("triage", decision_node(model, {"team": TEAM}, inputs="ticket", output_key="triage"))
    builder.add_node("priority", decision_node(model, {"urgent": URGENT}, route=("urgent", {"yes": "page",
                                                                                          "no": "queue"})))
    builder.add_node("page", lambda state: {"lane": "page"})
    builder.add_node("queue", lambda state: {"lane": "queue"})
    builder.add_edge(START, "triage")
    builder.add_edge("triage", "priority")
    builder.add_edge("page", END)
    builder.add_edge("queue", END)
    return builder.compile(checkpointer=InMemorySaver())


def test_downstream_decisions_replay_identically_from_every_checkpoint_and_in_fresh_threads():
    engine = content_engine()
    graph = chain_graph(CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)))

    def run(arg, config):
        start = len(engine.reads)
        out = graph.invoke(arg, config)
        return out, [(r.canvas, r.messages) for r in engine.reads[start:]]

    ticket = "The export button crashes the app."
    first, reads = run({"ticket": ticket}, thread("chain-0"))
    assert len(reads) == 2  # triage, then priority
    record = first["triage"]["team"]
    assert "latency_s" in record["timing"] and "latency_s" not in record["read"]  # timings stay out of reads
    # the second node reads the first one's answer, not its record
    assert json.loads(reads[1][1][1]["content"]) == {"ticket": ticket, "triage": {"team": record["answer"]}}

    def same_as_first(out):
        assert out["lane"] == first["lane"]
        for key in ("triage", "decisions"):
            assert {q: (d["answer"], d["read"]) for q, d in out[key].items()} == \
                   {q: (d["answer"], d["read"]) for q, d in first[key].items()}

    for n in (1, 2):  # fresh threads: the same reads, byte for byte
        out, again = run({"ticket": ticket}, thread(f"chain-{n}"))
        assert again == reads
        same_as_first(out)

    replayed_from = set()
    for snapshot in graph.get_state_history(thread("chain-0")):
        if snapshot.next not in (("triage",), ("priority",)):
            continue
        out, again = run(None, snapshot.config)
        assert again == reads[-len(again):] and len(again) == (2 if snapshot.next == ("triage",) else 1)
        same_as_first(out)
        replayed_from.add(snapshot.next)
    assert replayed_from == {("triage",), ("priority",)}


def test_earlier_decisions_reach_later_inputs_as_answers_only():
    from canvasroute.harness._records import answers_only

    record = {"answer": "tech", "path": "canvas", "result": {}, "read": {"entropy": 0.1}, "timing": {"latency_s": 1.0}}
    old_record = {k: v for k, v in record.items() if k != "timing"}  # checkpoints written before `timing`
    state = {"ticket": "x", "triage": {"team": record}, "history": [{"team": old_record}], "last": record, "n": 3}
    assert answers_only(state) == {"ticket": "x", "triage": {"team": "tech"}, "history": [{"team": "tech"}],
                                   "last": "tech", "n": 3}
    plain = {"ticket": "x", "meta": {"answer": "42"}, "items": (1, 2)}
    assert answers_only(plain) is plain  # nothing to reduce: the same object


# -- human review lane --------------------------------------------------------------------


def test_an_unsure_answer_interrupts_and_the_resume_takes_the_humans_option():
    engine = fixed_engine(UNSURE)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    node = decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", TEAMS), review=ReviewPolicy())
    graph = triage_graph(node, checkpointer=InMemorySaver())

    paused = graph.invoke({"ticket": "Something about my account"}, thread("review"))
    [pending] = paused["__interrupt__"]
    assert pending.value["type"] == REVIEW_EVENT and pending.value["node"] == "triage"
    assert pending.value["state"] == "Something about my account"
    item = pending.value["questions"]["team"]
    assert item["options"] == ["billing", "tech"] and item["answer"] == "billing"
    assert item["crossed"] == ["max_normalized_entropy"]
    assert "lane" not in paused and graph.get_state(thread("review")).next == ("triage",)

    done = graph.invoke(Command(resume="tech"), thread("review"))
    assert done["lane"] == "tech"
    assert done["decisions"]["team"]["answer"] == "tech" and done["decisions"]["team"]["path"] == "human"
    assert done["decisions"]["team"]["read"]["answer"] == "billing"  # what the model said
    assert engine.calls == 1  # the resumed node reused its read


async def test_review_of_several_questions_resumes_with_a_mapping():
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0))
    node = decision_node(model, QUESTIONS, inputs="ticket", route=("team", TEAMS),
                         review=ReviewPolicy(questions=frozenset({"team", "urgent"}), include_state=False))
    graph = triage_graph(node, checkpointer=InMemorySaver())

    paused = await graph.ainvoke({"ticket": "hm"}, thread("several"))
    value = paused["__interrupt__"][0].value
    assert set(value["questions"]) == {"team", "urgent"} and "state" not in value
    with pytest.raises(DecisionError, match="2 questions are under review"):
        await graph.ainvoke(Command(resume="tech"), thread("several"))

    paused = await graph.ainvoke({"ticket": "hm"}, thread("several-2"))
    with pytest.raises(DecisionError, match="'sales' is not an option of 'team'"):
        await graph.ainvoke(Command(resume={"team": "sales", "urgent": "no"}), thread("several-2"))

    await graph.ainvoke({"ticket": "hm"}, thread("several-3"))
    done = await graph.ainvoke(Command(resume={"team": "tech", "urgent": "no"}), thread("several-3"))
    assert done["lane"] == "tech"
    assert {q: (d["answer"], d["path"]) for q, d in done["decisions"].items()} == {
        "team": ("tech", "human"), "urgent": ("no", "human"), "severity": ("0", "unsure")}


def test_review_policy_is_a_frozen_keyword_only_slotted_hashable_value():
    from dataclasses import FrozenInstanceError

    policy = ReviewPolicy(questions=frozenset({"team"}), include_state=False)
    assert policy == ReviewPolicy(questions=frozenset({"team"}), include_state=False)
    assert len({policy, ReviewPolicy(questions=frozenset({"team"}), include_state=False), ReviewPolicy()}) == 2
    assert not hasattr(policy, "__dict__")  # slotted
    with pytest.raises(FrozenInstanceError):
        policy.include_state = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        ReviewPolicy(frozenset({"team"}))  # type: ignore[misc]  # keyword-only
    for bad in (["team"], {"team"}, "team", frozenset({1})):
        with pytest.raises(TypeError, match="frozenset of question ids"):
            ReviewPolicy(questions=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="include_state is a bool"):
        ReviewPolicy(include_state="yes")  # type: ignore[arg-type]


def test_confident_and_escalated_answers_do_not_go_to_review():
    sure = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    graph = triage_graph(decision_node(sure, {"team": TEAM}, route=("team", TEAMS), review=ReviewPolicy()),
                         checkpointer=InMemorySaver())
    assert graph.invoke({"ticket": "Crash"}, thread("sure"))["lane"] == "tech"

    escalating = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                                     escalate_to=GenericFakeChatModel(messages=iter([AIMessage('{"team": "tech"}')])))
    graph = triage_graph(decision_node(escalating, {"team": TEAM}, route=("team", TEAMS), review=ReviewPolicy()),
                         checkpointer=InMemorySaver())
    out = graph.invoke({"ticket": "Hmm"}, thread("escalated"))
    assert "__interrupt__" not in out and out["lane"] == "tech"
    assert out["decisions"]["team"]["path"] == "escalated"


def test_interrupts_raised_inside_the_node_are_never_swallowed():
    engine = fixed_engine(SURE_TECH)

    def questions(state):
        interrupt("confirm the questions")  # GraphBubbleUp from user code inside the node
        return {"team": TEAM}

    graph = triage_graph(decision_node(CanvasDecisionModel(engine=engine), questions, route=("team", TEAMS)),
                         checkpointer=InMemorySaver())
    paused = graph.invoke({"ticket": "Crash"}, thread("bubble"))
    assert paused["__interrupt__"][0].value == "confirm the questions" and engine.calls == 0
    assert graph.invoke(Command(resume=True), thread("bubble"))["lane"] == "tech"


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_an_interrupt_inside_the_escalation_target_pauses_the_graph(mode):
    """A human as the escalation target: its `interrupt()` must reach LangGraph, not
    become an EscalationError."""
    from langchain_core.runnables import RunnableLambda

    asked = []

    def human(messages):
        asked.append(messages[-1].content)
        return {"team": interrupt({"ask": "which team?"})}

    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                                escalate_to=RunnableLambda(human, name="human"))
    graph = triage_graph(decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", TEAMS)),
                         checkpointer=InMemorySaver())
    run = graph.invoke if mode == "invoke" else None

    async def call(arg, cfg):
        return run(arg, cfg) if run else await graph.ainvoke(arg, cfg)

    paused = await call({"ticket": "Hmm"}, thread(f"human-{mode}"))
    assert paused["__interrupt__"][0].value == {"ask": "which team?"} and "lane" not in paused
    done = await call(Command(resume="tech"), thread(f"human-{mode}"))
    assert done["lane"] == "tech" and done["decisions"]["team"]["path"] == "escalated"
    assert done["decisions"]["team"]["read"]["escalation_model"] == "human"
    assert "Hmm" in asked[0]


# -- faults and retries -------------------------------------------------------------------


def flaky_engine(error: Exception) -> FunctionEngine:
    """Raises `error` on the first read, then answers SURE_TECH."""

    def rows(read):
        if engine.calls == 1:
            raise error
        return label_rows(engine, SURE_TECH, read)

    engine = FunctionEngine(rows)
    return engine


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_retry_policy_retries_a_transient_engine_fault(mode):
    engine = flaky_engine(EngineUnavailable("vLLM is restarting"))
    node = decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, route=("team", TEAMS))
    graph = triage_graph(node, retry_policy=RetryPolicy(initial_interval=0.01, jitter=False))
    out = graph.invoke({"ticket": "x"}) if mode == "invoke" else await graph.ainvoke({"ticket": "x"})
    assert out["lane"] == "tech" and engine.calls == 2


def test_without_a_retry_policy_the_typed_error_propagates():
    engine = flaky_engine(EngineUnavailable("vLLM is restarting"))
    graph = triage_graph(decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, route=("team", TEAMS)))
    with pytest.raises(EngineUnavailable) as caught:
        graph.invoke({"ticket": "x"})
    assert isinstance(caught.value, ConnectionError)


def test_retry_policy_does_not_retry_a_refused_request():
    engine = flaky_engine(EngineRequestError("diffusion_seed_canvas must hold exactly 32 ids", status=400))
    node = decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, route=("team", TEAMS))
    graph = triage_graph(node, retry_policy=RetryPolicy(initial_interval=0.01, jitter=False))
    with pytest.raises(EngineRequestError):
        graph.invoke({"ticket": "x"})
    assert engine.calls == 1


FAST = {"initial_interval": 0.01, "jitter": False}


@pytest.mark.parametrize("error, ours, langgraphs", [
    (EngineUnavailable("vLLM is restarting"), 2, 2),
    (EngineTimeout("read timed out after 30 s"), 2, 2),  # a TimeoutError too: LangGraph's OSError rule
    (EngineResponseError("slot row lacks label ids"), 1, 2),  # not transient: LangGraph's default retries it
    (EngineRequestError("canvas too wide", status=400), 1, 1),
])
def test_retry_on_retries_only_transient_faults(error, ours, langgraphs):
    for retry_policy, calls in ((RetryPolicy(retry_on=retry_on, **FAST), ours), (RetryPolicy(**FAST), langgraphs)):
        engine = flaky_engine(error)
        graph = triage_graph(decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, route=("team", TEAMS)),
                             retry_policy=retry_policy)
        if calls == 2:
            assert graph.invoke({"ticket": "x"})["lane"] == "tech"
        else:
            with pytest.raises(type(error)):
                graph.invoke({"ticket": "x"})
        assert engine.calls == calls


def test_retry_on_does_not_retry_a_spent_escalation_budget():
    escalations = iter([AIMessage('{"team": "tech"}')] * 3)
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                                escalate_to=Escalation(GenericFakeChatModel(messages=escalations),
                                                       budget=EscalationBudget(max_per_thread=1)),
                                outcomes=OutcomePolicy(over_budget="raise"))
    for retry_policy, runs in ((RetryPolicy(retry_on=retry_on, **FAST), 1), (RetryPolicy(**FAST), 3)):
        node_runs = []
        node = decision_node(model, {"team": TEAM}, route=("team", TEAMS),
                             inputs=lambda state: node_runs.append(1) or state["ticket"])  # noqa: B023 - run below
        graph = triage_graph(node, checkpointer=InMemorySaver(), retry_policy=retry_policy)
        tid = f"budget-{runs}"
        assert graph.invoke({"ticket": "hm"}, thread(tid))["decisions"]["team"]["path"] == "escalated"
        node_runs.clear()
        with pytest.raises(BudgetExhausted):
            graph.invoke({"ticket": "hm"}, thread(tid))
        assert len(node_runs) == runs  # LangGraph's default would retry it to max_attempts


# -- concurrency --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_parallel_decision_nodes_read_concurrently(mode):
    barrier = asyncio.Barrier(2)

    async def rows(read):
        await bounded(barrier.wait(), 20, what="both reads in flight")  # passes only if both are at once
        return label_rows(engine, SURE_TECH, read)

    engine = FunctionEngine(rows)
    model = CanvasDecisionModel(engine=engine)
    builder = StateGraph(State)
    builder.add_node("team_node", decision_node(model, {"team": TEAM}, inputs="ticket"))
    builder.add_node("urgency_node", decision_node(model, {"urgent": URGENT}, inputs="ticket"))
    builder.add_edge(START, "team_node")
    builder.add_edge(START, "urgency_node")
    graph = builder.compile()
    if mode == "invoke":
        out = await asyncio.to_thread(graph.invoke, {"ticket": "Crash, now!"})
    else:
        out = await graph.ainvoke({"ticket": "Crash, now!"})
    assert engine.calls == 2
    assert {q: d["answer"] for q, d in out["decisions"].items()} == {"team": "tech", "urgent": "yes"}


# -- run context, stream events, spans ----------------------------------------------------


@dataclass
class RunContext:
    gate: Any = None
    decision_model: Any = None


def test_runtime_context_sets_the_gate_and_the_model_for_one_run():
    engine = fixed_engine(LEANING)
    node = decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, route=("team", TEAMS))
    graph = triage_graph(node, context_schema=RunContext)

    out = graph.invoke({"ticket": "x"})  # the model's gate: uncertain, re-read 3 times
    assert engine.calls == 2 and out["decisions"]["team"]["read"]["reads"] == 4

    out = graph.invoke({"ticket": "x"}, context=RunContext(gate={"max_normalized_entropy": 0.95}))
    assert engine.calls == 3 and out["decisions"]["team"]["read"]["confident"] is True

    out = graph.invoke({"ticket": "x"}, context=RunContext(gate=GatePolicy(rereads=0)))
    assert engine.calls == 4 and out["decisions"]["team"]["read"]["reads"] == 1

    per_question = {"per_question": {"team": {"max_normalized_entropy": 0.95}}}
    out = graph.invoke({"ticket": "x"}, context=RunContext(gate=per_question))
    assert engine.calls == 5 and out["decisions"]["team"]["read"]["confident"] is True

    other = fixed_engine(SURE_TECH)
    out = graph.invoke({"ticket": "x"}, context=RunContext(decision_model=CanvasDecisionModel(engine=other)))
    assert engine.calls == 5 and other.calls == 1 and out["lane"] == "tech"

    with pytest.raises(ValueError, match=r"unknown GatePolicy fields \['bogus'\]"):
        graph.invoke({"ticket": "x"}, context={"gate": {"bogus": 1}})


def test_each_decision_set_is_one_event_on_the_custom_stream():
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    graph = triage_graph(decision_node(model, QUESTIONS, inputs="ticket", route=("team", TEAMS)))
    events = list(graph.stream({"ticket": "Crash"}, stream_mode="custom"))
    assert len(events) == 1
    [event] = events
    assert event["type"] == DECISION_EVENT and event["node"] == "triage" and event["goto"] == "tech"
    assert event["answers"] == {"team": "tech", "urgent": "yes", "severity": "2"}
    assert event["paths"] == {"team": "canvas", "urgent": "canvas", "severity": "canvas"}
    assert set(event["entropies"]) == set(QUESTIONS) and all(0 <= h < 0.1 for h in event["entropies"].values())


def test_decision_spans_carry_the_graph_node_and_thread(spans):
    model = CanvasDecisionModel(engine=fixed_engine(SURE_TECH))
    graph = triage_graph(decision_node(model, {"team": TEAM}, route=("team", TEAMS)), checkpointer=InMemorySaver())
    spans.clear()
    graph.invoke({"ticket": "Crash"}, thread("traced"))
    [decide] = [s for s in spans.get_finished_spans() if s.name.startswith("decide ")]
    assert decide.attributes[GRAPH_NODE] == "triage" and decide.attributes[GEN_AI_CONVERSATION_ID] == "traced"
    [question] = decide.events
    assert question.attributes[QUESTION_ID] == "team" and question.attributes[FIGURE_KEYS["answer"]] == "tech"


# -- the conditional-edge adapter ---------------------------------------------------------


async def test_route_on_routes_a_conditional_edge_sync_and_async():
    engine = fixed_engine(SURE_TECH)
    builder = StateGraph(State)
    builder.add_node("receive", lambda state: {})
    builder.add_node("billing", lane("billing"))
    builder.add_node("tech", lane("tech"))
    builder.add_edge(START, "receive")
    builder.add_conditional_edges("receive", route_on(CanvasDecisionModel(engine=engine), TEAM, TEAMS,
                                                      inputs="ticket"), TEAMS)
    builder.add_edge("billing", END)
    builder.add_edge("tech", END)
    graph = builder.compile()
    assert graph.invoke({"ticket": "Crash"})["lane"] == "tech"
    out = await graph.ainvoke({"ticket": "Crash"})
    assert out["lane"] == "tech" and engine.calls == 2
    assert engine.reads[0].canvas == engine.reads[1].canvas
    assert not out.get("decisions")  # an edge cannot write state: that is what decision_node is for
    events = list(graph.stream({"ticket": "Crash"}, stream_mode="custom"))
    assert [(e["node"], e["goto"]) for e in events] == [("receive", "tech")]


def test_route_on_uses_the_run_context_like_a_node():
    engine, other = fixed_engine(UNSURE), fixed_engine(SURE_TECH)
    builder = StateGraph(State, context_schema=RunContext)
    builder.add_node("receive", lambda state: {})
    builder.add_node("billing", lane("billing"))
    builder.add_node("tech", lane("tech"))
    builder.add_edge(START, "receive")
    builder.add_conditional_edges("receive", route_on(CanvasDecisionModel(engine=engine), TEAM, TEAMS), TEAMS)
    graph = builder.compile()
    out = graph.invoke({"ticket": "x"}, context=RunContext(decision_model=CanvasDecisionModel(engine=other)))
    assert out["lane"] == "tech" and engine.calls == 0 and other.calls == 1


def test_escalation_budgets_are_counted_per_graph_thread():
    replies = iter([AIMessage('{"team": "tech"}')] * 4)
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                                escalate_to=Escalation(GenericFakeChatModel(messages=replies),
                                                       budget=EscalationBudget(max_per_thread=1)))
    graph = triage_graph(decision_node(model, {"team": TEAM}, route=("team", TEAMS)), checkpointer=InMemorySaver())
    paths = [graph.invoke({"ticket": "hm"}, thread(tid))["decisions"]["team"] for tid in ("a", "a", "b")]
    assert [p["path"] for p in paths] == ["escalated", "unsure", "escalated"]
    assert paths[1]["read"]["cause"] == "over_budget"


def test_a_node_runs_outside_a_graph_too():
    node = decision_node(CanvasDecisionModel(engine=fixed_engine(SURE_TECH)), {"team": TEAM}, inputs="ticket",
                         route=("team", TEAMS))
    command = node.invoke({"ticket": "Crash"})
    assert command.goto == "tech" and command.update["decisions"]["team"]["answer"] == "tech"


def test_a_node_reads_with_the_gateways_read_options():
    """`decision_node(read=...)`: the instructions head every canvas's system prompt, a
    question read `alone` gets a canvas of its own (observed or not: through `invoke` and
    `decide` alike), the options enter the node cache key, and an unknown one is refused."""
    questions = {"team": TEAM, "urgent": URGENT}
    engine = fixed_engine(SURE_TECH)
    model = CanvasDecisionModel(engine=engine)
    told = {"instructions": "Every ticket is from an EU customer.", "alone": {"urgent"}}
    node = decision_node(model, questions, inputs="ticket", read=told)
    builder = StateGraph(State)
    builder.add_node("triage", node)
    builder.add_edge(START, "triage")
    graph = builder.compile()
    for observed in (False, True):
        before = len(engine.reads)
        config = {"callbacks": [BaseCallbackHandler()]} if observed else None
        out = graph.invoke({"ticket": "Refund me"}, config)
        reads = engine.reads[before:]
        assert [len(r.slots) for r in reads] == [1, 1]  # urgent alone: two canvases of one slot
        assert [URGENT.instructions in r.messages[0]["content"] for r in reads] == [False, True]
        assert all(r.messages[0]["content"].startswith("Every ticket is from an EU customer.\n\n") for r in reads)
        assert out["decisions"]["team"]["answer"] == "tech"
    plain = decision_node(model, questions, inputs="ticket")
    assert node.cache_key({"ticket": "Refund me"}) != plain.cache_key({"ticket": "Refund me"})
    with pytest.raises(ValueError, match=r"unknown read options \['tone'\]; ReadOptions has alone, constrained, "
                                         "images, instructions, isolate, steps, think"):
        decision_node(model, questions, read={"tone": "formal"})
    # the edge adapter takes them too
    edge = route_on(model, TEAM, TEAMS, inputs="ticket", read=ReadOptions(instructions="EU customers only."))
    routed = StateGraph(State)
    routed.add_node("start", lambda state: {})
    for lane in TEAMS.values():
        routed.add_node(lane, lambda state, lane=lane: {"lane": lane})
        routed.add_edge(lane, END)
    routed.add_edge(START, "start")
    routed.add_conditional_edges("start", edge, TEAMS)
    before = len(engine.reads)
    assert routed.compile().invoke({"ticket": "Refund me"})["lane"] == "tech"
    assert engine.reads[before].messages[0]["content"].startswith("EU customers only.\n\n")
    with pytest.raises(ValueError, match="tone"):
        route_on(model, TEAM, TEAMS, read={"tone": "formal"})
