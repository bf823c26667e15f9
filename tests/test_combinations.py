"""Features together (issue 21): each test is one defect found where two features meet.

Faults, caches and budgets (1-7), review, shadow, abstain and dependent questions (8-12),
inputs users really pass (13-15), saying what happened (16-17). The test names carry the
item's number. Faults come from a `FunctionEngine` whose function raises at a chosen read,
real HTTP (a `VLLMServerEngine` and `ChatOpenAI` against closed ports, the real vLLM
server behind a proxy-like transport) where a client's behaviour is the point.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import math
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from background import job
from conftest import ROOT, _free_port, fixed_engine
from deadlines import Watch, finish
from langchain_core.decisions import Choice, Noul
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableLambda
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command
from promptrows import PromptRows, by_instructions, pick
from pydantic import BaseModel
from services import child_env
from typing_extensions import TypedDict

from canvasroute.apps.calibration.rows import Row
from canvasroute.apps.eval import evaluate
from canvasroute.engine import (
    Connection,
    DecisionError,
    EngineResponseError,
    EngineUnavailable,
    EscalationError,
    FunctionEngine,
    ImagesUnsupported,
    InputTooLong,
    Timeout,
    UnsureAnswer,
    VLLMServerEngine,
)
from canvasroute.engine.testing import LoopbackVLLM
from canvasroute.harness import DECISION_EVENT, NodeCache, ReviewPolicy, decision_node, merge_decisions
from canvasroute.router import (
    CanvasDecisionModel,
    DecisionCache,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    parse_questions,
    render_state,
    state_images,
)
from canvasroute.router._plan import messages, plan

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Is it urgent?")
MANY = Choice(instructions="Which product line?", criteria={f"line {i}": None for i in range(200)})
NO_GATE = GatePolicy(max_normalized_entropy=None, rereads=0)
SURE = {"A": -0.05, "B": -4.0, "yes": -0.05, "no": -4.0}
UNSURE = {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70}
GROUP_READ = "(First: which group"
"""What the group read of a question read in two steps has in its instructions."""


class Target:
    """An escalation target (a Runnable chat stand-in) answering fixed options; counts calls."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.calls = answers, 0
        self.runnable = RunnableLambda(self._reply, name="target")

    def _reply(self, msgs: Any) -> AIMessage:
        self.calls += 1
        asked = [q for q in self.answers if f'Question "{q}"' in msgs[-1].content]
        return AIMessage(json.dumps({q: self.answers[q] for q in asked}))


def peaked(read, p: float = 0.9) -> list[dict[int, float]]:
    """Every slot: probability p on the read's first label id, the rest shared."""
    ids = read.label_ids
    rest = math.log((1 - p) / (len(ids) - 1))
    return [{i: math.log(p) if n == 0 else rest for n, i in enumerate(ids)} for _ in read.slots]


