"""One decision, carried whole (issue 28): each test is one defect where a piece of a call was
dropped between two modules, closed by building one `DecisionRequest` where a decision enters.

The test names carry the issue's item number. Items 2 and 3 (images and instructions reach the
escalation target) are in test_images.py and test_escalation.py, 8 and 16 (`serve`) in
test_server*.py, 10 and 14 (the engine's lanes and thoughts) in test_lanes*.py and
test_read_options.py, 12 (the dashboard) in test_dashboard.py.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
from conftest import fixed_engine
from lanes import LANES, State, lanes
from langchain_core.decisions import Choice, Noul
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command, RetryPolicy, Send

from canvasroute.engine import CanvasRead, DecisionError, EngineUnavailable, EscalationError, FunctionEngine, Thought
from canvasroute.harness import NodeCache, ReviewPolicy, decision_node, retry_on, route_on
from canvasroute.router import (
    CanvasDecisionModel,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    load_policy,
    save_policy,
)

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Is it urgent?")
MANY = Choice(instructions="Which product line?", criteria={f"line {i}": None for i in range(200)})
UNSURE = {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70}


class Target:
    """An escalation target answering fixed options; counts calls and the questions asked."""

    def __init__(self, answers: dict[str, str], name: str = "target") -> None:
        self.answers, self.calls, self.asked = answers, 0, 0
        self.runnable = RunnableLambda(self._reply, name=name)

    def _reply(self, msgs: Any) -> AIMessage:
        self.calls += 1
        asked = [q for q in self.answers if f'Question "{q}"' in msgs[-1].content]
        self.asked += len(asked)
        return AIMessage(json.dumps({q: self.answers[q] for q in asked}))




def thread(name: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": name}}


# -- 1: the node cache looks inside fan-out branch groups -----------------------------------------


def test_01_a_fan_out_with_a_node_cache_never_replays_a_faulted_branch():
    """`NodeCache` with `Send` fan-out (`branch=`) stored and replayed the fallback an engine fault
    produced: it never looked inside `{question_id: {branch: record}}`."""
    down = {"on": True}

    def rows(read: CanvasRead) -> list[dict[int, float]]:
        if down["on"]:
            raise EngineUnavailable("engine down")
        return [{i: -0.01 if n == 0 else -6.0 for n, i in enumerate(read.label_ids)}] * len(read.slots)

    model = CanvasDecisionModel(engine=FunctionEngine(rows), outcomes=OutcomePolicy(
        engine_fault="fallback", fallback={"relevant": "no"}))
    grade = decision_node(model, {"relevant": URGENT}, inputs="doc", branch="doc_id")
    builder = StateGraph(State)
    builder.add_node("grade", grade, cache_policy=grade.cache_policy(ttl=300))
    builder.add_conditional_edges(START, lambda s: [Send("grade", {"doc": t, "doc_id": d})
                                                    for d, t in s["docs"].items()], ["grade"])
    builder.add_edge("grade", END)
    cache = NodeCache(InMemoryCache())
    graph = builder.compile(cache=cache)
    docs = {"d1": "Refunds take five days.", "d2": "We open at nine."}
    faulted = graph.invoke({"docs": docs})["decisions"]["relevant"]
    assert {b: r["path"] for b, r in faulted.items()} == {"d1": "fallback", "d2": "fallback"}
    assert cache.refused == 2
    down["on"] = False
    healed = graph.invoke({"docs": docs})["decisions"]["relevant"]
    assert {b: (r["path"], r["answer"]) for b, r in healed.items()} == {"d1": ("canvas", "yes"),
                                                                       "d2": ("canvas", "yes")}


# -- 4, 5: store budgets: one count per model, the edge counts too ----------------------------------


def test_04_two_models_with_budgets_of_their_own_keep_their_own_store_counts():
    """Two models with their own budgets and the default name shared one store namespace: B was
    refused its first escalation because A had spent."""
    store = InMemoryStore()
    a_target, b_target = Target({"team": "tech"}, "big-a"), Target({"team": "billing"}, "big-b")
    budget = EscalationBudget(max_per_window=1)
    a = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=Escalation(a_target.runnable, budget=budget))
    b = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=Escalation(b_target.runnable, budget=budget))
    assert a.budget_scope != b.budget_scope
    ga = lanes(decision_node(a, {"team": TEAM}, inputs="ticket", route=("team", LANES)), store=store)
    gb = lanes(decision_node(b, {"team": TEAM}, inputs="ticket", route=("team", LANES)), store=store)
    assert ga.invoke({"ticket": "one"})["decisions"]["team"]["path"] == "escalated"
    assert gb.invoke({"ticket": "two"})["decisions"]["team"]["path"] == "escalated"  # its own budget
    spent = ga.invoke({"ticket": "three"})["decisions"]["team"]
    assert (spent["path"], spent["read"]["cause"]) == ("unsure", "over_budget")
    assert (a_target.calls, b_target.calls) == (1, 1)


def test_05_route_on_counts_the_graph_stores_budget_as_a_node_does():
    """`route_on` ignored the graph store's budget meter: a budget of 1 per window allowed 2."""
    store = InMemoryStore()
    target = Target({"route": "tech"})
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE),
                                escalate_to=Escalation(target.runnable, budget=EscalationBudget(max_per_window=1)))
    builder = StateGraph(State)
    builder.add_node("start", lambda state: {})
    for lane in LANES.values():
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    builder.add_edge(START, "start")
    builder.add_conditional_edges("start", route_on(model, TEAM, LANES, inputs="ticket"), LANES)
    graph = builder.compile(store=store)
    assert graph.invoke({"ticket": "one"})["lane"] == "tech"  # escalated: the target said tech
    assert graph.invoke({"ticket": "two"})["lane"] == "billing"  # over budget: the canvas answer
    assert target.calls == 1
    assert model.budget_counters["granted"] == 0  # counted in the store, not in the model's own meter
    counted = store.search(("canvasroute", "budget", model.budget_scope, "window"))
    assert len(counted) == 1


