"""0.1 programs keep running until 0.3.0 (issue #34, point 6).

Every keyword 0.2.0 removed is accepted with one `DeprecationWarning` naming its 0.2 spelling, at
the caller's line, and decides exactly as the 0.2 spelling does: each test builds both spellings
and compares what they decide (the request's key: questions, read options, state, gate, outcomes,
seed; the reports; the connection's settings). `test_a_0_1_program_decides_as_its_0_2_spelling`
runs the Python blocks of the 0.1.0 README (`tests/legacy/README-0.1.0.md`, as `git show
f5fe812^:README.md` has it) and the 0.1 settings that README documents, beside the same program
in 0.2 spelling. pyproject's `filterwarnings` makes these warnings errors everywhere else in the
suite, so no library path (and no other test) uses a 0.1 spelling unnoticed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import fixed_engine
from langchain_core._api import LangChainBetaWarning
from langchain_core.decisions import Choice, Noul
from langchain_core.prompts import ChatPromptTemplate
from promptrows import PromptRows, pick
from pydantic import SecretStr

import canvasroute
from canvasroute.engine import (
    Batching,
    BudgetExhausted,
    CalibrationError,
    Connection,
    EngineUnavailable,
    FunctionEngine,
    Limits,
    Retries,
    Timeout,
    UnsureAnswer,
    VLLMServerEngine,
)
from canvasroute.harness import DecisionEdge, DecisionNode, decision_node, route_on
from canvasroute.router import (
    CanvasDecisionModel,
    Escalation,
    EscalationBudget,
    GatePolicy,
    InMemoryBudgetMeter,
    OutcomePolicy,
    ReadOptions,
    SystemOneDecisionModel,
    load_policy,
)
from canvasroute.router._policy import policy_to_dict
from canvasroute.router.testing import ScriptedTarget

HERE = __file__
LEGACY = Path(__file__).parent / "legacy"
TEAM = Choice(instructions="Which team owns this?", criteria={"billing": None, "technical": None})
URGENT = Noul(instructions="Does it need an answer today?")
QUESTIONS = {"team": TEAM, "urgent": URGENT}
TICKET = "I was charged twice for my subscription this month."
UNSURE = {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70}
"""Every slot near 50/50: the gate does not pass it."""
SURE = {"A": -0.01, "B": -6.0, "yes": -0.01, "no": -6.0}


@contextmanager
def old_spelling(*says: str):
    """The block warns (`DeprecationWarning`, naming the removal release), every warning at a line
    of this file (the caller's), and the warnings say each of `says`."""
    with pytest.warns(DeprecationWarning) as caught:
        yield caught
    texts = " | ".join(str(w.message) for w in caught)
    for said in says:
        assert said in texts
    assert all("(the 0.1 spelling is removed in 0.3.0)" in str(w.message) for w in caught), texts
    assert all(w.filename == HERE for w in caught), [(w.filename, w.lineno) for w in caught]


def figures(response) -> dict[str, Any]:
    """What a decision decided, per question (every report figure but its latency)."""
    return {q: r.model_dump(exclude={"latency_s"}) for q, r in response.reads.items()}


def faulty() -> FunctionEngine:
    def rows(read):
        raise EngineUnavailable("engine down")

    return FunctionEngine(rows)


def same_model(old: CanvasDecisionModel, new: CanvasDecisionModel, questions: Any = QUESTIONS) -> None:
    """Both models make the same requests (the key covers questions, read, gate, outcomes, seed)."""
    assert (old.policy, old.outcomes, old.read) == (new.policy, new.outcomes, new.read)
    assert type(old.policy) is GatePolicy  # the 0.1 keywords are gone once the model has mapped them
    assert old.request(TICKET, questions).key == new.request(TICKET, questions).key


def same_decision(old: CanvasDecisionModel, new: CanvasDecisionModel, questions: Any = QUESTIONS) -> Any:
    """Both decide the same (or raise the same error); returns the 0.2 spelling's response or error."""
    results = []
    for model in (old, new):
        try:
            results.append(figures(model.decide(TICKET, questions)))
        except Exception as exc:  # noqa: BLE001 - the same error is the same decision
            results.append((type(exc), str(exc)))
    assert results[0] == results[1]
    return results[1]


# -- GatePolicy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["answer", "fallback", "raise", "review"])
def test_on_unsure_is_the_models_uncertain_outcome_without_a_target(action):
    fallback = {"fallback": {"team": "billing", "urgent": "no"}}
    with old_spelling("GatePolicy: on_unsure= is the model's OutcomePolicy(uncertain=...)"):
        old = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(on_unsure=action, rereads=0),
                                  outcomes=OutcomePolicy(**fallback))
    new = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                              outcomes=OutcomePolicy(uncertain=action, **fallback))
    same_model(old, new)
    decided = same_decision(old, new)
    if action == "raise":
        assert decided[0] is UnsureAnswer
    else:
        assert decided["team"]["path"] == ("fallback" if action == "fallback" else "unsure")


