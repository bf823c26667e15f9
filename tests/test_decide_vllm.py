"""Dependent questions and abstain on the real vLLM server (tiny random DiffusionGemma).

The model is random, so each test first learns what it answers (same seed, same canvas)
and then makes the condition match, or not match, that answer.
"""

from __future__ import annotations

import pytest
from langchain_core.decisions import Choice, Noul

from canvasroute.engine import VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy

pytestmark = pytest.mark.vllm

TEAM = Choice(instructions="Which team owns this ticket?",
              criteria={"billing": "charges, refunds", "technical": "bugs, outages", "sales": "plans"})
URGENT = Noul(instructions="Does the customer need an answer today?")
TICKET = "I was charged twice for my subscription this month."
SURE = GatePolicy(max_normalized_entropy=None, rereads=0)
"""No gate: one read per layer, the canvas argmax answers."""


async def test_the_child_read_follows_the_parent_answer_on_the_server(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    model = CanvasDecisionModel(engine=engine, policy=SURE)
    alone = await model.adecide(TICKET, {"team": TEAM}, seed=11)  # the parent's layer is this canvas
    picked = alone.reads["team"].answer
    others = [o for o in TEAM.criteria if o != picked]

    sent = engine.requests_sent
    asked = await model.adecide(TICKET, {"team": TEAM, "urgent": URGENT}, seed=11,
                                depends_on={"urgent": ("team", picked)})
    assert asked.reads["team"].answer == picked
    assert asked.canvas_reads == 2 and asked.reads["urgent"].path == "canvas"
    assert asked.reads["urgent"].asked_if["parent_answer"] == picked
    assert 0.0 <= asked.answers["urgent"].noul <= 1.0
    read_requests = engine.requests_sent - sent

    sent = engine.requests_sent
    skipped = await model.adecide(TICKET, {"team": TEAM, "urgent": URGENT}, seed=11,
                                  depends_on={"urgent": ("team", others)})
    assert skipped.canvas_reads == 1 and skipped.reads["urgent"].path == "skipped"
    assert "urgent" not in skipped.answers
    assert engine.requests_sent - sent < read_requests  # the second read was never sent
    await engine.aclose()


async def test_abstain_is_one_more_label_on_the_server(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    policy = GatePolicy(max_normalized_entropy=None, rereads=0, abstain=True)
    model = CanvasDecisionModel(engine=engine, policy=policy,
                                outcomes=OutcomePolicy(abstained="fallback",
                                                       fallback={"team": "sales", "urgent": "no"}))
    resp = await model.adecide(TICKET, {"team": TEAM, "urgent": URGENT}, seed=3)
    for qid, q_options in (("team", list(TEAM.criteria)), ("urgent", ["yes", "no"])):
        report = resp.reads[qid]
        canvas = report.canvas_probabilities
        assert list(canvas) == [*q_options, "(abstain)"] and len(report.labels) == len(q_options) + 1
        assert sum(canvas.values()) == pytest.approx(1.0)
        won = max(canvas, key=canvas.__getitem__)
        if won == "(abstain)":
            assert (report.path, report.cause, report.answer) == ("fallback", "abstained", model.outcomes.fallback[qid])
        else:
            assert report.path == "canvas" and report.answer == won
            assert sum(report.probabilities.values()) == pytest.approx(1.0)
            assert report.probabilities[won] == pytest.approx(canvas[won] / (1 - canvas["(abstain)"]))
    await engine.aclose()
