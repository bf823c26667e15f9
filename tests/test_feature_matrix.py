"""The feature matrix, property-based (hypothesis): features combined as users combine them.

One drawn example is a whole setup: questions of every kind (a 200-option Choice read in
two steps among them), `depends_on`, abstain with each outcome, every `OutcomePolicy` action,
`order_views`, the model's `DecisionCache`, the graph's `NodeCache`, a `Send` fan-out with
`branch=` beside it, shadow mode, human review, escalation budgets (in memory, or in the
graph's store shared by the node, a `route_on` edge after it and a second model with a budget
of its own), an escalation target that answers, fails (each `OutcomePolicy.target_fault`) or is
absent, an engine fault at one kind of read (discovery, first read, re-read, in-group read) or
none, a generated state (an image in it, seldom), request-level `instructions` and questions
read `alone` (on the model and on the node), `think` (with two-step questions), fixed `samples`
(on a causal engine too), and a calibrated per-question gate under every override layer (a
flag's `with_overrides`, the run's `Runtime.context.gate` or the request's `gate=`). It runs
twice (the engine healed for the second run), and once more from scratch. Invariants, not examples:

(a) no fault, no budget refusal and no failed escalation is ever cached or replayed;
(b) every exception that leaves the library is a `CanvasRouteError` with a hint;
(c) every asked question has exactly one record, its path and cause from the documented sets,
    and they say what happened;
(d) the same inputs and seed give the same canvases and the same branch;
(e) budget counters stay exact, per model;
(f) a hit or a replay reports no new usage;
(g) what the canvas read had, the escalation target saw: the instructions and the images;
(h) every gate override reached every question, per-question fits included;
(i) every absorbed engine fault was logged (WARNING) and marked on its span;
(j) every read of a thinking decision continued a thought; no agreement is reported over reads
    that could not differ;
(k) an escalated answer's distribution is the target's, option by option, with option names
    that prefix each other (`opt0`, `opt01`, `opt010`; `line 1` beside `line 10`..`line 199`);
(l) a setup written with 0.1's keywords (where 0.1 had them: `on_engine_error`, `fallback`,
    `budget` with `when_spent`, the gate's `on_unsure` / `on_abstain`, `read_options`) warns, holds
    every invariant above, and reads the same canvases and takes the same branch as the same setup
    in 0.2's spelling (its from-scratch run, (d)).
(m) totals mean what they say: a run's decision events and its records total the same
    (`run_totals`), a replayed decision (the `DecisionCache`, the `NodeCache`) spent nothing and
    keeps what it cost as its `original`, what a run without faults reports as read is what
    the engine read, and its target calls are the calls the target counted (a target whose
    first reply is prose is asked again: two calls).

Examples are bounded and derandomized (a fixed seed: CI runs the same examples every time);
`CANVASROUTE_MATRIX_EXAMPLES=500` explores further.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
import re
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
from langgraph.types import Command, Send
from promptrows import Block, blocks
from typing_extensions import TypedDict

from canvasroute.engine import (
    CanvasRead,
    CanvasRouteError,
    DecisionError,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailable,
    EscalationError,
    FunctionEngine,
    Thought,
)
from canvasroute.harness import (
    DECISION_EVENT,
    REVIEW_EVENT,
    NodeCache,
    ReviewPolicy,
    decision_node,
    merge_decisions,
    route_on,
    run_totals,
)
from canvasroute.harness._store_budget import store_meter
from canvasroute.router import (
    ABSTAIN,
    CAUSES,
    PATHS,
    CanvasDecisionModel,
    DecisionCache,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    Totals,
)

EXAMPLES = int(os.environ.get("CANVASROUTE_MATRIX_EXAMPLES", "500"))
MANY = 200
"""Options of the big Choice: past one read's 128 label ids, so it is read in two steps."""
ABSTAIN_LINE = "none of these"


# -- the scripted engine -----------------------------------------------------------------------


