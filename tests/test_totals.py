"""Totals that mean what they say (issue #34.3): what a run spent, on every path.

The rule (`Totals`, `run_totals`): totals count what was spent where they are reported. A decision
set decided now counts its reads, canvases, escalations, tokens and seconds; a replayed one (a
`DecisionCache` hit, a review's resume, a `NodeCache` hit) spent nothing, says how it was replayed
(`replayed`) and keeps what it spent when it was decided (`original`). Over a thread's runs, its
events and the records that keep every decision set total the same, and both equal what the engine
and the target did. Each path here is a real LangGraph graph (InMemorySaver, InMemoryCache, Send,
interrupt and `Command(resume=...)`) on `FunctionEngine` and `ScriptedTarget`, whose calls we count.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

import pytest
from conftest import fixed_engine
from langchain_core.decisions import Noul
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, RetryPolicy, Send
from typing_extensions import TypedDict

from canvasroute.engine import DecisionError, run_sync
from canvasroute.harness import NodeCache, ReviewPolicy, decision_node, merge_decisions, retry_on, run_totals
from canvasroute.router import CanvasDecisionModel, DecisionCache, GatePolicy, OutcomePolicy, Totals
from canvasroute.router.testing import ScriptedTarget

UNSURE = {"yes": -0.69, "no": -0.70}
"""A toss-up: over the gate, so it escalates (with a target) or goes to review (without)."""
SURE = {"yes": -0.01, "no": -6.0}
GATE = GatePolicy(max_normalized_entropy=0.5, rereads=0)
OK = {"ok": Noul(instructions="Is the ticket resolved?")}


class State(TypedDict, total=False):
    ticket: str
    attempt: Annotated[int, operator.add]
    docs: dict[str, str]
    doc: str
    doc_id: str
    decisions: Annotated[dict, merge_decisions]


def one_node(model: CanvasDecisionModel, *, review: ReviewPolicy | None = None, cache: bool = False,
             retry: bool = False, checkpointer: Any = None) -> Any:
    """START -> decide -> END (a decision about `ticket`)."""
    node = decision_node(model, OK, inputs="ticket", review=review)
    builder = StateGraph(State)
    builder.add_node("decide", node, cache_policy=node.cache_policy() if cache else None,
                     retry_policy=RetryPolicy(retry_on=retry_on, initial_interval=0.0, jitter=False) if retry else None)
    builder.add_edge(START, "decide")
    builder.add_edge("decide", END)
    return builder.compile(checkpointer=checkpointer, cache=NodeCache(InMemoryCache()) if cache else None)


def fan_out(model: CanvasDecisionModel, *, cache: bool = False) -> Any:
    """START -.Send per document.-> grade -> END (records by branch, `branch="doc_id"`)."""
    node = decision_node(model, {"relevant": Noul(instructions="Is the passage relevant?")}, inputs="doc",
                         branch="doc_id")
    builder = StateGraph(State)
    builder.add_node("grade", node, cache_policy=node.cache_policy() if cache else None)
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": t, "doc_id": d})
                                                    for d, t in s["docs"].items()], ["grade"])
    builder.add_edge("grade", END)
    return builder.compile(cache=NodeCache(InMemoryCache()) if cache else None)


def run(graph: Any, value: Any, config: Any = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The last state and the decision events of one run (`stream`, custom and values modes)."""
    events, out = [], {}
    for mode, chunk in graph.stream(value, config, stream_mode=["custom", "values"]):
        if mode == "custom":
            events.append(chunk)
        else:
            out = chunk
    return out, events


