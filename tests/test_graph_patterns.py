"""The LangGraph patterns users write, on real graphs and real checkpointers.

Fan-out with `Send` (one record per branch, micro-batched reads), durable review (a resume
in a fresh graph, model and engine never reads or escalates again: InMemorySaver and
SqliteSaver here, PostgreSQL across two processes in test_durable.py), streams
(`custom`, `astream_events`, before an interrupt), the prebuilt `HumanInterrupt` review,
the checks a node makes of its graph, retries owned by one layer, and the served model
name callback tracers see.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Annotated, Any

import pytest
from conftest import fixed_engine, label_rows
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.decisions import Choice, Noul
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, RetryPolicy, Send
from typing_extensions import TypedDict

from canvasroute import (
    CanvasDecisionModel,
    DecisionError,
    EngineOverloaded,
    Escalation,
    EscalationBudget,
    FunctionEngine,
    GatePolicy,
    GraphSetupError,
    OutcomePolicy,
    ReviewPolicy,
    VLLMServerEngine,
    decision_node,
    merge_decisions,
    retry_on,
)
from canvasroute.engine import Connection, Retries
from canvasroute.harness import DECISION_EVENT, REVIEW_EVENT

RELEVANT = Noul(instructions="Is the passage about refunds?")
TEAM = Choice(instructions="Which team handles the ticket?", criteria={"billing": "payments", "tech": "bugs"})
URGENT = Noul(instructions="Is it urgent?")
LANES = {"billing": "billing", "tech": "tech"}
DOCS = ["Refunds are paid within 5 days.", "Shipping takes a week.", "Ask for a refund here.", "Our office hours."]


class Docs(TypedDict, total=False):
    docs: list[str]
    decisions: Annotated[dict, merge_decisions]


class Ticket(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def refund_engine() -> FunctionEngine:
    """`yes` for sure when the read's state mentions a refund, `no` for sure otherwise."""

    def rows(read):  # the state, without the question block an isolated read puts after it
        yes = "refund" in read.messages[-1]["content"].split("\n\nRead the input and answer")[0].lower()
        return label_rows(engine, {"yes": -0.01 if yes else -6.0, "no": -6.0 if yes else -0.01}, read)

    engine = FunctionEngine(rows)
    return engine


def fan_out(node: Any, checkpointer: Any = None) -> Any:
    builder = StateGraph(Docs)
    builder.add_node("grade", node)
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": d, "doc_id": f"d{i}"})
                                                   for i, d in enumerate(s["docs"])], ["grade"])
    builder.add_edge("grade", END)
    return builder.compile(checkpointer=checkpointer)


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


def lanes_graph(node: Any, checkpointer: Any = None, state: type | None = None, **node_kwargs: Any) -> Any:
    """START -> triage (`node`) -> billing | tech -> END (a node without a route ends the run)."""
    builder = StateGraph(state or Ticket)
    builder.add_node("triage", node, **node_kwargs)
    builder.add_edge(START, "triage")
    for lane in ("billing", "tech"):
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    return builder.compile(checkpointer=checkpointer)


# -- 1. fan-out: one record per branch -------------------------------------------------------


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_send_fan_out_keeps_one_record_per_branch(mode):
    engine = refund_engine()
    graph = fan_out(decision_node(CanvasDecisionModel(engine=engine), {"relevant": RELEVANT}, inputs="doc"),
                    InMemorySaver())
    run = graph.invoke if mode == "invoke" else None
    out = run({"docs": DOCS}, thread(mode)) if run else await graph.ainvoke({"docs": DOCS}, thread(mode))
    records = out["decisions"]["relevant"]  # grouped by question id, keyed by the Send's position
    assert sorted(records) == ["0", "1", "2", "3"] and engine.calls == 4
    assert {k: r["answer"] for k, r in records.items()} == {"0": "yes", "1": "no", "2": "yes", "3": "no"}