class Scripted(FunctionEngine):
    """Rows from each question's mood (`sure`, `borderline`, `unsure`, `abstain`), tilted by the canvas
    noise (so re-reads differ); a fault at one kind of read until `healed`; it takes images, and
    writes a thought (seeded) when asked."""

    def __init__(self, moods: Mapping[str, str], fault: str | None, fault_type: type[CanvasRouteError],
                 max_model_len: int, causal: bool) -> None:
        super().__init__(self._rows, model="scripted", max_model_len=max_model_len, causal_readout=causal)
        self.moods, self.fault, self.fault_type = moods, fault, fault_type
        self.healed = False
        self.seen: set[tuple[str, str]] = set()
        """Prompts read in this run (a repeat is a re-read)."""
        self.log: list[tuple[str, tuple[int, ...]]] = []
        self.faults = 0
        """Faults raised in this run."""
        self.too_long = 0
        """Reads whose prompt + canvas exceeded the context (a server refuses them: never send one)."""
        self.prompts: list[str] = []
        self.thinking = False
        """The decision thinks (`think`): every read must continue a thought."""
        self.unthought = 0
        """Reads of a thinking decision that continued no thought."""
        self.images: list[tuple[str, ...]] = []
        """The images each read carried."""

    def _raise(self) -> None:
        self.faults += 1
        raise self.fault_type("engine fault (injected)", hint="the test injects it")

    async def info(self):  # type: ignore[no-untyped-def]
        if self.fault == "info" and not self.healed:
            self._raise()
        return dataclasses.replace(await super().info(), accepts_images=True)

    async def read(self, batch: Any) -> Any:  # a vision model: the images are taken, not read as text
        self.images += [tuple(r.images) for r in batch]
        return await super().read([dataclasses.replace(r, images=()) for r in batch])

    async def think(self, messages: Any, budget: int, *, seed: int) -> Thought:
        digest = hashlib.sha256(f"{messages[0]['content']}|{seed}".encode()).digest()
        return Thought(ids=tuple(digest[:3]), text="hm", closed=True, prompt_tokens=3)

    async def _rows(self, read: CanvasRead) -> list[dict[int, float]]:
        if await self.count_prompt(read.messages) + len(read.canvas) > (await super().info()).max_model_len:
            self.too_long += 1
            raise EngineRequestError("prompt + canvas exceed the context", status=400)
        self.unthought += self.thinking and read.thought is None
        self.prompts.append(read.messages[-1]["content"])
        system = read.messages[0]["content"]
        found = blocks(system) or blocks(read.messages[-1]["content"])  # an isolated causal read: after the state
        assert len(found) == len(read.slots)
        prompt = (system, read.messages[-1]["content"])
        kind = ("in_group" if any(b.instructions.startswith("Q") and "(First:" not in b.instructions
                                  and len(b.labels) > 8 for b in found)
                else "reread" if prompt in self.seen else "first")
        self.seen.add(prompt)
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
    """An escalation target answering each asked question's first option, with a distribution
    over its first options (`WEIGHTS`) as OpenAI-shaped logprobs: each value one token with its
    closing quote, the alternatives the other options written the same way; or failing. It keeps
    what it was shown (the last human message: text and image parts)."""

    WEIGHTS = (0.6, 0.3, 0.1)

    def __init__(self, fails: bool, name: str = "target", *, malformed: bool = False) -> None:
        self.fails, self.malformed, self.calls, self.questions = fails, malformed, 0, 0
        self.texts: list[str] = []
        self.images: list[list[str]] = []
        self.runnable = RunnableLambda(self._reply, name=name)

    def _reply(self, msgs: Any) -> AIMessage:
        self.calls += 1
        last = msgs[-1].content
        retry = isinstance(last, str) and last.startswith("That reply was invalid")  # the request: 2 messages back
        content = msgs[-3 if retry else -1].content
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        text = "".join(p["text"] for p in parts if p.get("type") == "text")
        if not retry:
            self.texts.append(text)
            self.images.append([p["image_url"]["url"] for p in parts if p.get("type") == "image_url"])
        if self.fails:
            raise ConnectionError("the escalation target is down")
        if self.malformed and not retry:  # prose first: the escalation asks again, a second call
            return AIMessage("I am not sure which options fit.")
        asked = {qid: re.findall(r'"([^"]*)"(?: \([^)]*\))?(?:, |$)', options) for qid, options in re.findall(
            r'^Question "([^"]+)": .*? Options: (.*?)\.(?: Fast model\'s probabilities: .*)?$', text, re.MULTILINE)}
        self.questions += len(asked)
        tokens: list[dict[str, Any]] = [{"token": "{", "logprob": 0.0}]
        for i, (qid, options) in enumerate(asked.items()):
            tokens.append({"token": ("" if i == 0 else ", ") + json.dumps(qid) + ': "', "logprob": 0.0})
            alternatives = [{"token": o + '"', "logprob": math.log(p)} for o, p in Target.given(options).items()]
            tokens.append({"token": options[0] + '"', "logprob": alternatives[0]["logprob"],
                           "top_logprobs": alternatives})
        tokens.append({"token": "}", "logprob": 0.0})
        text = "".join(t["token"] for t in tokens)
        assert json.loads(text) == {qid: options[0] for qid, options in asked.items()}
        return AIMessage(text, usage_metadata={"input_tokens": 7, "output_tokens": 2, "total_tokens": 9},
                         response_metadata={"logprobs": {"content": tokens}})

    @staticmethod
    def given(options: Any) -> dict[str, float]:
        """The distribution this target gives a question with these options."""
        weights = Target.WEIGHTS[:len(options)]
        return {o: w / sum(weights) for o, w in zip(options, weights, strict=False)}


