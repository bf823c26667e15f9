"""The escalation-rate controller (issue #35 point 2): thresholds that move online to hold a rate.

A drifting stream with known ground truth (`canvasroute.apps.bench.controller.DriftStream`: each
question's normalized entropy from a Beta whose mean shifts at a given decision) drives a
`FunctionEngine`; the controller must bring the realised escalation rate back to its target, a
property of the algorithm (seeded, no timing). Beside it: state shared through a real LangGraph
store, the decision and node caches, budgets, review, fan-out, engine faults, a certified gate,
traces and both HTTP wires.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from typing import Annotated, Any

import httpx
import pytest
from lanes import one_node_graph
from langchain_core.decisions import Noul
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.store.memory import InMemoryStore
from langgraph.types import CachePolicy, Command, Send
from prometheus_client.parser import text_string_to_metric_families
from typing_extensions import TypedDict

from canvasroute.apps.bench.controller import (
    QUESTIONS,
    DriftStream,
    entropy_probs,
    off_windows,
    reached,
    run_stream,
    settled,
    stream_engine,
)
from canvasroute.apps.cli import main
from canvasroute.apps.server import create_app
from canvasroute.engine import (
    BudgetExhausted,
    CanvasRead,
    DecisionError,
    EngineUnavailable,
    EscalationError,
    FunctionEngine,
    UnsureAnswer,
)
from canvasroute.harness import (
    NodeCache,
    ReviewPolicy,
    StoreControllerState,
    decision_node,
    merge_decisions,
    route_on,
)
from canvasroute.router import (
    CanvasDecisionModel,
    Certificate,
    Controller,
    ControllerState,
    DecisionCache,
    Escalation,
    EscalationBudget,
    GatePolicy,
    InMemoryControllerState,
    OutcomePolicy,
)
from canvasroute.router import telemetry as tm
from canvasroute.router.testing import ScriptedTarget

URGENT = Noul(instructions="Does the customer need an answer within the hour?")
TARGET = 0.2


def h_engine() -> FunctionEngine:
    """Reads a state 'h=<x> ...' as a yes/no distribution of normalized entropy x; 'down' fails."""
    def rows(read: CanvasRead) -> list[dict[int, float]]:
        text = read.messages[-1]["content"]
        if "down" in text:
            raise EngineUnavailable("engine down")
        found = re.search(r"h=([0-9.]+)", text)
        assert found is not None
        p, q = entropy_probs(float(found.group(1)), 2)
        return [{engine.token_id("yes"): math.log(max(p, 1e-12)), engine.token_id("no"): math.log(max(q, 1e-12))}
                ] * len(read.slots)

    engine = FunctionEngine(rows)
    return engine


def target() -> ScriptedTarget:
    return ScriptedTarget(script={"urgent": "yes", "team": "billing"})


def controlled(threshold: float = 0.5, *, engine: Any = None, controller: Controller | None = None,
               **escalation: Any) -> CanvasDecisionModel:
    """A model gating `urgent` at `threshold` (one read), escalating under a 20 % controller."""
    controller = controller or Controller(target=TARGET)
    outcomes = escalation.pop("outcomes", OutcomePolicy())
    cache = escalation.pop("cache", None)
    policy = escalation.pop("policy", GatePolicy(max_normalized_entropy=threshold, rereads=0))
    return CanvasDecisionModel(engine=engine or h_engine(), policy=policy, outcomes=outcomes, cache=cache,
                               escalate_to=Escalation(target(), controller=controller, **escalation))


def offset(model: CanvasDecisionModel, qid: str = "urgent") -> float:
    return float(model.controller_counters["questions"][qid]["offset"])


def decisions(model: CanvasDecisionModel, qid: str = "urgent") -> int:
    found = model.controller_counters.get("questions", {}).get(qid)
    return int(found["decisions"]) if found else 0


def gate_threshold(report: Any) -> float:
    found = re.match(r"H/lnK <= ([0-9.]+)", report.gate)
    assert found is not None, report.gate
    return float(found.group(1))


async def loosen(model: CanvasDecisionModel, n: int = 10) -> None:
    """n decisions the gate does not pass (h=0.9): the controller raises the threshold."""
    for i in range(n):
        await model.adecide(f"h=0.9 loosen {i}", {"urgent": URGENT})


# -- the algorithm ------------------------------------------------------------------------


async def test_the_controller_brings_the_escalation_rate_back_to_its_target_after_a_drift():
    """urgent gets harder (Beta(3,7) -> Beta(5,5)), team easier (Beta(5,5) -> Beta(3,6)) at decision
    500: at the base thresholds (each the pre-drift 80 % quantile) the rates go to ~0.66 and ~0.03;
    with the controller, the last 1,000 decisions escalate 20 % +-2 points per question."""
    stream = DriftStream(2000, 500, seed=7)
    base = {qid: stream.quantile(qid, 1 - TARGET, after=False) for qid in QUESTIONS}
    model = CanvasDecisionModel(
        engine=stream_engine(stream), escalate_to=Escalation(target(), controller=Controller(target=TARGET)),
        policy=GatePolicy(rereads=0, per_question={q: GatePolicy(max_normalized_entropy=t, rereads=0)
                                                   for q, t in base.items()}))
    escalated: dict[str, list[bool]] = {qid: [] for qid in QUESTIONS}
    for i in range(stream.n):
        response = await model.adecide(f"ticket {i}", QUESTIONS)
        for qid, report in response.reads.items():
            escalated[qid].append(not report.confident)
    for qid in QUESTIONS:
        without = sum(h > base[qid] for h in stream.entropy[qid][1000:]) / 1000
        assert abs(without - TARGET) > 0.15, (qid, without)  # the drift is real
        rate = sum(escalated[qid][1000:]) / 1000
        assert abs(rate - TARGET) <= 0.02, (qid, rate)
    assert decisions(model, "urgent") == decisions(model, "team") == stream.n


async def test_the_offset_is_exactly_step_times_the_escalations_beyond_the_target():
    """ACI's identity, the source of its bound: with no update clamped, offset = step * sum(escalated - target),
    so over any T decisions the realised rate is within (offset range) / (step * T) of the target."""
    stream = DriftStream(600, 200, seed=3)
    controller = Controller(target=TARGET, max_offset=1.0, step=0.01)
    model = CanvasDecisionModel(engine=stream_engine(stream), escalate_to=Escalation(target(), controller=controller),
                                policy=GatePolicy(max_normalized_entropy=0.45, rereads=0))
    urgent = {"urgent": QUESTIONS["urgent"]}
    sum_err = previous = 0.0
    for i in range(stream.n):
        report = (await model.adecide(f"ticket {i}", urgent)).reads["urgent"]
        sum_err += float(not report.confident) - TARGET
        assert offset(model) == pytest.approx(controller.step * sum_err, abs=1e-9)
        # the threshold applied is the offset before the decision, rounded to the resolution
        assert abs(gate_threshold(report) - (0.45 + previous)) <= controller.resolution / 2 + 1e-9
        previous = offset(model)


async def test_a_step_is_bounded_and_the_offset_stays_within_its_bounds():
    controller = Controller(target=TARGET, step=0.05, max_offset=0.1)
    model = controlled(0.5, controller=controller)
    seen = []
    for i in range(30):
        before = offset(model) if i else 0.0
        await model.adecide(f"h=0.95 n{i}", {"urgent": URGENT})
        seen.append(offset(model))
        assert offset(model) - before <= controller.step * (1 - TARGET) + 1e-12
    assert max(seen) == pytest.approx(0.1)  # anti-windup: it stops at the bound, it does not integrate past it
    await model.adecide("h=0.0 back", {"urgent": URGENT})  # one pass moves it back down at once
    assert offset(model) == pytest.approx(0.1 - controller.step * TARGET)


def test_controller_values_are_checked():
    for bad in ({"target": 0.0}, {"target": 1.0}, {"target": 0.2, "step": 0.0}, {"target": 0.2, "max_offset": 2},
                {"target": 0.2, "sync_every": 0}, {"target": 0.2, "resolution": 0.5}, {"target": True}):
        with pytest.raises(ValueError, match="Controller"):
            Controller(**bad)
    with pytest.raises(ValueError, match="controller_state needs controller"):
        Escalation(target(), controller_state=InMemoryControllerState(Controller(target=0.2)))
    with pytest.raises(TypeError, match="must be a Controller"):
        Escalation(target(), controller=0.2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ControllerState"):
        CanvasDecisionModel(engine=h_engine(), escalate_to=Escalation(
            target(), controller=Controller(target=0.2), controller_state=object()))
    assert isinstance(InMemoryControllerState(Controller(target=0.2)), ControllerState)


# -- shared through a LangGraph store -----------------------------------------------------------


async def test_models_sharing_one_store_take_the_steps_one_controller_would():
    """Three models, each its own StoreControllerState on one InMemoryStore (as three processes
    would), taking turns: with sync_every=1 every decision reads the others' shares first and writes
    its own after, so the thresholds are exactly those of one model with one in-process state."""
    stream = DriftStream(240, 80, seed=11)
    controller = Controller(target=TARGET, sync_every=1, resolution=0.0)
    urgent = {"urgent": QUESTIONS["urgent"]}
    policy = GatePolicy(max_normalized_entropy=0.45, rereads=0)
    store = InMemoryStore()
    states = [StoreControllerState(store, controller, scope="shared") for _ in range(3)]
    workers = [CanvasDecisionModel(engine=stream_engine(stream), policy=policy, escalate_to=Escalation(
        target(), controller=controller, controller_state=state)) for state in states]
    alone = CanvasDecisionModel(engine=stream_engine(stream), policy=policy,
                                escalate_to=Escalation(target(), controller=controller))
    for i in range(stream.n):
        shared = (await workers[i % 3].adecide(f"ticket {i}", urgent)).reads["urgent"]
        single = (await alone.adecide(f"ticket {i}", urgent)).reads["urgent"]
        assert gate_threshold(shared) == pytest.approx(gate_threshold(single), abs=1e-9), i
        assert shared.confident == single.confident
    items = store.search(("canvasroute", "controller", "shared"))
    assert len(items) == 3 and {i.key for i in items} == {s.worker for s in states}  # one item per worker
    assert sum(i.value["questions"]["urgent"]["share"] for i in items) == pytest.approx(offset(alone), abs=1e-9)
    assert workers[0].controller_counters["workers"] == 3


@pytest.mark.services
async def test_workers_on_a_real_postgres_store_take_the_steps_one_controller_would(postgres_dsn):
    from langgraph.store.postgres import PostgresStore

    stream = DriftStream(90, 30, seed=5)
    controller = Controller(target=TARGET, sync_every=1, resolution=0.0)
    urgent = {"urgent": QUESTIONS["urgent"]}
    policy = GatePolicy(max_normalized_entropy=0.45, rereads=0)
    alone = CanvasDecisionModel(engine=stream_engine(stream), policy=policy,
                                escalate_to=Escalation(target(), controller=controller))
    with PostgresStore.from_conn_string(postgres_dsn) as store:
        store.setup()
        states = [StoreControllerState(store, controller, scope="postgres") for _ in range(2)]
        workers = [CanvasDecisionModel(engine=stream_engine(stream), policy=policy, escalate_to=Escalation(
            target(), controller=controller, controller_state=state)) for state in states]
        for i in range(stream.n):
            shared = (await workers[i % 2].adecide(f"ticket {i}", urgent)).reads["urgent"]
            single = (await alone.adecide(f"ticket {i}", urgent)).reads["urgent"]
            assert gate_threshold(shared) == pytest.approx(gate_threshold(single), abs=1e-9), i
        items = store.search(("canvasroute", "controller", "postgres"))
    assert sum(i.value["questions"]["urgent"]["share"] for i in items) == pytest.approx(offset(alone), abs=1e-9)


class Ticket(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]


async def test_a_decision_node_in_a_graph_with_a_store_keeps_its_controller_there_with_no_wiring():
    store = InMemoryStore()
    every = Controller(target=TARGET, sync_every=1)  # each decision writes its step to the store
    model = controlled(0.5, controller=every)
    graph = one_node_graph(decision_node(model, {"urgent": URGENT}, inputs="ticket"), store=store)
    for i in range(3):
        out = await graph.ainvoke({"ticket": f"h=0.9 graph {i}"})
        assert out["decisions"]["urgent"]["path"] == "escalated"
    scope = model.controller_scope
    assert scope is not None
    items = store.search(("canvasroute", "controller", scope))
    assert len(items) == 1
    share = items[0].value["questions"]["urgent"]["share"]
    assert share == pytest.approx(3 * 0.02 * (1 - TARGET))
    assert decisions(model) == 0, "the model's own in-process state was not used: the store's was"
    # a second graph on the same store, another model of the same make: it steers by the shared offset
    twin = controlled(0.5, controller=every)
    graph2 = one_node_graph(decision_node(twin, {"urgent": URGENT}, inputs="ticket"), store=store)
    out = await graph2.ainvoke({"ticket": "h=0.1 twin"})
    assert out["decisions"]["urgent"]["read"]["gate"] == f"H/lnK <= {round(0.5 + share, 2):g}"


class _Counted:
    """A policy value that counts how often it is spelled out (`repr`: what a store scope hashes)."""

    reprs = 0

    def __repr__(self) -> str:
        type(self).reprs += 1
        return super().__repr__()


class CountedController(_Counted, Controller):
    reprs = 0


class CountedBudget(_Counted, EscalationBudget):
    reprs = 0


async def test_a_models_store_scopes_are_worked_out_once_not_on_every_decision():
    """A graph store finds the model's controller and budget by their scopes: the same names as
    ever, hashed once per model, however many decisions look them up."""
    store = InMemoryStore()
    controller, budget = CountedController(target=TARGET, sync_every=1), CountedBudget(max_per_window=100)
    model = controlled(0.5, controller=controller, budget=budget)
    scopes = (model.controller_scope, model.budget_scope)
    assert None not in scopes and (CountedController.reprs, CountedBudget.reprs) == (1, 1)
    graph = one_node_graph(decision_node(model, {"urgent": URGENT}, inputs="ticket"), store=store)
    for i in range(3):
        assert (await graph.ainvoke({"ticket": f"h=0.9 scope {i}"}))["decisions"]["urgent"]["path"] == "escalated"
    assert (model.controller_scope, model.budget_scope) == scopes
    assert (CountedController.reprs, CountedBudget.reprs) == (1, 1)
    twin = controlled(0.5, controller=controller, budget=budget)  # another worker's model of the same make
    assert (twin.controller_scope, twin.budget_scope) == scopes
    assert len(store.search(("canvasroute", "controller", scopes[0]))) == 1
    assert store.search(("canvasroute", "budget", scopes[1], "window"))


async def test_route_on_steers_and_observes_through_the_model():
    model = controlled(0.5)
    builder = StateGraph(Ticket)
    builder.add_node("start", lambda state: {})
    builder.add_node("done", lambda state: {})
    builder.add_edge(START, "start")
    builder.add_conditional_edges("start", route_on(model, URGENT, {"yes": "done", "no": "done"}, inputs="ticket",
                                                    question_id="urgent"))
    builder.add_edge("done", END)
    await builder.compile().ainvoke({"ticket": "h=0.9 edge"})
    assert decisions(model) == 1 and offset(model) > 0


# -- caches -----------------------------------------------------------------------------------


COARSE = Controller(target=TARGET, resolution=0.1)
"""Thresholds on a 0.1 grid: a few decisions move the offset without moving the threshold."""


async def test_a_decision_cache_replays_only_what_was_gated_at_the_same_thresholds_and_a_hit_does_not_feed_it():
    model = controlled(0.5, controller=COARSE, cache=DecisionCache())
    first = await model.adecide("h=0.55 cached", {"urgent": URGENT})
    assert first.reads["urgent"].path == "escalated" and decisions(model) == 1
    again = await model.adecide("h=0.55 cached", {"urgent": URGENT})  # the threshold is still 0.5
    assert again.canvas_reads == 0 and model.cache.hits == 1
    assert decisions(model) == 1, "a hit was not gated again: the controller did not count it"
    await loosen(model, 5)  # the threshold moves to 0.6
    moved = await model.adecide("h=0.55 cached", {"urgent": URGENT})
    assert model.cache.hits == 1, "an answer gated at another threshold was not replayed"
    assert moved.reads["urgent"].path == "canvas" and moved.reads["urgent"].gate == "H/lnK <= 0.6"


async def test_a_node_cache_key_names_the_thresholds_and_its_miss_is_decided_with_exactly_those():
    model = controlled(0.5, controller=COARSE)
    node = decision_node(model, {"urgent": URGENT}, inputs="ticket")
    graph = one_node_graph(node, cache=NodeCache(InMemoryCache()))
    await graph.ainvoke({"ticket": "h=0.55 node"})
    await graph.ainvoke({"ticket": "h=0.55 node"})  # a hit: the node does not run
    assert decisions(model) == 1
    await loosen(model, 5)
    out = await graph.ainvoke({"ticket": "h=0.55 node"})
    assert decisions(model) == 7 and out["decisions"]["urgent"]["path"] == "canvas"
    # the key pins the thresholds: a controller moving between the key and the run changes nothing
    state = {"ticket": "h=0.65 pinned"}
    node.cache_key(state)
    assert model.request("x", {"urgent": URGENT}).gate.max_normalized_entropy == 0.5  # (a request is not steered)
    await loosen(model, 5)  # now 0.7
    command = await node.ainvoke(state)
    assert command.update["decisions"]["urgent"]["read"]["gate"] == "H/lnK <= 0.6"
    assert command.update["decisions"]["urgent"]["path"] == "escalated"


@pytest.mark.parametrize("policy", ["cache_policy()", "CachePolicy(key_func=node.cache_key)"])
async def test_a_hand_built_cache_policy_pins_and_refuses_as_cache_policy_does(policy):
    """`CachePolicy(key_func=node.cache_key)` is the same node cache as `node.cache_policy()`: the
    run its key brings decides with the thresholds the key named; a keyless fan-out and history= are refused."""
    def cached(node: Any) -> Any:
        return node.cache_policy() if policy == "cache_policy()" else CachePolicy(key_func=node.cache_key)

    model = controlled(0.5, controller=COARSE)
    node = decision_node(model, {"urgent": URGENT}, inputs="ticket")
    builder = StateGraph(Ticket)
    builder.add_node("triage", node, cache_policy=cached(node))
    builder.add_edge(START, "triage")
    builder.add_edge("triage", END)
    graph = builder.compile(cache=NodeCache(InMemoryCache()))
    assert (await graph.ainvoke({"ticket": "h=0.65 hand"}))["decisions"]["urgent"]["read"]["gate"] == "H/lnK <= 0.5"
    state = {"ticket": "h=0.65 pinned"}
    node.cache_key(state)  # as LangGraph computes it before the run; the controller then moves
    await loosen(model, 5)  # now 0.6
    command = await node.ainvoke(state)
    assert command.update["decisions"]["urgent"]["read"]["gate"] == "H/lnK <= 0.5"  # the key's, not 0.6
    assert command.update["decisions"]["urgent"]["path"] == "escalated"
    unpinned = await node.ainvoke({"ticket": "h=0.65 no key"})
    assert unpinned.update["decisions"]["urgent"]["read"]["gate"] == "H/lnK <= 0.6"

    class Fan(TypedDict, total=False):
        tickets: list[str]
        ticket: str
        decisions: Annotated[dict, merge_decisions]

    keyless = decision_node(controlled(0.5), {"urgent": URGENT}, inputs="ticket")
    fan = StateGraph(Fan)
    fan.add_node("triage", keyless, cache_policy=cached(keyless))
    fan.add_conditional_edges(START, lambda s: [Send("triage", {"ticket": t}) for t in s["tickets"]], ["triage"])
    with pytest.raises(DecisionError, match="node cache and runs in a Send fan-out"):
        await fan.compile(cache=NodeCache(InMemoryCache())).ainvoke({"tickets": ["h=0.1 a", "h=0.1 b"]})
    kept = decision_node(controlled(0.5), {"urgent": URGENT}, inputs="ticket", history=2)
    with pytest.raises(DecisionError, match="history= and a node cache"):
        cached(kept).key_func({"ticket": "h=0.1 kept"})  # refused by cache_policy(), else at the key


async def test_a_node_cache_miss_builds_the_keys_request_and_the_runs_and_no_third(monkeypatch):
    """The run finds its pin from its own request: it does not build the key's request again."""
    built = []
    request = CanvasDecisionModel.request

    def counted(self: CanvasDecisionModel, *args: Any, **kwargs: Any) -> Any:
        built.append(kwargs.get("site"))
        return request(self, *args, **kwargs)

    model = controlled(0.5, controller=COARSE)
    graph = one_node_graph(decision_node(model, {"urgent": URGENT}, inputs="ticket"), cache=NodeCache(InMemoryCache()))
    monkeypatch.setattr(CanvasDecisionModel, "request", counted)
    out = await graph.ainvoke({"ticket": "h=0.65 built"})
    assert out["decisions"]["urgent"]["path"] == "escalated" and decisions(model) == 1
    assert [site is None for site in built] == [True, False]  # cache_key's request, then the run's