def test_branch_keys_records_by_what_makes_the_branch_distinct():
    engine = refund_engine()
    graph = fan_out(decision_node(CanvasDecisionModel(engine=engine), {"relevant": RELEVANT, "urgent": URGENT},
                                  inputs="doc", branch="doc_id"))
    out = graph.invoke({"docs": DOCS})
    assert sorted(out["decisions"]) == ["relevant", "urgent"]
    assert {k: r["answer"] for k, r in out["decisions"]["relevant"].items()} == {
        "d0": "yes", "d1": "no", "d2": "yes", "d3": "no"}
    assert sorted(out["decisions"]["urgent"]) == ["d0", "d1", "d2", "d3"] and engine.calls == 4


def test_two_branches_with_one_key_fail_instead_of_overwriting():
    node = decision_node(CanvasDecisionModel(engine=refund_engine()), {"relevant": RELEVANT}, inputs="doc",
                         branch=lambda state: state["doc"].split()[0])  # "Refunds", "Shipping", "Ask", "Our"
    assert len(fan_out(node).invoke({"docs": DOCS})["decisions"]["relevant"]) == 4
    with pytest.raises(DecisionError, match="have the branch key 'Refunds'"):
        fan_out(node).invoke({"docs": [*DOCS, "Refunds again."]})


def test_a_node_cache_in_a_fan_out_replays_each_branchs_own_records():
    from langgraph.cache.memory import InMemoryCache

    engine = refund_engine()
    node = decision_node(CanvasDecisionModel(engine=engine), {"relevant": RELEVANT}, inputs="doc", branch="doc_id")
    builder = StateGraph(Docs)
    builder.add_node("grade", node, cache_policy=node.cache_policy())
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": d, "doc_id": f"d{i}"})
                                                   for i, d in enumerate(s["docs"])], ["grade"])
    graph = builder.compile(cache=InMemoryCache())
    twice = [DOCS[0], DOCS[0], DOCS[1]]  # two branches read the same passage
    assert sorted(graph.invoke({"docs": twice})["decisions"]["relevant"]) == ["d0", "d1", "d2"]
    calls = engine.calls
    assert sorted(graph.invoke({"docs": twice})["decisions"]["relevant"]) == ["d0", "d1", "d2"]
    assert engine.calls == calls  # all three from the cache, each under its own key

    keyless = decision_node(CanvasDecisionModel(engine=engine), {"relevant": RELEVANT}, inputs="doc")
    builder = StateGraph(Docs)
    builder.add_node("grade", keyless, cache_policy=keyless.cache_policy())
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": d}) for d in s["docs"]], ["grade"])
    with pytest.raises(DecisionError, match="node cache and runs in a Send fan-out"):
        builder.compile(cache=InMemoryCache()).invoke({"docs": twice})


def test_merge_decisions_merges_branch_groups_and_replaces_records():
    rec = {"answer": "yes", "path": "canvas", "result": None, "read": {}, "timing": {}}
    other = {**rec, "answer": "no"}
    assert merge_decisions({"q": {"0": rec}}, {"q": {"1": other}}) == {"q": {"0": rec, "1": other}}
    assert merge_decisions({"q": {"0": rec}}, {"q": {"0": other}}) == {"q": {"0": other}}  # a re-run replaces
    assert merge_decisions({"q": rec, "p": rec}, {"q": other}) == {"q": other, "p": rec}


@pytest.mark.parametrize("first, second", [("record", "group"), ("group", "record")])
def test_merge_decisions_refuses_one_question_id_as_a_record_and_as_branch_records(first, second):
    """Two nodes asking the same question id, one fanned out: one would silently replace the other."""
    rec = {"answer": "yes", "path": "canvas", "result": None, "read": {}, "timing": {}}
    forms = {"record": rec, "group": {"doc-1": rec}}
    with pytest.raises(GraphSetupError, match="question 'q' is written both as one record and as fan-out"):
        merge_decisions({"q": forms[first]}, {"q": forms[second]})