# -- 6: review and dependent questions, the mapping form -------------------------------------------


@pytest.mark.parametrize("depends_on", [
    {"urgent": {"team": {"billing"}}},                       # the mapping form
    {"urgent": {"summary": None, "team": {"billing"}}},      # the reviewed parent is not the first key
])
def test_06_review_refuses_a_reviewed_parent_in_every_form_of_depends_on(depends_on):
    """Review with the mapping form of `depends_on` raised a bare ValueError, or let a reviewed
    parent through when it was not the first key."""
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE))
    questions = {"team": TEAM, "urgent": URGENT, "summary": Noul(instructions="Is there a summary?")}
    with pytest.raises(DecisionError, match=r"review and depends_on do not combine .*'team'") as caught:
        decision_node(model, questions, route=("team", LANES), review=ReviewPolicy(), depends_on=depends_on)
    assert caught.value.hint
    reviews_children = ReviewPolicy(questions=frozenset({"urgent"}))  # a child alone may be reviewed
    decision_node(model, questions, route=("team", LANES), review=reviews_children, depends_on=depends_on)


# -- 7: every gate override reaches a calibrated question -------------------------------------------


def test_07_runtime_context_gate_and_flags_reach_per_question_fits(tmp_path):
    """`Runtime.context.gate` (and `serve`/`eval` flags, `with_overrides`) never reached a question
    that `calibrate` fitted: per-question gates kept the file's values."""
    fitted = GatePolicy(max_normalized_entropy=0.5, per_question={"team": GatePolicy(max_normalized_entropy=0.2,
                                                                                     temperature=1.7)})
    path = save_policy(tmp_path / "policy.json", fitted)
    flagged = load_policy(path).with_overrides(max_normalized_entropy=1.0)  # what a --threshold flag does
    assert flagged.for_question("team").max_normalized_entropy == 1.0
    assert flagged.for_question("team").temperature == 1.7  # the fit the flag did not name stays
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=load_policy(path))
    node = decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", LANES))
    graph = lanes(node)
    assert graph.invoke({"ticket": "x"})["decisions"]["team"]["path"] == "unsure"
    relaxed = graph.invoke({"ticket": "x"}, context={"gate": {"max_normalized_entropy": 1.0}})
    assert relaxed["decisions"]["team"]["path"] == "canvas"  # the run's gate reached the fitted question
    assert relaxed["decisions"]["team"]["read"]["gate"] == "H/lnK <= 1"


# -- 9: a fault, then a failing escalation, keeps the engine's attempts -------------------------------