def test_on_unsure_beside_a_target_escalates_as_in_0_1():
    """0.1 asked `on_unsure` only when nothing could answer instead: with a target it escalated."""
    with old_spelling("on_unsure="):
        policy = GatePolicy(on_unsure="raise", rereads=0)
    old = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=policy,
                              escalate_to=ScriptedTarget(script={"team": "technical", "urgent": "yes"}))
    new = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=0),
                              escalate_to=ScriptedTarget(script={"team": "technical", "urgent": "yes"}))
    same_model(old, new)
    assert old.outcomes.uncertain == "escalate"
    assert same_decision(old, new)["team"]["path"] == "escalated"


def test_on_abstain_is_the_models_abstained_outcome():
    rows = PromptRows(pick("none of these / can't tell", 0.8))
    with old_spelling("GatePolicy: on_abstain= is the model's OutcomePolicy(abstained=...)",
                      "CanvasDecisionModel: fallback= is outcomes=OutcomePolicy(fallback=...)"):
        old = CanvasDecisionModel(engine=rows.engine, fallback={"team": "billing"},
                                  policy=GatePolicy(abstain=True, on_abstain="fallback", rereads=0))
    new = CanvasDecisionModel(engine=PromptRows(pick("none of these / can't tell", 0.8)).engine,
                              policy=GatePolicy(abstain=True, rereads=0),
                              outcomes=OutcomePolicy(abstained="fallback", fallback={"team": "billing"}))
    same_model(old, new, {"team": TEAM})
    decided = same_decision(old, new, {"team": TEAM})
    assert (decided["team"]["path"], decided["team"]["cause"], decided["team"]["answer"]) == (
        "fallback", "abstained", "billing")


def test_per_question_policies_keep_their_0_1_keywords_when_they_agree_and_are_refused_when_not():
    with old_spelling("on_unsure="):
        agree = GatePolicy(on_unsure="raise", per_question={"team": GatePolicy(min_margin=0.3, on_unsure="raise")})
        differ = GatePolicy(per_question={"team": GatePolicy(on_unsure="raise")})
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=agree)
    assert model.outcomes.uncertain == "raise" and model.policy.per_question["team"] == GatePolicy(min_margin=0.3)
    # 0.1 read on_unsure per question (an override replaced the whole policy): 0.2 has one outcome per model
    with pytest.raises(ValueError, match=r"GatePolicy\(on_unsure=...\) differs between questions "
                                         r"\(every other question: 'answer', question 'team': 'raise'"):
        CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=differ)
    # with a target 0.1 escalated every question whatever it said: nothing differs
    target = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=differ, escalate_to=ScriptedTarget(script={}))
    assert target.outcomes == OutcomePolicy()


def test_a_gate_keeps_its_0_1_keywords_through_its_copies():
    with old_spelling("on_unsure="):
        policy = GatePolicy(on_unsure="review")
    for copy in (policy.with_overrides(rereads=0), canvasroute.router.resolve_gate(policy, {"rereads": 0})):
        assert CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=copy).outcomes.uncertain == "review"
    with pytest.raises(ValueError, match="on_unsure must be one of answer, fallback, raise, review, not 'maybe'"):
        GatePolicy(on_unsure="maybe")
    assert policy_to_dict(policy) == policy_to_dict(GatePolicy())  # a saved policy holds no outcome


