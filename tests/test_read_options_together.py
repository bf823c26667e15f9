"""The read options beside the features they meet: the decision cache, engine faults and
escalation, budgets, many options, order views, dependent questions (FunctionEngine: each
test counts what was read; the options themselves run on the real server in test_read_options).
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import fixed_engine
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage

from canvasroute.engine import EngineUnavailable, FunctionEngine
from canvasroute.router import (
    CanvasDecisionModel,
    DecisionCache,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
)

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Is it urgent?")
QUESTIONS = {"team": TEAM, "urgent": URGENT}
SURE = {"A": -0.05, "B": -4.0, "yes": -0.05, "no": -4.0}
UNSURE = {"A": math.log(0.5), "B": math.log(0.5), "yes": math.log(0.5), "no": math.log(0.5)}


def test_the_cache_tells_every_read_option_apart():
    engine = fixed_engine(SURE)
    model = CanvasDecisionModel(engine=engine, cache=DecisionCache())
    variants = [{}, {"read": {"instructions": "EU customers"}}, {"read": {"alone": {"team"}}}, {"read": {"steps": 2}},
                {"gate": GatePolicy(samples=3)}, {"depends_on": {"urgent": {"team": None}}},
                {"read": {"images": ["data:image/png;base64,AAAA"]}}]
    for options in variants:
        if "images" in options.get("read", {}):
            continue  # FunctionEngine reads text only (images: test_images.py)
        model.decide("Refund me", QUESTIONS, **options)
    reads = len(engine.reads)
    for options in variants[:-1]:
        again = model.decide("Refund me", QUESTIONS, **options)
        assert again.canvas_reads == 0 and again.diagnostics is not None  # each one a hit of its own entry
    assert len(engine.reads) == reads and model.cache.hits == len(variants) - 1


async def test_a_fault_during_fixed_samples_escalates_every_question_it_hit():
    calls = []

    def rows(read):
        calls.append(read)
        if len(calls) % 3 == 2:  # the second of three samples
            raise EngineUnavailable("vLLM went away")
        return [dict.fromkeys(read.label_ids, -1.0)] * len(read.slots)

    target = GenericFakeChatModel(messages=iter([AIMessage(json.dumps({"team": "tech", "urgent": "no"}))]))
    model = CanvasDecisionModel(engine=FunctionEngine(rows), escalate_to=target)
    resp = await model.adecide("Refund me", QUESTIONS, gate=GatePolicy(samples=3, rereads=0))
    assert len(calls) == 2  # the samples go out in one engine call; the fault ends it
    for r in resp.reads.values():
        assert r.path == "escalated" and "vLLM went away" in r.error
    assert resp.answers["team"].choice == "tech"
    with pytest.raises(EngineUnavailable):
        await CanvasDecisionModel(engine=FunctionEngine(rows), outcomes=OutcomePolicy(engine_fault="raise")).adecide(
            "Refund me", QUESTIONS, gate=GatePolicy(samples=3))


async def test_samples_spend_no_budget_and_the_gate_still_escalates_after_them():
    target = GenericFakeChatModel(messages=iter([AIMessage(json.dumps({"team": "billing", "urgent": "yes"}))] * 2))
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE),
                                escalate_to=Escalation(target, budget=EscalationBudget(max_per_window=2)))
    resp = await model.adecide("Refund me", QUESTIONS, gate=GatePolicy(samples=4, rereads=0))
    assert resp.canvas_reads == 4 and {r.reads for r in resp.reads.values()} == {4}
    assert {r.path for r in resp.reads.values()} == {"escalated"}  # uncertain after its 4 samples
    assert model.budget_counters["granted"] == 2  # one per escalated question, not per read


async def test_samples_with_a_question_read_in_two_steps_and_with_order_views():
    big = Choice(instructions="Which topic?", criteria={f"t{i}": None for i in range(200)})  # > 128 label ids
    engine = FunctionEngine(lambda read: [dict.fromkeys(read.label_ids, -1.0)] * len(read.slots), canvas_width=64)
    routed = await CanvasDecisionModel(engine=engine, read={"constrained": False}).adecide(
        "x", {"topic": big}, gate=GatePolicy(samples=3, rereads=0))
    assert routed.reads["topic"].reads == 3 + 1  # the group slot read 3 times, the option in it once
    viewed = await CanvasDecisionModel(engine=engine).adecide(
        "x", {"team": Choice(instructions="Which?", criteria={"a": None, "b": None, "c": None})},
        gate=GatePolicy(samples=2, rereads=0, order_views=1))
    assert viewed.canvas_reads == 2 and viewed.reads["team"].reads == 2  # views share each read's canvas


async def test_a_child_reads_its_parents_final_answer_escalated_or_not():
    """The restated answer is the parent's final one: after an escalation, the escalation's."""
    target = GenericFakeChatModel(messages=iter([AIMessage(json.dumps({"team": "tech"})),
                                                 AIMessage(json.dumps({"why": "no"}))]))
    engine = fixed_engine(UNSURE)
    model = CanvasDecisionModel(engine=engine, escalate_to=target, policy=GatePolicy(rereads=0))
    why = Noul(instructions="Is the customer angry?")
    resp = await model.adecide("Refund me", {"team": TEAM, "why": why}, depends_on={"why": {"team": None}},
                               read={"instructions": "EU customers", "alone": {"why"}, "steps": 2})
    assert resp.reads["team"].path == "escalated" and resp.reads["team"].answer == "tech"
    child = engine.reads[-1]
    assert child.messages[1]["content"].endswith("Earlier answers about this input:\n- Which team?: tech")
    assert child.messages[0]["content"].startswith("EU customers\n\n") and child.steps == 2
    assert resp.diagnostics.stages == [["team"], ["why"]] and resp.diagnostics.chunks == [["team"], ["why"]]