class Faults(logging.Handler):
    """The WARNING records `canvasroute.router` writes for absorbed engine faults."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


FAULT_LOG = Faults()
logging.getLogger("canvasroute.router").addHandler(FAULT_LOG)


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
    if kind == "choice":  # names that prefix each other: a target's mass must stay each one's own
        return Choice(instructions=text, criteria={f"opt{i}{c}": None for c in ("", "1", "10")})
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
IMAGE_URL = "data:image/png;base64,iVBORw0KGgo="
INSTRUCTIONS = [None, None, "All tickets are from EU customers.", "Context. " * 40]


@st.composite
def setups(draw: st.DrawFn) -> dict[str, Any]:
    graph = draw(st.booleans())
    fan_out = graph and draw(st.sampled_from([False, False, True]))  # a Send fan-out with branch=
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
    shadow = graph and not fan_out and draw(st.booleans())
    review = graph and not shadow and not fan_out and draw(st.booleans())
    odd = draw(st.sampled_from([None] * 6 + ["image", "object"])) if not graph else draw(
        st.sampled_from([None] * 6 + ["image"]))
    think = 0 if odd == "image" else draw(st.sampled_from([0, 0, 0, 6]))
    state = ({"photo": _IMAGE} if odd == "image" else {"odd": object()} if odd == "object" else draw(
        st.one_of(st.text(max_size=40), _json_like) if graph else st.one_of(st.text(max_size=40), _json_like, _rich)))
    target = draw(st.sampled_from([None, None, "answers", "fails"] if review
                                  else ["answers", "answers", "fails", None]))
    uncertain = draw(st.sampled_from(["escalate", "escalate", "answer", "fallback", "raise", "review"]))
    return {
        "graph": graph, "fan_out": fan_out, "kinds": kinds, "qids": qids, "depends": depends, "shadow": shadow,
        "review": review,
        "moods": {q: draw(st.sampled_from(["sure", "borderline", "unsure", "abstain", "abstain"] if abstain
                                          else ["sure", "borderline", "unsure"])) for q in qids},
        "fault": fault,
        "fault_type": draw(st.sampled_from([EngineUnavailable, EngineResponseError])),
        "max_model_len": 800 if two_step == "too long" else 4096,
        # a review lane stands in for an escalation target, mostly
        "target": target,
        "engine_fault": draw(st.sampled_from(["escalate", "raise", "fallback"])),
        "fallback": draw(st.sampled_from([True, True, True, False])),
        "abstain": abstain, "abstained": draw(st.sampled_from(["escalate", "fallback", "answer"])),
        "uncertain": uncertain, "over_budget": draw(st.sampled_from(["answer", "fallback", "raise"])),
        "target_fault": draw(st.sampled_from(["answer", "answer", "fallback", "raise"])),
        "order_views": draw(st.integers(0, 2)), "rereads": draw(st.integers(0, 2)),
        "samples": draw(st.sampled_from([1, 1, 1, 2])), "causal": draw(st.sampled_from([False, False, True])),
        "think": think, "isolate": draw(st.sampled_from(["auto", "auto", "none", "all"])),
        # long instructions beside a two-step question and a small context: every read must still fit
        "instructions": draw(st.sampled_from(INSTRUCTIONS)),
        "alone": tuple(q for q in qids if draw(st.sampled_from([False, False, True]))),
        # a calibrated fit for the first question, and an override layer over everything
        "fit": draw(st.sampled_from([None, {"temperature": 1.5}, {"max_normalized_entropy": 0.2, "temperature": 0.8}])),
        "layer": draw(st.sampled_from([None, "flags", "context", "request"])),
        "layer_gate": draw(st.sampled_from([0.3, 0.95])),
        "budget": draw(st.sampled_from([None, "memory", "store", "store"] if graph else [None, "memory"])),
        "edge": graph and not fan_out and not shadow and draw(st.booleans()),  # a route_on edge after the node
        "second_model": graph and not fan_out and draw(st.sampled_from([False, False, True])),
        "per_window": draw(st.integers(0, 2)),
        "model_cache": draw(st.sampled_from([True, True, False])),
        "node_cache": graph and draw(st.sampled_from([True, True, False])),
        "state": state, "seed": draw(st.none() | st.integers(0, 2**31)),
        "spelling": draw(st.sampled_from(["0.2", "0.2", "0.1"])),  # (l): 0.1's keywords where 0.1 had them
        "malformed": draw(st.sampled_from([False, False, True])),  # (m): the target's first reply is prose
    }


# -- one run of a setup -----------------------------------------------------------------------


class GraphState(TypedDict, total=False):
    ticket: Any
    docs: dict[str, Any]
    doc: Any
    doc_id: str
    decisions: Annotated[dict, merge_decisions]
    lane: str
    after: str


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
    other: CanvasDecisionModel | None = None
    """A second model with a budget of its own, in the same store (its decisions: `after`)."""
    other_target: Target | None = None


def _options(kind: str, question: Any) -> tuple[str, ...]:
    return ("yes", "no") if kind == "noul" else ("0", "1", "2") if kind == "score" else tuple(question.criteria)


def gate_of(s: dict[str, Any]) -> GatePolicy:
    """The model's policy: the drawn read settings, a calibrated fit for the first question, and
    (`flags`) the override layer applied the way `serve`/`eval` flags are."""
    base = GatePolicy(rereads=s["rereads"], abstain=s["abstain"], order_views=s["order_views"], samples=s["samples"])
    if s["fit"] is not None:
        base = dataclasses.replace(base, per_question={s["qids"][0]: dataclasses.replace(base, **s["fit"])})
    if s["layer"] == "flags":
        base = base.with_overrides(max_normalized_entropy=s["layer_gate"])
    return base


def expected_gate(s: dict[str, Any], qid: str) -> float:
    """(h): the threshold a question is held to after every layer."""
    if s["layer"] is not None:
        return s["layer_gate"]
    if s["fit"] is not None and qid == s["qids"][0]:
        return s["fit"].get("max_normalized_entropy", 0.5)
    return 0.5


def build(s: dict[str, Any]) -> Built:
    questions = {q: _question(i, k) for i, (q, k) in enumerate(zip(s["qids"], s["kinds"], strict=True))}
    options = {q: _options(k, questions[q]) for q, k in zip(s["qids"], s["kinds"], strict=True)}
    engine = Scripted(s["moods"], s["fault"], s["fault_type"], s["max_model_len"], s["causal"])
    engine.thinking = bool(s["think"])
    target = Target(s["target"] == "fails", malformed=s["malformed"]) if s["target"] else None
    budget = EscalationBudget(max_per_window=s["per_window"], window_s=3600) if s["budget"] else None
    fallback = {q: o[0] for q, o in options.items()} if s["fallback"] else {}
    outcomes = OutcomePolicy(
        engine_fault=s["engine_fault"] if fallback or s["engine_fault"] != "fallback" else "escalate",
        uncertain=s["uncertain"] if fallback or s["uncertain"] != "fallback" else "answer",
        abstained=s["abstained"] if fallback or s["abstained"] != "fallback" else "answer",
        over_budget=s["over_budget"] if fallback or s["over_budget"] != "fallback" else "answer",
        target_fault=s["target_fault"] if fallback or s["target_fault"] != "fallback" else "answer", fallback=fallback)
    settings = {"policy": gate_of(s), "outcomes": outcomes,
                "escalate_to": Escalation(target.runnable, budget=budget) if target else None}
    with spelled(s):
        model = CanvasDecisionModel(engine=engine, cache=DecisionCache() if s["model_cache"] else None,
                                    **(in_0_1(settings, target, budget) if s["spelling"] == "0.1" else settings))
    built = Built(s, engine, target, model, questions, options)
    read = {"instructions": s["instructions"], "alone": s["alone"], "think": s["think"], "isolate": s["isolate"]}
    node_read = {"read_options" if s["spelling"] == "0.1" else "read": read}
    if not s["graph"]:
        return built
    route = (s["qids"][0], {o: f"lane{n}" for n, o in enumerate(options[s["qids"][0]])})
    builder = StateGraph(GraphState)
    if s["fan_out"]:
        with spelled(s):
            node = decision_node(model, questions, inputs="doc", depends_on=s["depends"], branch="doc_id",
                                 **node_read)
        builder.add_node("grade", node, cache_policy=node.cache_policy() if s["node_cache"] else None)
        builder.add_conditional_edges(START, lambda st_: [Send("grade", {"doc": v, "doc_id": k})
                                                          for k, v in st_["docs"].items()], ["grade"])
        builder.add_edge("grade", END)
    else:
        with spelled(s):
            node = decision_node(model, questions, inputs="ticket", route=route, depends_on=s["depends"],
                                 review=ReviewPolicy() if s["review"] else None,
                                 shadow=(lambda state: "lane0") if s["shadow"] else None, **node_read)
        builder.add_node("triage", node, cache_policy=node.cache_policy() if s["node_cache"] else None)
        builder.add_edge(START, "triage")
        paths = {o: f"lane{n}" for n, o in enumerate(options[s["qids"][0]])}
        for lane in route[1].values():
            builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
            if s["edge"]:  # the same model again, on an edge: its escalations count in the same store
                with spelled(s):
                    edge = route_on(model, questions[s["qids"][0]], paths, inputs="ticket", question_id="edge",
                                    **{k: {**read, "alone": ()} for k in node_read})
                builder.add_conditional_edges(lane, edge, dict.fromkeys(paths, "tail"))
            else:
                builder.add_edge(lane, "tail")
        if s["second_model"]:
            built.other_target = Target(False, name="other")
            built.other = CanvasDecisionModel(engine=Scripted({"Z0": "unsure"}, None, EngineUnavailable, 4096, False),
                                              escalate_to=Escalation(built.other_target.runnable, budget=budget)
                                              if budget else built.other_target.runnable)
            other = decision_node(built.other, {"Z0": Noul(instructions="Z0: another model's question?")},
                                  inputs="ticket", output_key="decisions")
            builder.add_node("tail", lambda state: {"after": "tail"})
            builder.add_node("other", other)
            builder.add_edge("tail", "other")
            builder.add_edge("other", END)
        else:
            builder.add_node("tail", lambda state: {"after": "tail"})
            builder.add_edge("tail", END)
    built.cache = NodeCache(InMemoryCache()) if s["node_cache"] else None
    built.store = InMemoryStore() if s["budget"] == "store" else None
    built.graph = builder.compile(checkpointer=InMemorySaver(), cache=built.cache, store=built.store)
    return built


def spelled(s: dict[str, Any]) -> Any:
    """Where a 0.1-spelled setup uses 0.1 keywords: each warns (`DeprecationWarning`)."""
    return pytest.warns(DeprecationWarning) if s["spelling"] == "0.1" else contextlib.nullcontext()


def in_0_1(settings: dict[str, Any], target: Any, budget: EscalationBudget | None) -> dict[str, Any]:
    """A model's settings as 0.1 wrote them where 0.1 had a keyword (`on_engine_error`, `fallback`,
    `budget` with `when_spent`, the gate's `on_unsure` / `on_abstain`); what 0.1 could not say stays 0.2's."""
    outcomes: OutcomePolicy = settings["outcomes"]
    policy = settings["policy"]
    gate_words = {"on_abstain": outcomes.abstained} if outcomes.abstained != "answer" and policy.abstain else {}
    if target is None and outcomes.uncertain != "escalate":  # 0.1 asked on_unsure only without a target
        gate_words["on_unsure"] = outcomes.uncertain
    policy = dataclasses.replace(policy, **gate_words, per_question={  # 0.1 read them per question
        q: dataclasses.replace(p, **gate_words) for q, p in policy.per_question.items()})
    rest = {"uncertain": outcomes.uncertain} if "on_unsure" not in gate_words else {}
    rest |= {"abstained": outcomes.abstained} if "on_abstain" not in gate_words else {}
    old: dict[str, Any] = {"policy": policy, "on_engine_error": outcomes.engine_fault}
    if target is not None:
        old["escalate_to"] = target.runnable
        if budget is not None:
            spent = {"answer": "keep"}.get(outcomes.over_budget, outcomes.over_budget)
            old["budget"] = EscalationBudget(max_per_window=budget.max_per_window, window_s=budget.window_s,
                                             when_spent=spent)
        elif outcomes.over_budget != "answer":
            rest["over_budget"] = outcomes.over_budget
    elif outcomes.over_budget != "answer":
        rest["over_budget"] = outcomes.over_budget
    if outcomes.target_fault != "answer":  # 0.1 had no word for it
        rest["target_fault"] = outcomes.target_fault
    if "fallback" in rest.values():  # an outcome 0.1 could not say that needs the options: 0.2's, together
        return {**old, "outcomes": OutcomePolicy(**rest, fallback=outcomes.fallback)}
    return {**old, "fallback": dict(outcomes.fallback), "outcomes": OutcomePolicy(**rest)}


@dataclasses.dataclass
class Run:
    error: BaseException | None = None
    records: dict[str, dict[str, Any]] | None = None
    """qid -> {path, answer, read: ReadReport fields} (graph records, or a response's reads; a fan-out
    records one per branch: qid@branch)."""
    usage: dict[str, int] | None = None
    lane: str | None = None
    node_ran: bool = True
    hits: int = 0
    """Decisions the model's DecisionCache answered in this run."""
    shadow: dict[str, Any] | None = None
    faults: int = 0
    """Engine faults raised during the run."""
    logged: int = 0
    """WARNING records of absorbed faults during the run."""
    totals: tuple[Totals, Totals] | None = None
    """(m): what the run's decision events and its records total (`run_totals`), or a response's
    totals twice (no graph)."""
    reads: int = 0
    """Canvas reads the engine made during the run (faulted ones included)."""
    replays: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """(m): the `timing` of every record a cache replayed, or of a replayed response."""
    calls: int = 0
    """(m): calls the escalation target itself counted during the run."""