def test_fan_out_with_review_pauses_each_unsure_branch_and_resumes_without_reading_again():
    """Features together: Send branches, review, the durable task, per-branch records."""

    def rows(read):  # sure about refunds, a toss-up about everything else
        sure = "refund" in read.messages[-1]["content"].lower()
        return label_rows(engine, {"yes": -0.01, "no": -6.0} if sure else {"yes": -0.69, "no": -0.70}, read)

    engine = FunctionEngine(rows)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    graph = fan_out(decision_node(model, {"relevant": RELEVANT}, inputs="doc", branch="doc_id",
                                  review=ReviewPolicy(include_state=False)), InMemorySaver())
    paused = graph.invoke({"docs": DOCS}, thread("fan-review"))
    pending = paused["__interrupt__"]
    assert len(pending) == 2 and engine.calls == 4  # "Shipping..." and "Our office..." wait for a human
    done = graph.invoke(Command(resume={i.id: "no" for i in pending}), thread("fan-review"))
    records = done["decisions"]["relevant"]
    assert engine.calls == 4  # the resumed branches reused their reads
    assert {k: (r["answer"], r["path"]) for k, r in records.items()} == {
        "d0": ("yes", "canvas"), "d1": ("no", "human"), "d2": ("yes", "canvas"), "d3": ("no", "human")}


async def test_concurrent_branches_share_the_in_process_engines_micro_batches(tiny_dgemma_dir):
    pytest.importorskip("torch")
    from canvasroute import Batching, TransformersEngine

    engine = TransformersEngine.from_pretrained(tiny_dgemma_dir, batching=Batching(window_s=0.2, max_batch=16))
    try:
        graph = fan_out(decision_node(CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)),
                                      {"relevant": RELEVANT}, inputs="doc"))
        for run in ("invoke", "ainvoke"):
            before = engine.forward_passes
            out = await graph.ainvoke({"docs": DOCS}) if run == "ainvoke" else \
                await asyncio.to_thread(graph.invoke, {"docs": DOCS})
            passes = engine.forward_passes - before
            print(f"{run}: 4 Send branches -> {passes} forward pass(es)")
            assert len(out["decisions"]["relevant"]) == 4 and passes < 4
    finally:
        await engine.aclose()


@pytest.mark.vllm
async def test_a_fan_out_on_the_real_vllm_server_reads_each_branch(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    try:
        graph = fan_out(decision_node(CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)),
                                      {"relevant": RELEVANT}, inputs="doc", branch="doc_id"))
        out = await graph.ainvoke({"docs": DOCS})
    finally:
        await engine.aclose()
    records = out["decisions"]["relevant"]
    assert sorted(records) == ["d0", "d1", "d2", "d3"] and engine.requests_sent == 4
    assert all(r["answer"] in ("yes", "no") and r["read"]["reads"] == 1 for r in records.values())


# -- 2. durable review: a resume never pays twice ----------------------------------------------


def counted_target(log: list[str]) -> RunnableLambda:
    """An escalation target that counts its calls and answers differently each time."""

    def answer(messages):
        log.append(messages[-1].content)
        return {"team": ("billing", "tech")[len(log) % 2]}  # tech, billing, tech, ...

    return RunnableLambda(answer, name="big")


def review_graph(log: list[str], checkpointer: Any, engine: FunctionEngine) -> Any:
    """team escalates (budget: one a decision); urgent is over budget, so a human reviews it."""
    model = CanvasDecisionModel(engine=engine,
                                policy=GatePolicy(rereads=0, max_normalized_entropy=0.5),
                                escalate_to=Escalation(counted_target(log), budget=EscalationBudget(max_per_thread=1)),
                                outcomes=OutcomePolicy(over_budget="answer"))
    return lanes_graph(decision_node(model, {"team": TEAM, "urgent": URGENT}, inputs="ticket",
                                     route=("team", LANES), review=ReviewPolicy()), checkpointer)


UNSURE = {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70}


