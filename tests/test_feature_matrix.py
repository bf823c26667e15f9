"""The feature matrix, property-based (hypothesis): features combined as users combine them.

One drawn example is a whole setup: questions of every kind (a 200-option Choice read in
two steps among them), `depends_on`, abstain with each `on_abstain`, `on_unsure`,
`order_views`, the model's `DecisionCache`, the graph's `NodeCache`, shadow mode, human
review, escalation budgets (in memory, or in the graph's store), an escalation target that
answers, fails or is absent, an engine fault at one kind of read (discovery, first read,
re-read, in-group read) or none, a generated state, and the gateway's read options: fixed
`samples`, request-level `instructions` and questions read `alone` (the last two on the
model alone: a graph node takes no read options). It runs twice (the engine healed
for the second run), and once more from scratch. Invariants, not examples:

(a) no fault and no budget refusal is ever cached or replayed;
(b) every exception that leaves the library is a `CanvasRouteError` with a hint;
(c) every asked question has exactly one record, its path from the documented set, and the
    path says what happened;
(d) the same inputs and seed give the same canvases and the same branch;
(e) budget counters stay exact;
(f) a hit or a replay reports no new usage.

Examples are bounded and derandomized (a fixed seed: CI runs the same examples every time);
`CANVASROUTE_MATRIX_EXAMPLES=500` explores further.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command
from promptrows import Block, blocks
from typing_extensions import TypedDict

from canvasroute.engine import (
    CanvasRouteError,
    DecisionError,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailable,
    EscalationError,
    FunctionEngine,
)
from canvasroute.harness import DECISION_EVENT, NodeCache, ReviewPolicy, decision_node, merge_decisions
from canvasroute.harness._store_budget import store_meter
from canvasroute.router import ABSTAIN, CanvasDecisionModel, DecisionCache, EscalationBudget, GatePolicy
from canvasroute.router._types import Path

PATHS = frozenset(typing.get_args(Path))
EXAMPLES = int(os.environ.get("CANVASROUTE_MATRIX_EXAMPLES", "500"))
MANY = 200
"""Options of the big Choice: past one read's 128 label ids, so it is read in two steps."""
ABSTAIN_LINE = "none of these"


# -- the scripted engine -----------------------------------------------------------------------


class Scripted(FunctionEngine):
    """Rows from each question's mood (`sure`, `borderline`, `unsure`, `abstain`), tilted by the canvas
    noise (so re-reads differ); a fault at one kind of read until `healed`."""

    def __init__(self, moods: Mapping[str, str], fault: str | None, fault_type: type[CanvasRouteError],
                 max_model_len: int) -> None:
        super().__init__(self._rows, model="scripted", max_model_len=max_model_len)
        self.moods, self.fault, self.fault_type = moods, fault, fault_type
        self.healed = False
        self.seen: set[str] = set()
        """System prompts read in this run (a repeat is a re-read)."""
        self.log: list[tuple[str, tuple[int, ...]]] = []
        self.faults = 0
        """Faults raised in this run."""
        self.too_long = 0
        """Reads whose prompt + canvas exceeded the context (a server refuses them: never send one)."""
        self.prompts: list[str] = []

    def _raise(self) -> None:
        self.faults += 1
        raise self.fault_type("engine fault (injected)", hint="the test injects it")

    async def info(self):  # type: ignore[no-untyped-def]
        if self.fault == "info" and not self.healed:
            self._raise()
        return await super().info()

    async def _rows(self, read) -> list[dict[int, float]]:
        if await self.count_prompt(read.messages) + len(read.canvas) > (await super().info()).max_model_len:
            self.too_long += 1
            raise EngineRequestError("prompt + canvas exceed the context", status=400)
        self.prompts.append(read.messages[-1]["content"])
        system = read.messages[0]["content"]
        found = blocks(system)
        assert len(found) == len(read.slots)
        kind = ("in_group" if any(b.instructions.startswith("Q") and "(First:" not in b.instructions
                                  and len(b.labels) > 8 for b in found)
                else "reread" if system in self.seen else "first")
        self.seen.add(system)
        self.log.append((kind, read.canvas))
        if kind == self.fault and not self.healed:
            self._raise()
        tilt = int.from_bytes(hashlib.sha256(repr(read.canvas).encode()).digest()[:2], "big") / 65536
        return [{self.token_id(label): math.log(p) for label, p in zip(b.labels, self._probs(b, tilt), strict=True)}
                for b in found]

    def _probs(self, block: Block, tilt: float) -> list[float]:
        qid = block.instructions.split(":", 1)[0]
        mood = self.moods.get(qid, "sure")
        k = len(block.labels)
        abstain = next((i for i, t in enumerate(block.texts) if t.startswith(ABSTAIN_LINE)), None)
        real = [i for i in range(k) if i != abstain]
        winner = min(real, key=lambda i: block.texts[i])  # the same option in every order-bias view
        if mood == "abstain" and abstain is not None:
            winner, p = abstain, 0.8
        elif mood == "sure":
            p = 0.97
        elif mood == "borderline":  # about the default gate (H/lnK 0.5): the noise decides, re-reads settle it
            p = 1 - (1 - (0.8 + 0.19 * tilt)) * 2 / k
        else:  # near uniform, the noise tilts it
            p = 1 / k + 0.1 * tilt / k
        return [p if i == winner else (1 - p) / (k - 1) for i in range(k)]


