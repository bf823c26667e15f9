"""Loops of decisions: `history=`, route functions of the state, and what a run's reads add up to.

The tutorials' graphs loop (grade, retry while the grade is "no", stop after `max_retries`) and
fan out (`Send` one grader per document). These check the mechanics on `FunctionEngine`, whose
answers each test picks: records keep their earlier iterations, bounded, in a `Send` branch too
(its input is only its payload), and `run_totals` of the records equals that of the events and
the reads the engine saw.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

import pytest
from conftest import fixed_engine
from langchain_core.decisions import Noul
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from typing_extensions import TypedDict

from canvasroute.harness import decision_node, merge_decisions, run_totals
from canvasroute.router import CanvasDecisionModel

NO = {"yes": -6.0, "no": -0.01}
"""Every Noul reads "no", confidently."""


class LoopState(TypedDict, total=False):
    attempt: Annotated[int, operator.add]
    max_retries: int
    docs: dict[str, str]
    decisions: Annotated[dict, merge_decisions]


def retry_loop(model: CanvasDecisionModel, *, history: int):
    """attempt -> grade -.-> attempt (while "no" and retries last) | END."""

    def again(decisions: dict[str, Any], state: LoopState) -> str:
        retry = decisions["good"]["answer"] == "no" and state["attempt"] <= state["max_retries"]
        return "attempt" if retry else END

    grade = decision_node(model, {"good": Noul(instructions="Is the attempt good?")}, inputs="attempt",
                          route=again, destinations=("attempt", END), history=history)
    builder = StateGraph(LoopState)
    builder.add_node("attempt", lambda state: {"attempt": 1})
    builder.add_node("grade", grade)
    builder.add_edge(START, "attempt")
    builder.add_edge("attempt", "grade")
    return builder.compile()


def run(graph: Any, state: Any, config: Any = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The final state and the decision events of one run."""
    events, out = [], {}
    for mode, chunk in graph.stream(state, config, stream_mode=["custom", "values"]):
        if mode == "custom":
            events.append(chunk)
        else:
            out = chunk
    return out, events


@pytest.mark.parametrize("max_retries", [0, 2, 5])
def test_a_route_of_the_state_stops_the_retry_loop_after_max_retries(max_retries):
    engine = fixed_engine(NO)
    out, events = run(retry_loop(CanvasDecisionModel(engine=engine), history=10), {"max_retries": max_retries})
    assert out["attempt"] == max_retries + 1 and engine.calls == max_retries + 1
    assert [e["goto"] for e in events] == ["attempt"] * max_retries + [END]


def test_history_keeps_each_questions_earlier_records_newest_last_and_bounded():
    out, events = run(retry_loop(CanvasDecisionModel(engine=fixed_engine(NO)), history=2), {"max_retries": 4})
    record = out["decisions"]["good"]
    ids = [e["decision"] for e in events]
    assert len(ids) == 5 and record["timing"]["decision"] == ids[-1]
    assert [h["timing"]["decision"] for h in record["history"]] == ids[-3:-1]  # the two before it, oldest first
    assert all("history" not in h for h in record["history"])  # flat: no history inside history


def test_with_history_the_first_run_holds_an_empty_history():
    out, _ = run(retry_loop(CanvasDecisionModel(engine=fixed_engine(NO)), history=2), {"max_retries": 0})
    assert out["decisions"]["good"]["history"] == []  # the key is there from the first run: no .get needed


def test_without_history_a_loop_keeps_only_its_newest_record():
    out, _ = run(retry_loop(CanvasDecisionModel(engine=fixed_engine(NO)), history=0), {"max_retries": 2})
    assert "history" not in out["decisions"]["good"]
    assert run_totals(out["decisions"]).decisions == 1  # the records alone undercount a loop: the events do not


def test_history_in_shadow_mode_keeps_the_canvas_records_beside_the_routers_choices():
    """Issue 34.4: shadow mode wrote its records without their history (`_finish_shadow`)."""
    engine = fixed_engine(NO)
    grade = decision_node(CanvasDecisionModel(engine=engine), {"good": Noul(instructions="Is the attempt good?")},
                          inputs="attempt", route=lambda decisions: "attempt", destinations=("attempt", END),
                          shadow=lambda state: "attempt" if state["attempt"] < 3 else END, history=5)
    builder = StateGraph(LoopState)
    builder.add_node("attempt", lambda state: {"attempt": 1})
    builder.add_node("grade", grade)
    builder.add_edge(START, "attempt")
    builder.add_edge("attempt", "grade")
    out, events = run(builder.compile(), {})
    record = out["decisions"]["good"]
    assert out["attempt"] == 3 and engine.calls == 3  # the existing router stopped the loop
    assert [h["timing"]["decision"] for h in record["history"]] == [e["decision"] for e in events][:-1]
    assert [h["shadow"]["destination"] for h in [*record["history"], record]] == ["attempt", "attempt", END]
    assert run_totals(out["decisions"]) == run_totals(events) and run_totals(events).reads == 3