def test_a_requests_gate_with_0_1_keywords_is_that_decisions_outcome():
    """`decide(gate=...)`, `Runtime.context.gate` and an `invoke` request's `gate` (0.1: `policy`)."""
    new = CanvasDecisionModel(engine=fixed_engine(UNSURE), outcomes=OutcomePolicy(uncertain="raise"))
    old = CanvasDecisionModel(engine=fixed_engine(UNSURE))
    with old_spelling("on_unsure="):
        layer = GatePolicy(on_unsure="raise", rereads=0)
    assert old.request(TICKET, QUESTIONS, gate=layer).key == new.request(TICKET, QUESTIONS, gate={"rereads": 0}).key
    with old_spelling("gate: on_unsure= is the model's OutcomePolicy(uncertain=...)"):
        as_dict = old.request(TICKET, QUESTIONS, gate={"on_unsure": "raise", "rereads": 0})
    assert as_dict.key == new.request(TICKET, QUESTIONS, gate={"rereads": 0}).key
    assert old.outcomes == OutcomePolicy()  # the model's own outcomes are untouched


def test_a_requests_gate_with_0_1_keywords_in_a_per_question_policy_is_not_dropped():
    """0.1 replaced the whole policy per question: one question's own `on_unsure` is an outcome
    0.2 cannot say for one question, so it is refused as on the model's policy, never ignored."""
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE))
    with old_spelling("on_unsure="):
        inner = GatePolicy(on_unsure="raise", rereads=0)
    with pytest.raises(ValueError, match=r"question 'team': 'raise'.*set OutcomePolicy\(uncertain=...\) on the model"):
        model.request(TICKET, QUESTIONS, gate=GatePolicy(per_question={"team": inner}))
    with old_spelling("on_unsure="):
        same = GatePolicy(on_unsure="answer", rereads=0)  # what every other question does: nothing to refuse
    built = model.request(TICKET, QUESTIONS, gate=GatePolicy(per_question={"team": same}))
    new = CanvasDecisionModel(engine=fixed_engine(UNSURE), outcomes=OutcomePolicy(uncertain="answer"))
    plain = GatePolicy(per_question={"team": GatePolicy(rereads=0)})
    assert built.key == new.request(TICKET, QUESTIONS, gate=plain).key


# -- CanvasDecisionModel ---------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["escalate", "raise", "fallback"])
def test_on_engine_error_and_fallback_are_outcomes(action):
    fallback = {"team": "billing", "urgent": "no"}
    target = {"escalate_to": ScriptedTarget(script={"team": "technical", "urgent": "yes"})}
    with old_spelling("on_engine_error= is outcomes=OutcomePolicy(engine_fault=...)"):
        old = CanvasDecisionModel(engine=faulty(), on_engine_error=action, fallback=fallback, **target)
    new = CanvasDecisionModel(engine=faulty(), outcomes=OutcomePolicy(engine_fault=action, fallback=fallback),
                              escalate_to=ScriptedTarget(script={"team": "technical", "urgent": "yes"}))
    same_model(old, new)
    decided = same_decision(old, new)
    assert decided[0] is EngineUnavailable if action == "raise" else decided["team"]["path"] == {
        "escalate": "escalated", "fallback": "fallback"}[action]


@pytest.mark.parametrize(("spent", "over_budget"), [("keep", "answer"), ("answer", "answer"),
                                                     ("fallback", "fallback"), ("raise", "raise")])
def test_the_budget_and_when_spent_are_the_escalation_and_its_over_budget_outcome(spent, over_budget):
    fallback = {"team": "billing", "urgent": "no"}
    with old_spelling("CanvasDecisionModel: budget= is escalate_to=Escalation(target, budget=...)",
                      "EscalationBudget: when_spent= is the model's OutcomePolicy(over_budget=...) ('keep' is "
                      "'answer')"):
        old = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=ScriptedTarget(script={}),
                                  budget=EscalationBudget(max_per_window=0, when_spent=spent), fallback=fallback)
    spent_target = Escalation(ScriptedTarget(script={}), budget=EscalationBudget(max_per_window=0))
    new = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=spent_target,
                              outcomes=OutcomePolicy(over_budget=over_budget, fallback=fallback))
    same_model(old, new)
    assert type(old.escalation.budget) is EscalationBudget and old.escalation.budget == new.escalation.budget
    assert old.budget_scope == new.budget_scope  # a store counts both in one namespace
    decided = same_decision(old, new)
    assert decided[0] is BudgetExhausted if over_budget == "raise" else (
        decided["team"]["cause"], decided["team"]["path"]) == (
        "over_budget", {"answer": "unsure", "fallback": "fallback"}[over_budget])