def _flat(decisions: Mapping[str, Any] | None, b: Built) -> dict[str, dict[str, Any]] | None:
    """Graph records as qid -> record (qid@branch in a fan-out; another model's questions left out)."""
    if decisions is None:
        return None
    out = {}
    for qid, value in decisions.items():
        if qid not in b.questions:
            continue
        if b.s["fan_out"]:
            out.update({f"{qid}@{branch}": rec for branch, rec in value.items()})
        else:
            out[qid] = value
    return out


def run(b: Built, thread: str) -> Run:
    b.engine.seen, b.engine.faults = set(), 0
    logged = len(FAULT_LOG.records)
    s = b.s
    read = {"instructions": s["instructions"], "alone": s["alone"], "think": s["think"], "isolate": s["isolate"]}
    gate = {"max_normalized_entropy": s["layer_gate"]} if s["layer"] in ("context", "request") else None
    reads = len(b.engine.log)
    calls = b.target.calls if b.target is not None else 0
    try:
        hits = b.model.cache.hits if b.model.cache else 0
        if not s["graph"]:
            resp = b.model.decide(s["state"], b.questions, seed=s["seed"], depends_on=s["depends"],
                                  thread_id=thread, read=read, gate=gate)
            replays = ([{"replayed": resp.replayed, "totals": resp.totals.as_dict(),
                         "original": resp.original.as_dict() if resp.original else None}] if resp.replayed else [])
            got = Run(records={q: {"path": r.path, "answer": r.answer, "read": r.model_dump(exclude={"latency_s"})}
                               for q, r in resp.reads.items()}, usage=dict(resp.usage), faults=b.engine.faults,
                      hits=b.model.cache.hits - hits if b.model.cache else 0,
                      logged=len(FAULT_LOG.records) - logged, totals=(resp.totals, resp.totals),
                      reads=len(b.engine.log) - reads, replays=replays,
                      calls=(b.target.calls if b.target is not None else 0) - calls)
            resp.answers.clear()  # a caller editing its response changes no later hit
            resp.reads.clear()
            resp.usage["input_tokens"] = 10**6
            return got
        config = {"configurable": {"thread_id": thread}}
        value: Any = ({"docs": {"d1": s["state"], "d2": [s["state"], "again"]}} if s["fan_out"]
                      else {"ticket": s["state"]})
        context = {"gate": gate} if gate is not None else None
        events: list[dict[str, Any]] = []
        reviews: list[dict[str, Any]] = []
        """The review events (a paused run's read counts there, (m))."""
        out: dict[str, Any] = {}
        for _ in range(4):  # resume every review with another option than the canvas's
            pending: Any = ()
            for mode, chunk in b.graph.stream(value, config, stream_mode=["custom", "values", "updates"],
                                              context=context):
                if mode == "custom" and chunk.get("type") in (DECISION_EVENT, REVIEW_EVENT) \
                        and chunk["node"] in ("triage", "grade"):
                    (events if chunk["type"] == DECISION_EVENT else reviews).append(chunk)
                elif mode == "values":
                    out = chunk
                elif mode == "updates" and "__interrupt__" in chunk:
                    pending = (*pending, *chunk["__interrupt__"])  # one update per waiting branch
            if not pending:
                break
            def overruled(interrupt: Any) -> dict[str, str]:  # another option than the canvas's, per question
                return {q: next(o for o in item["options"] if o != item["answer"])
                        for q, item in interrupt.value["questions"].items()}

            # a fan-out's branches wait for review each: every interrupt is resumed by its id
            value = Command(resume=overruled(pending[0]) if len(pending) == 1 else {
                i.id: overruled(i) for i in pending})
        records = _flat(out.get("decisions"), b)
        timings = [rec["timing"] for rec in (records or {}).values()]
        return Run(records=records, lane=out.get("lane"), node_ran=bool(events),
                   faults=b.engine.faults, hits=b.model.cache.hits - hits if b.model.cache else 0,
                   shadow=events[-1].get("shadow") if events else None, logged=len(FAULT_LOG.records) - logged,
                   totals=(run_totals([*reviews, *events]), run_totals(records or {})), reads=len(b.engine.log) - reads,
                   replays=[t for t in timings if t.get("replayed") in ("decision_cache", "node_cache")],
                   calls=(b.target.calls if b.target is not None else 0) - calls)
    except Exception as exc:  # noqa: BLE001 - judged by check_error
        return Run(error=exc, faults=b.engine.faults, logged=len(FAULT_LOG.records) - logged)