class State(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def lanes(node, *, cache=None, checkpointer=None, cache_policy=None):
    builder = StateGraph(State)
    builder.add_node("triage", node, cache_policy=cache_policy)
    builder.add_edge(START, "triage")
    for lane in ("billing", "tech"):
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    return builder.compile(cache=cache, checkpointer=checkpointer)


# -- 1-7: faults, caches and budgets ----------------------------------------------------------


@pytest.mark.parametrize("failing", ["reread", "in_group"])
@pytest.mark.parametrize("expensive", ["escalate", "fallback"])
async def test_01_a_fault_in_either_read_of_a_many_option_question_fails_expensive(failing, expensive):
    """A question read in two steps (group, then option): a failed re-read of the group or a
    failed in-group read escalates or takes the fallback, like any fault (it crashed with a
    bare `ValueError: zip() ...` from the group's 2-entry distribution)."""
    group_reads = []

    def rows(read):
        grouped = GROUP_READ in read.messages[0]["content"]
        group_reads.append(grouped)
        kind = ("first" if group_reads.count(True) == 1 else "reread") if grouped else "in_group"
        if kind == failing:
            raise EngineUnavailable("engine down")
        return peaked(read, 0.6 if grouped else 0.9)  # the group read stays unsure: it is re-read

    target = Target({"q": "line 7"})
    extra = ({"escalate_to": target.runnable} if expensive == "escalate"
             else {"outcomes": OutcomePolicy(engine_fault="fallback", fallback={"q": "line 3"})})
    model = CanvasDecisionModel(engine=FunctionEngine(rows), policy=GatePolicy(rereads=1), **extra)
    r = (await model.adecide("an order", {"q": MANY})).reads["q"]
    assert r.error == "EngineUnavailable: engine down" and not r.confident
    assert r.canvas_probabilities is None  # the group's distribution is no distribution over the options
    if expensive == "escalate":
        assert (r.path, r.answer, r.escalation_model, target.calls) == ("escalated", "line 7", "target", 1)
    else:
        assert (r.path, r.answer) == ("fallback", "line 3")


async def _state_fitting_the_group_read_only(engine, max_model_len: int) -> str:
    """A state that fits MANY's group read but not its in-group reads."""
    the_plan = await plan(engine, parse_questions({"q": MANY}))
    spec, route = the_plan.specs["q"], the_plan.routes["q"]

    async def need(chunk, state: str) -> int:
        return await engine.count_prompt(messages(chunk, state)) + chunk.width

    group = the_plan.chunks[0]
    members = [(await plan(engine, {"q": route.member_spec(spec, g)})).chunks[0] for g in range(len(route.groups))]
    lo, hi = 0, max_model_len
    while lo < hi:  # the most words the group read takes
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if await need(group, " ".join(["word"] * mid)) <= max_model_len else (lo, mid - 1)
    state = " ".join(["word"] * lo)
    assert min([await need(m, state) for m in members]) > max_model_len
    return state


async def test_02_the_in_group_read_is_length_checked_before_any_read():
    """Every read a plan can send is checked before the first one: a state that fits the
    group read but not the in-group read is refused with InputTooLong, nothing sent (it got
    an engine refusal after reads, and with escalate_to a silent escalation every call)."""
    engine = FunctionEngine(lambda read: peaked(read), max_model_len=2048)
    state = await _state_fitting_the_group_read_only(engine, 2048)
    target = Target({"q": "line 1"})
    model = CanvasDecisionModel(engine=engine, policy=NO_GATE, escalate_to=target.runnable)
    with pytest.raises(InputTooLong, match="in-group read of 'q'") as caught:
        await model.adecide(state, {"q": MANY})
    assert caught.value.hint and engine.calls == 0 and target.calls == 0
    # the same when the long question is a child of a depends_on: refused before the parent is read
    with pytest.raises(InputTooLong):
        await model.adecide(state, {"team": TEAM, "q": MANY}, depends_on={"q": ("team", "billing")})
    assert engine.calls == 0


@pytest.mark.vllm
async def test_02_the_real_vllm_server_gets_no_read_it_would_refuse(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    info = await engine.info()
    state = await _state_fitting_the_group_read_only(engine, info.max_model_len)
    model = CanvasDecisionModel(engine=engine, policy=NO_GATE, escalate_to=Target({"q": "line 1"}).runnable)
    with pytest.raises(InputTooLong):
        await model.adecide(state, {"q": MANY})
    assert engine.requests_sent == 0


def test_03_the_node_cache_never_replays_a_decision_a_fault_produced():
    """NodeCache: LangGraph stores every finished node's writes; a fallback an engine fault
    produced is not among them, so the node decides again once the engine is back (a plain
    InMemoryCache replayed the fallback for the whole TTL)."""
    down = {"now": True}

    def rows(read):
        if down["now"]:
            raise EngineUnavailable("engine down")
        return [{engine.token_id("A"): -0.05, engine.token_id("B"): -4.0}] * len(read.slots)

    engine = FunctionEngine(rows)
    model = CanvasDecisionModel(engine=engine,
                                outcomes=OutcomePolicy(engine_fault="fallback", fallback={"team": "tech"}))
    node = decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}))
    cache = NodeCache(InMemoryCache())
    graph = lanes(node, cache=cache, cache_policy=node.cache_policy(ttl=300))
    first = graph.invoke({"ticket": "Refund me"})
    assert first["lane"] == "tech" and first["decisions"]["team"]["path"] == "fallback" and cache.refused == 1
    down["now"] = False
    again = graph.invoke({"ticket": "Refund me"})
    assert again["lane"] == "billing" and again["decisions"]["team"]["path"] == "canvas"
    reads = len(engine.reads)
    graph.invoke({"ticket": "Refund me"})  # a healthy decision is cached as before
    assert len(engine.reads) == reads