# -- budgets, review, fan-out, faults ---------------------------------------------------------------


async def test_the_budget_caps_calls_and_its_refusals_do_not_wind_the_controller_up():
    """Refused escalations are still questions the gate did not pass: the controller takes the same
    steps with a spent budget as without one, and never tightens to buy escalations it cannot have."""
    capped = controlled(0.3, budget=EscalationBudget(max_per_window=2, window_s=3600))
    free = controlled(0.3)
    for i in range(12):
        a = await capped.adecide(f"h=0.6 b{i}", {"urgent": URGENT})
        b = await free.adecide(f"h=0.6 b{i}", {"urgent": URGENT})
        assert gate_threshold(a.reads["urgent"]) == gate_threshold(b.reads["urgent"])
    assert capped.budget_counters["granted"] == 2 and capped.budget_counters["refused"] >= 1
    assert a.reads["urgent"].cause in ("over_budget", None)
    assert offset(capped) == pytest.approx(offset(free)) and offset(capped) > 0


async def test_a_reviewed_decision_is_observed_once_across_its_interrupt_and_resume():
    model = controlled(0.3, budget=EscalationBudget(max_per_window=0), outcomes=OutcomePolicy(over_budget="answer"))
    graph = one_node_graph(decision_node(model, {"urgent": URGENT}, inputs="ticket", review=ReviewPolicy()),
                           checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "review"}}
    paused = await graph.ainvoke({"ticket": "h=0.6 review"}, config)
    assert "__interrupt__" in paused and decisions(model) == 1
    done = await graph.ainvoke(Command(resume="no"), config)
    assert done["decisions"]["urgent"]["path"] == "human"
    assert decisions(model) == 1, "the resume replayed the checkpointed decision: nothing was gated again"