# -- the invariants -------------------------------------------------------------------------------


def check_error(b: Built, r: Run) -> None:
    """(b): typed, with a hint; no read the engine must refuse was sent; no image as text; an
    escalation that fails after an engine fault names it as its cause."""
    assert b.engine.too_long == 0, "a read longer than the context was sent"
    assert not any(_IMAGE["base64"] in p for p in b.engine.prompts), "an image went into the prompt as text"
    if r.error is not None:
        assert isinstance(r.error, CanvasRouteError), f"untyped {type(r.error).__name__}: {r.error!r}"
        assert r.error.hint, f"{type(r.error).__name__} without a hint: {r.error}"
        if isinstance(r.error, EscalationError) and r.faults and b.model.outcomes.engine_fault == "escalate":
            assert isinstance(r.error.__cause__, b.s["fault_type"]), "the engine fault is not the cause"


def check_records(b: Built, r: Run) -> None:
    """(c), (h), (i), (j): one record per asked question, a documented path and cause that say
    what happened; the gate each was held to; faults said; thoughts and agreement honest."""
    assert b.engine.unthought == 0, "a read of a thinking decision continued no thought"
    if r.records is None:
        return
    s = b.s
    outcomes = b.model.outcomes
    if s["shadow"] and ((r.shadow and r.shadow.get("canvas_error")) or (not r.node_ran and not r.records)):
        # the router routed and the canvas read beside it failed: on the span and event, no record (a
        # node-cache hit replays that routing, the router's answer, with no record either)
        assert not r.records
        if r.shadow:  # only an engine fault, or a read too long for the model, fails the canvas read
            allowed = {s["fault_type"].__name__} if r.faults else set()
            allowed |= {"InputTooLong"} if s["max_model_len"] < 4096 and "many" in s["kinds"] else set()
            assert r.shadow["canvas_error"] in allowed, (r.shadow["canvas_error"], allowed)
        return
    branches = ("@d1", "@d2") if s["fan_out"] else ("",)
    assert set(r.records) == {q + b_ for q in b.questions for b_ in branches}
    parents = {c: p for c, (p, _) in (s["depends"] or {}).items()}
    if any(rec["read"]["error"] for rec in r.records.values()) and r.node_ran and not r.hits:
        assert r.logged >= 1, "an engine fault was absorbed and nothing was logged"
    for key, rec in r.records.items():
        qid, _, branch = key.partition("@")
        read, path, cause = rec["read"], rec["path"], rec["read"]["cause"]
        human = path == "human"  # a reviewer's answer: the read says what the canvas did
        if human:
            assert s["review"] or outcomes.uncertain == "review"
            assert not read["confident"] and read["path"] != "escalated"
            assert rec["answer"] in b.options[qid]
            path = read["path"]
        assert path in PATHS and path != "human", path
        assert cause is None or cause in CAUSES, cause
        assert read["confident"] == (path in ("canvas", "reread")), (path, read)
        assert (cause is None) == (path in ("canvas", "reread", "skipped")), (path, cause)
        if read["gate"] is not None:  # (h): every override layer reached every question
            assert read["gate"].startswith(f"H/lnK <= {expected_gate(s, qid):g}"), (read["gate"], qid)
        if read["agreement"] is not None:  # (j): agreement only over reads that could differ
            assert read["reads"] > 1 and read["rereadable"], read
        if s["shadow"]:  # "would escalate": asked, and not passed by the gate
            assert rec["shadow"]["would_escalate"] == (not read["confident"] and path != "skipped")
        if qid in parents:  # asked (or skipped) on the parent's final answer, a reviewer's included
            cond = read["asked_if"]
            parent = r.records[parents[qid] + (f"@{branch}" if branch else "")]
            assert cond["parent_answer"] == parent["answer"]
            assert (path == "skipped") == (cond["parent_answer"] not in cond["answers"])
        if path == "skipped":
            assert qid in parents and rec["answer"] is None
            continue
        assert rec["answer"] in b.options[qid]
        if read["error"] is not None:  # a fault is never a cheap answer
            assert cause in ("engine_fault", "over_budget", "target_fault") and path in ("escalated", "fallback"), (
                path, read)
        if cause == "target_fault":  # the escalation failed: the target's fault is named
            assert read["escalation_error"] and b.target is not None and b.target.fails, read
        assert (read["escalation_error"] is not None) == (cause == "target_fault"), read
        if cause == "abstained":
            assert s["abstain"] and read["canvas_probabilities"] is not None
            assert max(read["canvas_probabilities"], key=read["canvas_probabilities"].get) == ABSTAIN
        if path == "escalated":
            assert read["escalation_model"] == "target" and b.target is not None and not b.target.fails
            assert cause in ("uncertain", "abstained", "engine_fault")
            given = Target.given(b.options[qid])  # (k): the target's distribution, option by option
            assert read["probabilities"] == pytest.approx({o: given.get(o, 0.0) for o in b.options[qid]}), qid
        elif path == "unsure":
            assert read["crossed"] or cause in ("abstained", "over_budget", "target_fault"), read
        elif path == "fallback":
            assert human or rec["answer"] == b.options[qid][0]
            assert cause in ("engine_fault", "over_budget", "target_fault") or outcomes.fallback, cause
        elif path in ("canvas", "reread"):
            assert not read["crossed"]
            routed = s["kinds"][s["qids"].index(qid)] == "many" and read["reads"] >= 2
            base = 1 if not read["rereadable"] else s["samples"]
            assert (read["reads"] - routed > base) == (path == "reread")  # samples are no re-reads
        if cause == "over_budget":
            assert s["budget"] and path in ("unsure", "fallback")