class Target:
    """An escalation target answering each asked question's first option; or failing."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.calls, self.questions = fails, 0, 0
        self.runnable = RunnableLambda(self._reply, name="target")

    def _reply(self, msgs: Any) -> AIMessage:
        self.calls += 1
        if self.fails:
            raise ConnectionError("the escalation target is down")
        text = msgs[-1].content
        asked = dict(re.findall(r'^Question "([^"]+)": .*? Options: "([^"]+)"', text, re.MULTILINE))
        self.questions += len(asked)
        return AIMessage(json.dumps(asked), usage_metadata={"input_tokens": 7, "output_tokens": 2, "total_tokens": 9})


# -- the drawn setup ----------------------------------------------------------------------------


class Tier(enum.Enum):
    GOLD = "gold"


@dataclasses.dataclass(frozen=True)
class Pair:
    left: Any
    right: Any


def _question(i: int, kind: str) -> Any:
    text = f"Q{i}: question {i}?"
    if kind == "noul":
        return Noul(instructions=text)
    if kind == "choice":
        return Choice(instructions=text, criteria={f"opt{i}{c}": None for c in "abc"})
    if kind == "score":
        return Score(instructions=text, criteria=["low", "mid", "high"])
    return Choice(instructions=text, criteria={f"line {n}": None for n in range(MANY)})


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, width=32),
                  st.text(max_size=12), st.datetimes(), st.dates(), st.uuids(),
                  st.decimals(allow_nan=False, allow_infinity=False, places=2), st.text(max_size=6).map(str.encode),
                  st.frozensets(st.text(max_size=4), max_size=3))
_json_like = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3),
    st.tuples(inner, inner)), max_leaves=6)
_rich = st.recursive(st.one_of(_leaf, st.sampled_from(list(Tier)), st.text(max_size=5).map(lambda s: s + "\ud83d")),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.one_of(st.text(max_size=6), st.tuples(
                                                 st.text(max_size=3), st.integers(0, 9))), inner, max_size=3),
                                             st.builds(Pair, inner, inner), st.sets(st.text(max_size=4), max_size=3)),
                     max_leaves=6)
_IMAGE = {"type": "image", "base64": "iVBORw0KGgo=", "mime_type": "image/png"}


@st.composite
def setups(draw: st.DrawFn) -> dict[str, Any]:
    graph = draw(st.booleans())
    kinds = [draw(st.sampled_from(["noul", "choice", "score"]))]
    kinds += draw(st.lists(st.sampled_from(["noul", "choice", "score", "many", "many"]), max_size=2))
    qids = [f"Q{i}" for i in range(len(kinds))]
    depends = None
    if len(qids) > 1 and draw(st.sampled_from([True, True, True, False])):
        depends = {qids[-1]: (qids[0], draw(st.sampled_from(_options(kinds[0], _question(0, kinds[0])))))}
    abstain = draw(st.booleans())
    # a two-step question meets a fault in either of its reads, or a context its in-group read
    # does not fit (800 tokens: its group read fits); any setup may meet a fault elsewhere
    two_step = draw(st.sampled_from(["fits", "too long", "in_group", "reread"])) if "many" in kinds else "fits"
    fault = two_step if two_step in ("in_group", "reread") else draw(st.sampled_from([None, None, "info", "first",
                                                                                    "reread"]))
    shadow = graph and draw(st.booleans())
    review = graph and not shadow and draw(st.booleans())
    odd = not graph and draw(st.sampled_from([None] * 8 + ["image", "object"]))  # seldom: they end at once
    state = ({"photo": _IMAGE} if odd == "image" else {"odd": object()} if odd == "object" else draw(
        st.one_of(st.text(max_size=40), _json_like) if graph else st.one_of(st.text(max_size=40), _json_like, _rich)))
    return {
        "graph": graph, "kinds": kinds, "qids": qids, "depends": depends, "shadow": shadow, "review": review,
        "moods": {q: draw(st.sampled_from(["sure", "borderline", "unsure", "abstain", "abstain"] if abstain
                                          else ["sure", "borderline", "unsure"])) for q in qids},
        "fault": fault,
        "fault_type": draw(st.sampled_from([EngineUnavailable, EngineResponseError])),
        "max_model_len": 800 if two_step == "too long" else 4096,
        # a review lane stands in for an escalation target, mostly
        "target": draw(st.sampled_from([None, None, "answers", "fails"] if review
                                       else ["answers", "answers", "fails", None])),
        "on_engine_error": draw(st.sampled_from(["escalate", "raise", "fallback"])),
        "fallback": draw(st.sampled_from([True, True, True, False])),
        "abstain": abstain, "on_abstain": draw(st.sampled_from(["escalate", "fallback"])),
        "on_unsure": draw(st.sampled_from(["answer", "fallback", "raise", "review"])),
        "order_views": draw(st.integers(0, 2)), "rereads": draw(st.integers(0, 2)),
        "samples": draw(st.sampled_from([1, 1, 1, 2])),
        # long instructions beside a two-step question and a small context: every read must still fit
        "instructions": None if graph else draw(st.sampled_from([None, None, "All tickets are from EU customers.",
                                                                 "Context. " * 40])),
        "alone": () if graph else tuple(q for q in qids if draw(st.sampled_from([False, False, True]))),
        "budget": draw(st.sampled_from([None, "memory", "store"] if graph else [None, "memory"])),
        "per_window": draw(st.integers(0, 2)), "when_spent": draw(st.sampled_from(["keep", "fallback", "raise"])),
        "model_cache": draw(st.sampled_from([True, True, False])),
        "node_cache": graph and draw(st.sampled_from([True, True, False])),
        "state": state, "seed": draw(st.none() | st.integers(0, 2**31)),
    }


# -- one run of a setup -----------------------------------------------------------------------


class GraphState(TypedDict, total=False):
    ticket: Any
    decisions: Annotated[dict, merge_decisions]
    lane: str


@dataclasses.dataclass
class Built:
    s: dict[str, Any]
    engine: Scripted
    target: Target | None
    model: CanvasDecisionModel
    questions: dict[str, Any]
    options: dict[str, tuple[str, ...]]
    graph: Any = None
    cache: NodeCache | None = None
    store: InMemoryStore | None = None


def _options(kind: str, question: Any) -> tuple[str, ...]:
    return ("yes", "no") if kind == "noul" else ("0", "1", "2") if kind == "score" else tuple(question.criteria)


def build(s: dict[str, Any]) -> Built:
    questions = {q: _question(i, k) for i, (q, k) in enumerate(zip(s["qids"], s["kinds"], strict=True))}
    options = {q: _options(k, questions[q]) for q, k in zip(s["qids"], s["kinds"], strict=True)}
    engine = Scripted(s["moods"], s["fault"], s["fault_type"], s["max_model_len"])
    target = Target(s["target"] == "fails") if s["target"] else None
    budget = (EscalationBudget(max_per_window=s["per_window"], window_s=3600, when_spent=s["when_spent"])
              if s["budget"] else None)
    model = CanvasDecisionModel(
        engine=engine, escalate_to=target.runnable if target else None, budget=budget,
        policy=GatePolicy(rereads=s["rereads"], abstain=s["abstain"], on_abstain=s["on_abstain"],
                          on_unsure=s["on_unsure"], order_views=s["order_views"], samples=s["samples"]),
        on_engine_error=s["on_engine_error"] if s["fallback"] or s["on_engine_error"] != "fallback" else "escalate",
        fallback={q: o[0] for q, o in options.items()} if s["fallback"] else {},
        cache=DecisionCache() if s["model_cache"] else None)
    built = Built(s, engine, target, model, questions, options)
    if s["graph"]:
        route = (s["qids"][0], {o: f"lane{n}" for n, o in enumerate(options[s["qids"][0]])})
        node = decision_node(model, questions, inputs="ticket", route=route, depends_on=s["depends"],
                             review=ReviewPolicy() if s["review"] else None,
                             shadow=(lambda state: "lane0") if s["shadow"] else None)
        builder = StateGraph(GraphState)
        builder.add_node("triage", node, cache_policy=node.cache_policy() if s["node_cache"] else None)
        builder.add_edge(START, "triage")
        for lane in route[1].values():
            builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
            builder.add_edge(lane, END)
        built.cache = NodeCache(InMemoryCache()) if s["node_cache"] else None
        built.store = InMemoryStore() if s["budget"] == "store" else None
        built.graph = builder.compile(checkpointer=InMemorySaver(), cache=built.cache, store=built.store)
    return built


@dataclasses.dataclass
class Run:
    error: BaseException | None = None
    records: dict[str, dict[str, Any]] | None = None
    """qid -> {path, answer, read: ReadReport fields} (graph records, or a response's reads)."""
    usage: dict[str, int] | None = None
    lane: str | None = None
    node_ran: bool = True
    hit: bool = False
    shadow: dict[str, Any] | None = None
    faults: int = 0
    """Engine faults raised during the run."""


def run(b: Built, thread: str) -> Run:
    b.engine.seen, b.engine.faults = set(), 0
    try:
        hits = b.model.cache.hits if b.model.cache else 0
        if not b.s["graph"]:
            resp = b.model.decide(b.s["state"], b.questions, seed=b.s["seed"], depends_on=b.s["depends"],
                                  thread_id=thread, instructions=b.s["instructions"], alone=b.s["alone"])
            got = Run(records={q: {"path": r.path, "answer": r.answer, "read": r.model_dump(exclude={"latency_s"})}
                               for q, r in resp.reads.items()}, usage=dict(resp.usage), faults=b.engine.faults,
                      hit=bool(b.model.cache and b.model.cache.hits > hits))
            resp.answers.clear()  # a caller editing its response changes no later hit
            resp.reads.clear()
            resp.usage["input_tokens"] = 10**6
            return got
        config = {"configurable": {"thread_id": thread}}
        value: Any = {"ticket": b.s["state"]}
        events: list[dict[str, Any]] = []
        for _ in range(4):  # resume every review with another option than the canvas's
            pending: Any = ()
            for mode, chunk in b.graph.stream(value, config, stream_mode=["custom", "values", "updates"]):
                if mode == "custom" and chunk.get("type") == DECISION_EVENT:
                    events.append(chunk)
                elif mode == "values":
                    out = chunk
                elif mode == "updates" and "__interrupt__" in chunk:
                    pending = chunk["__interrupt__"]
            if not pending:
                break
            value = Command(resume={q: next(o for o in item["options"] if o != item["answer"])  # overrule it
                                    for q, item in pending[0].value["questions"].items()})
        return Run(records=out.get("decisions"), lane=out.get("lane"), node_ran=bool(events), faults=b.engine.faults,
                   hit=bool(b.model.cache and b.model.cache.hits > hits),
                   shadow=events[-1].get("shadow") if events else None)
    except Exception as exc:  # noqa: BLE001 - judged by check_error
        return Run(error=exc, faults=b.engine.faults)


# -- the invariants -------------------------------------------------------------------------------


def check_error(b: Built, r: Run) -> None:
    """(b): typed, with a hint; no read the engine must refuse was sent; no image as text; an
    escalation that fails after an engine fault names it as its cause."""
    assert b.engine.too_long == 0, "a read longer than the context was sent"
    assert not any(_IMAGE["base64"] in p for p in b.engine.prompts), "an image went into the prompt as text"
    if r.error is not None:
        assert isinstance(r.error, CanvasRouteError), f"untyped {type(r.error).__name__}: {r.error!r}"
        assert r.error.hint, f"{type(r.error).__name__} without a hint: {r.error}"
        if isinstance(r.error, EscalationError) and r.faults and b.model.on_engine_error == "escalate":
            assert isinstance(r.error.__cause__, b.s["fault_type"]), "the engine fault is not the cause"


def check_records(b: Built, r: Run) -> None:
    """(c): one record per asked question, a documented path that says what happened."""
    if r.records is None:
        return
    if b.s["shadow"] and ((r.shadow and r.shadow.get("canvas_error")) or (not r.node_ran and not r.records)):
        # the router routed and the canvas read beside it failed: on the span and event, no record (a
        # node-cache hit replays that routing, the router's answer, with no record either)
        assert not r.records
        if r.shadow:  # only an engine fault, or a read too long for the model, fails the canvas read
            allowed = {b.s["fault_type"].__name__} if r.faults else set()
            allowed |= {"InputTooLong"} if b.s["max_model_len"] < 4096 and "many" in b.s["kinds"] else set()
            assert r.shadow["canvas_error"] in allowed, (r.shadow["canvas_error"], allowed)
        return
    assert set(r.records) == set(b.questions)
    parents = {c: p for c, (p, _) in (b.s["depends"] or {}).items()}
    for qid, rec in r.records.items():
        read, path = rec["read"], rec["path"]
        human = path == "human"  # a reviewer's answer: the read says what the canvas did
        if human:
            assert b.s["review"] or b.s["on_unsure"] == "review"
            assert not read["confident"] and read["escalation_model"] is None
            assert rec["answer"] in b.options[qid]
            path = read["path"]
        assert path in PATHS, path
        assert read["confident"] == (path in ("canvas", "reread")), (path, read)
        if b.s["shadow"]:  # "would escalate": asked, and not passed by the gate
            assert rec["shadow"]["would_escalate"] == (not read["confident"] and path != "skipped")
        if qid in parents:  # asked (or skipped) on the parent's final answer, a reviewer's included
            cond = read["asked_if"]
            assert cond["parent_answer"] == r.records[parents[qid]]["answer"]
            assert (path == "skipped") == (cond["parent_answer"] not in cond["answers"])
        if path == "skipped":
            assert qid in parents and rec["answer"] is None
            continue
        assert rec["answer"] in b.options[qid]
        if read["error"] is not None:  # a fault is never a cheap answer
            assert path in ("escalated", "fallback"), (path, read["error"])
        if path == "escalated":
            assert read["escalation_model"] == "target" and b.target is not None and not b.target.fails
        elif path == "abstained":
            assert b.s["abstain"] and read["canvas_probabilities"] is not None
            assert max(read["canvas_probabilities"], key=read["canvas_probabilities"].get) == ABSTAIN
            if b.s["on_abstain"] == "fallback" and not b.s["shadow"] and not read["over_budget"]:
                assert read["escalation_model"] is None and (human or rec["answer"] == b.options[qid][0])
        elif path == "unsure":
            assert read["crossed"] and (b.target is None or b.s["shadow"] or read["over_budget"])
        elif path == "fallback":
            assert read["error"] is not None or read["over_budget"]
            assert human or rec["answer"] == b.options[qid][0]
        elif path in ("canvas", "reread"):
            assert not read["crossed"] and not read["over_budget"]
            routed = b.s["kinds"][b.s["qids"].index(qid)] == "many" and read["reads"] >= 2
            assert (read["reads"] - routed > b.s["samples"]) == (path == "reread")  # samples are no re-reads
        if read["over_budget"]:
            assert b.s["budget"] and path in ("unsure", "fallback", "abstained")


def check_cache(b: Built, first: Run, second: Run) -> None:
    """(a) and (f): nothing faulted or refused is stored or replayed; a hit spends nothing."""
    bad = [rec for rec in (first.records or {}).values()
           if rec["read"].get("error") or rec["read"].get("over_budget")]
    if b.s["model_cache"] and not b.s["shadow"] and bad:
        assert not second.hit, "a faulted or budget-refused decision was replayed by the DecisionCache"
    if b.s["node_cache"] and bad:
        assert second.node_ran, "a faulted or budget-refused decision was replayed by the node cache"
    for rec in (second.records or {}).values():
        assert not rec["read"].get("error"), "healed engine, yet a fault is on record (a replay)"
    if second.hit and second.usage is not None:
        assert second.usage["input_tokens"] == second.usage["output_tokens"] == 0
        assert second.records == first.records, "a hit differs from the decision it replays"
    if b.cache is not None:
        for entries in b.cache.cache._cache.values():  # what the inner LangGraph cache holds
            for enc, raw, _expiry in entries.values():
                for _channel, value in b.cache.serde.loads_typed((enc, raw)):
                    for rec in (value.values() if isinstance(value, Mapping) else ()):
                        read = rec.get("read", {}) if isinstance(rec, Mapping) else {}
                        assert not (read.get("error") or read.get("over_budget")), "stored a faulted decision"


def check_budget(b: Built, runs: list[Run]) -> None:
    """(e): granted = questions the target answered (a failed escalation is refunded);
    refused = questions marked over budget (when no decision raised)."""
    if not b.s["budget"]:
        return
    meter = store_meter(b.model, b.store) if b.store is not None else b.model._memo.outcomes.meter
    counts = meter.snapshot()
    fresh = [r for r in runs if not r.hit and r.node_ran]  # a replay spends nothing
    escalated = sum(1 for r in fresh for rec in (r.records or {}).values() if rec["read"]["escalation_model"])
    over = sum(1 for r in fresh for rec in (r.records or {}).values() if rec["read"]["over_budget"])
    answered = b.target.questions if b.target is not None else 0
    assert counts["granted"] == answered >= escalated, (counts, answered, escalated)
    assert counts["granted"] <= b.s["per_window"]
    if not any(r.error is not None for r in runs):
        assert counts["refused"] == over and answered == escalated, (counts, over)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setups())