async def test_each_send_branch_is_one_observation():
    model = controlled(0.5)

    class Fan(TypedDict, total=False):
        tickets: list[str]
        ticket: str
        decisions: Annotated[dict, merge_decisions]

    builder = StateGraph(Fan)
    builder.add_node("triage", decision_node(model, {"urgent": URGENT}, inputs="ticket", branch="ticket"))
    builder.add_conditional_edges(START, lambda s: [Send("triage", {"ticket": t}) for t in s["tickets"]], ["triage"])
    builder.add_edge("triage", END)
    out = await builder.compile().ainvoke({"tickets": ["h=0.9 a", "h=0.9 b", "h=0.1 c"]})
    assert len(out["decisions"]["urgent"]) == 3 and decisions(model) == 3
    assert offset(model) == pytest.approx(0.02 * (2 * (1 - TARGET) - TARGET))


async def test_engine_faults_do_not_move_the_controller_and_stay_visible(caplog):
    model = controlled(0.5)
    await loosen(model, 2)
    before = offset(model)
    with caplog.at_level(logging.WARNING, logger="canvasroute.router"):
        faulted = await model.adecide("h=0.1 down", {"urgent": URGENT})
    assert faulted.reads["urgent"].path == "escalated" and faulted.reads["urgent"].error
    assert "engine fault absorbed" in caplog.text  # no silent fault
    assert decisions(model) == 2 and offset(model) == before, "a fault is not a gate outcome"
    raising = controlled(0.5, outcomes=OutcomePolicy(engine_fault="raise"))
    with pytest.raises(EngineUnavailable):
        await raising.adecide("h=0.1 down", {"urgent": URGENT})
    assert decisions(raising) == 0