def test_history_under_review_keeps_each_iterations_human_answer():
    """A loop whose grade goes to a person each time: every pause and resume, and the records keep
    each human answer; the thread's events and its records total the reads once."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Command

    from canvasroute.harness import ReviewPolicy
    from canvasroute.router import GatePolicy

    engine = fixed_engine({"yes": -0.69, "no": -0.70})  # a toss-up: every grade goes to review
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.1, rereads=0))

    def again(decisions: dict[str, Any], state: LoopState) -> str:
        return "attempt" if decisions["good"]["answer"] == "no" else END

    grade = decision_node(model, {"good": Noul(instructions="Is the attempt good?")}, inputs="attempt",
                          route=again, destinations=("attempt", END), history=5, review=ReviewPolicy())
    builder = StateGraph(LoopState)
    builder.add_node("attempt", lambda state: {"attempt": 1})
    builder.add_node("grade", grade)
    builder.add_edge(START, "attempt")
    builder.add_edge("attempt", "grade")
    graph = builder.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "graded"}}
    out, events = run(graph, {}, config)
    for answer in ("no", "no", "yes"):
        assert "__interrupt__" in out
        out, more = run(graph, Command(resume=answer), config)
        events += more
    record = out["decisions"]["good"]
    assert [(h["answer"], h["path"]) for h in [*record["history"], record]] == [
        ("no", "human"), ("no", "human"), ("yes", "human")]
    assert engine.calls == 3 and out["attempt"] == 3
    assert run_totals(out["decisions"]) == run_totals(events) and run_totals(events).reads == 3


def fan_out_loop(model: CanvasDecisionModel, *, history: int):
    """fan -.Send per doc.-> grade -> check -.-> fan (while attempts last) | END."""
    grade = decision_node(model, {"relevant": Noul(instructions="Is the passage relevant?")},
                          inputs=lambda s: {"passage": s["text"], "attempt": s["attempt"]}, branch="doc_id",
                          history=history)
    builder = StateGraph(LoopState)
    builder.add_node("fan", lambda state: {"attempt": 1})
    builder.add_node("grade", grade)
    builder.add_node("check", lambda state: {})
    builder.add_edge(START, "fan")
    builder.add_conditional_edges("fan", lambda s: [Send("grade", {"doc_id": d, "text": t, "attempt": s["attempt"]})
                                                    for d, t in s["docs"].items()], ["grade"])
    builder.add_edge("grade", "check")
    builder.add_conditional_edges("check", lambda s: "fan" if s["attempt"] < s["max_retries"] else END, ["fan", END])
    return builder.compile()


def test_history_in_a_send_branch_comes_from_the_graph_state_not_the_payload():
    """A `Send` branch's input is its payload, which holds no records: the node reads them from the graph."""
    engine = fixed_engine(NO)
    docs = {"faq-2": "Refunds take five days.", "faq-9": "The office opens at nine."}
    out, events = run(fan_out_loop(CanvasDecisionModel(engine=engine), history=5), {"docs": docs, "max_retries": 3})
    grades = out["decisions"]["relevant"]
    assert sorted(grades) == ["faq-2", "faq-9"]  # one record per document, each with its own earlier ones
    for doc, record in grades.items():
        mine = [e["decision"] for e in events if e["branch"] == doc]
        assert len(mine) == 3 and record["timing"]["decision"] == mine[-1]
        assert [h["timing"]["decision"] for h in record["history"]] == mine[:-1]
    assert run_totals(out["decisions"]) == run_totals(events)
    assert run_totals(events).reads == engine.calls == 6


def test_run_totals_of_the_records_equal_the_events_and_the_engines_reads_with_history():
    engine = fixed_engine(NO)
    out, events = run(retry_loop(CanvasDecisionModel(engine=engine), history=3), {"max_retries": 3})
    by_records, by_events = run_totals(out["decisions"]), run_totals(events)
    assert by_records == by_events
    assert (by_events.decisions, by_events.questions, by_events.reads, by_events.escalations) == (4, 4, 4, 0)
    assert by_events.reads == engine.calls


def test_a_route_of_the_state_returning_an_undeclared_node_is_refused():
    model = CanvasDecisionModel(engine=fixed_engine(NO))
    node = decision_node(model, {"good": Noul(instructions="Good?")}, route=lambda decisions, state: "elsewhere",
                         destinations=("attempt", END))
    builder = StateGraph(LoopState)
    builder.add_node("grade", node)
    builder.add_node("attempt", lambda state: {})
    builder.add_edge(START, "grade")
    with pytest.raises(ValueError, match=r"route returned 'elsewhere', which is not one of the declared destinations"):
        builder.compile().invoke({"attempt": 0})