@pytest.fixture(params=["memory", "sqlite"])
def saver(request, tmp_path):
    if request.param == "memory":
        yield InMemorySaver()
        return
    sqlite = pytest.importorskip("langgraph.checkpoint.sqlite")
    with sqlite.SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as s:
        yield s


def test_a_resume_in_a_fresh_graph_reuses_the_read_and_the_escalation(saver):
    """The resuming graph, model and engine are new objects (as in another process): only the
    checkpoint carries the decision, and the branch is the one reviewed."""
    log: list[str] = []
    first_engine = fixed_engine(UNSURE)
    paused = review_graph(log, saver, first_engine).invoke({"ticket": "Hm, something odd."}, thread("t"))
    [pending] = paused["__interrupt__"]
    assert list(pending.value["questions"]) == ["urgent"] and len(log) == 1 and first_engine.calls == 1

    second_engine = fixed_engine(UNSURE)
    done = review_graph(log, saver, second_engine).invoke(Command(resume="yes"), thread("t"))
    assert len(log) == 1 and second_engine.calls == 0  # no second read, no second escalation
    team = done["decisions"]["team"]
    assert team["path"] == "escalated" and done["lane"] == team["answer"] == "tech"  # the first call's answer
    assert done["decisions"]["urgent"]["answer"] == "yes" and done["decisions"]["urgent"]["path"] == "human"


async def test_the_durable_task_resumes_async_too():
    log: list[str] = []
    saver = InMemorySaver()
    await review_graph(log, saver, fixed_engine(UNSURE)).ainvoke({"ticket": "Hm."}, thread("a"))
    engine = fixed_engine(UNSURE)
    done = await review_graph(log, saver, engine).ainvoke(Command(resume={"urgent": "no"}), thread("a"))
    assert len(log) == 1 and engine.calls == 0 and done["decisions"]["urgent"]["path"] == "human"


def test_a_review_lane_without_a_checkpointer_is_refused_before_any_read():
    engine = fixed_engine(UNSURE)
    graph = review_graph([], None, engine)
    with pytest.raises(GraphSetupError, match="no checkpointer") as caught:
        graph.invoke({"ticket": "Hm."})
    assert "checkpointer=InMemorySaver()" in caught.value.hint and engine.calls == 0
    assert isinstance(caught.value, ValueError)


# -- 3. records dropped without a word ---------------------------------------------------------


class NoDecisions(TypedDict, total=False):
    ticket: str
    lane: str


def test_a_state_without_the_decisions_key_warns_once_naming_key_and_reducer():
    node = decision_node(CanvasDecisionModel(engine=fixed_engine({"A": -0.01, "B": -6.0})), {"team": TEAM},
                         inputs="ticket", route=("team", LANES))
    graph = lanes_graph(node, state=NoDecisions)
    with pytest.warns(UserWarning, match=r"'decisions'.*Annotated\[dict, merge_decisions\]"):
        assert graph.invoke({"ticket": "Refund"})["lane"] == "billing"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph.invoke({"ticket": "Refund"})  # once per node
        fan_out(decision_node(CanvasDecisionModel(engine=refund_engine()), {"relevant": RELEVANT},
                              inputs="doc")).invoke({"docs": DOCS})  # a state with the key: silent


# -- 4. one layer owns retries -------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("max_retries, requests", [(3, 4), (0, 3)])
async def test_a_503_engine_costs_one_layers_attempts_not_their_product(vllm_url, max_retries, requests):
    """The real vLLM server behind a 503 on reads: the engine retries (4 attempts), and
    `retry_on` leaves its error alone; with `max_retries=0` the node's RetryPolicy owns them."""
    from canvasroute.engine.testing import FailingPaths

    failing = FailingPaths({"/v1/chat/completions"}, status=503, message="overloaded (injected)")
    engine = VLLMServerEngine(Connection(vllm_url, retries=Retries(max_retries=max_retries, backoff=0.001),
                                         transport=failing))
    node = decision_node(CanvasDecisionModel(engine=engine, outcomes=OutcomePolicy(engine_fault="raise")),
                         {"team": TEAM}, inputs="ticket")
    graph = lanes_graph(node, retry_policy=RetryPolicy(retry_on=retry_on, max_attempts=3, initial_interval=0.001,
                                                       jitter=False))
    try:
        with pytest.raises(EngineOverloaded) as caught:
            await graph.ainvoke({"ticket": "Refund me"})
    finally:
        await engine.aclose()
    assert failing.failed == requests and caught.value.attempts == max_retries + 1