def test_the_escalation_settings_are_one_escalation():
    prompt = ChatPromptTemplate.from_messages([("human", "{state}\n{questions}\n{keys}")])
    meter = InMemoryBudgetMeter(EscalationBudget(max_per_window=5))
    target = ScriptedTarget(script={"team": "technical", "urgent": "yes"})
    with old_spelling("escalation_timeout= is escalate_to=Escalation(target, timeout=...)",
                      "escalation_prompt= is escalate_to=Escalation(target, prompt=...)",
                      "escalation_output= is escalate_to=Escalation(target, output=...)",
                      "budget_meter= is escalate_to=Escalation(target, meter=...)"):
        old = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=target, escalation_timeout=5.0,
                                  escalation_prompt=prompt, escalation_output="text",
                                  budget=EscalationBudget(max_per_window=5), budget_meter=meter)
    new = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=Escalation(
        target, timeout=5.0, prompt=prompt, output="text", budget=EscalationBudget(max_per_window=5), meter=meter))
    same_model(old, new)
    assert old.escalation == new.escalation
    assert same_decision(old, new)["team"]["path"] == "escalated"
    with old_spelling("budget_meter="), pytest.raises(ValueError, match="budget_meter needs budget="):
        CanvasDecisionModel(engine=fixed_engine(SURE), escalate_to=target, budget_meter=meter)
    with old_spelling("budget_meter="):  # the budget in the 0.2 spelling beside the meter in the 0.1 one
        mixed = CanvasDecisionModel(engine=fixed_engine(UNSURE), escalate_to=Escalation(
            target, budget=EscalationBudget(max_per_window=5)), budget_meter=meter)
    assert mixed.escalation.meter is meter and mixed.escalation.budget == EscalationBudget(max_per_window=5)


def test_constrained_is_a_read_option():
    with old_spelling("constrained= is read=ReadOptions(constrained=...)"):
        old = CanvasDecisionModel(engine=fixed_engine(SURE), constrained=False, read={"isolate": "none"})
    new = CanvasDecisionModel(engine=fixed_engine(SURE), read=ReadOptions(constrained=False, isolate="none"))
    same_model(old, new)
    assert same_decision(old, new)["team"]["label_mass"] is not None  # unconstrained: measured


def test_both_spellings_of_one_setting_are_refused():
    target = ScriptedTarget(script={})
    cases = [
        (lambda: CanvasDecisionModel(engine=faulty(), on_engine_error="raise", outcomes=OutcomePolicy(
            engine_fault="fallback", fallback={"team": "billing"})), "on_engine_error= means OutcomePolicy"),
        (lambda: CanvasDecisionModel(engine=faulty(), policy=GatePolicy(on_unsure="raise"),
                                     outcomes=OutcomePolicy(uncertain="review")), "GatePolicy(on_unsure=...) means"),
        (lambda: CanvasDecisionModel(engine=faulty(), fallback={"team": "tech"},
                                     outcomes=OutcomePolicy(fallback={"team": "billing"})), "fallback= beside"),
        (lambda: CanvasDecisionModel(engine=faulty(), escalate_to=Escalation(target, timeout=5),
                                     escalation_timeout=10), "escalation_timeout= beside escalate_to=Escalation"),
        (lambda: CanvasDecisionModel(engine=faulty(), constrained=True, read={"constrained": False}),
         "constrained= beside"),
        (lambda: CanvasDecisionModel(engine=fixed_engine(SURE)).decide(TICKET, QUESTIONS, policy=GatePolicy(),
                                                                       gate={"rereads": 0}), "policy= is the 0.1"),
        (lambda: CanvasDecisionModel(engine=fixed_engine(SURE)).decide(
            TICKET, QUESTIONS, instructions="x", read={"instructions": "y"}), "instructions= beside read="),
        (lambda: decision_node(CanvasDecisionModel(engine=faulty()), QUESTIONS, read_options={}, read={}),
         "read_options= is the 0.1 spelling of read="),
        (lambda: VLLMServerEngine(Connection("http://127.0.0.1:9"), max_retries=0), "beside a Connection"),
        (lambda: VLLMServerEngine("http://127.0.0.1:9", base_url="http://127.0.0.1:9"), "give one of them"),
        (lambda: SystemOneDecisionModel(Connection("http://127.0.0.1:9"), model="m", timeout=5), "beside a Connection"),
    ]
    for build, says in cases:
        with pytest.raises(TypeError, match=re.escape(says)), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            build()


# -- a decision's keywords -------------------------------------------------------------------------