async def arun(graph: Any, value: Any, config: Any = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    events, out = [], {}
    async for mode, chunk in graph.astream(value, config, stream_mode=["custom", "values"]):
        if mode == "custom":
            events.append(chunk)
        else:
            out = chunk
    return out, events


def spend(totals: Totals) -> tuple[int, ...]:
    """Everything a run spent but its seconds: decisions, questions, reads, canvases, escalations, tokens,
    target calls, hedges, hedges cancelled and hedges that ran on."""
    return totals.as_tuple()[:-1]



def records(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Every record of the decisions key, flat or by branch."""
    found = []
    for value in out.get("decisions", {}).values():
        found += list(value.values()) if "timing" not in value else [value]
    return found


def test_a_decision_cache_hit_spent_nothing_and_keeps_what_the_decision_cost():
    target = ScriptedTarget(script={"ok": "yes"})
    engine = fixed_engine(UNSURE)
    model = CanvasDecisionModel(engine=engine, policy=GATE, escalate_to=target, cache=DecisionCache())
    first = model.decide("Refund me", OK)
    again = run_sync(model.adecide("Refund me", OK))
    assert first.reads["ok"].path == again.reads["ok"].path == "escalated"  # how it was decided: unchanged
    assert (first.replayed, first.original) == (None, None)
    assert spend(first.totals) == (1, 1, 1, 1, 1, first.usage["input_tokens"], first.usage["output_tokens"], 1, 0, 0, 0)
    assert again.replayed == "decision_cache" and again.canvas_reads == 0
    assert again.totals == Totals()  # nothing read, nothing escalated, no decision made
    assert again.original == first.totals
    assert (engine.calls, target.calls) == (1, 1)


def test_a_plain_run_and_a_fan_out_total_the_engines_reads_in_events_and_records():
    engine = fixed_engine(SURE)
    out, events = run(one_node(CanvasDecisionModel(engine=engine, policy=GATE)), {"ticket": "Refund me"})
    assert run_totals(out["decisions"]) == run_totals(events)
    assert spend(run_totals(events))[:5] == (1, 1, 1, 1, 0) and engine.calls == 1
    assert out["decisions"]["ok"]["timing"]["replayed"] is None  # decided now
    engine = fixed_engine(SURE)
    docs = {"faq-2": "Refunds take five days.", "faq-9": "The office opens at nine."}
    out, events = run(fan_out(CanvasDecisionModel(engine=engine, policy=GATE)), {"docs": docs})
    assert sorted(out["decisions"]["relevant"]) == ["faq-2", "faq-9"]
    assert run_totals(out["decisions"]) == run_totals(events)
    assert run_totals(events).reads == run_totals(events).decisions == engine.calls == 2


def test_a_decision_cache_hit_inside_a_node_spent_nothing_in_its_event_and_records():
    """The escalated decision replayed by the model's cache: no read, no escalation in this run."""
    target = ScriptedTarget(script={"ok": "yes"})
    engine = fixed_engine(UNSURE)
    graph = one_node(CanvasDecisionModel(engine=engine, policy=GATE, escalate_to=target, cache=DecisionCache()))
    first, first_events = run(graph, {"ticket": "Refund me"})
    assert run_totals(first_events).escalations == 1
    out, events = run(graph, {"ticket": "Refund me"})
    assert (engine.calls, target.calls) == (1, 1)
    (decided,) = events
    assert decided["replayed"] == "decision_cache" and decided["paths"] == {"ok": "escalated"}
    assert run_totals(events) == run_totals(out["decisions"]) == Totals()
    timing = out["decisions"]["ok"]["timing"]
    assert timing["replayed"] == "decision_cache" and timing["original"] == first["decisions"]["ok"]["timing"]["totals"]


@pytest.mark.parametrize("shape", ["one node", "fan-out", "async"])
def test_a_node_cache_hit_sends_no_event_and_its_records_spent_nothing(shape):
    engine = fixed_engine(SURE)
    model = CanvasDecisionModel(engine=engine, policy=GATE)
    if shape == "fan-out":
        graph, given = fan_out(model, cache=True), {"docs": {"faq-2": "Refunds take five days.", "faq-9": "Nine."}}
    else:
        graph, given = one_node(model, cache=True), {"ticket": "Refund me"}
    runner = run if shape != "async" else lambda *a: run_sync(arun(*a))  # NodeCache.aget
    first, first_events = runner(graph, given)
    out, events = runner(graph, given)
    assert engine.calls == len(first_events) and events == []  # the node did not run
    assert run_totals(out["decisions"]) == run_totals(events) == Totals()
    before = {r["timing"]["decision"]: r["timing"]["totals"] for r in records(first)}
    for record in records(out):
        timing = record["timing"]
        assert timing["replayed"] == "node_cache" and timing["decision"] not in before  # a replay: an id of its own
        assert timing["original"] in before.values() and timing["original"]["reads"] == 1
    assert [r["answer"] for r in records(out)] == [r["answer"] for r in records(first)]
    assert run_totals(first["decisions"]) == run_totals(first_events)


def test_a_node_cache_and_history_do_not_combine():
    node = decision_node(CanvasDecisionModel(engine=fixed_engine(SURE)), OK, history=2)
    with pytest.raises(DecisionError, match="history= and a node cache"):
        node.cache_policy()


def paused_and_resumed(graph: Any, runner: Any) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    config = {"configurable": {"thread_id": "review"}}
    paused, paused_events = runner(graph, {"ticket": "Refund me"}, config)
    assert "__interrupt__" in paused
    out, events = runner(graph, Command(resume="yes"), config)
    return paused_events, out, events


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_review_counts_the_paused_runs_read_once_and_the_resume_spends_nothing(mode):
    engine = fixed_engine(UNSURE)
    graph = one_node(CanvasDecisionModel(engine=engine, policy=GATE), review=ReviewPolicy(),
                     checkpointer=InMemorySaver())
    paused_events, out, events = paused_and_resumed(
        graph, run if mode == "sync" else lambda *a: run_sync(arun(*a)))
    assert engine.calls == 1
    (waiting,) = paused_events  # the paused run read: its review event says so
    assert waiting["type"] == "canvasroute.review" and run_totals(paused_events).reads == 1
    (decided,) = events  # the resume read nothing: the checkpointed decision came back
    assert decided["type"] == "canvasroute.decision" and decided["replayed"] == "checkpoint"
    assert run_totals(events) == Totals() and decided["original"]["reads"] == 1
    record = out["decisions"]["ok"]
    assert record["path"] == "human" and record["timing"]["replayed"] == "checkpoint"
    assert record["timing"]["decision"] == waiting["decision"] != decided["decision"]
    # over the thread's runs the events and the records total the read once
    assert run_totals(out["decisions"]) == run_totals(paused_events + events)
    assert spend(run_totals(out["decisions"]))[:5] == (1, 1, 1, 1, 0)


def test_a_failed_attempt_that_a_retry_policy_retries_counts_nothing():
    """The first escalation times out (retryable, one attempt) and the model raises it
    (`target_fault="raise"`): the node raises, LangGraph runs it again. The failed attempt finished
    no decision set: no event, no record, no totals."""
    target = ScriptedTarget(script={"ok": "yes"}, faults=[TimeoutError("slow")])
    engine = fixed_engine(UNSURE)
    graph = one_node(CanvasDecisionModel(engine=engine, policy=GATE, escalate_to=target,
                                         outcomes=OutcomePolicy(target_fault="raise")), retry=True)
    out, events = run(graph, {"ticket": "Refund me"})
    assert (engine.calls, target.calls, len(events)) == (2, 2, 1)
    assert run_totals(out["decisions"]) == run_totals(events)
    assert spend(run_totals(events))[:5] == (1, 1, 1, 1, 1)  # the attempt that returned


def test_a_replay_from_a_checkpoint_before_the_node_reads_again_and_counts_it():
    engine = fixed_engine(SURE)
    graph = one_node(CanvasDecisionModel(engine=engine, policy=GATE), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "travel"}}
    run(graph, {"ticket": "Refund me"}, config)
    before = next(s for s in graph.get_state_history(config) if s.next == ("decide",))
    out, events = run(graph, None, before.config)  # time travel: the node after the checkpoint runs again
    assert engine.calls == 2 and len(events) == 1 and events[0]["replayed"] is None
    assert run_totals(out["decisions"]) == run_totals(events) and run_totals(events).reads == 1


def test_history_records_of_a_loop_the_decision_cache_answers_total_one_read():
    """A loop asks the same decision about the same ticket: the first iteration reads, the
    others are replays; the records (`history=`) and the events say so."""
    engine = fixed_engine({"yes": -6.0, "no": -0.01})
    model = CanvasDecisionModel(engine=engine, policy=GATE, cache=DecisionCache())
    grade = decision_node(model, OK, inputs="ticket", history=5,
                          route=lambda d, s: "attempt" if s["attempt"] < 4 else END, destinations=("attempt", END))
    builder = StateGraph(State)
    builder.add_node("attempt", lambda state: {"attempt": 1})
    builder.add_node("grade", grade)
    builder.add_edge(START, "attempt")
    builder.add_edge("attempt", "grade")
    out, events = run(builder.compile(), {"ticket": "Refund me"})
    record = out["decisions"]["ok"]
    assert len(events) == 4 and len(record["history"]) == 3 and engine.calls == 1
    assert [e["replayed"] for e in events] == [None] + ["decision_cache"] * 3
    assert [h["timing"]["replayed"] for h in [*record["history"], record]] == [None] + ["decision_cache"] * 3
    assert run_totals(out["decisions"]) == run_totals(events)
    assert spend(run_totals(events))[:5] == (1, 1, 1, 1, 0)


def test_a_review_checkpointed_before_decision_sets_had_ids_still_resumes_as_a_replay():
    """The review's task output was the response alone before it held the decision set's id."""
    from canvasroute.harness._review import _checkpointed

    decided = CanvasDecisionModel(engine=fixed_engine(SURE), policy=GATE).decide("Refund me", OK)
    done = _checkpointed(decided.model_dump(mode="json"), False, 0.01)
    assert done.response.replayed == "checkpoint" and done.response.totals == Totals()
    assert done.spent == done.response.original == decided.totals and done.decision


def summed(events: list[dict[str, Any]]) -> Totals:
    """What a consumer that adds up every event's totals (no dedup by id) sees."""
    return sum((Totals.from_dict(e["totals"]) for e in events), Totals())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_review_repaused_without_a_resume_sends_no_second_review_event(mode):
    """`invoke(None)` on a paused thread re-runs the node: its decision comes back from the
    checkpoint and it pauses again, but the read was reported when it was made, so the events
    summed as they come total the read once."""
    engine = fixed_engine(UNSURE)
    graph = one_node(CanvasDecisionModel(engine=engine, policy=GATE), review=ReviewPolicy(),
                     checkpointer=InMemorySaver())
    runner = run if mode == "sync" else lambda *a: run_sync(arun(*a))
    config = {"configurable": {"thread_id": "repause"}}
    paused, paused_events = runner(graph, {"ticket": "Refund me"}, config)
    again, again_events = runner(graph, None, config)
    assert "__interrupt__" in paused and "__interrupt__" in again and engine.calls == 1
    assert [e["type"] for e in paused_events] == ["canvasroute.review"] and again_events == []
    out, events = runner(graph, Command(resume="yes"), config)
    everything = paused_events + again_events + events
    assert summed(everything) == run_totals(everything) == run_totals(out["decisions"])
    assert spend(summed(everything))[:5] == (1, 1, 1, 1, 0)


def test_a_fan_out_reviewed_one_branch_at_a_time_reports_each_read_once():
    """Two `Send` branches pause; resuming one re-runs the other, which pauses again from its
    checkpointed decision and sends nothing: every event's totals summed equal the records'."""
    engine = fixed_engine(UNSURE)
    node = decision_node(CanvasDecisionModel(engine=engine, policy=GATE), OK, inputs="doc", branch="doc_id",
                         review=ReviewPolicy())
    builder = StateGraph(State)
    builder.add_node("grade", node)
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": t, "doc_id": d})
                                                    for d, t in s["docs"].items()], ["grade"])
    builder.add_edge("grade", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "fan-out review"}}
    _, everything = run(graph, {"docs": {"faq-2": "Refunds take five days.", "faq-9": "Nine."}}, config)
    first, second = graph.get_state(config).interrupts
    _, half_events = run(graph, Command(resume={first.id: "yes"}), config)
    assert [i.id for i in graph.get_state(config).interrupts] == [second.id]
    assert [e["type"] for e in half_events] == ["canvasroute.decision"]  # the resumed branch only
    out, last_events = run(graph, Command(resume={second.id: "no"}), config)
    everything += half_events + last_events
    assert engine.calls == 2 and sorted(out["decisions"]["ok"]) == ["faq-2", "faq-9"]
    assert summed(everything) == run_totals(everything) == run_totals(out["decisions"])
    assert spend(summed(everything))[:5] == (2, 2, 2, 2, 0)