@pytest.mark.parametrize(("raises", "answers"), [
    (OutcomePolicy(over_budget="raise"), OutcomePolicy(over_budget="answer")),
    (OutcomePolicy(uncertain="raise"), OutcomePolicy(uncertain="answer")),
])
async def test_a_decision_that_raises_its_outcome_is_observed_as_one_that_answers_it(raises, answers):
    """Issue 40.1: decisions that raised (`over_budget="raise"` past a spent budget) were never observed,
    so only the answers the gate passed reached the controller and a spent budget tightened the
    threshold. The gate's outcome is the same whether its action answers or raises: the same steps."""
    spent = EscalationBudget(max_per_window=0)
    raising, answering = (controlled(0.3, outcomes=o, budget=spent) for o in (raises, answers))
    for i in range(10):
        for h in (0.9, 0.1):  # half over the gate: 50 % escalations against a 20 % target
            with pytest.raises((BudgetExhausted, UnsureAnswer)) if h == 0.9 else contextlib.nullcontext():
                await raising.adecide(f"h={h} r{i}", {"urgent": URGENT})
            await answering.adecide(f"h={h} r{i}", {"urgent": URGENT})
    assert decisions(raising) == decisions(answering) == 20
    assert offset(raising) == pytest.approx(offset(answering)) == pytest.approx(10 * 0.02 * (1 - 2 * TARGET))


