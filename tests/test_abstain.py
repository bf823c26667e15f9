"""Abstain: one more label in the slot, "none of these / can't tell" (`GatePolicy.abstain`).

Rows come from the prompt (`promptrows`): the abstain label is the line whose text is
the abstain description, so a rule can make it win or lose by name.
"""

from __future__ import annotations

import json
import re

import pytest
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from promptrows import PromptRows, blocks, by_instructions, pick

from canvasroute.engine import BudgetExhausted, DecisionError
from canvasroute.router import CanvasDecisionModel, EscalationBudget, GatePolicy, OutcomePolicy
from canvasroute.router import Escalation as Target

TEAM = Choice(instructions="Which team owns this?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Is it urgent?")
SEVERITY = Score(instructions="How severe?", criteria=["minor", "major"])
ABSTAIN_LINE = "none of these / can't tell"
ABSTAINS = GatePolicy(max_normalized_entropy=None, rereads=0, abstain=True)


def abstaining(p: float = 0.8) -> PromptRows:
    return PromptRows(lambda block: pick(ABSTAIN_LINE, p)(block))


class Big:
    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.prompts = answers, []
        self.runnable = RunnableLambda(self._reply, name="big")

    def _reply(self, messages):
        self.prompts.append(messages[-1].content)
        asked = re.findall(r'^Question "([^"]+)"', messages[-1].content, re.MULTILINE)
        return AIMessage(json.dumps({q: self.answers[q] for q in asked}))


async def test_the_abstain_label_is_one_more_label_in_the_same_slot():
    rows = PromptRows(pick("billing", 0.6))
    model = CanvasDecisionModel(engine=rows.engine, policy=ABSTAINS, escalate_to=Big({}).runnable)
    resp = await model.adecide("x", {"team": TEAM})
    (block,) = blocks(rows.systems[0])
    assert block.labels == ("A", "B", "C") and block.texts == ("billing", "tech", ABSTAIN_LINE)
    report = resp.reads["team"]
    assert report.path == "canvas" and report.answer == "billing"
    assert report.canvas_probabilities == pytest.approx({"billing": 0.6, "tech": 0.2, "(abstain)": 0.2})
    assert report.probabilities == pytest.approx({"billing": 0.75, "tech": 0.25})  # the abstain share removed
    assert resp.answers["team"].probabilities == pytest.approx({"billing": 0.75, "tech": 0.25})
    assert report.labels == ["A", "B", "C"]


async def test_a_winning_abstain_label_escalates_without_offering_abstain_to_the_escalation():
    esc = Big({"team": "tech"})
    rows = abstaining()
    model = CanvasDecisionModel(engine=rows.engine, policy=ABSTAINS, escalate_to=esc.runnable)
    resp = await model.adecide("x", {"team": TEAM})
    report = resp.reads["team"]
    assert (report.path, report.cause, report.answer, report.escalation_model) == (
        "escalated", "abstained", "tech", "big")
    assert report.canvas_probabilities["(abstain)"] == pytest.approx(0.8)
    assert resp.answers["team"].choice == "tech"
    (prompt,) = esc.prompts
    assert '"billing"' in prompt and '"tech"' in prompt and "(abstain)" not in prompt


async def test_a_winning_abstain_label_takes_the_fallback_when_the_policy_says_so():
    esc = Big({"team": "tech"})
    rows = abstaining()
    policy = GatePolicy(max_normalized_entropy=None, rereads=0, abstain=True)
    model = CanvasDecisionModel(engine=rows.engine, policy=policy, escalate_to=esc.runnable,
                                outcomes=OutcomePolicy(abstained="fallback",
                                                       fallback={"team": "billing", "urgent": "no"}))
    resp = await model.adecide("x", {"team": TEAM, "urgent": URGENT})
    for qid, answer in (("team", "billing"), ("urgent", "no")):
        assert (resp.reads[qid].path, resp.reads[qid].cause, resp.reads[qid].answer,
                resp.reads[qid].escalation_model) == ("fallback", "abstained", answer, None)
    assert resp.answers["urgent"].noul == 0.0
    assert esc.prompts == []  # nothing escalated