@pytest.fixture
def asked(monkeypatch):
    """The requests `arun` is given (it answers nothing)."""
    seen = []

    async def arun(self, request):
        seen.append(request)
        return canvasroute.router.CanvasResponse(model="m", answers={})

    monkeypatch.setattr(CanvasDecisionModel, "arun", arun)
    return seen


@pytest.mark.parametrize("reads", [{"instructions": "EU customers", "alone": {"urgent"}, "steps": 2, "think": 16},
                                   {"images": ["data:image/png;base64,iVBORw0KGgo="]}], ids=["text", "images"])
async def test_decides_0_1_keywords_are_the_requests_own(asked, reads):
    budget = EscalationBudget(max_per_window=3)
    model = CanvasDecisionModel(engine=fixed_engine(SURE), escalate_to=Escalation(ScriptedTarget(script={}),
                                                                                budget=budget))
    meter = InMemoryBudgetMeter(budget)
    old = {"policy": GatePolicy(rereads=0), **reads, "budget_meter": meter, "seed": 7}
    name = next(iter(reads))
    with old_spelling("CanvasDecisionModel.decide: policy= is gate=", f"{name}= is read={{'{name}': ...}}",
                      "budget_meter= is model.arun(model.request(...).metered(meter))"):
        model.decide(TICKET, QUESTIONS, **old)
    with old_spelling("CanvasDecisionModel.adecide: policy= is gate="):
        await model.adecide(TICKET, QUESTIONS, **old)
    with old_spelling("CanvasDecisionModel.invoke: policy= is gate="):
        model.invoke({"state": TICKET, "questions": QUESTIONS, **old})
    spelled = model.request(TICKET, QUESTIONS, gate=GatePolicy(rereads=0), read=reads, seed=7).metered(meter)
    assert len(asked) == 3
    for request in asked:
        assert request.key == spelled.key and request.read == spelled.read and request.state == spelled.state
        assert request.escalation.meter is meter
    with pytest.raises(canvasroute.engine.DecisionError, match=r"no key\(s\) \['colour'\]"):
        model.invoke({"state": TICKET, "questions": QUESTIONS, "colour": "red"})


# -- the harness -----------------------------------------------------------------------------------


def test_read_options_is_read_on_nodes_and_edges():
    model = CanvasDecisionModel(engine=fixed_engine(SURE))
    read = {"instructions": "EU customers", "alone": {"urgent"}}
    paths = {"billing": "a", "technical": "b"}
    with old_spelling("decision_node: read_options= is read="):
        node = decision_node(model, QUESTIONS, read_options=read)
    with old_spelling("route_on: read_options= is read="):
        edge = route_on(model, TEAM, paths, read_options={"instructions": "EU customers"})
    with old_spelling("DecisionNode: read_options= is read=", "DecisionEdge: read_options= is read="):
        built = DecisionNode(model, QUESTIONS, inputs=None, route=None, output_key="decisions", name=None,
                             review=None, destinations=None, read_options=read)
        DecisionEdge(model, TEAM, paths, inputs=None, question_id="route", read_options={"instructions": "EU"})
    assert node.read == built.read == decision_node(model, QUESTIONS, read=read).read
    assert edge.read == route_on(model, TEAM, paths, read={"instructions": "EU customers"}).read


# -- engines and clients ---------------------------------------------------------------------------


def settings(connection: Connection) -> tuple[Any, ...]:
    return (connection.urls, connection.timeout, connection.limits, connection.retries, connection.verify,
            connection.cert, connection.trust_env, connection.transport, connection._headers)


def test_the_vllm_engines_transport_keywords_are_its_connection():
    import httpx

    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    old = {"api_key": "k", "timeout": 12.0, "connect_timeout": 2.0, "max_concurrency": 4, "max_retries": 0,
           "backoff": 0.5, "replica_cooldown": 1.0, "verify": False, "cert": None, "keepalive_expiry": 1.0,
           "max_response_bytes": 1024, "trust_env": False, "transport": transport}
    with old_spelling(*(f"{name}= is Connection(url" for name in old)):
        engine = VLLMServerEngine("http://127.0.0.1:9", model="m", **old)
    spelled = VLLMServerEngine(Connection(
        "http://127.0.0.1:9", api_key="k", timeout=Timeout(read=12.0, connect=2.0),
        limits=Limits(max_concurrency=4, keepalive_expiry=1.0, max_response_bytes=1024),
        retries=Retries(max_retries=0, backoff=0.5, replica_cooldown=1.0), verify=False, trust_env=False,
        transport=transport), model="m")
    assert settings(engine.connection) == settings(spelled.connection)
    assert repr(engine) == repr(spelled)
    with old_spelling("VLLMServerEngine: base_url= is the first argument, connection"):
        by_name = VLLMServerEngine(base_url=["http://127.0.0.1:9", "http://127.0.0.1:10"], max_retries=1)
    assert settings(by_name.connection) == settings(Connection(["http://127.0.0.1:9", "http://127.0.0.1:10"],
                                                               retries=1))


