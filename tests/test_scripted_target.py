"""`ScriptedTarget`: the escalation target's double, behind a real `CanvasDecisionModel`.

The canvas comes from `FunctionEngine`: unsure (every label 0.5) so every question escalates
through canvasroute's own structured-output path (`with_structured_output(..., include_raw=True)`,
a tool call back), or confident, so none does. The last test escalates from a real canvas on the
vLLM CPU server.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Literal

import pytest
from conftest import fixed_engine
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage
from pydantic import BaseModel, Field, ValidationError

from canvasroute.engine import EscalationError, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, Escalation, GatePolicy, OutcomePolicy
from canvasroute.router.testing import ScriptedTarget

TICKET = "I was charged twice for my subscription, please refund me now!"
TEAM = Choice(instructions="Which team should handle this ticket?",
              criteria={"billing": "payments, refunds", "tech": "bugs, outages"})
URGENT = Noul(instructions="Is the customer asking for urgent help?")
SEVERITY = Score(instructions="How severe is the problem?", criteria=["minor", "major", "critical"])
UNSURE = {label: math.log(0.5) for label in ("A", "B", "C", "yes", "no", "1", "2", "3")}
"""Every slot: its labels at equal odds (normalized entropy 1): over any gate."""


def unsure_model(target: Any, **escalation: Any) -> CanvasDecisionModel:
    """A model that escalates everything to `target` (`escalation`: `Escalation`'s other fields); a
    failed escalation raises (`target_fault="raise"`), so the target's faults are read as they are."""
    return CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                               escalate_to=Escalation(target, **escalation),
                               outcomes=OutcomePolicy(target_fault="raise"))


def test_the_double_sees_the_question_its_options_and_the_canvas_hint_and_its_answer_is_the_escalated_one():
    target = ScriptedTarget(script={"team": "tech"})
    resp = unsure_model(target).decide(TICKET, {"team": TEAM})
    report = resp.reads["team"]
    assert (report.path, report.answer, report.escalation_model) == ("escalated", "tech", "scripted")
    assert report.canvas_probabilities == {"billing": 0.5, "tech": 0.5}
    assert target.calls == 1
    request = target.prompts[0][-1].text
    assert TICKET in request
    assert ('Question "team": Which team should handle this ticket? Options: "billing" (payments, refunds), '
            '"tech" (bugs, outages). Fast model\'s probabilities: {"billing": 0.5, "tech": 0.5}') in request


def test_a_confident_canvas_never_calls_the_double():
    target = ScriptedTarget(script={"team": "tech"})
    model = CanvasDecisionModel(engine=fixed_engine({"A": -0.01, "B": -6.0}), escalate_to=target)
    assert model.decide(TICKET, {"team": TEAM}).reads["team"].path == "canvas"
    assert target.calls == 0 and target.prompts == []


def test_a_scripted_distribution_becomes_the_escalated_answers_distribution():
    target = ScriptedTarget(script={"team": {"billing": 0.7, "tech": 0.3}, "urgent": {"yes": 0.1, "no": 0.9},
                                    "severity": {"0": 0.2, "1": 0.5, "2": 0.3}})
    resp = unsure_model(target).decide(TICKET, {"team": TEAM, "urgent": URGENT, "severity": SEVERITY})
    assert {q: r.answer for q, r in resp.reads.items()} == {"team": "billing", "urgent": "no", "severity": "1"}
    assert resp.reads["team"].probabilities == pytest.approx({"billing": 0.7, "tech": 0.3})
    assert resp.answers["urgent"].noul == pytest.approx(0.1)
    assert resp.answers["severity"].probabilities == pytest.approx({0: 0.2, 1: 0.5, 2: 0.3})
    logprobs = target.invoke("x").response_metadata  # no schema bound: JSON text of the mapping, logprobs beside
    assert logprobs["model_name"] == "scripted" and logprobs["logprobs"]["content"][3]["top_logprobs"][0] == {
        "token": 'billing",', "logprob": pytest.approx(math.log(0.7))}  # the value and what ends it: one token


def test_a_function_script_gets_each_question_id_its_options_and_the_requests_text():
    seen: list[tuple[str, tuple[Any, ...]]] = []

    def script(qid: str, options: tuple[Any, ...], text: str) -> str:
        seen.append((qid, options))
        return options[0] if "refund" in text else options[-1]

    target = ScriptedTarget(script=script)
    resp = unsure_model(target).decide(TICKET, {"team": TEAM, "urgent": URGENT, "severity": SEVERITY})
    assert seen == [("team", ("billing", "tech")), ("urgent", ("yes", "no")), ("severity", ("0", "1", "2"))]
    assert {q: r.answer for q, r in resp.reads.items()} == {"team": "billing", "urgent": "yes", "severity": "0"}
    assert target.calls == 1  # one escalation call answers every unsure question


