"""The decision request: what one decision is, built once where it enters and carried whole.

Every way into a decision (`CanvasDecisionModel.decide/invoke`, `decision_node`, `route_on`,
`canvasroute serve` on either wire, shadow mode, `canvasroute eval`) builds one frozen
`DecisionRequest` (`CanvasDecisionModel.request`) and hands it down. Each stage (plan, read,
re-read, gate, escalate, review, cache, trace, record) takes the request, or the part it owns,
and never receives one of its fields by hand or works one out again:

```
DecisionRequest
├── state        StateView: the value as given, its rendered text, its images, a digest
├── questions    QuestionSet: the parsed questions (QuestionSpec), their key, dependencies
├── read         ReadOptions: instructions, alone, steps, think, images, constrained
├── gate         GatePolicy, every override applied once (`resolve_gate`)
├── outcomes     OutcomePolicy: what happens when the gate is not passed
├── escalation   Escalation (target, output, prompt, timeout, budget, meter, controller, hedge, audit) or None
└── identity     Identity: seed, thread, branch, span attributes; `key` for caches
```

A new option joins `ReadOptions` (how canvases are read) or the gate, once, and every
stage sees it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Literal

from langchain_core.decisions import Choice, Noul, Score

from canvasroute.engine import SPECIAL_CANDIDATES, DecisionError, defuse

from ._policy import (
    ControlSetting,
    Escalation,
    GatePolicy,
    LiveSetting,
    OutcomePolicy,
    check_fallbacks,
    resolve_gates,
)
from ._questions import Dependencies, QuestionSpec, option_text, parse_depends_on, parse_questions
from ._schema import schema_questions
from ._state import read_state

__all__ = ["MAX_STEPS", "MAX_THINK", "DecisionRequest", "Identity", "QuestionSet", "ReadOptions", "StateView",
           "read_options", "schema_decision"]

MAX_STEPS = 8
"""Denoising steps one read may take (vLLM's gateway caps `steps` there too)."""
MAX_THINK = 4096
"""Tokens a thought may take (vLLM's gateway's cap)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOptions:
    """How a decision's canvases are read.

    Example:
        ```python
        model.decide(ticket, questions, read=ReadOptions(instructions="All tickets are from EU customers"))
        decision_node(model, questions, read={"alone": {"summary"}})   # a dict of the same fields
        ```
    """

    instructions: str = ""
    """Context for every question, at the head of each canvas's system prompt (defused like the state)."""
    alone: frozenset[str] = frozenset()
    """Questions each read in a canvas of their own."""
    steps: int = 1
    """Denoising steps per read (the template pinned past the first)."""
    think: int = 0
    """Token budget of the thought the model writes before each canvas is read (0: none)."""
    images: tuple[str, ...] = ()
    """Image URLs sent with every read, beside those in the state (`StateView.images` holds both)."""
    constrained: bool | None = None
    """Reads normalized over the request's label ids only (vLLM's `diffusion_constrained`): the
    same label distribution, in well under half the time on the vLLM CPU server, but no label
    mass. None: constrained unless the gate reads label mass."""
    isolate: Literal["none", "auto", "all"] = "auto"
    """Read each question without the others in view, in a canvas of its own: `all`; `none` (one
    joint canvas, chunked only to fit); `auto` (default): on a causal engine, where a slot sees the
    questions before it, and on others for sets of 2-4 yes/no questions, where reading them together
    is known to cost accuracy (`canvasroute.router._plan.isolated`). On a bidirectional engine an
    isolated read is the question's lone read; on a causal one the state comes first, so the reads
    share its prefix."""

    def __post_init__(self) -> None:
        alone = self.alone
        if isinstance(alone, str) or not isinstance(alone, Collection) or not all(isinstance(q, str) for q in alone):
            raise DecisionError(f"alone must be a collection of question ids, got {alone!r}")
        object.__setattr__(self, "alone", frozenset(alone))
        for name, value, low, top in (("steps", self.steps, 1, MAX_STEPS), ("think", self.think, 0, MAX_THINK)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
                raise DecisionError(f"{name} must be an integer within {low}..{top}, got {value!r}")
        images = self.images
        if isinstance(images, str) or not isinstance(images, Collection) or not all(
                isinstance(u, str) and u for u in images):
            raise DecisionError("images must be a sequence of image URLs (data:image/...;base64,... or http(s))")
        object.__setattr__(self, "images", tuple(images))
        if not isinstance(self.instructions, str):
            object.__setattr__(self, "instructions", option_text(self.instructions))
        object.__setattr__(self, "instructions", self.instructions.strip())
        if self.constrained is not None and not isinstance(self.constrained, bool):
            raise DecisionError(f"constrained must be a bool or None, got {self.constrained!r}")
        if self.isolate not in ("none", "auto", "all"):
            raise DecisionError(f"isolate must be none, auto or all, got {self.isolate!r}")

    def key(self) -> str:
        """What in these settings changes a read (for cache keys and the default seed)."""
        return repr((self.constrained, self.instructions, sorted(self.alone), self.steps, self.think, self.isolate))


READ_FIELDS = frozenset(f.name for f in fields(ReadOptions))
NO_READ_OPTIONS = ReadOptions()


def read_options(value: ReadOptions | Mapping[str, Any] | None, base: ReadOptions = NO_READ_OPTIONS) -> ReadOptions:
    """`ReadOptions` from itself (taken whole), a dict of its fields over `base` (instructions may
    be any JSON value), or None (`base`): a call's read options over its model's, as a gate layer
    over a policy.

    Raises:
        DecisionError: a key `ReadOptions` does not have, or a value it refuses.
    """
    if value is None:
        return base
    if isinstance(value, ReadOptions):
        return value
    if not isinstance(value, Mapping):
        raise DecisionError(f"read options are a ReadOptions or a dict of its fields, not {type(value).__name__}")
    if unknown := sorted(set(value) - READ_FIELDS):
        raise DecisionError(f"unknown read options {unknown}; ReadOptions has {', '.join(sorted(READ_FIELDS))}")
    values = {k: v for k, v in value.items() if v is not None}
    if "instructions" in values and not isinstance(values["instructions"], str):
        values["instructions"] = option_text(values["instructions"])
    return replace(base, **values) if values else base


def schema_decision(schema: type, read: ReadOptions | Mapping[str, Any] | None) -> tuple[
        dict[str, Any], ReadOptions | Mapping[str, Any] | None]:
    """A schema (a pydantic model or TypedDict class) given as a decision's questions: its fields'
    questions (`questions_from_schema`), and `read` with the schema's docstring as the decision's
    `instructions` unless `read` gives its own (as `with_structured_output` asks it).

    Raises:
        UnsupportedQuestion: not a schema, or a field with no question form (named).
    """
    questions, doc = schema_questions(schema)
    if not doc:
        return questions, read
    if read is None:
        return questions, {"instructions": doc}
    if isinstance(read, ReadOptions):
        return questions, read if read.instructions else replace(read, instructions=doc)
    if isinstance(read, Mapping) and read.get("instructions") in (None, ""):
        return questions, {**read, "instructions": doc}
    return questions, read


@dataclass(frozen=True, slots=True)
class StateView:
    """The state as the model reads it."""

    value: Any
    """The state as given (a decision-model escalation target and a human reviewer see it)."""
    text: str
    """Its rendered text (`render_state`; special tokens are defused per engine when read)."""
    images: tuple[str, ...]
    """Every image the reads send: the state's image blocks, then `ReadOptions.images`."""
    digest: str
    """SHA-256 (hex) of the text and the images: what the reads depend on."""


@dataclass(frozen=True, slots=True)
class QuestionSet:
    """The decision's questions, parsed once."""

    specs: Mapping[str, QuestionSpec]
    """Question id -> its canvas view, in the caller's order."""
    key: str
    """An exact key of the questions as asked (plans and caches use it)."""
    depends: Dependencies
    """Which questions wait for which answers, and the read stages they imply."""

    @property
    def options(self) -> dict[str, tuple[str, ...]]:
        """Each question's options, in label order."""
        return {qid: spec.options for qid, spec in self.specs.items()}

    @property
    def asked(self) -> dict[str, Any]:
        """The questions as the caller asked them (langchain-core models)."""
        return {qid: spec.question for qid, spec in self.specs.items()}


class QuestionSets:
    """A model's parsed question sets, by key (an LRU of `KEEP`): a set asked before is not
    parsed again."""

    KEEP = 256

    def __init__(self) -> None:
        self._sets: OrderedDict[str, QuestionSet] = OrderedDict()

    def get(self, questions: Mapping[str, Any], depends_on: Mapping[str, Any] | None = None) -> QuestionSet:
        """The parsed set of `questions`, with `depends_on`'s dependencies (none: independent)."""
        key, sets = question_set_key(questions), self._sets
        if key is None or key not in sets:
            specs = parse_questions(questions)
            key = key or json.dumps({qid: s.question.model_dump(mode="json") for qid, s in specs.items()})
            sets[key] = QuestionSet(specs, key, parse_depends_on(None, specs))
            while len(sets) > self.KEEP:
                sets.popitem(last=False)
        sets.move_to_end(key)
        qset = sets[key]
        return qset if depends_on is None else replace(qset, depends=parse_depends_on(depends_on, qset.specs))


_QUESTION_TYPES = frozenset((Noul, Choice, Score))


def question_set_key(questions: Any) -> str | None:
    """A cheap exact key for a mapping of question models: each id with pydantic's JSON of
    its question (`model_dump_json`), in order. None when `questions` is anything else
    (plain dicts, subclasses): such a set is parsed first, then keyed by its parse.

    Questions are mutable models, so the key is computed on every call, never cached by identity.
    """
    if not isinstance(questions, Mapping) or not questions:
        return None
    parts = []
    for qid, q in questions.items():
        if type(q) not in _QUESTION_TYPES or type(qid) is not str:
            return None
        parts.append(f"{qid!r}:{q.__pydantic_serializer__.to_json(q).decode()}")
    return ",".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """Who and where a decision is: its noise seed and the run it belongs to."""

    seed: int
    """The noise seed (read k uses `seed + 7919 k`): unless given, a hash of where the decision runs
    (`site`), what it asks and what it reads, so a replay reads the same canvases."""
    site: tuple[str, str] | None = None
    """Where the decision runs: a graph node's checkpoint namespace and its node or edge (None
    outside a graph)."""
    thread_id: str | None = None
    """The LangGraph thread (per-thread budgets, span attributes)."""
    branch: str | None = None
    """The fan-out branch a decision node's records are grouped under (None: flat)."""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    """Span attributes naming where the decision runs (graph node, thread)."""


@dataclass(frozen=True, kw_only=True)
class DecisionRequest:
    """One decision, whole: built once by `CanvasDecisionModel.request` and read by every stage."""

    state: StateView
    questions: QuestionSet
    read: ReadOptions
    gate: GatePolicy
    """The gate, every override applied (`resolve_gate`)."""
    gates: Mapping[str, GatePolicy]
    """The gate of each question (`gate.for_question(id)`), resolved once."""
    constrained: bool
    """Whether the reads are normalized over the labels (no label mass): `read.constrained`, or
    unless some question's gate reads label mass."""
    outcomes: OutcomePolicy
    escalation: Escalation | None
    identity: Identity
    mode: Literal["deployed", "canvas_only"] = "deployed"
    """`canvas_only`: measure the canvas alone (shadow mode, `canvasroute eval`): nothing
    escalates, every question gets the canvas's best real option (flagged not confident where
    the gate did not pass it), and an engine fault raises."""
    controlled: Mapping[str, ControlSetting] | None = None
    """What the escalation-rate controller set, per question it moves (`Escalation.controller`):
    applied once at the start of the run (`canvasroute.router._control.steer`), its thresholds then
    in `gate` and `gates`. None: no controller, or not applied yet."""
    live: Mapping[str, LiveSetting] | None = None
    """What live certification set, per question it gates (`Escalation.audit`): the certified
    threshold and the audit coin, applied once at the start of the run, before the controller
    (`canvasroute.router._audit.steer`), its thresholds and live certificates then in `gate` and
    `gates`. None: no audit, or not applied yet."""

    @cached_property
    def key(self) -> str:
        """A SHA-256 (hex) of everything that decides the answers: questions and dependencies,
        read options, state, gate, outcomes, seed and mode (the same in every process)."""
        h = hashlib.sha256()
        parts = (self.questions.key, self.questions.depends.key(), self.read.key(), self.state.digest,
                 repr(self.gate), repr(self.outcomes), str(self.identity.seed), self.mode)
        for part in parts:
            data = part.encode()
            h.update(len(data).to_bytes(8, "big"))  # length-prefixed: no two part lists collide
            h.update(data)
        return h.hexdigest()

    def canvas_only(self) -> DecisionRequest:
        """This decision measured on the canvas alone (no escalation, no fallback, faults raise)."""
        return replace(self, escalation=None, mode="canvas_only")

    def metered(self, meter: Any) -> DecisionRequest:
        """This decision with its escalation budget counted by `meter` (e.g. a graph store's)."""
        if self.escalation is None or self.escalation.budget is None or meter is None:
            return self
        return replace(self, escalation=replace(self.escalation, meter=meter))

    def audited_by(self, state: Any) -> DecisionRequest:
        """This decision with its live certification's rows kept by `state` (e.g. a graph store's)."""
        if self.escalation is None or self.escalation.audit is None or state is None:
            return self
        return replace(self, escalation=replace(self.escalation, audit_state=state))

    def controlled_by(self, state: Any) -> DecisionRequest:
        """This decision with its escalation-rate controller's offsets kept by `state` (e.g. a graph store's)."""
        if self.escalation is None or self.escalation.controller is None or state is None:
            return self
        return replace(self, escalation=replace(self.escalation, controller_state=state))


@dataclass(frozen=True, kw_only=True, slots=True)
class Defaults:
    """What every request of one model starts from (`CanvasDecisionModel`'s fields, resolved)."""

    read: ReadOptions
    policy: GatePolicy
    outcomes: OutcomePolicy
    escalation: Escalation | None
    canvas_only: bool = False
    """Requests measure the canvas alone (`CanvasDecisionModel.canvas_only()`)."""
    sets: QuestionSets = field(default_factory=QuestionSets, compare=False)
    """The model's parsed question sets."""


def build_request(defaults: Defaults, questions: Mapping[str, Any] | type, state: Any, *,
                  depends_on: Mapping[str, Any] | None, read: ReadOptions | Mapping[str, Any] | None,
                  gate: GatePolicy | Mapping[str, Any] | None, seed: int | None, thread_id: str | None,
                  attributes: Mapping[str, Any] | None, site: tuple[str, str] | None) -> DecisionRequest:
    """The request a model makes of `state` and `questions` (`CanvasDecisionModel.request`'s
    arguments), every option checked and resolved once (`seed` None: the default seed, of the
    site when there is one)."""
    if isinstance(questions, type):  # a schema: its fields are the questions, its docstring the instructions
        questions, read = schema_decision(questions, read)
    qset = defaults.sets.get(questions, depends_on)
    options = read_options(read, defaults.read)
    if unknown := sorted(options.alone - set(qset.specs)):
        raise DecisionError(f"alone names {unknown[:5]}, which are not among the questions",
                            hint=f"alone takes ids of this decision's questions: {list(qset.specs)[:8]}")
    text, images = read_state(state)
    images = (*images, *options.images)
    if options.think and images:
        raise DecisionError("think writes a thought about text: a decision with images cannot think",
                            hint="drop think=, or keep images out of the decision state")
    resolved, gates = resolve_gates(defaults.policy, gate, qset.specs)
    if not defaults.canvas_only:  # every fallback is an option; every abstaining or unsure question has a way out
        check_fallbacks({qid: spec.options for qid, spec in qset.specs.items()}, gates, defaults.outcomes,
                        defaults.escalation is not None)
    digest = state_digest(text, images)
    if seed is None:
        seed = site_seed(site, qset.specs, qset.key, text) if site is not None else default_seed(qset.key, options,
                                                                                               digest)
    identity = Identity(seed=seed, thread_id=thread_id, attributes=dict(attributes or {}), site=site)
    constrained = (not any(g.min_label_mass is not None for g in gates.values()) if options.constrained is None
                   else options.constrained)
    return DecisionRequest(state=StateView(state, text, images, digest), questions=qset, read=options,
                           gate=resolved, gates=gates, constrained=constrained, outcomes=defaults.outcomes,
                           escalation=None if defaults.canvas_only else defaults.escalation, identity=identity,
                           mode="canvas_only" if defaults.canvas_only else "deployed")


REQUEST: ContextVar[DecisionRequest | None] = ContextVar("canvasroute_request", default=None)
"""A request built before langchain-core's Runnable machinery runs (`invoke` carries only
state and questions to `_classify`): the harness's observed path sets it."""


def state_digest(text: str, images: tuple[str, ...]) -> str:
    """SHA-256 of a rendered state and its images (length-prefixed parts)."""
    h = hashlib.sha256()
    for part in (text, *images):
        data = part.encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def default_seed(questions_key: str, read: ReadOptions, digest: str) -> int:
    """The noise seed of a decision that names none and runs nowhere in particular: a hash of what
    it asks and what it reads, so identical requests read identically in every process."""
    blob = f"[{_quote(questions_key)}, {_quote(read.key())}, {_quote(digest)}]"  # json.dumps of the list
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "big")


def site_seed(site: tuple[str, str], specs: Mapping[str, QuestionSpec], key: str, text: str) -> int:
    """The noise seed of a decision where it runs (`site`: a graph node's namespace and its node or
    edge): `sha256(json.dumps([namespace, node, questions, render_state(state)], sort_keys=True))`,
    its first four bytes. The hash of everything before the state is kept per site and question set.
    The thread is deliberately left out: identical inputs in different threads read alike."""
    prefix = _PREFIXES.get((site, key))
    if prefix is None:
        asked = {qid: spec.question.model_dump(mode="json") for qid, spec in specs.items()}
        prefix = hashlib.sha256(f"[{_quote(site[0])}, {_quote(site[1])}, "
                                f"{json.dumps(asked, sort_keys=True, default=str)}, ".encode())
        if len(_PREFIXES) >= 256:  # bounded: a graph has few nodes and question sets
            _PREFIXES.clear()
        _PREFIXES[site, key] = prefix
    digest = prefix.copy()
    digest.update(f"{_quote(defuse(text, SPECIAL_CANDIDATES))}]".encode())
    return int.from_bytes(digest.digest()[:4], "big")


_quote = json.encoder.encode_basestring_ascii
"""`json.dumps` of one str."""
_PREFIXES: dict[tuple[tuple[str, str], str], Any] = {}
"""(site, question set key) -> sha256 of the seed's JSON up to the state."""