def test_03_budget_refusals_are_not_replayed_by_the_node_cache():
    """A decision the budget turned away is not stored either: another thread with budget
    left decides the same ticket again and escalates (a plain cache replayed the refusal)."""
    target = Target({"team": "tech"})
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE),
                                escalate_to=Escalation(target.runnable, budget=EscalationBudget(max_per_thread=1)),
                                policy=NO_GATE.with_overrides(max_normalized_entropy=0.5),
                                outcomes=OutcomePolicy(over_budget="answer"))
    node = decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}))
    cache = NodeCache(InMemoryCache())
    graph = lanes(node, cache=cache, cache_policy=node.cache_policy())
    t1, t2 = ({"configurable": {"thread_id": t}} for t in ("t1", "t2"))
    assert graph.invoke({"ticket": "Refund me"}, t1)["decisions"]["team"]["path"] == "escalated"
    spent = graph.invoke({"ticket": "My app crashes"}, t1)["decisions"]["team"]
    assert spent["read"]["cause"] == "over_budget" and cache.refused == 1
    fresh = graph.invoke({"ticket": "My app crashes"}, t2)["decisions"]["team"]
    assert (fresh["path"], fresh["answer"], target.calls) == ("escalated", "tech", 2)
    assert spent["path"] == "unsure"  # acted on the canvas answer the gate did not pass (item 16)
    with pytest.raises(TypeError, match="BaseCache"):
        NodeCache({})


def test_04_the_decision_cache_keeps_no_budget_refusal():
    """An answer the budget degraded (`over_budget`) is not stored: another thread with
    budget left, or the same after the window, decides again (it replayed the degraded
    answer for the whole TTL)."""
    target = Target({"team": "tech"})
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE),
                                escalate_to=Escalation(target.runnable, budget=EscalationBudget(max_per_thread=1)),
                                policy=NO_GATE.with_overrides(max_normalized_entropy=0.5), cache=DecisionCache())
    assert model.decide("first", {"team": TEAM}, thread_id="t1").reads["team"].path == "escalated"
    spent = model.decide("second", {"team": TEAM}, thread_id="t1").reads["team"]
    assert spent.cause == "over_budget"
    fresh = model.decide("second", {"team": TEAM}, thread_id="t2").reads["team"]
    assert (fresh.path, fresh.answer, fresh.cause) == ("escalated", "tech", "uncertain")
    assert target.calls == 2 and len(model.cache) == 2  # both escalations kept, the refusal not
    assert spent.path == "unsure"


def test_05_editing_a_response_changes_no_later_hit():
    model = CanvasDecisionModel(engine=fixed_engine(SURE), cache=DecisionCache())
    request = {"state": "Refund me", "questions": {"team": TEAM, "urgent": URGENT}}
    first = model.invoke(request)
    first.answers["team"].choice = "tech"
    first.answers.pop("urgent")
    first.reads.clear()
    second = model.invoke(request)
    assert second.canvas_reads == 0 and model.cache.hits == 1
    assert second.answers["team"].choice == "billing" and set(second.answers) == {"team", "urgent"}
    assert set(second.reads) == {"team", "urgent"}
    second.answers.clear()
    assert set(model.invoke(request).answers) == {"team", "urgent"}


def test_06_a_hit_reports_no_new_usage():
    model = CanvasDecisionModel(engine=fixed_engine(SURE), cache=DecisionCache())
    request = {"state": "Refund me", "questions": {"team": TEAM}}
    first = model.invoke(request)
    assert first.usage["output_tokens"] > 0
    hit = model.invoke(request)
    assert model.cache.hits == 1
    assert (hit.usage["input_tokens"], hit.usage["output_tokens"], hit.usage["total_tokens"]) == (0, 0, 0)


_KEY_SCRIPT = """
import json, sys
sys.path[:0] = sys.argv[1:3]
from conftest import fixed_engine
from langchain_core.decisions import Choice
from canvasroute.harness import decision_node, decision_seed
from canvasroute.router import CanvasDecisionModel
q = Choice(instructions="Which team?", criteria={k: None for k in ("billing", "tech", "sales", "legal")})
node = decision_node(CanvasDecisionModel(engine=fixed_engine({"A": -0.1})), {"team": q, "why": q},
                     depends_on={"why": ("team", {"billing", "tech", "sales", "legal"})})
state = {"ticket": "Refund me", "tags": {"vip", "eu", "mobile", "refund", "urgent"}, "seen": frozenset({3, 1, 2})}
print(json.dumps([node.cache_key(state), decision_seed("triage", "node", {"team": q}, state)]))
"""


