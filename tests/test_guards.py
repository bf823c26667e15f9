"""Defaults that protect (issue #39 point 5): the escalation's guards and the warning for no target.

- An engine outage cannot multiply the target's traffic without bound: engine faults escalate at
  most `Breaker.fault_escalations` questions per window (30 per 30 s by default); past it an engine
  fault is over budget (`BudgetExhausted`, or its fallback), never a cheap answer.
- A target outage does not fail every decision that needed it: a failed escalation answers from
  the canvas (cause `target_fault`, path `unsure`, the target's fault in `escalation_error`) by
  default, and after `Breaker.failures` failures in a row the target is not called until a probe
  answers (half open after `cooldown_s`).
- A model with no target and `uncertain="escalate"` warns once that its answers route `unsure`.

Each state change is logged once, marked on the decide span and counted; each short circuit is
marked and counted. The combinations: budget, hedge, controller, review, both caches, fan-out with
`Send`, both wires of `serve`, and `canvasroute serve --escalate-systemone` with its target killed
mid-load (real processes, the loopback vLLM-wire server as their engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import httpx
import pytest
from conftest import fixed_engine
from deadlines import Watch, patience, until, wait, wait_until
from langchain_core.decisions import Noul
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send
from prometheus_client.parser import text_string_to_metric_families
from services import child_env
from typing_extensions import TypedDict

from canvasroute.apps.observability.page import render
from canvasroute.apps.observability.report import build_report
from canvasroute.apps.observability.traces import span_record
from canvasroute.apps.server import create_app, run_in_thread
from canvasroute.engine import (
    BreakerOpen,
    BudgetExhausted,
    Connection,
    EngineUnavailable,
    EscalationError,
    FunctionEngine,
)
from canvasroute.engine.testing import spawn
from canvasroute.harness import NodeCache, ReviewPolicy, decision_node, merge_decisions
from canvasroute.router import (
    Breaker,
    CanvasDecisionModel,
    Controller,
    DecisionCache,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    SystemOneDecisionModel,
)
from canvasroute.router import telemetry as tm
from canvasroute.router.testing import ScriptedTarget

URGENT = Noul(instructions="Does the customer need an answer today?")
ONE = {"urgent": URGENT}
UNSURE = {"yes": -0.69, "no": -0.70}
"""A toss-up: over the gate, so it escalates."""
GATE = GatePolicy(max_normalized_entropy=0.5, rereads=0)
TICKET = "I was charged twice and need the refund today."
DOWN = ConnectionError("the big model is down")


def dead(n: int = 1000, **kwargs: Any) -> ScriptedTarget:
    """A target whose first `n` calls fail as an unreachable server does."""
    return ScriptedTarget(script={"urgent": "yes"}, faults=[DOWN] * n, **kwargs)


def unsure_model(target: Any, *, engine: Any = None, **options: Any) -> CanvasDecisionModel:
    """A model whose every question escalates to `target` (`options`: the model's other fields)."""
    return CanvasDecisionModel(engine=engine or fixed_engine(UNSURE), policy=options.pop("policy", GATE),
                               escalate_to=target, **options)


def engine_down() -> FunctionEngine:
    def read(_: Any) -> Any:
        raise EngineUnavailable("connection refused", hint="is the server running at this URL?")
    return FunctionEngine(read)


async def outcomes(model: CanvasDecisionModel, n: int, questions: dict[str, Any] = ONE) -> list[Any]:
    """`n` decisions one after another (distinct states): each report, or the error it raised."""
    out: list[Any] = []
    for i in range(n):
        try:
            out.append((await model.adecide(f"ticket {i}: {TICKET}", questions)).reads["urgent"])
        except Exception as exc:  # noqa: BLE001 - what a decision ended with is the point
            out.append(exc)
    return out


@pytest.fixture
def points(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, dict[str, Any]], int]]:
    """`points(metric, attributes)`: the sum of a counter's points whose attributes include these,
    from a real SDK meter provider of this test's own."""
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from canvasroute.router.telemetry import _spans

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    monkeypatch.setattr(metrics, "get_meter_provider", lambda: provider)
    monkeypatch.delitem(_spans._cache, "meter", raising=False)

    def read(name: str, match: dict[str, Any]) -> int:
        data = reader.get_metrics_data()
        return sum(p.value for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
                   for m in sm.metrics if m.name == name for p in m.data.data_points
                   if match.items() <= dict(p.attributes).items())

    yield read
    _spans._cache.pop("meter", None)