async def test_a_retryable_failure_is_not_observed_its_retry_is():
    """A fault that may pass by itself (the target timed out, and the model raises it rather than answer
    degraded) decided nothing: a retry decides it again and is observed then (once), as `Totals` counts
    a failed attempt as nothing."""
    slow = ScriptedTarget(script={"urgent": "yes"}, faults=[TimeoutError()])
    flaky = CanvasDecisionModel(engine=h_engine(), policy=GatePolicy(max_normalized_entropy=0.3, rereads=0),
                                escalate_to=Escalation(slow, controller=Controller(target=TARGET)),
                                outcomes=OutcomePolicy(target_fault="raise"))
    with pytest.raises(EscalationError) as info:
        await flaky.adecide("h=0.9 flaky", {"urgent": URGENT})
    assert info.value.retryable and decisions(flaky) == 0
    assert (await flaky.adecide("h=0.9 flaky", {"urgent": URGENT})).reads["urgent"].path == "escalated"
    assert decisions(flaky) == 1


class BrokenStore(InMemoryStore):
    """A store whose every call fails, as a database that went away."""

    async def abatch(self, ops: Any) -> Any:
        raise ConnectionError("store down")


async def test_a_store_that_is_down_does_not_fail_the_decision_and_is_logged_marked_and_counted(caplog, spans):
    controller = Controller(target=TARGET)
    state = StoreControllerState(BrokenStore(), controller, scope="broken")
    model = controlled(0.5, controller=controller, controller_state=state)
    with caplog.at_level(logging.WARNING, logger="canvasroute.router"):
        response = await model.adecide("h=0.9 broken store", {"urgent": URGENT})
    assert response.reads["urgent"].path == "escalated"
    assert "could not refresh" in caplog.text and "could not record" in caplog.text
    decide = next(s for s in spans.get_finished_spans() if s.name.startswith("decide"))
    assert decide.attributes[tm.CONTROLLER_FAULT] == "ConnectionError"
    assert offset(model) > 0, "the step was kept here; it is written when the store is back"