# -- 5. streams -------------------------------------------------------------------------------------


async def test_astream_events_carries_each_decision_as_a_custom_event():
    graph = fan_out(decision_node(CanvasDecisionModel(engine=refund_engine()), {"relevant": RELEVANT},
                                  inputs="doc", branch="doc_id"))
    events = [e async for e in graph.astream_events({"docs": DOCS[:2]}, version="v2")
              if e["event"] == "on_custom_event"]
    assert [e["name"] for e in events] == [DECISION_EVENT, DECISION_EVENT]
    by_branch = {e["data"]["branch"]: e["data"] for e in events}
    assert by_branch["d0"]["answers"] == {"relevant": "yes"} and by_branch["d1"]["answers"] == {"relevant": "no"}
    custom = [c async for c in graph.astream({"docs": DOCS[:2]}, stream_mode="custom")]

    def replayed(event: dict) -> dict:  # everything but the wall clock and the run's ids is the same
        return {**event, "decision": None, "totals": {k: v for k, v in event["totals"].items() if k != "latency_s"}}

    assert sorted(map(replayed, custom), key=lambda c: c["branch"]) == sorted(
        map(replayed, by_branch.values()), key=lambda c: c["branch"])


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_decision_waiting_for_review_is_streamed_before_the_interrupt_once(mode):
    saver, log = InMemorySaver(), []
    graph = review_graph(log, saver, fixed_engine(UNSURE))
    cfg = thread(f"stream-{mode}")

    async def custom(value):
        if mode == "sync":
            return await asyncio.to_thread(lambda: list(graph.stream(value, cfg, stream_mode="custom")))
        return [c async for c in graph.astream(value, cfg, stream_mode="custom")]

    before = await custom({"ticket": "Hm."})
    [waiting] = before
    assert waiting["type"] == REVIEW_EVENT and waiting["review"] == ["urgent"] and waiting["goto"] is None
    assert waiting["paths"] == {"team": "escalated", "urgent": "unsure"}
    after = await custom(Command(resume="no"))
    [final] = after  # the resume sends the final decision, not the review event again
    assert final["type"] == DECISION_EVENT and final["paths"]["urgent"] == "human" and final["goto"] == "tech"


async def test_astream_events_shows_the_review_event_before_the_interrupt():
    graph = review_graph([], InMemorySaver(), fixed_engine(UNSURE))
    names = [e["name"] async for e in graph.astream_events({"ticket": "Hm."}, thread("ev"), version="v2")
             if e["event"] == "on_custom_event"]
    assert names == [REVIEW_EVENT]


# -- 6. the prebuilt HumanInterrupt ---------------------------------------------------------------


def inbox_graph(engine: FunctionEngine, questions: dict[str, Any], saver: Any) -> Any:
    return lanes_graph(decision_node(CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)), questions,
                                     inputs="ticket", route=("team", LANES),
                                     review=ReviewPolicy(interrupt="human_interrupt")), saver)