def test_09_an_engine_fault_then_a_failing_escalation_is_not_retried_again_by_the_node():
    """The combined error lost the engine's `attempts`: `retry_on` then retried the node (6 engine
    requests instead of 2)."""
    requests = []

    def rows(read: CanvasRead) -> list[dict[int, float]]:
        requests.append(read)
        raise EngineUnavailable("engine down", attempts=2)  # as VLLMServerEngine(Connection(url, retries=1)) raises it

    def target(msgs: Any) -> AIMessage:
        raise ConnectionError("the escalation target is down too")

    model = CanvasDecisionModel(engine=FunctionEngine(rows), escalate_to=RunnableLambda(target))
    graph = lanes(decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", LANES)))
    builder_policy = RetryPolicy(retry_on=retry_on, max_attempts=3, initial_interval=0.001, jitter=False)
    node = decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", LANES))
    builder = StateGraph(State)
    builder.add_node("triage", node, retry_policy=builder_policy)
    builder.add_edge(START, "triage")
    for lane in LANES.values():
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    graph = builder.compile()
    with pytest.raises(EscalationError) as caught:
        graph.invoke({"ticket": "x"})
    assert caught.value.attempts == 2 and isinstance(caught.value.__cause__, EngineUnavailable)
    assert len(requests) == 1  # one read (its engine made 2 requests), not retried by the node


# -- 11: samples on a causal engine do not pretend to agree -------------------------------------------


def test_11_samples_on_a_causal_engine_read_once_and_report_no_agreement():
    """`samples=N` on a causal engine reported agreement 1.0 and stderr 0 over N identical reads."""
    engine = FunctionEngine(lambda read: [{i: -0.2 if n == 0 else -2.0 for n, i in enumerate(read.label_ids)}]
                            * len(read.slots), causal_readout=True)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(samples=4, rereads=0, max_normalized_entropy=None))
    resp = model.decide("x", {"team": TEAM})  # one question: its slot sees no noisy position before it
    team = resp.reads["team"]
    assert resp.canvas_reads == 1 and team.reads == 1 and team.rereadable is False
    assert team.agreement is None and team.stderr is None
    joint = {"isolate": "none"}  # one canvas: urgent's slot sees team's noise, so its reads vary
    both = model.decide("x", {"team": TEAM, "urgent": URGENT}, read=joint)
    assert both.canvas_reads == 4 and both.reads["team"].reads == 1 and both.reads["urgent"].reads == 4
    assert both.reads["urgent"].agreement is not None
    apart = model.decide("x", {"team": TEAM, "urgent": URGENT})  # a causal engine isolates by default
    assert apart.canvas_reads == 2 and {r.reads for r in apart.reads.values()} == {1}
    assert {r.agreement for r in apart.reads.values()} == {None}


# -- 13: a reviewer's option is recorded as they chose it --------------------------------------------


def test_13_an_agent_inbox_edit_keeps_the_options_case():
    """An Agent Inbox edit to `US` was recorded as `us` (a case-folded option lookup)."""
    region = Choice(instructions="Which region?", criteria={"us": None, "US": None, "eu": None})
    even = FunctionEngine(lambda read: [{i: math.log(1 / 3) for i in read.label_ids}] * len(read.slots))
    model = CanvasDecisionModel(engine=even, policy=GatePolicy(rereads=0))
    node = decision_node(model, {"region": region}, inputs="ticket",
                         review=ReviewPolicy(interrupt="human_interrupt"))
    builder = StateGraph(State)
    builder.add_node("triage", node)
    builder.add_edge(START, "triage")
    graph = builder.compile(checkpointer=InMemorySaver())
    graph.invoke({"ticket": "x"}, thread("inbox"))
    [request] = graph.get_state(thread("inbox")).tasks[0].interrupts[0].value
    edit = {"type": "edit", "args": {"action": request["action_request"]["action"], "args": {"region": "US"}}}
    done = graph.invoke(Command(resume=[edit]), thread("inbox"))
    assert (done["decisions"]["region"]["answer"], done["decisions"]["region"]["path"]) == ("US", "human")
    graph.invoke({"ticket": "y"}, thread("inbox2"))
    edit["args"]["args"] = {"region": "Eu"}  # no exact match: one option case-folds to it
    assert graph.invoke(Command(resume=[edit]), thread("inbox2"))["decisions"]["region"]["answer"] == "eu"