def guard_events(spans: Any) -> list[tuple[str, str]]:
    """(guard, what) of every `canvasroute.guard` event on the decide spans, in order."""
    return [(e.attributes[tm.GUARD], e.attributes[tm.GUARD_WHAT]) for s in spans.get_finished_spans()
            if s.name.startswith("decide ") for e in s.events if e.name == tm.GUARD_EVENT]


def said(caplog: pytest.LogCaptureFixture, text: str) -> int:
    """WARNING lines of canvasroute.router that hold `text`."""
    return sum(text in r.getMessage() for r in caplog.records
               if r.name == "canvasroute.router" and r.levelno == logging.WARNING)


# -- the values -----------------------------------------------------------------------------


def test_the_guards_are_on_by_default_and_say_what_is_wrong():
    escalation = Escalation(ScriptedTarget(script={}))
    assert escalation.breaker == Breaker(failures=5, window_s=30.0, cooldown_s=30.0, fault_escalations=30)
    assert OutcomePolicy().target_fault == "answer"
    for bad, says in [({"failures": 0}, "Breaker.failures must be an integer >= 1"),
                      ({"cooldown_s": 0}, "Breaker.cooldown_s must be a positive number"),
                      ({"window_s": float("inf")}, "Breaker.window_s must be a positive number"),
                      ({"fault_escalations": -1}, "Breaker.fault_escalations must be an integer >= 0"),
                      ({"failures": True}, "Breaker.failures")]:
        with pytest.raises(ValueError, match=says):
            Breaker(**bad)
    with pytest.raises(ValueError, match=r"OutcomePolicy\.target_fault must be one of answer, fallback, raise"):
        OutcomePolicy(target_fault="escalate")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Escalation\.breaker must be a Breaker"):
        Escalation(ScriptedTarget(script={}), breaker={"failures": 3})
    with pytest.raises(ValueError, match="breaker_state needs breaker="):
        Escalation(ScriptedTarget(script={}), breaker=None, breaker_state=object())
    with pytest.raises(Exception, match="question 'urgent' may take a fallback \\(target_fault='fallback'\\)"):
        unsure_model(dead(), outcomes=OutcomePolicy(target_fault="fallback", fallback={"other": "x"})).decide(
            TICKET, ONE)


# -- an engine outage: capped ---------------------------------------------------------------


async def test_an_engine_outage_sends_the_target_at_most_the_default_cap(caplog, spans, points):
    """Today an outage sent every decision to the large model. By default 30 engine faults escalate
    per 30 s; the rest raise `BudgetExhausted` naming the cap and what to do, never a cheap answer."""
    target = ScriptedTarget(script={"urgent": "no"})
    model = unsure_model(target, engine=engine_down())
    with caplog.at_level(logging.WARNING, logger="canvasroute.router"):
        ended = await outcomes(model, 40)
    assert [getattr(r, "path", None) for r in ended[:30]] == ["escalated"] * 30 and target.calls == 30
    past = ended[30:]
    assert all(isinstance(e, BudgetExhausted) for e in past), past
    assert "engine faults' escalations are capped at 30 per 30 s" in past[0].message
    assert "EngineUnavailable: connection refused" in past[0].message
    assert "fault_escalations" in past[0].hint and isinstance(past[0].__cause__, EngineUnavailable)
    assert said(caplog, "engine faults' escalations to scripted capped") == 1  # once, not per decision
    assert guard_events(spans).count(("fault_cap", "capped")) == 1
    assert guard_events(spans).count(("fault_cap", "refused")) == 10
    assert points("canvasroute.guards", {tm.GUARD: "fault_cap", tm.GUARD_WHAT: "refused"}) == 10
    assert points("canvasroute.guards", {tm.GUARD: "fault_cap", tm.GUARD_WHAT: "capped"}) == 1
    snap = model.breaker_counters
    assert (snap["fault_escalations"], snap["fault_refused"], snap["fault_cap"]) == (30, 10, 30)
    assert snap["state"] == "closed"  # the engine's faults are no failures of the target