def test_the_review_interrupt_is_langgraphs_human_interrupt():
    from pydantic import TypeAdapter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # langgraph marks the TypedDicts as moved; the shape is the same
        from langgraph.prebuilt.interrupt import HumanInterrupt, HumanResponse

    graph = inbox_graph(fixed_engine(UNSURE), {"team": TEAM}, InMemorySaver())
    paused = graph.invoke({"ticket": "Something about my account"}, thread("inbox"))
    [request] = paused["__interrupt__"][0].value
    TypeAdapter(HumanInterrupt).validate_python(request, strict=True)
    assert request["action_request"] == {"action": "Review triage", "args": {"team": "billing"}}
    assert all(request["config"].values()) and "Something about my account" in request["description"]
    assert "`billing` 50%" in request["description"]
    response = {"type": "edit", "args": {"action": "Review triage", "args": {"team": "tech"}}}
    TypeAdapter(HumanResponse).validate_python(response)
    done = graph.invoke(Command(resume=[response]), thread("inbox"))  # Agent Inbox sends a list of one
    assert done["lane"] == "tech" and done["decisions"]["team"]["path"] == "human"


@pytest.mark.parametrize("response, answer, path", [
    ({"type": "accept", "args": None}, "billing", "human"),
    ({"type": "response", "args": "Tech"}, "tech", "human"),
    ({"type": "ignore", "args": None}, "billing", "unsure"),  # the canvas's unsure answer stands
])
def test_accept_respond_and_ignore(response, answer, path):
    graph = inbox_graph(fixed_engine(UNSURE), {"team": TEAM}, InMemorySaver())
    graph.invoke({"ticket": "Hm."}, thread("r"))
    done = graph.invoke(Command(resume=response), thread("r"))
    assert (done["decisions"]["team"]["answer"], done["decisions"]["team"]["path"]) == (answer, path)
    assert done["lane"] == answer


@pytest.mark.parametrize("response, match", [
    ({"type": "edit", "args": {"action": "x", "args": {"team": "sales"}}}, "'sales' is not an option of 'team'"),
    ({"type": "edit", "args": {"action": "x", "args": {"other": "no"}}}, "not under review"),
    ({"type": "response", "args": "tech"}, "a text response can answer only one"),
    ({"type": "approve"}, "accept, edit, response or ignore"),
])
def test_a_bad_human_response_is_a_typed_error(response, match):
    graph = inbox_graph(fixed_engine(UNSURE), {"team": TEAM, "urgent": URGENT}, InMemorySaver())
    graph.invoke({"ticket": "Hm."}, thread("bad"))
    with pytest.raises(DecisionError, match=match):
        graph.invoke(Command(resume=response), thread("bad"))


# -- 7. callback tracers see the served model ---------------------------------------------------------


def test_callback_tracers_see_the_served_model_name():
    class Runs(BaseCallbackHandler):
        def __init__(self) -> None:
            self.models: list[str] = []

        def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
            if (kwargs.get("metadata") or {}).get("ls_model_name"):
                self.models.append(kwargs["metadata"]["ls_model_name"])

        on_llm_start = on_chain_start

    engine = FunctionEngine(lambda read: label_rows(engine, {"A": -0.01, "B": -6.0}, read), model="dgemma-served")
    node = decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM}, inputs="ticket")
    seen = Runs()
    lanes_graph(node).invoke({"ticket": "Refund"}, {"callbacks": [seen]})
    assert seen.models == ["dgemma-served"]  # not "canvas"
    named = CanvasDecisionModel(engine=engine, model="my-router")  # an explicit name is kept
    assert named._traced_config(None)["metadata"]["ls_model_name"] == "my-router"


def test_escalation_messages_stay_off_the_messages_stream():
    """`stream_mode="messages"` streams chat-model tokens; a decision's escalation is tagged
    `nostream`, so its JSON never shows there (the decision is on the custom stream)."""
    from langchain_core.language_models import GenericFakeChatModel

    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                                escalate_to=GenericFakeChatModel(messages=iter([AIMessage('{"team": "tech"}')])))
    node = decision_node(model, {"team": TEAM}, inputs="ticket")
    chunks = list(lanes_graph(node).stream({"ticket": "Hm."}, stream_mode=["messages", "custom"]))
    assert [mode for mode, _ in chunks] == ["custom"] and chunks[0][1]["paths"] == {"team": "escalated"}

