"""CanvasDecisionModel's contract: per-chunk re-reads, hashable policies, one question
validator, no per-request mutation, LangChain method names, LangSmith usage via public hooks."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from langchain_core.decisions import Box, Choice, Noul

from canvasroute import router
from canvasroute.engine import DecisionError, FunctionEngine, UnsupportedQuestion
from canvasroute.router import (
    CanvasDecisionModel,
    EscalationBudget,
    GatePolicy,
    SystemOneDecisionModel,
    validate_questions,
)
from canvasroute.router.systemone import _wire_questions

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Urgent?")


def uncertain(read):
    return [{i: math.log(0.5) for i in read.label_ids}] * len(read.slots)


async def test_rereads_are_per_chunk():
    # a canvas of 12 tokens holds one question: two chunks; `team` asks 1 re-read, `urgent` 3
    engine = FunctionEngine(uncertain, canvas_width=12)
    policy = GatePolicy(rereads=3, per_question={"team": GatePolicy(rereads=1)})
    resp = await CanvasDecisionModel(engine=engine, policy=policy).adecide("x", {"team": TEAM, "urgent": URGENT})
    per_chunk: dict[str, int] = {}
    for read in engine.reads:
        per_chunk[read.messages[0]["content"]] = per_chunk.get(read.messages[0]["content"], 0) + 1
    # 1 + 1 re-read, 1 + 3 re-reads (not 1 + 3 for both)
    assert len(per_chunk) == 2 and sorted(per_chunk.values()) == [2, 4]
    assert resp.canvas_reads == 6 and engine.calls == 2
    assert (resp.reads["team"].reads, resp.reads["urgent"].reads) == (2, 4)


def test_policies_hash_and_use_slots():
    policy = GatePolicy(per_question={"team": GatePolicy(min_margin=0.3)})
    same = GatePolicy(per_question={"team": GatePolicy(min_margin=0.3)})
    assert hash(policy) == hash(same) and policy == same and {policy: 1}[same] == 1
    assert hash(EscalationBudget(max_per_window=3)) == hash(EscalationBudget(max_per_window=3))
    for p in (policy, EscalationBudget()):
        assert not hasattr(p, "__dict__")
    with pytest.raises(TypeError):
        policy.per_question["other"] = GatePolicy()  # type: ignore[index]
    assert policy.for_question("team").min_margin == 0.3


async def test_a_decision_does_not_mutate_the_model():
    engine = FunctionEngine(uncertain, model="served-name")
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    resp = await model.adecide("x", {"team": TEAM})
    assert resp.model == "served-name" and model.model == "canvas"


def test_sync_decide_and_async_adecide_on_both_decision_models():
    for cls in (CanvasDecisionModel, SystemOneDecisionModel):
        assert not _is_coroutine(cls.decide) and _is_coroutine(cls.adecide)
    resp = CanvasDecisionModel(engine=FunctionEngine(uncertain), policy=GatePolicy(rereads=0)).decide(
        "x", {"team": TEAM}, seed=3)
    assert resp.reads["team"].answer in ("billing", "tech")


def _is_coroutine(fn) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def test_router_imports_nothing_private_from_langchain_core():
    for path in Path(router.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"from langchain_core[\w.]* import[^\n]*\b_\w", text), path
        assert not re.search(r"langchain_core(\.\w+)*\._", text), path


@pytest.mark.parametrize("invoke", ["sync", "async"])
async def test_usage_reaches_langsmith_through_the_public_hooks_with_request_keys(monkeypatch, invoke):
    import langchain_core.decisions.base as base

    class Run:
        def __init__(self) -> None:
            self.extra: dict[str, object] = {}

    run = Run()
    monkeypatch.setattr(base, "get_current_run_tree", lambda: run)

    engine = FunctionEngine(uncertain)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    request = {"state": "x", "questions": {"team": TEAM}, "seed": 11, "attributes": {"node": "n"}}
    resp = model.invoke(request) if invoke == "sync" else await model.ainvoke(request)
    assert run.extra["metadata"]["usage_metadata"] == dict(resp.usage)
    assert engine.reads[0].canvas == await _first_canvas(seed=11)  # the request's seed reached the read
    with pytest.raises(DecisionError, match="decision request"):
        await model.ainvoke({"questions": {"team": TEAM}})


async def _first_canvas(seed: int):
    engine = FunctionEngine(uncertain)
    await CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)).adecide("x", {"team": TEAM}, seed=seed)
    return engine.reads[0].canvas


def test_one_question_validator_for_model_client_and_server():
    raw = {"team": {"type": "choice", "instructions": "?", "criteria": {"a": None, "b": None}},
           "where": Box(instructions="find the cat")}
    with pytest.raises(UnsupportedQuestion, match="Box"):
        validate_questions(raw)
    ok = validate_questions(raw, allow_box=True)
    assert isinstance(ok["team"], Choice) and isinstance(ok["where"], Box)
    assert set(_wire_questions(raw)) == {"team", "where"}  # the client uses the same validator
    for bad, error in [({}, DecisionError), ([("a", TEAM)], DecisionError), ({" ": TEAM}, UnsupportedQuestion),
                       ({"x": {"type": "poll"}}, UnsupportedQuestion)]:
        with pytest.raises(error):
            validate_questions(bad)
        with pytest.raises(error):
            _wire_questions(bad)
        with pytest.raises(error):
            router.parse_questions(bad)


# -- model_copy ------------------------------------------------------------------------------------


async def test_a_model_copy_gates_and_escalates_with_its_new_settings_and_counts_its_own_budget():
    """Issue 40.1: `model_copy(update=...)` reported the new policy and target but gated and escalated
    with the old ones, through the original's budget meter and controller state. A copy is the model
    its fields build: validated, derived again, with its own in-process meter and controller state."""
    from canvasroute.router import Controller, Escalation
    from canvasroute.router.testing import ScriptedTarget

    old, new = ScriptedTarget(script={"team": "billing"}), ScriptedTarget(script={"team": "tech"})
    original = CanvasDecisionModel(engine=FunctionEngine(uncertain), policy=GatePolicy(rereads=0),
                                   escalate_to=Escalation(old, budget=EscalationBudget(max_per_window=1),
                                                          controller=Controller(target=0.2)))
    assert (await original.adecide("spent", {"team": TEAM})).reads["team"].path == "escalated"
    lenient = original.model_copy(update={"policy": GatePolicy(max_normalized_entropy=1.0, rereads=0)})
    report = (await lenient.adecide("x", {"team": TEAM})).reads["team"]
    assert (report.path, report.gate) == ("canvas", "H/lnK <= 1"), "gated with the copy's policy"
    elsewhere = original.model_copy(update={"escalate_to": new})  # a bare target, wrapped as the constructor does
    assert isinstance(elsewhere.escalate_to, Escalation) and elsewhere.escalation.target is new
    report = (await elsewhere.adecide("y", {"team": TEAM})).reads["team"]
    assert (report.path, report.answer, old.calls, new.calls) == ("escalated", "tech", 1, 1)
    same = original.model_copy(update={"model": "canvas-b"})  # the same escalation: its own meter and state
    report = (await same.adecide("z", {"team": TEAM})).reads["team"]
    assert report.path == "escalated", "not the original's spent budget"
    assert original.budget_counters["granted"] == same.budget_counters["granted"] == 1
    assert same.escalation.meter is not original.escalation.meter
    assert same.controller_counters["questions"]["team"]["decisions"] == 1
    assert original.controller_counters["questions"]["team"]["decisions"] == 1
    shared = original.model_copy(update={"escalate_to": original.escalation})  # said so: the original's own
    assert shared.escalation.meter is original.escalation.meter and shared.budget_scope is None
    with pytest.raises(ValueError, match="escalate_to"):
        original.model_copy(update={"escalate_to": 42})
    assert original.model_copy(update={"read": {"constrained": False}}).read.constrained is False
    assert original.model_copy().model_fields_set == original.model_fields_set
