"""Dependent questions: `depends_on={child: (parent, answers)}` inside one decision.

Rows come from the prompt each read is sent with (`promptrows`), so which questions a
read holds, and what each answers, are known before the call.
"""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from promptrows import PromptRows, blocks, by_instructions, pick
from typing_extensions import TypedDict

from canvasroute.engine import DecisionError
from canvasroute.harness import merge_decisions
from canvasroute.harness._records import entries
from canvasroute.router import CanvasDecisionModel, GatePolicy

TEAM = Choice(instructions="Which team owns this?", criteria={"billing": None, "tech": None, "sales": None})
REASON = Choice(instructions="Why a refund?", criteria={"double charge": None, "cancelled": None})
URGENT = Noul(instructions="Is it urgent?")
SEVERITY = Score(instructions="How severe?", criteria=["minor", "major"])
QUESTIONS = {"team": TEAM, "reason": REASON, "urgent": URGENT}
SURE = GatePolicy(max_normalized_entropy=None, rereads=0)
"""No gate: the canvas argmax answers, one read per layer."""


class TicketState(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]


def scripted(team: str) -> PromptRows:
    return PromptRows(by_instructions({"Which team": pick(team), "Why a refund": pick("cancelled"),
                                       "Is it urgent": pick("no"), "How severe": pick(1)}))


def asked(rows: PromptRows, read: int) -> list[str]:
    return [b.instructions for b in blocks(rows.systems[read])]


async def test_child_is_read_in_a_second_read_when_the_parent_answer_matches():
    rows = scripted("billing")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    resp = await model.adecide("charged twice", QUESTIONS, depends_on={"reason": ("team", "billing")})
    assert resp.canvas_reads == 2 and rows.engine.calls == 2
    assert asked(rows, 0) == ["Which team owns this?", "Is it urgent?"]  # parents (and free questions) first
    assert asked(rows, 1) == ["Why a refund?"]
    assert resp.answers["reason"].choice == "cancelled"
    assert resp.reads["reason"].path == "canvas"
    assert resp.reads["reason"].asked_if == {"question": "team", "answers": ["billing"], "parent_answer": "billing"}
    assert resp.reads["team"].asked_if is None
    assert list(resp.reads) == ["team", "reason", "urgent"]  # the caller's order


async def test_child_is_skipped_without_a_read_when_the_parent_answer_does_not_match():
    rows = scripted("tech")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    resp = await model.adecide("charged twice", QUESTIONS, depends_on={"reason": ("team", {"billing", "sales"})})
    assert resp.canvas_reads == 1 and rows.engine.calls == 1
    assert "reason" not in resp.answers and set(resp.answers) == {"team", "urgent"}
    skipped = resp.reads["reason"]
    assert (skipped.path, skipped.answer, skipped.reads, skipped.confident) == ("skipped", None, 0, False)
    assert skipped.probabilities == {} and skipped.canvas_probabilities is None
    assert skipped.asked_if == {"question": "team", "answers": ["billing", "sales"], "parent_answer": "tech"}
    record = entries(resp, {})["reason"]  # the graph-state record
    assert (record["answer"], record["path"], record["result"]) == (None, "skipped", None)


async def test_a_chain_skips_the_grandchild_of_a_skipped_child():
    rows = scripted("tech")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    resp = await model.adecide("x", {**QUESTIONS, "severity": SEVERITY},
                               depends_on={"reason": ("team", "billing"), "severity": ("reason", "cancelled")})
    assert resp.reads["severity"].path == "skipped"
    assert resp.reads["severity"].asked_if["parent_answer"] is None
    assert rows.engine.calls == 1


async def test_three_layers_read_three_times_and_noul_and_score_conditions_match():
    rows = scripted("billing")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    resp = await model.adecide("x", {**QUESTIONS, "severity": SEVERITY},
                               depends_on={"reason": ("urgent", False), "severity": ("reason", ["cancelled"])})
    assert [asked(rows, i) for i in range(3)] == [["Which team owns this?", "Is it urgent?"],
                                                  ["Why a refund?"], ["How severe?"]]
    assert resp.answers["severity"].score == pytest.approx(0.1 * 0 + 0.9 * 1)
    assert resp.canvas_reads == 3


async def test_the_condition_uses_the_escalated_answer_of_an_uncertain_parent():
    """The canvas leans to tech but is unsure; the escalation says billing: the child is asked."""
    rows = PromptRows(by_instructions({"Which team": lambda b: [0.3, 0.4, 0.3], "Why a refund": pick(0)}))
    calls = []

    def escalation(messages):
        calls.append(messages[-1].content)
        return AIMessage(json.dumps({"team": "billing"}))

    model = CanvasDecisionModel(engine=rows.engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                                escalate_to=RunnableLambda(escalation))
    resp = await model.adecide("x", {"team": TEAM, "reason": REASON}, depends_on={"reason": ("team", "billing")})
    assert resp.reads["team"].path == "escalated" and resp.reads["team"].canvas_probabilities["tech"] == 0.4
    assert resp.reads["reason"].path == "canvas" and resp.answers["reason"].choice == "double charge"
    assert len(calls) == 1 and rows.engine.calls == 2