@job
def keys_per_hash_seed(work: Path) -> list[tuple[int, int, str, str]]:
    """`_KEY_SCRIPT` under PYTHONHASHSEED 0 to 3, side by side: (seed, exit status, stdout, stderr) of each."""
    tests = str(ROOT / "tests")
    procs = {seed: subprocess.Popen([sys.executable, "-c", _KEY_SCRIPT, str(ROOT / "src"),
                                     tests], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=child_env(PYTHONHASHSEED=str(seed))) for seed in (0, 1, 2, 3)}
    watches = {seed: Watch(proc.pid, cpu_s=120, idle_s=120, what=f"the keys under PYTHONHASHSEED={seed}")
               for seed, proc in procs.items()}
    outputs = {seed: finish(proc, watches[seed]) for seed, proc in procs.items()}
    return [(seed, procs[seed].returncode, *outputs[seed]) for seed in procs]


@pytest.mark.slow
def test_07_node_cache_keys_and_seeds_are_the_same_in_every_process(keys_per_hash_seed):
    """Workers sharing a cache share its hits: the key (and the seed) of the same decision
    is the same under any hash randomisation (sets in depends_on and in the state)."""
    assert [code for _, code, _, _ in keys_per_hash_seed] == [0] * 4, [err[-2000:] for *_, err in keys_per_hash_seed]
    out = {stdout for _, _, stdout, _ in keys_per_hash_seed}
    assert len(out) == 1, out


# -- 8-12: review, shadow, abstain and dependent questions ------------------------------------


def test_08_review_of_a_parent_question_with_depends_on_is_refused():
    """The children of a reviewed parent would follow the canvas, not the human: the node
    refuses the combination; reviewing only the children is fine."""
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE))
    questions = {"team": TEAM, "urgent": URGENT}
    route = ("team", {"billing": "billing", "tech": "tech"})
    with pytest.raises(DecisionError, match=r"parent question\(s\) \['team'\]") as caught:
        decision_node(model, questions, route=route, review=ReviewPolicy(), depends_on={"urgent": ("team", "billing")})
    assert caught.value.hint
    node = decision_node(model, questions, inputs="ticket", route=route, review=ReviewPolicy(questions=frozenset(
        {"urgent"})), depends_on={"urgent": ("team", "billing")})
    graph = lanes(node, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "r"}}
    paused = graph.invoke({"ticket": "Refund me"}, config)
    assert list(paused["__interrupt__"][0].value["questions"]) == ["urgent"]
    done = graph.invoke(Command(resume="yes"), config)
    assert done["decisions"]["urgent"]["answer"] == "yes" and done["lane"] == "billing"
    # OutcomePolicy(uncertain="review") of a parent is the same combination
    unsure_review = CanvasDecisionModel(engine=fixed_engine(UNSURE), outcomes=OutcomePolicy(uncertain="review"))
    graph = lanes(decision_node(unsure_review, questions, inputs="ticket", route=route,
                                depends_on={"urgent": ("team", "billing")}), checkpointer=InMemorySaver())
    with pytest.raises(DecisionError, match="review and depends_on"):
        graph.invoke({"ticket": "Refund me"}, config)


def test_09_shadow_mode_compares_with_an_abstaining_policy():
    """The shadow read is the canvas alone (`canvas_only()`): an abstaining policy neither
    needs a target there nor raises; each record compares (it raised DecisionError, so no
    record was written and the dashboard showed 0 % agreement)."""
    abstains = PromptRows(pick("none of these", 0.8))
    model = CanvasDecisionModel(engine=abstains.engine, policy=NO_GATE.with_overrides(abstain=True),
                                escalate_to=Target({"team": "tech"}).runnable)
    node = decision_node(model, {"team": TEAM}, inputs="ticket",
                         route=("team", {"billing": "billing", "tech": "tech"}), shadow=lambda state: "billing")
    chunks = list(lanes(node).stream({"ticket": "Refund me"}, stream_mode=["custom", "values"]))
    final = [c for mode, c in chunks if mode == "values"][-1]
    record = final["decisions"]["team"]
    assert final["lane"] == "billing" and (record["path"], record["read"]["cause"]) == ("unsure", "abstained")
    assert "canvas_error" not in record["shadow"]
    assert record["shadow"]["canvas_destination"] == record["answer"] and record["shadow"]["would_escalate"] is True
    (event,) = [c for mode, c in chunks if mode == "custom" and c["type"] == DECISION_EVENT]
    assert event["shadow"]["would_escalate"] == ["team"] and event["shadow"]["canvas_destination"] is not None


