"""Escalation budgets are exact: refused or failed escalations spend nothing, under concurrency."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest
from langchain_core.decisions import Choice, Noul
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda

from canvasroute.engine import BudgetExhausted, EscalationError, FunctionEngine
from canvasroute.router import (
    BudgetMeter,
    CanvasDecisionModel,
    Escalation,
    EscalationBudget,
    GatePolicy,
    InMemoryBudgetMeter,
    OutcomePolicy,
)

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Urgent?")


def uncertain_engine() -> FunctionEngine:
    """Every slot reads 50/50 over its labels: every question wants to escalate."""
    def rows(read):
        return [{i: math.log(0.5) for i in read.label_ids}] * len(read.slots)
    return FunctionEngine(rows)


class Target:
    """A fake escalation target: answers from the options, fails for states holding 'fail'."""

    def __init__(self) -> None:
        self.escalated: list[str] = []
        self.runnable = RunnableLambda(self._reply, name="target")

    async def _reply(self, messages):
        await asyncio.sleep(0)  # let the 64 decisions interleave
        text = messages[-1].content
        if "fail" in text:
            raise RuntimeError("target down")
        asked = re.findall(r'^Question "([^"]+)"', text, re.MULTILINE)
        self.escalated += asked
        return AIMessage(json.dumps({q: {"team": "tech", "urgent": "yes"}[q] for q in asked}))


def model(target: Target, over_budget: str, **budget) -> CanvasDecisionModel:
    """A failed escalation raises (`target_fault="raise"`): what these tests count is what it spent."""
    return CanvasDecisionModel(engine=uncertain_engine(), policy=GatePolicy(rereads=0),
                               escalate_to=Escalation(target.runnable, budget=EscalationBudget(**budget)),
                               outcomes=OutcomePolicy(over_budget=over_budget, target_fault="raise",
                                                      fallback={"team": "billing", "urgent": "no"}))


async def test_64_concurrent_decisions_keep_exact_counts():
    target = Target()
    m = model(target, "answer", max_per_window=20, window_s=3600)
    results = await asyncio.gather(*(m.adecide(f"ticket {i}", {"team": TEAM}) for i in range(64)))
    paths = [r.reads["team"].path for r in results]
    assert paths.count("escalated") == 20 and paths.count("unsure") == 44
    assert sum(r.reads["team"].cause == "over_budget" for r in results) == 44
    assert len(target.escalated) == 20
    assert m.budget_counters == {"granted": 20, "refused": 44, "refunded": 0, "in_window": 20}


async def test_64_concurrent_decisions_with_raises_and_failures_spend_only_what_escalated():
    # half the calls ask two questions, some escalations fail, `raise` refuses the rest:
    # whatever raised was refunded, so the window holds exactly what the target answered
    target = Target()
    m = model(target, "raise", max_per_window=30, window_s=3600, max_per_thread=6)

    async def one(i: int):
        questions = {"team": TEAM, "urgent": URGENT} if i % 2 else {"team": TEAM}
        state = f"ticket {i}" + (" fail" if i % 9 == 0 else "")
        try:
            return await m.adecide(state, questions, thread_id=f"t{i % 8}")
        except (BudgetExhausted, EscalationError) as exc:
            return exc

    results = await asyncio.gather(*(one(i) for i in range(64)))
    answered = [r for r in results if not isinstance(r, Exception)]
    failed = [r for r in results if isinstance(r, EscalationError)]
    refused = [r for r in results if isinstance(r, BudgetExhausted)]
    assert failed and refused and answered and len(answered) + len(failed) + len(refused) == 64
    counters = m.budget_counters
    escalated = sum(len(r.reads) for r in answered)
    assert escalated == len(target.escalated) == counters["granted"] == counters["in_window"] <= 30
    asked = sum(2 if i % 2 else 1 for i in range(64))
    assert counters["granted"] + counters["refused"] + counters["refunded"] == asked
    # the budget is full only if nothing more fits: a refused 1-question call means < 1 left
    # for its thread or the window at that moment; afterwards a fresh thread still gets what is left
    left = 30 - counters["granted"]
    late = [await m.adecide(f"late {i}", {"team": TEAM}, thread_id=f"late{i}") for i in range(left)]
    assert all(r.reads["team"].path == "escalated" for r in late)
    with pytest.raises(BudgetExhausted):
        await m.adecide("one too many", {"team": TEAM}, thread_id="fresh")


async def test_a_raised_refusal_spends_no_budget():
    # 3 left, a 2-question call gets 2... then a 2-question call gets 1 of 2 and raises:
    # its grant is refunded, so a later 1-question call still escalates
    target = Target()
    m = model(target, "raise", max_per_window=3, window_s=3600)
    await m.adecide("first", {"team": TEAM, "urgent": URGENT})
    with pytest.raises(BudgetExhausted):
        await m.adecide("second", {"team": TEAM, "urgent": URGENT})
    assert m.budget_counters == {"granted": 2, "refused": 1, "refunded": 1, "in_window": 2}
    assert (await m.adecide("third", {"team": TEAM})).reads["team"].path == "escalated"
    assert m.budget_counters["in_window"] == 3 and len(target.escalated) == 3


async def test_a_failed_escalation_is_refunded():
    target = Target()
    m = model(target, "answer", max_per_window=1, window_s=3600)
    with pytest.raises(EscalationError):
        await m.adecide("please fail", {"team": TEAM})
    assert m.budget_counters == {"granted": 0, "refused": 0, "refunded": 1, "in_window": 0}
    assert (await m.adecide("fine", {"team": TEAM})).reads["team"].path == "escalated"


async def test_a_custom_meter_plugs_in():
    class Ledger:
        """A meter backed by something else (here a dict standing in for a store)."""

        def __init__(self) -> None:
            self.log: list[tuple[str, int, str | None]] = []

        async def take(self, n, thread):
            self.log.append(("take", n, thread))
            return min(n, 1)

        async def refund(self, n, thread):
            self.log.append(("refund", n, thread))

        def snapshot(self):
            return {"granted": sum(n for op, n, _ in self.log if op == "take"), "refused": 0}

    ledger = Ledger()
    assert isinstance(ledger, BudgetMeter) and isinstance(InMemoryBudgetMeter(EscalationBudget()), BudgetMeter)
    m = CanvasDecisionModel(engine=uncertain_engine(), policy=GatePolicy(rereads=0),
                            escalate_to=Escalation(Target().runnable, budget=EscalationBudget(), meter=ledger),
                            outcomes=OutcomePolicy(over_budget="raise"))
    with pytest.raises(BudgetExhausted):
        await m.adecide("x", {"team": TEAM, "urgent": URGENT}, thread_id="t")
    assert ledger.log == [("take", 2, "t"), ("refund", 1, "t")]
    with pytest.raises(ValueError, match="BudgetMeter"):
        CanvasDecisionModel(engine=uncertain_engine(),
                            escalate_to=Escalation(Target().runnable, budget=EscalationBudget(), meter=object()))
    with pytest.raises(ValueError, match="needs budget"):
        Escalation(Target().runnable, meter=ledger)


async def test_a_meter_for_one_request_counts_that_decision_only():
    """`request.metered(meter)` (what a decision node does with a graph store) counts that
    decision against the model's budget; the model's own meter is left untouched."""
    shared = InMemoryBudgetMeter(EscalationBudget(max_per_window=1, window_s=3600))
    m = model(Target(), "answer", max_per_window=5, window_s=3600)
    first = await m.arun(m.request("one", {"team": TEAM}).metered(shared))
    second = await m.arun(m.request("two", {"team": TEAM}).metered(shared))
    assert first.reads["team"].path == "escalated" and second.reads["team"].cause == "over_budget"
    assert shared.snapshot()["granted"] == 1 and m.budget_counters["granted"] == 0
    plain = CanvasDecisionModel(engine=uncertain_engine(), policy=GatePolicy(rereads=0))
    request = plain.request("x", {"team": TEAM})
    assert request.metered(shared) is request  # no budget: nothing to count