def check_totals(b: Built, r: Run) -> None:
    """(m): the events and the records total the same; a replay spent nothing and keeps what it
    cost; a run without faults reports the reads the engine made (a `route_on` edge reads with the
    same engine but writes no record: its reads are the events' only, and not drawn here)."""
    if r.error is not None or r.totals is None:
        return
    events, records = r.totals
    assert events == records, (events, records)
    event(f"totals: {'replayed' if r.replays else 'read'}{', no fault' if not r.faults else ''}")
    for timing in r.replays:
        assert Totals.from_dict(timing["totals"]) == Totals(), timing
        assert timing["original"] is not None and timing["original"]["decisions"] == 1, timing
    if not b.s["edge"]:  # (a route_on edge asks the same target, in no record)
        assert events.target_calls == r.calls, ("target calls: the totals' against the target's own", events, r.calls)
        if r.calls:
            event(f"target calls: {'asked again after prose' if b.s['malformed'] else 'answered at once'}")
    if not r.faults and not b.s["edge"]:
        assert events.reads == r.reads, (events, r.reads)
        cached = ("decision_cache", "node_cache")
        escalated = sum(rec["read"]["path"] == "escalated" for rec in (r.records or {}).values()
                        if not (r.replays and not b.s["graph"]) and rec.get("timing", {}).get("replayed") not in cached)
        assert events.escalations == escalated, (events, escalated)