def test_the_system_one_clients_transport_fields_are_its_connection():
    import httpx

    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    old = {"api_key": SecretStr("k"), "timeout": 9.0, "max_retries": 1, "backoff": 0.1, "max_connections": 8,
           "verify": False, "cert": None, "transport": transport}
    with old_spelling("SystemOneDecisionModel: api_key= is Connection(url, api_key=...)",
                      "timeout= is Connection(url, timeout=Timeout(read=...))",
                      "max_connections= is Connection(url, limits=Limits(max_concurrency=...))"):
        client = SystemOneDecisionModel("http://127.0.0.1:9/", model="jev", **old)
    spelled = SystemOneDecisionModel(Connection("http://127.0.0.1:9", api_key="k", timeout=9.0, retries=Retries(
        max_retries=1, backoff=0.1), limits=Limits(max_concurrency=8), verify=False, transport=transport), model="jev")
    assert settings(client.connection) == settings(spelled.connection) and repr(client) == repr(spelled)
    with old_spelling("base_url= is the first argument (connection)"):
        named = SystemOneDecisionModel(base_url="http://127.0.0.1:9", model="jev", max_retries=0)
    assert settings(named.connection) == settings(Connection("http://127.0.0.1:9", retries=0))


def test_the_transformers_engines_batching_keywords_are_one_batching(tiny_dgemma_dir):
    from canvasroute.engine import TransformersEngine

    spelled = TransformersEngine.from_pretrained(tiny_dgemma_dir, batching=Batching(max_batch=4, window_s=0.01,
                                                                                   max_queue=8))
    loaded = (spelled.model, spelled.tokenizer)  # one load: the constructor is what is under test
    with old_spelling("TransformersEngine: max_batch= is batching=Batching(max_batch=...)",
                      "batch_window_s= is batching=Batching(window_s=...)",
                      "max_queue= is batching=Batching(max_queue=...)",
                      "canvas_prefix= is gone (the engine works out its canvas prefix",
                      "end_of_turn= is gone (the engine works out its end of turn"):
        engine = TransformersEngine(*loaded, max_batch=4, batch_window_s=0.01, max_queue=8, canvas_prefix="<x>",
                                    end_of_turn="<y>")
    assert [(b.max_batch, b.window_s, b.max_queue) for b in (engine._batcher, spelled._batcher)] == [(4, 0.01, 8)] * 2
    # 0.1's overrides of what the engine reports still apply (0.2 has no spelling for them)
    assert asyncio.run(engine.info()) == dataclasses.replace(asyncio.run(spelled.info()), canvas_prefix="<x>",
                                                             end_of_turn="<y>")
    with old_spelling("max_batch="), pytest.raises(TypeError, match="beside batching="):
        TransformersEngine(*loaded, max_batch=4, batching=Batching(window_s=1.0))


# -- policy files ----------------------------------------------------------------------------------


def test_a_0_1_policy_file_loads_and_its_outcome_keys_reach_the_model(tmp_path):
    fits = {"max_normalized_entropy": 0.4, "temperature": 1.5, "rereads": 2}
    written = {"format": "canvasroute.policy/1", "policy": {  # as 0.1's calibrate wrote one: every key, defaults too
        "max_normalized_entropy": 0.5, "on_unsure": "answer", "on_abstain": "escalate",
        "per_question": {"team": {**fits, "on_unsure": "answer", "on_abstain": "escalate"}}}}
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(written))
    with old_spelling("policy file: on_abstain= is the model's OutcomePolicy(abstained=...)"):
        loaded = load_policy(path)
    assert loaded == GatePolicy(per_question={"team": GatePolicy(**fits)})  # defaults: what 0.2's defaults mean
    written["policy"]["on_unsure"] = "review"
    written["policy"]["per_question"]["team"]["on_unsure"] = "review"
    path.write_text(json.dumps(written))
    with old_spelling("policy file: on_abstain="):
        reviewed = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=load_policy(path))
    assert reviewed.outcomes == OutcomePolicy(uncertain="review") and reviewed.policy == loaded
    written["policy"]["on_unsure"] = "later"
    path.write_text(json.dumps(written))
    with old_spelling("policy file"), pytest.raises(CalibrationError, match="on_unsure must be one of"):
        load_policy(path)