async def test_shadow_and_eval_reads_do_not_feed_the_controller():
    model = controlled(0.5)
    request = model.request("h=0.9 shadow", {"urgent": URGENT}).canvas_only()
    response = await model.arun(request)
    assert response.reads["urgent"].gate == "H/lnK <= 0.5" and decisions(model) == 0


# -- a certified gate ------------------------------------------------------------------------------

CERTIFIED = Certificate(max_error=0.05, confidence=0.9, rows=400, escalation_rate=0.3)


async def test_a_certified_gate_is_only_ever_tightened_unless_told():
    certified = GatePolicy(max_normalized_entropy=0.3, rereads=0, certificate=CERTIFIED)
    model = controlled(policy=certified)
    for i in range(20):  # everything escalates: the controller would loosen, the certificate forbids it
        report = (await model.adecide(f"h=0.6 c{i}", {"urgent": URGENT})).reads["urgent"]
        assert gate_threshold(report) == 0.3 and "certified" in report.gate  # held at it: it still claims its bound
    assert offset(model) == 0.0, "no windup against the certified bound either"
    for i in range(20):  # nothing escalates: tightening is allowed
        report = (await model.adecide(f"h=0.0 t{i}", {"urgent": URGENT})).reads["urgent"]
    assert gate_threshold(report) < 0.3
    assert "certified" not in report.gate, "a moved gate does not claim a bound proved on another threshold"
    told = controlled(policy=certified, controller=Controller(target=TARGET, loosen_certified=True))
    for i in range(5):
        report = (await told.adecide(f"h=0.6 l{i}", {"urgent": URGENT})).reads["urgent"]
    assert gate_threshold(report) > 0.3