def test_10_skipped_questions_are_not_counted_as_would_escalate():
    engine = fixed_engine({"A": -0.01, "B": -6.0, "yes": -0.01, "no": -6.0})  # sure: billing
    node = decision_node(CanvasDecisionModel(engine=engine), {"team": TEAM, "refund": URGENT, "bug": URGENT},
                         inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}),
                         shadow=lambda state: "billing", depends_on={"bug": ("team", "tech")})
    out = lanes(node).invoke({"ticket": "Refund me"})
    assert out["decisions"]["bug"]["path"] == "skipped"
    assert out["decisions"]["bug"]["shadow"]["would_escalate"] is False
    assert out["decisions"]["team"]["shadow"]["canvas_alone"] is True


async def test_11_eval_runs_an_abstaining_policy():
    """The canvas-only arm reads an abstaining policy (it raised DecisionError for any
    `abstain=True`): where abstain wins, the canvas answer is its best real option."""
    rows = PromptRows(by_instructions({"Which team": pick("none of these", 0.6)}))
    data = [Row(state, {"team": TEAM}, {"team": gold}) for state, gold in (("refund", "billing"), ("crash", "tech"))]
    result = await evaluate(rows.engine, data, policy=GatePolicy(abstain=True))
    assert [i.canvas_answer for i in result.items] == ["billing", "billing"]  # billing beats tech at 0.2 each
    assert result.canvas.decisions == 2
    target = Target({"team": "tech"}).runnable
    cascade = await evaluate(rows.engine, data, policy=GatePolicy(abstain=True), target=target)
    assert cascade.cascade.escalations == 2 and [i.cascade_path for i in cascade.items] == ["escalated"] * 2


async def test_12_on_abstain_fallback_takes_the_fallback_however_narrowly_abstain_wins():
    narrow = PromptRows(lambda block: [0.3, 0.3, 0.4])  # abstain wins, and the read is uncertain
    target = Target({"team": "billing"})
    model = CanvasDecisionModel(engine=narrow.engine,
                                policy=GatePolicy(abstain=True), escalate_to=target.runnable,
                                outcomes=OutcomePolicy(fallback={"team": "tech"}, abstained="fallback"))
    r = (await model.adecide("Refund me", {"team": TEAM})).reads["team"]
    assert (r.path, r.cause, r.answer, r.escalation_model, target.calls) == ("fallback", "abstained", "tech", None, 0)
    assert r.crossed == ["max_normalized_entropy"] and r.reads == 4  # re-read, still abstaining


# -- 13-15: inputs users really pass ------------------------------------------------------------


class Tier(enum.Enum):
    GOLD = "gold"


@dataclasses.dataclass
class Order:
    id: int
    items: tuple[str, ...]


class Ticket(BaseModel):
    text: str
    opened: dt.datetime
    decisions: dict = {}


def test_13_state_values_users_pass_are_rendered_or_refused_with_a_typed_error():
    state = {"when": dt.datetime(2026, 1, 2, 3, 4, 5), "day": dt.date(2026, 1, 2), "id": uuid.UUID(int=7),
             "price": Decimal("9.90"), "raw": b"plain text", "tags": {"vip", "eu", "mobile"}, "tier": Tier.GOLD,
             "order": Order(3, ("a", "b")), ("x", 1): "tuple key", "broken": "half \ud83d pair"}
    text = render_state(state)
    assert json.loads(text) == {
        "when": "2026-01-02T03:04:05", "day": "2026-01-02", "id": "00000000-0000-0000-0000-000000000007",
        "price": "9.90", "raw": "plain text", "tags": ["eu", "mobile", "vip"], "tier": "gold",
        "order": {"id": 3, "items": ["a", "b"]}, '["x", 1]': "tuple key", "broken": "half \ufffd pair"}
    text.encode()  # no lone surrogate left
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    for bad, where in ((object(), "state['v']"), (b"\xff\xfe", "state['v']"), (cyclic, "state['v']['self']")):
        with pytest.raises(DecisionError, match=where.replace("[", r"\[")) as caught:
            render_state({"v": bad})
        assert caught.value.hint
    model = CanvasDecisionModel(engine=fixed_engine(SURE))
    assert model.decide(state, {"team": TEAM}).reads["team"].path == "canvas"
    with pytest.raises(DecisionError):
        model.decide({"v": object()}, {"team": TEAM})