# -- where the warning points, and how often ------------------------------------------------------


def test_the_warning_names_the_callers_line_once_per_call_site():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default action: once per location
        for _ in range(3):
            GatePolicy(on_abstain="fallback")  # one site
        GatePolicy(on_abstain="fallback")  # another
    lines = [(w.filename, w.lineno) for w in caught]
    assert len(caught) == 2 and {f for f, _ in lines} == {HERE}
    assert lines[1][1] == lines[0][1] + 1 and all(w.category is DeprecationWarning for w in caught)


# -- a 0.1 program ---------------------------------------------------------------------------------


def offline_engine(url: Any = None, **kwargs: Any) -> FunctionEngine:
    """Stands in for `VLLMServerEngine(url, ...)` (built for real first, so its keywords are
    checked and warned about). The README's reads are sure (as tests/test_readme.py's are: its
    escalation target is a server); the program's (its instructions name EU customers) fail when
    the ticket names an outage, and else read each slot sure on one label or near 50/50, by a hash
    of the canvas and the slot."""
    VLLMServerEngine(url, **kwargs)

    def rows(read):
        prompt = json.dumps(read.messages)
        if "EU" in prompt and "outage" in prompt:
            raise EngineUnavailable("the engine is down")
        out = []
        for k in range(len(read.slots)):
            digest = hashlib.sha256(json.dumps([read.canvas, read.messages, k]).encode()).digest()
            if "EU" not in prompt:  # first or second label, sure
                first, second = (-0.01, -6.0) if digest[0] % 2 == 0 else (-6.0, -0.01)
                out.append({fake.token_id("A"): first, fake.token_id("B"): second, fake.token_id("yes"): first,
                            fake.token_id("no"): second})
                continue
            ids = list(read.label_ids)
            sure = ids[digest[0] % len(ids)] if digest[1] % 3 else None
            out.append({i: (-0.01 if i == sure else -6.0) if sure is not None else -1.0 for i in ids})
        return out

    fake = FunctionEngine(rows)
    return fake


PROGRAM_0_1 = '''
from canvasroute import CanvasDecisionModel, EscalationBudget, GatePolicy, VLLMServerEngine, decision_node
from canvasroute.router.testing import ScriptedTarget

urgent = Noul(instructions="Does it need an answer today?")
tuned = CanvasDecisionModel(
    engine=VLLMServerEngine("http://127.0.0.1:8000", timeout=30, max_retries=0),
    policy=GatePolicy(max_normalized_entropy=0.3, rereads=1, abstain=True, on_abstain="fallback"),
    escalate_to=ScriptedTarget(script={"team": "technical", "urgent": "yes"}),
    budget=EscalationBudget(max_per_window=2, when_spent="fallback"),
    on_engine_error="fallback",
    fallback={"team": "billing", "urgent": "no"},
    escalation_timeout=20,
)
tickets = ["Refund the second charge.", "The app crashes on start.", "Our outage started an hour ago.",
           "Can I change my plan?", "Login fails with error 500.", "Invoice is missing VAT."]
decided = [tuned.decide(t, {"team": team, "urgent": urgent}, instructions="Tickets come from EU customers.")
           for t in tickets]
triage = decision_node(tuned, {"team": team}, inputs="ticket", read_options={"instructions": "EU tickets."},
                       route=("team", {"billing": "billing", "technical": "tech"}))
lanes = StateGraph(TicketState)  # the README's state and lanes, routed by the tuned node
lanes.add_node("triage", triage)
lanes.add_node("billing", lambda state: {"handled_by": "billing"})
lanes.add_node("tech", lambda state: {"handled_by": "tech"})
lanes.add_edge(START, "triage")
lanes.add_edge("billing", END)
lanes.add_edge("tech", END)
routed = [lanes.compile().invoke({"ticket": t}) for t in tickets]
'''
"""The 0.1 settings the 0.1.0 README documents (abstain with `on_abstain`, a budget with `when_spent`,
`on_engine_error` and `fallback`, the escalation's timeout, read options per call and per node),
in the 0.1 spelling; it continues the README's blocks (`team` and `Noul` are theirs)."""