async def test_depends_on_travels_as_a_request_key_through_invoke():
    rows = scripted("sales")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    resp = await model.ainvoke({"state": "x", "questions": QUESTIONS, "depends_on": {"reason": ("team", "billing")}})
    assert resp.reads["reason"].path == "skipped" and "reason" not in resp.answers


async def test_skipped_questions_are_on_the_span(spans):
    rows = scripted("tech")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    await model.adecide("x", QUESTIONS, depends_on={"reason": ("team", "billing")})
    (decide,) = [s for s in spans.get_finished_spans() if s.name.startswith("decide ")]
    from canvasroute.router import telemetry as tm

    events = {e.attributes[tm.QUESTION_ID]: e.attributes for e in decide.events if e.name == tm.QUESTION_EVENT}
    assert events["reason"][tm.FIGURE_KEYS["path"]] == "skipped"
    assert tm.FIGURE_KEYS["answer"] not in events["reason"]
    assert events["team"][tm.FIGURE_KEYS["path"]] == "canvas"


async def test_every_condition_must_hold_and_a_parent_without_one_only_orders():
    """`{child: {parent: answers or None}}`: all conditions hold or the child is skipped
    (the first failing one is reported); a None parent is read first, whatever it answers."""
    rows = scripted("billing")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    both = await model.adecide("x", QUESTIONS, depends_on={"reason": {"team": "billing", "urgent": "no"}})
    assert both.reads["reason"].path == "canvas" and both.canvas_reads == 2
    assert both.reads["reason"].asked_if == {"question": "team", "answers": ["billing"], "parent_answer": "billing"}
    one_fails = await model.adecide("x", QUESTIONS, depends_on={"reason": {"team": "billing", "urgent": "yes"}})
    assert one_fails.reads["reason"].path == "skipped"
    assert one_fails.reads["reason"].asked_if == {"question": "urgent", "answers": ["yes"], "parent_answer": "no"}
    ordered = await model.adecide("x", QUESTIONS,
                                  depends_on={"reason": {"team": None}, "urgent": ("reason", "cancelled")})
    assert ordered.diagnostics.stages == [["team"], ["reason"], ["urgent"]]
    assert ordered.reads["reason"].asked_if is None and ordered.reads["urgent"].path == "canvas"
    assert "Earlier answers about this input:\n- Which team owns this?: billing" in rows.users[-2]
    assert rows.users[-1].endswith("- Why a refund?: cancelled")


@pytest.mark.parametrize(("depends_on", "message"), [
    ({"reason": ("team", "billing"), "team": ("reason", "cancelled")}, "cycle: team -> reason -> team"),
    ({"reason": ("reason", "cancelled")}, "cycle: reason -> reason"),
    ({"reason": ("owner", "billing")}, "parent 'owner'"),
    ({"why": ("team", "billing")}, "'why', which is not one of the questions"),
    ({"reason": ("team", "finance")}, "'finance' is not an answer of 'team'"),
    ({"reason": ("urgent", "maybe")}, "'maybe' is not an answer of 'urgent'"),
    ({"reason": ("team", [])}, "non-empty"),
    ({"reason": "team"}, "must be a pair"),
    ({"reason": {}}, "must be a pair"),
    ({"reason": {"team": "billing", "owner": None}}, "parent 'owner'"),
    ({"reason": {"team": None}, "team": {"reason": None}}, "cycle: team -> reason -> team"),
    (["reason"], "must be a mapping"),
])
async def test_bad_conditions_are_decision_errors_before_any_read(depends_on, message):
    rows = scripted("billing")
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    with pytest.raises(DecisionError, match=message.replace("(", r"\(")):
        await model.adecide("x", QUESTIONS, depends_on=depends_on)
    assert rows.engine.calls == 0


@pytest.mark.parametrize("team, reason", [("billing", "cancelled"), ("tech", None)])
def test_a_decision_node_asks_a_child_only_when_its_parent_calls_for_it(team, reason):
    from langgraph.graph import END, START, StateGraph

    from canvasroute.harness import decision_node

    rows = scripted(team)
    model = CanvasDecisionModel(engine=rows.engine, policy=SURE)
    node = decision_node(model, {"team": TEAM, "reason": REASON}, inputs="ticket",
                         route=("team", {"billing": "billing", "tech": "tech", "sales": "tech"}),
                         depends_on={"reason": ("team", "billing")})
    builder = StateGraph(TicketState)
    builder.add_node("triage", node)
    for lane in ("billing", "tech"):
        builder.add_node(lane, lambda state: {})
        builder.add_edge(lane, END)
    builder.add_edge(START, "triage")
    out = builder.compile().invoke({"ticket": "Refund the cancelled plan."})
    assert out["decisions"]["team"]["answer"] == team
    assert out["decisions"]["reason"]["answer"] == reason
    assert out["decisions"]["reason"]["path"] == ("canvas" if reason else "skipped")
    assert len(rows.systems) == (2 if reason else 1)  # the child's read happens only when asked


def test_the_route_question_of_a_node_cannot_be_a_child():
    from canvasroute.harness import decision_node

    model = CanvasDecisionModel(engine=scripted("billing").engine, policy=SURE)
    with pytest.raises(ValueError, match="cannot depend"):
        decision_node(model, {"team": TEAM, "reason": REASON}, depends_on={"reason": ("team", "billing")},
                      route=("reason", {"double charge": "a", "cancelled": "b"}))