def test_13_a_pydantic_state_with_a_datetime_decides_alone_and_in_a_graph_alike():
    engine = fixed_engine(SURE)
    model = CanvasDecisionModel(engine=engine)
    ticket = Ticket(text="Refund me", opened=dt.datetime(2026, 1, 2, 3, 4))
    model.decide(ticket, {"team": TEAM})
    builder = StateGraph(Ticket)
    builder.add_node("triage", decision_node(model, {"team": TEAM}, route=("team", {"billing": END, "tech": END})))
    builder.add_edge(START, "triage")
    out = builder.compile().invoke(ticket)
    assert out["decisions"]["team"]["answer"] == "billing"
    alone, in_graph = (json.loads(read.messages[-1]["content"]) for read in engine.reads)
    assert alone == {"text": "Refund me", "opened": "2026-01-02T03:04:00", "decisions": {}}
    assert in_graph == {"text": "Refund me", "opened": "2026-01-02T03:04:00"}  # the graph state minus its decisions


def test_14_image_blocks_anywhere_in_the_state_are_images():
    png = {"type": "image", "base64": "iVBORw0KGgo=", "mime_type": "image/png"}
    state = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, png]}],
             "attachment": {"type": "image_url", "image_url": {"url": "https://example.test/a.png"}},
             "nested": [[{"photo": png}]], "history": [HumanMessage(content=[png])]}
    assert state_images(state) == ("data:image/png;base64,iVBORw0KGgo=", "https://example.test/a.png",
                                   "data:image/png;base64,iVBORw0KGgo=", "data:image/png;base64,iVBORw0KGgo=")
    text = render_state(state)
    assert "iVBORw0KGgo" not in text and "example.test" not in text and '{"type": "image"}' in text
    engine = fixed_engine(SURE)
    with pytest.raises(ImagesUnsupported):  # an engine that cannot see images refuses before any read
        CanvasDecisionModel(engine=engine).decide({"attachment": png}, {"team": TEAM})
    assert engine.calls == 0


async def test_14_a_dict_message_image_reaches_the_chat_endpoint_as_an_image_part():
    server = LoopbackVLLM()
    engine = VLLMServerEngine(Connection("http://vllm.test", transport=server.transport()))
    png = {"type": "image", "base64": "iVBORw0KGgo=", "mime_type": "image/png"}
    await CanvasDecisionModel(engine=engine, policy=NO_GATE).adecide(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, png]}]}, {"team": TEAM})
    parts = server.bodies[-1]["messages"][-1]["content"]
    assert {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}} in parts
    assert all("iVBORw0KGgo" not in p.get("text", "") for p in parts)