async def test_a_noul_and_a_score_can_abstain_and_answer_normally():
    rows = PromptRows(by_instructions({"Is it urgent": pick("yes", 0.7), "How severe": pick("major", 0.5)}))
    model = CanvasDecisionModel(engine=rows.engine, policy=ABSTAINS, escalate_to=Big({}).runnable)
    resp = await model.adecide("x", {"urgent": URGENT, "severity": SEVERITY})
    urgent, severity = blocks(rows.systems[0])
    assert urgent.labels == ("A", "B", "C") and urgent.texts[2] == ABSTAIN_LINE
    assert severity.labels == ("1", "2", "3") and severity.texts[2] == ABSTAIN_LINE
    assert resp.answers["urgent"].noul == pytest.approx(0.7 / 0.85)
    assert resp.answers["severity"].probabilities == pytest.approx({0: 1 / 3, 1: 2 / 3})
    assert resp.reads["severity"].path == "canvas"


async def test_only_the_questions_whose_policy_abstains_get_the_label():
    rows = PromptRows(by_instructions({"Which team": pick(ABSTAIN_LINE), "Is it urgent": pick("yes")}))
    policy = GatePolicy(max_normalized_entropy=None, rereads=0, per_question={"team": ABSTAINS})
    model = CanvasDecisionModel(engine=rows.engine, policy=policy,
                                outcomes=OutcomePolicy(abstained="fallback", fallback={"team": "tech"}))
    resp = await model.adecide("x", {"team": TEAM, "urgent": URGENT})
    team, urgent = blocks(rows.systems[0])
    assert len(team.labels) == 3 and urgent.labels == ("yes", "no")
    assert (resp.reads["team"].path, resp.reads["team"].cause) == ("fallback", "abstained")
    assert resp.reads["urgent"].path == "canvas"


async def test_past_the_budget_an_abstained_question_keeps_its_best_real_option_flagged():
    rows = PromptRows(lambda block: [0.15, 0.05, 0.8])
    model = CanvasDecisionModel(engine=rows.engine, policy=ABSTAINS,
                                escalate_to=Target(Big({}).runnable, budget=EscalationBudget(max_per_window=0)))
    report = (await model.adecide("x", {"team": TEAM})).reads["team"]
    assert (report.path, report.answer, report.cause, report.confident) == ("unsure", "billing", "over_budget", False)
    assert report.probabilities == pytest.approx({"billing": 0.75, "tech": 0.25})


async def test_past_the_budget_with_over_budget_raise_an_abstained_question_raises():
    model = CanvasDecisionModel(engine=abstaining().engine, policy=ABSTAINS,
                                escalate_to=Target(Big({}).runnable, budget=EscalationBudget(max_per_window=0)),
                                outcomes=OutcomePolicy(over_budget="raise"))
    with pytest.raises(BudgetExhausted):
        await model.adecide("x", {"team": TEAM})


async def test_an_abstaining_question_needs_somewhere_to_go():
    rows = abstaining()
    with pytest.raises(DecisionError, match="no escalation target"):
        await CanvasDecisionModel(engine=rows.engine, policy=ABSTAINS).adecide("x", {"team": TEAM})
    fallback = OutcomePolicy(abstained="fallback", fallback={"urgent": "no"})
    with pytest.raises(DecisionError, match="no fallback option"):
        await CanvasDecisionModel(engine=rows.engine, policy=ABSTAINS, outcomes=fallback).adecide("x", {"team": TEAM})
    assert rows.engine.calls == 0
    with pytest.raises(ValueError, match="abstained"):
        OutcomePolicy(abstained="keep")  # type: ignore[arg-type]


async def test_abstain_and_depends_on_together_the_child_follows_the_escalated_answer():
    rows = PromptRows(by_instructions({"Which team": pick(ABSTAIN_LINE), "Is it urgent": pick("yes")}))
    esc = Big({"team": "billing"})
    policy = GatePolicy(max_normalized_entropy=None, rereads=0, per_question={"team": ABSTAINS})
    model = CanvasDecisionModel(engine=rows.engine, policy=policy, escalate_to=esc.runnable)
    resp = await model.adecide("x", {"team": TEAM, "urgent": URGENT}, depends_on={"urgent": ("team", "billing")})
    assert (resp.reads["team"].path, resp.reads["team"].cause) == ("escalated", "abstained")
    assert resp.reads["urgent"].path == "canvas"
    assert rows.engine.calls == 2