def test_the_reply_is_a_tool_call_through_with_structured_output_as_from_a_real_chat_model():
    class GradeDocuments(BaseModel):
        """Binary score for relevance check on retrieved documents."""

        binary_score: Literal["yes", "no"] = Field(description="Documents are relevant to the question")

    target = ScriptedTarget(script=lambda qid, options, text: "yes" if "memory" in text else "no")
    grader = target.with_structured_output(GradeDocuments, include_raw=True)
    out = grader.invoke("Document: agents keep a memory. Question: agent memory")
    assert out["parsed"] == GradeDocuments(binary_score="yes") and out["parsing_error"] is None
    raw = out["raw"]
    assert isinstance(raw, AIMessage) and raw.content == '{"binary_score": "yes"}'
    assert raw.tool_calls == [{"name": "GradeDocuments", "args": {"binary_score": "yes"}, "id": "call_0",
                               "type": "tool_call"}]


async def test_a_fault_fails_its_call_only_and_every_call_is_counted():
    target = ScriptedTarget(script={"team": "tech"}, faults=[ConnectionError("target down")])
    model = unsure_model(target)
    with pytest.raises(EscalationError) as caught:
        await model.adecide(TICKET, {"team": TEAM})
    assert caught.value.failure == "network" and "target down" in caught.value.message
    assert (await model.adecide(TICKET, {"team": TEAM})).reads["team"].answer == "tech"
    assert target.calls == 2


async def test_a_malformed_reply_is_asked_again_once_with_the_invalid_reply_shown():
    target = ScriptedTarget(script={"team": "tech"}, faults=["malformed"])
    resp = await unsure_model(target).adecide(TICKET, {"team": TEAM})
    assert resp.reads["team"].answer == "tech" and target.calls == 2
    first, second = target.prompts
    assert second[:len(first)] == first
    assert second[-2].text == "I am not sure which option fits."
    assert second[-1].text.startswith("That reply was invalid (no JSON object")


async def test_two_malformed_replies_are_a_format_failure():
    target = ScriptedTarget(script={"team": "tech"}, faults=["malformed", "malformed"])
    with pytest.raises(EscalationError) as caught:
        await unsure_model(target).adecide(TICKET, {"team": TEAM})
    assert caught.value.failure == "format" and target.calls == 2


async def test_concurrent_escalations_are_each_counted_and_recorded():
    target = ScriptedTarget(script={"team": "tech"})
    model = unsure_model(target)
    tickets = [f"ticket {i}: refund me" for i in range(8)]
    resps = await asyncio.gather(*(model.adecide(t, {"team": TEAM}) for t in tickets))
    assert all(r.reads["team"].path == "escalated" for r in resps) and target.calls == 8
    assert sorted(p[-1].text.split("\n")[1] for p in target.prompts) == sorted(tickets)


def test_text_mode_answers_a_mapping_script_as_json_and_a_function_script_cannot():
    assert unsure_model(ScriptedTarget(script={"team": "tech"}), output="text").decide(
        TICKET, {"team": TEAM}).reads["team"].answer == "tech"
    target = ScriptedTarget(script=lambda qid, options, text: options[0])
    with pytest.raises(EscalationError, match="answers only through structured output"):
        unsure_model(target, output="text").decide(TICKET, {"team": TEAM})


def test_a_question_the_script_has_no_answer_for_fails_the_escalation_by_name():
    with pytest.raises(EscalationError, match="ScriptedTarget has no answer for question 'urgent'"):
        unsure_model(ScriptedTarget(script={"team": "tech"})).decide(TICKET, {"team": TEAM, "urgent": URGENT})


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"script": 5}, "script must be a mapping"),
    ({"script": {}, "faults": ["oops"]}, "a fault is an exception, 'malformed' or None"),
])
def test_a_double_built_wrong_is_refused(kwargs, says):
    with pytest.raises(ValidationError, match=says):
        ScriptedTarget(**kwargs)


@pytest.mark.vllm
async def test_the_double_sees_a_real_canvas_hint_from_the_server(vllm_url):
    target = ScriptedTarget(script={"team": "tech"})
    model = CanvasDecisionModel(engine=VLLMServerEngine(vllm_url), escalate_to=target,
                                policy=GatePolicy(min_margin=1.0, rereads=0))  # a margin no read reaches
    resp = await model.adecide(TICKET, {"team": TEAM})
    report = resp.reads["team"]
    assert (report.path, report.answer, target.calls) == ("escalated", "tech", 1)
    hint = json.dumps({k: round(v, 3) for k, v in report.canvas_probabilities.items()})
    assert f"Fast model's probabilities: {hint}" in target.prompts[0][-1].text