async def test_past_the_cap_an_engine_fault_takes_its_fallback_marked_and_the_window_frees_up(caplog, spans):
    target = ScriptedTarget(script={"urgent": "no"})
    model = unsure_model(Escalation(target, breaker=Breaker(fault_escalations=2, window_s=0.3)), engine=engine_down(),
                         outcomes=OutcomePolicy(over_budget="fallback", fallback={"urgent": "yes"}))
    with caplog.at_level(logging.WARNING, logger="canvasroute.router"):
        ended = await outcomes(model, 4)
        assert [(r.path, r.cause) for r in ended] == [("escalated", "engine_fault")] * 2 + [
            ("fallback", "over_budget")] * 2
        assert all(r.error.startswith("EngineUnavailable") for r in ended) and target.calls == 2
        await asyncio.sleep(0.35)  # the window has room again: engine faults escalate
        assert (await model.adecide("later", ONE)).reads["urgent"].path == "escalated"
    assert said(caplog, "capped") == 1 and said(caplog, "escalate to scripted again") == 1
    assert [w for g, w in guard_events(spans) if g == "fault_cap"] == ["capped", "refused", "refused", "uncapped"]


async def test_the_cap_counts_engine_faults_only_and_spends_no_budget_on_what_it_refuses():
    """Two questions, the engine failing for both: with a cap of 1, one escalates; the other is over
    budget (its fallback). The budget saw one grant; a failed escalation gives both grants back."""
    questions = {"urgent": URGENT, "refund": Noul(instructions="Refund?")}
    target = ScriptedTarget(script={"urgent": "no", "refund": "yes"})
    model = unsure_model(Escalation(target, budget=EscalationBudget(max_per_window=10),
                                    breaker=Breaker(fault_escalations=1)), engine=engine_down(),
                         outcomes=OutcomePolicy(over_budget="fallback", fallback={"urgent": "yes", "refund": "no"}))
    resp = await model.adecide(TICKET, questions)
    assert sorted(r.path for r in resp.reads.values()) == ["escalated", "fallback"]
    assert model.budget_counters["granted"] == 1 and model.breaker_counters["fault_refused"] == 1
    failing = unsure_model(Escalation(dead(), budget=EscalationBudget(max_per_window=10),
                                      breaker=Breaker(fault_escalations=5)), engine=engine_down())
    with pytest.raises(EscalationError, match="after the canvas engine failed: EngineUnavailable"):
        await failing.adecide(TICKET, ONE)  # an engine fault whose escalation failed: never an answer
    assert failing.budget_counters["granted"] == 0 and failing.breaker_counters["fault_escalations"] == 0


# -- a target outage: degraded, and a breaker ---------------------------------------------------


async def test_a_dead_target_degrades_to_the_canvas_answer_and_is_not_called_on_every_decision():
    """The default: each decision answers (path unsure, cause target_fault, the fault named); after
    5 failures the breaker opens and the next decisions do not call the target."""
    target = dead()
    ended = await outcomes(unsure_model(target), 8)
    assert all(getattr(r, "path", None) == "unsure" and r.cause == "target_fault" for r in ended), ended
    assert target.calls == 5  # the breaker opened after the fifth failure
    assert [r.escalation_error.split(":")[0] for r in ended] == ["EscalationError"] * 5 + ["BreakerOpen"] * 3
    assert "the big model is down" in ended[0].escalation_error and not ended[0].confident
    assert "circuit breaker of escalation target scripted is open" in ended[-1].escalation_error
    assert ended[0].answer in ("yes", "no") and ended[0].probabilities == pytest.approx(
        ended[0].canvas_probabilities)  # the canvas's own answer