def test_every_combination_holds(s):
    note(repr({k: v for k, v in s.items() if k != "state"}))
    event(f"{'graph' if s['graph'] else 'model'}{', two-step question' if 'many' in s['kinds'] else ''}")
    note(f"state={s['state']!r}")
    try:
        b = build(s)
    except CanvasRouteError as exc:  # a combination the node refuses, clearly (review of a depends_on parent)
        assert exc.hint
        event(f"refused: {type(exc).__name__}")
        return
    first = run(b, "t1")
    b.engine.healed = True
    second = run(b, "t1" if not s["graph"] else "t2")
    for r in (first, second):
        event(f"outcome: {type(r.error).__name__ if r.error else 'decided'}"
              + (f" {str(r.error)[:60]}" if isinstance(r.error, DecisionError) else ""))
        for rec in (r.records or {}).values():
            event(f"path: {rec['path']}")
        check_error(b, r)
        check_records(b, r)
    check_cache(b, first, second)
    check_budget(b, [first, second])
    # (d): from scratch, the same inputs read the same canvases and take the same branch
    again = build(s)
    replay = run(again, "t1")
    assert [c for _, c in again.engine.log] == [c for _, c in b.engine.log[:len(again.engine.log)]]
    assert type(replay.error) is type(first.error) and replay.lane == first.lane
    assert {q: (rec["path"], rec["answer"]) for q, rec in (replay.records or {}).items()} == {
        q: (rec["path"], rec["answer"]) for q, rec in (first.records or {}).items()}