def check_escalations(b: Built) -> None:
    """(g): the target saw what the canvas read had: the instructions, and every image."""
    if b.target is None:
        return
    for text, images in zip(b.target.texts, b.target.images, strict=True):
        if b.s["instructions"]:
            assert b.s["instructions"].strip() in text, "the instructions never reached the target"
        if isinstance(b.s["state"], dict) and b.s["state"].get("photo") == _IMAGE:
            assert images == [IMAGE_URL], "the image never reached the target"


def _decisions(r: Run) -> dict[str, list[dict[str, Any]]]:
    """A run's records by decision: one per fan-out branch, else one."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key, rec in (r.records or {}).items():
        out.setdefault(key.partition("@")[2], []).append(rec)
    return out


DECIDED_AGAIN = ("over_budget", "target_fault")
"""Causes no cache may replay: a spent budget, a failed escalation (the canvas's answer standing in)."""


def check_cache(b: Built, first: Run, second: Run) -> None:
    """(a) and (f): nothing faulted or refused is stored or replayed; a hit spends nothing."""
    decisions = _decisions(first)
    bad = [recs for recs in decisions.values() if any(
        rec["read"].get("error") or rec["read"].get("cause") in DECIDED_AGAIN for rec in recs)]
    if b.s["model_cache"] and not b.s["shadow"] and bad:  # only a decision nothing touched may be a hit
        edge = 1 if b.s["edge"] else 0  # the route_on edge's decision (the same model, no record of its own)
        assert second.hits <= len(decisions) - len(bad) + edge, \
            "a faulted or budget-refused decision was replayed by the DecisionCache"
    if b.s["node_cache"] and bad:
        assert second.node_ran, "a faulted or budget-refused decision was replayed by the node cache"
    for rec in (second.records or {}).values():
        assert not rec["read"].get("error"), "healed engine, yet a fault is on record (a replay)"
    if second.hits and second.usage is not None:
        assert second.usage["input_tokens"] == second.usage["output_tokens"] == 0
        assert second.records == first.records, "a hit differs from the decision it replays"
    if b.cache is not None:
        for entries in b.cache.cache._cache.values():  # what the inner LangGraph cache holds
            for enc, raw, _expiry in entries.values():
                for _channel, value in b.cache.serde.loads_typed((enc, raw)):
                    for rec in (value.values() if isinstance(value, Mapping) else ()):
                        groups = rec.values() if isinstance(rec, Mapping) and "read" not in rec else [rec]
                        for one in groups:
                            read = one.get("read", {}) if isinstance(one, Mapping) else {}
                            assert not (read.get("error") or read.get("cause") in DECIDED_AGAIN), \
                                "stored a faulted decision"


def check_budget(b: Built, runs: list[Run]) -> None:
    """(e): per model, granted = questions its target answered (a failed escalation is refunded)
    and within the window; refused = questions marked over budget (when no decision raised)."""
    if not b.s["budget"] or b.target is None:
        return
    meter = store_meter(b.model, b.store) if b.store is not None else b.model.escalation.meter  # type: ignore[union-attr]
    counts = meter.snapshot()
    answered = b.target.questions if b.target is not None else 0
    assert counts["granted"] == answered, (counts, answered)
    assert counts["granted"] <= b.s["per_window"]
    if b.other is not None and b.store is not None:  # its own budget: never refused for the first model's
        other = store_meter(b.other, b.store)
        assert other is not meter and other.namespace != meter.namespace
        assert other.snapshot()["granted"] == b.other_target.questions <= b.s["per_window"]  # type: ignore[union-attr]
    # a refused decision is never stored, so every run's refusals were decided afresh; an escalated one
    # may be a replay (the caches), so the target answered at least the first run's and at most all
    if not any(r.error is not None for r in runs) and not b.s["edge"]:
        def count(rs: list[Run], check: Any) -> int:
            return sum(1 for r in rs for rec in (r.records or {}).values() if check(rec))

        over = count(runs, lambda rec: rec["read"]["cause"] == "over_budget")
        escalated = [count([r], lambda rec: rec["read"]["path"] == "escalated" or rec["path"] == "escalated")
                     for r in runs]
        assert counts["refused"] == over, (counts, over)
        if b.s["model_cache"] or b.s["node_cache"]:
            assert escalated[0] <= answered <= sum(escalated), (answered, escalated)
        else:
            assert answered == sum(escalated), (answered, escalated)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setups())