async def test_the_breaker_opens_half_opens_and_recovers_each_change_said_once(caplog, spans, points):
    target = dead(4)  # down for 4 calls, then up
    model = unsure_model(Escalation(target, breaker=Breaker(failures=3, cooldown_s=0.2)))
    with caplog.at_level(logging.WARNING, logger="canvasroute.router"):
        first = await outcomes(model, 6)  # 3 failures open it; 3 short circuits
        assert target.calls == 3 and model.breaker_counters["state"] == "open"
        await asyncio.sleep(0.25)
        probe = await outcomes(model, 2)  # the probe fails (call 4): open again; the next is kept off
        assert target.calls == 4 and [r.escalation_error.split(":")[0] for r in probe] == [
            "EscalationError", "BreakerOpen"]
        await asyncio.sleep(0.25)
        recovered = await outcomes(model, 3)  # the probe answers: closed; every later decision escalates
    assert [r.path for r in recovered] == ["escalated"] * 3 and target.calls == 7
    assert [r.escalation_error.split(":")[0] for r in first] == ["EscalationError"] * 3 + ["BreakerOpen"] * 3
    assert said(caplog, "circuit breaker open after 3 failed calls") == 1
    assert said(caplog, "circuit breaker open after the probe failed") == 1
    assert said(caplog, "half open") == 2 and said(caplog, "answered again: circuit breaker closed") == 1
    assert said(caplog, "escalation to scripted failed for question(s)") == 4  # each failed call, no short circuit
    assert [w for g, w in guard_events(spans) if g == "breaker"] == [
        "open", "short_circuit", "short_circuit", "short_circuit", "half_open", "open", "short_circuit",
        "half_open", "closed"]
    assert points("canvasroute.guards", {tm.GUARD: "breaker", tm.GUARD_WHAT: "short_circuit"}) == 4
    assert points("canvasroute.guards", {tm.GUARD: "breaker", tm.GUARD_WHAT: "open"}) == 2
    assert points("canvasroute.faults", {tm.ERROR_TYPE: "EscalationError", tm.METRIC_PATH: "unsure"}) == 4
    assert points("canvasroute.faults", {tm.ERROR_TYPE: "BreakerOpen", tm.METRIC_PATH: "unsure"}) == 4
    assert points("canvasroute.decisions", {tm.METRIC_CAUSE: "target_fault", tm.METRIC_PATH: "unsure"}) == 8
    assert model.breaker_counters == {"state": "closed", "open": 2, "half_open": 2, "closed": 1,
                                      "short_circuits": 4, "failures": 4, "fault_refused": 0, "capped": 0,
                                      "uncapped": 0, "fault_cap": 30, "fault_escalations": 0}


async def test_while_a_probe_is_in_flight_the_other_decisions_are_kept_off_the_target():
    release = asyncio.Event()
    target = ScriptedTarget(script={"urgent": "yes"}, faults=[DOWN], hold=lambda call: release.wait())
    model = unsure_model(Escalation(target, breaker=Breaker(failures=1, cooldown_s=0.05)))
    first = asyncio.create_task(model.adecide("first", ONE))
    await asyncio.sleep(0.05)
    release.set()
    assert (await first).reads["urgent"].cause == "target_fault" and model.breaker_counters["state"] == "open"
    release.clear()
    await asyncio.sleep(0.06)
    probe = asyncio.create_task(model.adecide("probe", ONE))
    await until(lambda: target.calls == 2, what="the probe call")
    other = await model.adecide("other", ONE)  # the probe holds the half-open breaker's one call
    assert other.reads["urgent"].escalation_error.startswith("BreakerOpen") and "probe call is in flight" in (
        other.reads["urgent"].escalation_error)
    release.set()
    assert (await probe).reads["urgent"].path == "escalated" and target.calls == 2
    assert model.breaker_counters["state"] == "closed"


async def test_a_reply_outside_the_options_is_no_outage_and_raise_keeps_the_old_answer():
    """The target answered garbage: degraded, but the breaker counts no failure (it is up).
    `target_fault="raise"` raises the target's error as before; an open breaker's is `BreakerOpen`."""
    garbage = ScriptedTarget(script={"urgent": "yes"}, faults=["malformed"] * 20)
    model = unsure_model(Escalation(garbage, breaker=Breaker(failures=2)))
    ended = await outcomes(model, 3)
    assert all(r.cause == "target_fault" and "(format)" in r.escalation_error for r in ended)
    assert model.breaker_counters["failures"] == 0 and garbage.calls == 6  # asked again once each
    strict = unsure_model(Escalation(dead(), breaker=Breaker(failures=2)), outcomes=OutcomePolicy(target_fault="raise"))
    ended = await outcomes(strict, 3)
    assert [type(e) for e in ended] == [EscalationError, EscalationError, BreakerOpen]
    assert ended[2].retryable and ended[2].failure == "network" and "probed again in" in ended[2].message


async def test_an_engine_fault_whose_target_is_down_never_answers_and_the_breaker_fails_it_fast():
    target = dead()
    model = unsure_model(Escalation(target, breaker=Breaker(failures=2)), engine=engine_down())
    ended = await outcomes(model, 4)
    assert [type(e) for e in ended] == [EscalationError, EscalationError, BreakerOpen, BreakerOpen]
    assert all("after the canvas engine failed: EngineUnavailable" in e.message for e in ended)
    assert target.calls == 2  # no call while open
    fallback = unsure_model(Escalation(dead(), breaker=Breaker(failures=2)), engine=engine_down(),
                            outcomes=OutcomePolicy(target_fault="fallback", fallback={"urgent": "yes"}))
    r = (await fallback.adecide(TICKET, ONE)).reads["urgent"]
    assert (r.path, r.answer, r.cause) == ("fallback", "yes", "target_fault")
    assert r.error.startswith("EngineUnavailable") and r.escalation_error.startswith("EscalationError")