# -- 15: think, and a question read in two steps --------------------------------------------------------


class Thinker(FunctionEngine):
    """A FunctionEngine that writes a thought (its ids a function of the prompt and the seed)."""

    def __init__(self) -> None:
        super().__init__(self._rows)
        self.thoughts: list[tuple[str, int]] = []

    async def think(self, messages: Any, budget: int, *, seed: int) -> Thought:
        self.thoughts.append((messages[0]["content"], seed))
        ids = tuple((seed + len(messages[0]["content"]) + k) % 1000 for k in range(3))
        return Thought(ids=ids, text="thinking", closed=True, prompt_tokens=10)

    def _rows(self, read: CanvasRead) -> list[dict[int, float]]:
        assert read.thought is not None, "a read of a thinking decision continued no thought"
        return [{i: -0.01 if n == 0 else -7.0 for n, i in enumerate(read.label_ids)}] * len(read.slots)


def test_15_with_think_the_in_group_read_of_a_many_option_question_continues_a_thought():
    """The in-group read of a two-step question continued no thought; each prompt's thought is
    seeded by the decision (the same decision and seed write the same thought)."""
    engine = Thinker()
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    first = model.decide("an order", {"q": MANY, "team": TEAM}, read={"think": 8}, seed=5)
    assert first.reads["q"].reads == 2 and first.reads["q"].path == "canvas"  # its group, then the option
    prompts = [p for p, _ in engine.thoughts]
    assert len(prompts) == 2 and "(First: which group" in prompts[0] and "(First:" not in prompts[1]
    assert {seed for _, seed in engine.thoughts} == {5}
    assert len(first.diagnostics.thoughts) == 2
    again = model.decide("an order", {"q": MANY, "team": TEAM}, read={"think": 8}, seed=5)
    assert engine.thoughts[2:] == engine.thoughts[:2]
    assert [r.model_dump(exclude={"latency_s"}) for r in again.reads.values()] == [
        r.model_dump(exclude={"latency_s"}) for r in first.reads.values()]


# -- 17: the engine down behind a target is said, not only recorded ---------------------------------


def test_17_an_engine_fault_absorbed_by_escalation_is_logged_marked_and_counted(caplog, spans):
    """With the engine down and a target set, every decision escalated with no read and nothing was
    logged: the fault showed only inside the record."""
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    def rows(read: CanvasRead) -> list[dict[int, float]]:
        raise EngineUnavailable("vLLM is down", hint="start it")

    class Down(FunctionEngine):
        async def info(self) -> Any:
            raise EngineUnavailable("vLLM is down", hint="start it")

    reader = InMemoryMetricReader()
    from canvasroute.router.telemetry import _spans

    saved = metrics.get_meter_provider
    provider = MeterProvider(metric_readers=[reader])
    _spans._cache.pop("meter", None)
    metrics.get_meter_provider = lambda: provider  # type: ignore[assignment]
    try:
        target = Target({"team": "tech", "urgent": "no"})
        model = CanvasDecisionModel(engine=Down(rows), escalate_to=target.runnable)
        with caplog.at_level(logging.WARNING, logger="canvasroute.router"):
            resp = model.decide("x", {"team": TEAM, "urgent": URGENT})
    finally:
        metrics.get_meter_provider = saved  # type: ignore[assignment]
        _spans._cache.pop("meter", None)
    assert {r.path for r in resp.reads.values()} == {"escalated"} and target.calls == 1
    (record,) = [r for r in caplog.records if r.name == "canvasroute.router"]
    assert record.levelno == logging.WARNING
    assert "EngineUnavailable: vLLM is down" in record.getMessage() and "escalated to target" in record.getMessage()
    decide = next(s for s in spans.get_finished_spans() if s.name.startswith("decide "))
    assert decide.attributes["canvasroute.fault"] == "EngineUnavailable"
    (fault,) = [e for e in decide.events if e.name == "canvasroute.fault"]
    assert list(fault.attributes["canvasroute.fault.questions"]) == ["team", "urgent"]
    points = [p for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
              if m.name == "canvasroute.faults" for p in m.data.data_points]
    assert [(p.value, p.attributes["error.type"]) for p in points] == [(2, "EngineUnavailable")]
    assert math.isfinite(resp.latency_s)