def test_every_combination_holds(s):
    note(repr({k: v for k, v in s.items() if k != "state"}))
    event(f"{'fan-out' if s['fan_out'] else 'graph' if s['graph'] else 'model'}"
          f"{', two-step question' if 'many' in s['kinds'] else ''}{', think' if s['think'] else ''}")
    note(f"state={s['state']!r}")
    event(f"spelled in {s['spelling']}'s keywords")
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
            event(f"path: {rec['path']}, cause: {rec['read']['cause']}")
        check_error(b, r)
        check_records(b, r)
        check_totals(b, r)
    check_escalations(b)
    check_cache(b, first, second)
    check_budget(b, [first, second])
    # (d): from scratch, the same inputs read the same canvases and take the same branch
    again = build({**s, "spelling": "0.2"})  # (l): a 0.1-spelled setup decides as its 0.2 spelling does
    replay = run(again, "t1")
    if s["fan_out"]:  # the branches read concurrently: the same reads, in either order; either may raise first
        assert sorted(c for _, c in again.engine.log) == sorted(c for _, c in b.engine.log[:len(again.engine.log)])
        assert (replay.error is None) == (first.error is None)
    else:
        assert [c for _, c in again.engine.log] == [c for _, c in b.engine.log[:len(again.engine.log)]]
        assert type(replay.error) is type(first.error) and replay.lane == first.lane
    assert {q: (rec["path"], rec["answer"]) for q, rec in (replay.records or {}).items()} == {
        q: (rec["path"], rec["answer"]) for q, rec in (first.records or {}).items()}