# -- together: budget, hedge, controller, review, caches, fan-out ----------------------------------


async def test_a_dead_target_spends_no_budget_and_short_circuits_take_no_grant():
    model = unsure_model(Escalation(dead(), budget=EscalationBudget(max_per_window=3), breaker=Breaker(failures=2)))
    ended = await outcomes(model, 6)
    assert all(r.cause == "target_fault" for r in ended)  # not over_budget: nothing escalated, all refunded
    assert model.budget_counters == {"granted": 0, "refused": 0, "refunded": 2, "in_window": 0}


async def test_a_hedge_is_not_started_while_the_breaker_is_open():
    from test_hedge import BORDERLINE, Canvas, hedged

    target = dead()
    model = hedged(Canvas(BORDERLINE, BORDERLINE), target, breaker=Breaker(failures=2))
    first = [await model.adecide(f"ticket {i}", ONE) for i in range(2)]  # the hedges' calls fail: it opens
    assert [r.diagnostics.hedges for r in first] == [["failed"], ["failed"]] and target.calls == 2
    assert all(r.reads["urgent"].cause == "target_fault" for r in first)
    later = await model.adecide("ticket 3", ONE)
    assert later.diagnostics.hedges == ["refused"] and later.diagnostics.target_calls == 0 and target.calls == 2
    assert later.reads["urgent"].escalation_error.startswith("BreakerOpen")


async def test_a_target_outage_leaves_the_controller_where_a_working_target_would():
    def controlled(target: Any) -> CanvasDecisionModel:
        return unsure_model(Escalation(target, controller=Controller(target=0.2)))

    up, down = controlled(ScriptedTarget(script={"urgent": "yes"})), controlled(dead())
    for model in (up, down):
        await outcomes(model, 6)
    assert down.controller_counters == up.controller_counters  # the gate did not pass either: same rate
    assert down.controller_counters["questions"]["urgent"]["decisions"] == 6


class Ticket(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def lanes(node: Any, **compile: Any) -> Any:
    builder = StateGraph(Ticket)
    builder.add_node("triage", node, cache_policy=compile.pop("cache_policy", None))
    builder.add_edge(START, "triage")
    for lane in ("today", "later"):
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    return builder.compile(**compile)


ROUTE = ("urgent", {"yes": "today", "no": "later"})


def test_a_degraded_answer_goes_to_review_naming_the_target_fault():
    node = decision_node(unsure_model(dead()), ONE, inputs="ticket", route=ROUTE, review=ReviewPolicy())
    graph = lanes(node, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "review"}}
    paused = graph.invoke({"ticket": TICKET}, config)
    asked = paused["__interrupt__"][0].value["questions"]["urgent"]
    assert (asked["path"], asked["cause"]) == ("unsure", "target_fault")
    done = graph.invoke(Command(resume="yes"), config)
    assert (done["decisions"]["urgent"]["path"], done["lane"]) == ("human", "today")


async def test_neither_cache_keeps_a_degraded_answer_as_if_it_were_the_targets():
    """A degraded answer is decided again: once the target is back it answers (a cache that kept
    the canvas's guess would serve it for its whole lifetime as the decision)."""
    target = dead(1)
    model = unsure_model(Escalation(target, breaker=None), cache=DecisionCache())
    assert (await model.adecide(TICKET, ONE)).reads["urgent"].cause == "target_fault"
    back = await model.adecide(TICKET, ONE)
    assert (back.reads["urgent"].path, back.replayed, target.calls) == ("escalated", None, 2)
    assert (await model.adecide(TICKET, ONE)).replayed == "decision_cache"  # the target's answer is kept

    target = dead(1)
    node = decision_node(unsure_model(Escalation(target, breaker=None)), ONE, inputs="ticket", route=ROUTE)
    cache = NodeCache(InMemoryCache())
    graph = lanes(node, cache=cache, cache_policy=node.cache_policy(ttl=300))
    assert graph.invoke({"ticket": TICKET})["decisions"]["urgent"]["read"]["cause"] == "target_fault"
    assert cache.refused == 1
    again = graph.invoke({"ticket": TICKET})["decisions"]["urgent"]
    assert (again["path"], target.calls) == ("escalated", 2)