PROGRAM_0_2 = '''
from canvasroute import (CanvasDecisionModel, Connection, Escalation, EscalationBudget, GatePolicy, OutcomePolicy,
                         Timeout, VLLMServerEngine, decision_node)
from canvasroute.router.testing import ScriptedTarget

urgent = Noul(instructions="Does it need an answer today?")
tuned = CanvasDecisionModel(
    engine=VLLMServerEngine(Connection("http://127.0.0.1:8000", timeout=Timeout(read=30), retries=0)),
    policy=GatePolicy(max_normalized_entropy=0.3, rereads=1, abstain=True),
    escalate_to=Escalation(ScriptedTarget(script={"team": "technical", "urgent": "yes"}), timeout=20,
                           budget=EscalationBudget(max_per_window=2)),
    outcomes=OutcomePolicy(abstained="fallback", over_budget="fallback", engine_fault="fallback",
                           fallback={"team": "billing", "urgent": "no"}),
)
tickets = ["Refund the second charge.", "The app crashes on start.", "Our outage started an hour ago.",
           "Can I change my plan?", "Login fails with error 500.", "Invoice is missing VAT."]
decided = [tuned.decide(t, {"team": team, "urgent": urgent}, read={"instructions": "Tickets come from EU customers."})
           for t in tickets]
triage = decision_node(tuned, {"team": team}, inputs="ticket", read={"instructions": "EU tickets."},
                       route=("team", {"billing": "billing", "technical": "tech"}))
lanes = StateGraph(TicketState)  # the README's state and lanes, routed by the tuned node
lanes.add_node("triage", triage)
lanes.add_node("billing", lambda state: {"handled_by": "billing"})
lanes.add_node("tech", lambda state: {"handled_by": "tech"})
lanes.add_edge(START, "triage")
lanes.add_edge("billing", END)
lanes.add_edge("tech", END)
routed = [lanes.compile().invoke({"ticket": t}) for t in tickets]
'''
"""`PROGRAM_0_1` in 0.2 spelling."""


def run_program(monkeypatch, program: str) -> dict[str, Any]:
    readme = (LEGACY / "README-0.1.0.md").read_text(encoding="utf-8")
    blocks = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE)
              if lang == "python"]
    assert len(blocks) == 4
    monkeypatch.setattr(canvasroute, "VLLMServerEngine", offline_engine)
    session: dict[str, Any] = {"__name__": "program"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LangChainBetaWarning)  # the 0.1.0 README's agent block: a beta API
        for n, code in enumerate([*blocks, program], 1):  # one session: the 0.1.0 README's blocks continue
            exec(compile(code, f"0.1 program block {n}", "exec", dont_inherit=True), session)
    graph = session["builder"].compile()
    return {
        "usage": figures(session["resp"]),
        "graph": {k: v for k, v in session["out"]["decisions"]["team"].items() if k not in ("timing", "totals")},
        "testing": session["sure"].invoke({"state": "Refund me", "questions": {"team": session["team"]}})
        .answers["team"].choice,
        "tuned": [figures(r) for r in session["decided"]],
        "node": session["triage"].read,
        "routed": [(out["handled_by"], {k: v for k, v in out["decisions"]["team"].items()
                                        if k not in ("timing", "totals")}) for out in session["routed"]],
        "drawn": graph.get_graph().draw_mermaid(),
    }


def test_a_0_1_program_decides_as_its_0_2_spelling(monkeypatch):
    with pytest.warns(DeprecationWarning) as caught:
        old = run_program(monkeypatch, PROGRAM_0_1)
    said = " | ".join(str(w.message) for w in caught)
    for keyword in ("timeout=", "max_retries=", "on_abstain=", "budget=", "when_spent=", "on_engine_error=",
                    "fallback=", "escalation_timeout=", "instructions=", "read_options="):
        assert keyword in said
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the 0.2 spelling warns about nothing
        new = run_program(monkeypatch, PROGRAM_0_2)
    assert old == new
    paths = {r[q]["path"] for r in old["tuned"] for q in r}
    assert {"escalated", "fallback"} <= paths  # the settings mattered: escalations, then the spent budget's fallback
    assert {r["team"]["cause"] for r in old["tuned"]} >= {"engine_fault"}  # the outage ticket's fault, absorbed