@pytest.mark.parametrize("output", ["auto", "text"])
def test_a_malformed_reply_asked_again_is_two_target_calls_in_totals_records_and_traces(output, spans):
    """Issue 40.1: `Totals.target_calls` said 1 when a malformed reply was asked again (two calls to the
    target). Every call handed to the target counts: in the response, the graph's events and records,
    and the `escalate` span (`canvasroute.escalation.calls`) the trace report sums."""
    from canvasroute.apps.observability.report import build_report
    from canvasroute.apps.observability.traces import span_record
    from canvasroute.router import Escalation
    from canvasroute.router import telemetry as tm

    target = ScriptedTarget(script={"ok": "yes"}, faults=["malformed"])  # the first reply is prose
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GATE, escalate_to=Escalation(target, output=output))
    resp = model.decide("Refund me", OK)
    assert (resp.reads["ok"].path, target.calls, resp.totals.target_calls) == ("escalated", 2, 2)
    out, events = run(one_node(model), {"ticket": "Refund me, again"})  # answered at once: one call
    assert run_totals(events).target_calls == run_totals(out["decisions"]).target_calls == target.calls - 2 == 1
    finished = [span_record(s) for s in spans.get_finished_spans()]
    assert [s.attributes[tm.TARGET_CALLS] for s in finished if s.name.startswith("escalate ")] == [2, 1]
    assert sum(r.target_calls for r in build_report(finished).runs) == target.calls == 3