@pytest.mark.parametrize("base", [0.7419, 0.431518])  # a calibrated threshold, as `calibrate` writes one
async def test_a_certified_gate_held_at_offset_zero_keeps_its_exact_threshold_and_its_certificate(base, spans):
    """The controller moves a threshold by offsets on its grid; it never rounds the base: at offset 0 the
    gate is the certified one (the same number the certificate was proved on), and says so."""
    certified = GatePolicy(max_normalized_entropy=base, rereads=0, certificate=CERTIFIED)
    model = controlled(policy=certified)
    between = (round(base, 2) + base) / 2  # over the base rounded to the resolution, within the exact base
    report = (await model.adecide(f"h={between:.6f} exact", {"urgent": URGENT})).reads["urgent"]
    assert report.gate == certified.gate_text and "(certified: " in report.gate
    assert (report.path, report.confident) == ("canvas", True), "gated at the exact certified threshold"
    decide = [s for s in spans.get_finished_spans() if s.name.startswith("decide")][-1]
    event = next(e for e in decide.events if e.name == tm.QUESTION_EVENT)
    assert event.attributes[tm.FIGURE_KEYS["gate"]] == certified.gate_text
    for i in range(20):  # nothing escalates: the controller tightens, by whole steps of its resolution
        report = (await model.adecide(f"h=0.0 t{i}", {"urgent": URGENT})).reads["urgent"]
    steps = round((gate_threshold(report) - base) / 0.01)
    assert steps < 0 and gate_threshold(report) == pytest.approx(base + steps * 0.01)
    assert "certified" not in report.gate


async def test_an_uncertified_gate_stays_escalate_all_and_is_left_alone():
    uncertified = GatePolicy(max_normalized_entropy=0.3, rereads=0,
                             certificate=Certificate(max_error=0.05, confidence=0.9, rows=12, escalation_rate=1.0,
                                                     certified=False))
    model = controlled(policy=uncertified)
    for i in range(5):
        report = (await model.adecide(f"h=0.0 u{i}", {"urgent": URGENT})).reads["urgent"]
        assert report.path == "escalated" and "uncertified" in report.crossed
    assert decisions(model) == 0


async def test_an_uncertified_gate_on_its_own_threshold_is_moved_like_any_gate():
    """`calibrate(uncertified="threshold")` (issue #40): the gate keeps its own threshold and claims
    no bound, so the controller loosens it like a gate without a certificate, and its words keep
    saying it is uncertified."""
    own = Certificate(max_error=0.05, confidence=0.9, rows=12, escalation_rate=0.5, certified=False,
                      fallback="threshold")
    model = controlled(policy=GatePolicy(max_normalized_entropy=0.3, rereads=0, certificate=own))
    for i in range(5):
        report = (await model.adecide(f"h=0.6 o{i}", {"urgent": URGENT})).reads["urgent"]
        assert "uncertified" not in report.crossed
    assert gate_threshold(report) > 0.3 and decisions(model) == 5 and "uncertified" in report.gate


# -- traces and both wires ---------------------------------------------------------------------------