class Docs(TypedDict, total=False):
    docs: list[str]
    decisions: Annotated[dict, merge_decisions]


def test_branches_of_a_send_fan_out_share_the_models_breaker():
    target = dead()
    node = decision_node(unsure_model(Escalation(target, breaker=Breaker(failures=3))), ONE, inputs="doc")
    builder = StateGraph(Docs)
    builder.add_node("grade", node)
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": d}) for d in s["docs"]], ["grade"])
    builder.add_edge("grade", END)
    graph = builder.compile()
    docs = [f"ticket {i}: {TICKET}" for i in range(6)]
    first = graph.invoke({"docs": docs})["decisions"]["urgent"]
    assert len(first) == 6 and {r["read"]["cause"] for r in first.values()} == {"target_fault"}
    called = target.calls
    assert 3 <= called <= 6  # branches run at once: those in flight when it opened still called
    second = graph.invoke({"docs": docs})["decisions"]["urgent"]
    assert target.calls == called  # open: no branch of the next run calls the target
    assert {r["read"]["escalation_error"].split(":")[0] for r in second.values()} == {"BreakerOpen"}


# -- the wires ---------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_of(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=patience(10)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_both_wires_answer_a_degraded_decision_in_their_own_vocabulary():
    """A /v1/systemone target that is not there (real HTTP to a closed port): both wires answer 200,
    the canvas's answer with path unsure, cause target_fault and the fault named; /metrics shows the
    breaker open and its short circuits; `refuse_unsure` refuses such answers, reason target_fault."""
    gone = SystemOneDecisionModel(Connection(f"http://127.0.0.1:{closed_port()}", retries=0), model="jev-latest")
    model = unsure_model(Escalation(gone, breaker=Breaker(failures=2)))
    systemone = {"state": TICKET, "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}
    decisions = {"model": "function", "input": TICKET,
                 "questions": [{"type": "predicate", "name": "urgent", "instructions": "Urgent?"}]}
    with run_in_thread(create_app(model)) as url, run_in_thread(create_app(model, refuse_unsure=True)) as strict:
        limit_s = patience(30)
        jev = [httpx.post(f"{url}/v1/systemone", json=systemone, timeout=limit_s) for _ in range(3)]
        openai = httpx.post(f"{url}/v1/decisions", json=decisions, timeout=limit_s)
        refused = httpx.post(f"{strict}/v1/decisions", json=decisions, timeout=limit_s).json()
        seen, seen_strict = metrics_of(url), metrics_of(strict)
    assert [r.status_code for r in jev] == [200] * 3 and openai.status_code == 200
    for body in (r.json() for r in jev):
        figures = body["answers"]["urgent"]["x_canvasroute"]
        assert (body["answers"]["urgent"]["type"], figures["path"], figures["cause"]) == (
            "noul", "unsure", "target_fault")
        assert body["diagnostics"]["escalation_errors"]["urgent"] == figures["escalation_error"]
        assert body["diagnostics"]["questions"]["urgent"]["cause"] == "target_fault"
    assert [r.json()["answers"]["urgent"]["x_canvasroute"]["escalation_error"].split(":")[0] for r in jev] == [
        "EscalationError", "EscalationError", "BreakerOpen"]
    answer = openai.json()["answers"][0]
    assert (answer["type"], answer["canvasroute"]["cause"]) == ("predicate", "target_fault")
    assert answer["canvasroute"]["escalation_error"].startswith("BreakerOpen")
    assert (refused["answers"][0]["type"], refused["answers"][0]["canvasroute"]["cause"]) == ("refusal", "target_fault")
    assert seen[("canvasroute_server_breaker_state", (("state", "open"),))] == 1
    assert seen[("canvasroute_server_breaker_state", (("state", "closed"),))] == 0
    assert seen[("canvasroute_server_breaker_short_circuits_total", ())] >= 2
    assert seen[("canvasroute_server_breaker_transitions_total", (("state", "open"),))] == 1
    assert seen[("canvasroute_server_decisions_total", (("cause", "target_fault"), ("path", "unsure")))] == 4
    assert seen[("canvasroute_server_fault_cap_limit", ())] == 30
    assert seen_strict[("canvasroute_server_refusals_total", (("reason", "target_fault"),))] == 1


def test_on_target_fault_raise_answers_502_then_503_while_the_breaker_is_open():
    model = unsure_model(Escalation(dead(), breaker=Breaker(failures=1)), outcomes=OutcomePolicy(target_fault="raise"))
    body = {"state": TICKET, "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}
    with run_in_thread(create_app(model)) as url:
        failed, open_ = (httpx.post(f"{url}/v1/systemone", json=body, timeout=patience(30)) for _ in range(2))
        assert (failed.status_code, failed.json()["error"]["type"]) == (502, "escalation_failed")
        assert (open_.status_code, open_.json()["error"]["type"]) == (503, "escalation_unavailable")
        assert open_.headers["retry-after"] == "1"


def test_serve_takes_on_target_fault():
    from test_server import _args

    from canvasroute.apps.server import cli as serve

    url = ["--engine-url", "http://127.0.0.1:9", "--escalate-systemone", "http://127.0.0.1:12"]
    assert serve.build_model(_args(url)).outcomes.target_fault == "answer"
    assert serve.build_model(_args([*url, "--on-target-fault", "raise"])).outcomes.target_fault == "raise"
    with pytest.raises(SystemExit):
        _args([*url, "--on-target-fault", "fallback"])  # no fallback over HTTP: not a choice


@contextlib.contextmanager
def serve_process(argv: list[str], tmp_path: Any, name: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`canvasroute serve` as a process on a free port, and the process (to kill it)."""
    from test_server import _free_port

    port = _free_port()
    log = (tmp_path / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "canvasroute.apps.cli", "serve", *argv, "--port", str(port),
                             "--log-level", "warning"], cwd=tmp_path, env=child_env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=patience(2)).status_code == 200,
                   Watch(proc.pid, cpu_s=90, idle_s=60, what=name), what=f"{name} starting", proc=proc,
                   log=tmp_path / f"{name}.log")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            if wait(proc, Watch(proc.pid, cpu_s=60, idle_s=60, what=f"{name} stopping")) is None:
                proc.kill()
                proc.wait()
        log.close()


@pytest.mark.slow
def test_serve_escalate_systemone_keeps_answering_when_its_target_is_killed_mid_load(tmp_path):
    """Issue #39: killed mid-load behind `serve --escalate-systemone`, 44 of 60 requests answered 502.
    Now A answers every request: B's answers while B is up, A's canvas answer (path unsure, cause
    target_fault) after; after 5 failures A stops calling B (the breaker is open), and its /metrics
    and log say so. Both servers read the loopback vLLM-wire server."""
    n, workers, kill_after = 60, 4, 20
    body = {"state": TICKET, "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                                          "refund": {"type": "noul", "instructions": "Is a refund asked for?"}}}
    with spawn() as engine, \
            serve_process(["--engine-url", engine.url, "--max-normalized-entropy", "1.0"], tmp_path, "b") as (
                b, b_proc), \
            serve_process(["--engine-url", engine.url, "--max-normalized-entropy", "0", "--rereads", "0",
                           "--escalate-systemone", b], tmp_path, "a") as (a, _):
        done: list[tuple[int, dict[str, Any]]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            reply = httpx.post(f"{a}/v1/systemone", json={**body, "state": f"{TICKET} ({i})"}, timeout=patience(60))
            with lock:
                done.append((reply.status_code, reply.json()))
                if len(done) == kill_after:
                    b_proc.kill()  # SIGKILL, as a crash: requests to B in flight are cut off

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(n)))
        seen = metrics_of(a)
    assert [status for status, _ in done] == [200] * n, [reply for status, reply in done if status != 200][:2]
    figures = [(reply["answers"][q]["x_canvasroute"], reply["diagnostics"]) for _, reply in done
               for q in ("urgent", "refund")]
    escalated = [f for f, _ in figures if f["path"] == "escalated"]
    degraded = [(f, d) for f, d in figures if f["cause"] == "target_fault"]
    assert len(escalated) + len(degraded) == 2 * n and len(escalated) >= 2 * (kill_after - workers)
    assert all(f["path"] == "unsure" and f["escalation_error"] for f, _ in degraded)
    assert all(d["escalation_errors"] for _, d in degraded)
    assert any(f["escalation_error"].startswith("BreakerOpen") for f, _ in degraded)  # B no longer called
    assert seen[("canvasroute_server_breaker_state", (("state", "open"),))] == 1
    assert 5 <= seen[("canvasroute_server_breaker_failures_total", ())] <= 5 + workers + 1  # (+ a probe, if one)
    assert seen[("canvasroute_server_breaker_short_circuits_total", ())] >= n - kill_after - 5 - 2 * workers
    unsure = ("canvasroute_server_decisions_total", (("cause", "target_fault"), ("path", "unsure")))
    assert seen[unsure] == len(degraded)
    log = (tmp_path / "a.log").read_text()
    assert log.count("circuit breaker open after") == 1, log[-2000:]


# -- the dashboard ---------------------------------------------------------------------------


async def test_the_dashboard_shows_the_breakers_changes_and_what_it_kept_from_the_target(spans):
    target = dead(3)
    model = unsure_model(Escalation(target, breaker=Breaker(failures=3, cooldown_s=0.1)))
    await outcomes(model, 5)
    await asyncio.sleep(0.12)
    await outcomes(model, 1)
    report = build_report([span_record(s) for s in spans.get_finished_spans()])
    assert [(g.guard, g.what) for g in report.guards if g.change] == [
        ("breaker", "open"), ("breaker", "half_open"), ("breaker", "closed")]
    assert sum(len(g.questions) for g in report.guards if g.what == "short_circuit") == 2
    assert report.tally.causes["target_fault"] == 5
    page = render(report)
    assert 'id="guards-section"' in page and "breaker opened" in page and "kept from the target (open)" in page
    assert "answered without the target: BreakerOpen" in page and 'id="kpi-guards"' in page
    assert "target fault 5" in page  # the cause, beside the others


# -- no target, uncertain="escalate": one warning per model ------------------------------------------


def test_no_target_and_uncertain_escalate_warns_once_per_model_saying_answers_route_unsure():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = [CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GATE) for _ in range(2)]
        for model in models:
            for i in range(3):
                assert model.decide(f"ticket {i}", ONE).reads["urgent"].path == "unsure"
        said = [str(w.message) for w in caught if "has no escalation target" in str(w.message)]
        assert len(said) == 2, said  # one per model, not one per decision
        assert "has no escalation target" in said[0] and "path 'unsure'" in said[0]
        assert "escalate_to=" in said[0] and "OutcomePolicy(uncertain='answer')" in said[0]
        quiet = [CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GATE,
                                     outcomes=OutcomePolicy(uncertain="answer")),  # answering unsure is what it asks
                 CanvasDecisionModel(engine=fixed_engine({"yes": -0.01, "no": -6.0}), policy=GATE),  # all pass
                 CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GATE).canvas_only()]  # measures the canvas
        for model in quiet:
            model.decide(TICKET, ONE)
        assert len([w for w in caught if "has no escalation target" in str(w.message)]) == 2


def test_the_report_names_the_fault_in_the_json_a_graph_keeps():
    r = asyncio.run(outcomes(unsure_model(dead()), 1))[0]
    dumped = json.loads(r.model_dump_json())
    assert dumped["cause"] == "target_fault" and dumped["escalation_error"].startswith("EscalationError")


@pytest.mark.vllm
async def test_on_the_real_vllm_server_a_dead_target_leaves_the_real_canvas_answer(vllm_url):
    """The real tiny DiffusionGemma reads; the target is a /v1/systemone URL nobody serves (real
    HTTP). Every answer is the server's own canvas answer, flagged, and the breaker stops the calls."""
    from canvasroute.engine import VLLMServerEngine

    gone = SystemOneDecisionModel(Connection(f"http://127.0.0.1:{closed_port()}", retries=0), model="jev-latest")
    engine = VLLMServerEngine(vllm_url)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.0, rereads=0),
                                escalate_to=Escalation(gone, breaker=Breaker(failures=2)))
    ended = await outcomes(model, 4)
    assert [r.escalation_error.split(":")[0] for r in ended] == ["EscalationError"] * 2 + ["BreakerOpen"] * 2
    for r in ended:
        assert (r.path, r.cause, r.confident) == ("unsure", "target_fault", False)
        assert r.canvas_probabilities and r.answer == max(r.canvas_probabilities, key=r.canvas_probabilities.get)
    assert model.breaker_counters["failures"] == 2 and engine.requests_sent >= 4
    await engine.aclose()