class NoContextLength(httpx.AsyncBaseTransport):
    """A proxy in front of vLLM that drops `max_model_len` from `/v1/models`."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/models":
            return response
        data = json.loads(await response.aread())
        for entry in data["data"]:
            entry.pop("max_model_len", None)
        return httpx.Response(response.status_code, json=data)


async def _check_missing_context_length(url: str, inner: httpx.AsyncBaseTransport, max_model_len: int) -> None:
    engine = VLLMServerEngine(Connection(url, transport=NoContextLength(inner)))
    with pytest.raises(EngineResponseError, match="without max_model_len") as caught:
        await CanvasDecisionModel(engine=engine, policy=NO_GATE).adecide("Refund me", {"team": TEAM})
    assert "max_model_len=" in caught.value.hint
    told = VLLMServerEngine(Connection(url, transport=NoContextLength(inner)), max_model_len=max_model_len)
    resp = await CanvasDecisionModel(engine=told, policy=NO_GATE).adecide("Refund me", {"team": TEAM})
    assert resp.reads["team"].path == "canvas" and (await told.info()).max_model_len == max_model_len


async def test_15_a_server_without_max_model_len_says_so():
    """A proxy that drops `max_model_len`: the error says what could not be discovered and
    how to give it (every decision failed with `InputTooLong: ... a 1-token canvas`)."""
    await _check_missing_context_length("http://vllm.test", LoopbackVLLM().transport(), 2048)


@pytest.mark.vllm
async def test_15_the_real_vllm_server_behind_a_proxy_without_max_model_len(vllm_url):
    await _check_missing_context_length(vllm_url, httpx.AsyncHTTPTransport(), 1024)


# -- 16-17: say what happened -----------------------------------------------------------------


@pytest.mark.parametrize("uncertain", ["answer", "fallback", "raise"])
def test_16_an_unsure_answer_without_a_target_has_its_own_path_and_policy(uncertain):
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), policy=GatePolicy(rereads=1),
                                outcomes=OutcomePolicy(fallback={"team": "tech"}, uncertain=uncertain))
    if uncertain == "raise":
        with pytest.raises(UnsureAnswer, match="'team' stayed unsure after 2 read") as caught:
            model.decide("Refund me", {"team": TEAM})
        assert caught.value.hint
        return
    r = model.decide("Refund me", {"team": TEAM}).reads["team"]
    assert (r.path, r.confident, r.reads, r.crossed) == (
        {"answer": "unsure", "fallback": "fallback"}[uncertain], False, 2, ["max_normalized_entropy"])
    assert (r.answer, r.cause) == ({"answer": "billing", "fallback": "tech"}[uncertain], "uncertain")
    with pytest.raises(DecisionError, match=r"uncertain='fallback'\), but has no fallback option"):
        CanvasDecisionModel(engine=fixed_engine(UNSURE), outcomes=OutcomePolicy(
            uncertain="fallback", fallback={"urgent": "no"})).decide("x", {"team": TEAM})


def test_16_unsure_is_on_the_stream_event_and_review_takes_it():
    model = CanvasDecisionModel(engine=fixed_engine(UNSURE), outcomes=OutcomePolicy(uncertain="review"))
    node = decision_node(model, {"team": TEAM}, inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}))
    graph = lanes(node, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "u"}}
    chunks = list(graph.stream({"ticket": "Refund me"}, config, stream_mode=["custom", "updates"]))
    (interrupt,) = [c["__interrupt__"] for mode, c in chunks if mode == "updates" and "__interrupt__" in c]
    assert interrupt[0].value["questions"]["team"]["path"] == "unsure"
    done = list(graph.stream(Command(resume="tech"), config, stream_mode=["custom", "values"]))
    (event,) = [c for mode, c in done if mode == "custom" and c["type"] == DECISION_EVENT]
    assert event["paths"] == {"team": "human"} and [c for m, c in done if m == "values"][-1]["lane"] == "tech"
    plain = CanvasDecisionModel(engine=fixed_engine(UNSURE))  # default uncertain="escalate", no target: path unsure
    node = decision_node(plain, {"team": TEAM}, inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}))
    (event,) = [c for c in lanes(node).stream({"ticket": "Refund me"}, stream_mode="custom")
                if c["type"] == DECISION_EVENT]
    assert event["paths"] == {"team": "unsure"}


async def test_17_engine_down_and_escalation_down_names_both():
    """Real clients against closed ports: the canvas engine (VLLMServerEngine) and the
    escalation target (ChatOpenAI) both fail; the error names both and chains the canvas
    fault as its cause (it named only the escalation)."""
    from langchain_openai import ChatOpenAI

    engine_url, target_url = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}/v1"
    engine = VLLMServerEngine(Connection(engine_url, timeout=Timeout(connect=2), retries=0))
    target = ChatOpenAI(base_url=target_url, model="gemma-3-27b", api_key="EMPTY", max_retries=0, timeout=5)
    with pytest.raises(EscalationError) as caught:
        await CanvasDecisionModel(engine=engine, escalate_to=target).adecide("Refund me", {"team": TEAM})
    err = caught.value
    assert isinstance(err.__cause__, EngineUnavailable) and engine_url in str(err.__cause__)
    assert "gemma-3-27b" in err.message and "canvas engine failed" in err.message and engine_url in err.message
    assert "canvas engine" in err.hint and "escalation" in err.hint and err.retryable
    assert err.failure == "network"  # langchain-openai's OpenAIConnectionError is a connection error