async def test_each_question_event_records_the_threshold_it_was_gated_with(spans):
    model = controlled(0.5)
    await loosen(model, 3)
    report = (await model.adecide("h=0.1 traced", {"urgent": URGENT})).reads["urgent"]
    assert gate_threshold(report) == round(0.5 + 3 * 0.02 * (1 - TARGET), 2)
    decide = [s for s in spans.get_finished_spans() if s.name.startswith("decide")][-1]
    event = next(e for e in decide.events if e.name == tm.QUESTION_EVENT)
    assert event.attributes[tm.FIGURE_KEYS["gate"]] == report.gate


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_both_wires_show_the_threshold_and_metrics_show_the_controller():
    model = controlled(0.5)
    app = create_app(model)
    question = {"urgent": {"type": "noul", "instructions": "Urgent?"}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        for i in range(3):
            r = await http.post("/v1/systemone", json={"state": f"h=0.9 wire {i}", "questions": question})
            assert r.status_code == 200
        body = r.json()
        d = await http.post("/v1/decisions", json={"model": "function", "input": "h=0.1 wire", "questions": [
            {"type": "predicate", "name": "urgent", "instructions": "Urgent?"}]})
        assert d.status_code == 200, d.text
        scraped = _metrics((await http.get("/metrics")).text)
    assert body["diagnostics"]["questions"]["urgent"]["gate"] == "H/lnK <= 0.53"
    assert body["answers"]["urgent"]["x_canvasroute"]["gate"] == "H/lnK <= 0.53"
    loosened = round(0.5 + 3 * 0.02 * (1 - TARGET), 2)
    assert d.json()["answers"][0]["canvasroute"]["gate"] == f"H/lnK <= {loosened:g}"
    assert scraped[("canvasroute_server_controller_target", ())] == TARGET
    assert scraped[("canvasroute_server_controller_questions", ())] == 1
    assert scraped[("canvasroute_server_controller_offset", (("stat", "max"),))] == pytest.approx(offset(model))
    assert 0 < scraped[("canvasroute_server_controller_rate", ())] < 1


def test_serve_flags_give_the_served_model_its_controller():
    from test_server import _args

    from canvasroute.apps.server import cli as serve

    base = ["--engine-url", "http://127.0.0.1:9", "--escalate-url", "http://127.0.0.1:11/v1",
            "--escalate-model", "big"]
    model = serve.build_model(_args([*base, "--target-escalation", "0.2", "--controller-step", "0.05"]))
    assert model.escalation.controller == Controller(target=0.2, step=0.05)
    assert serve.build_model(_args(base)).escalation.controller is None
    with pytest.raises(ValueError, match="needs an escalation target"):
        serve.build_model(_args(["--engine-url", "http://127.0.0.1:9", "--target-escalation", "0.2"]))
    with pytest.raises(ValueError, match="needs --target-escalation"):
        serve.build_model(_args([*base, "--controller-step", "0.05"]))
    with pytest.raises(ValueError, match=r"Controller\.target"):
        serve.build_model(_args([*base, "--target-escalation", "1.5"]))


# -- the bench ------------------------------------------------------------------------------------


def test_the_bench_figures_mean_what_they_say():
    on_target = [i % 5 == 0 for i in range(3000)]  # exactly 20 %: in 2 points once the first few decisions are in
    assert settled(on_target, 1000, TARGET, 500) == 36 and off_windows(on_target, 1500, TARGET, 500) == 0
    late = [False] * 1000 + [True] * 300 + on_target[1300:]  # 300 escalations after the drift, then 20 %
    # in 2 points once at most 12 of the burst are left in the 500-window: 1,288 + 499 = 1,787
    assert settled(late, 1000, TARGET, 500) == 787
    assert settled([True] * 2000, 1000, TARGET, 500) is None
    assert reached([0.4] * 1005 + [0.63] * 995, 1000, 0.62) == 5 and reached([0.4] * 2000, 1000, 0.62) is None


async def test_four_workers_on_one_store_hold_the_target_after_the_drift_the_bench_runs():
    """The bench's run at a small size: four concurrent workers, each its own state on one store."""
    stream = DriftStream(1400, 400, seed=35)
    base = {qid: stream.quantile(qid, 1 - TARGET, after=False) for qid in QUESTIONS}
    run = await run_stream(stream, base, Controller(target=TARGET), 4)
    for qid in QUESTIONS:
        rate = sum(run.escalated[qid][700:]) / 700
        assert abs(rate - TARGET) <= 0.02, (qid, rate)
        assert abs(sum(h > base[qid] for h in stream.entropy[qid][700:]) / 700 - TARGET) > 0.15  # fixed: off
    assert run.syncs >= 1400 // 4 // 4  # every worker read the others' shares every 4 decisions at least


@pytest.mark.slow
def test_the_bench_section_reports_the_controller_beside_fixed_and_oracle_thresholds(capsys):
    assert main(["bench", "--quick", "--json", "--only", "controller"]) == 0
    import json

    section = json.loads(capsys.readouterr().out)["sections"]["controller"]
    rows = {(r["question"], r["gate"]): r for r in section["rows"]}
    assert set(rows) == {(q, g) for q in QUESTIONS for g in ("controller", "fixed (base)", "fixed at ideal")}
    for qid in QUESTIONS:
        held, fixed = rows[qid, "controller"], rows[qid, "fixed (base)"]
        assert abs(held["rate after"] - TARGET) <= 0.02 and abs(fixed["rate after"] - TARGET) > 0.15
        assert held["settled after"] is not None and fixed["settled after"] is None
        assert held["windows off"] < rows[qid, "fixed at ideal"]["windows off"]
    assert section["workers"] == 4 and section["store_reads"] > 0
