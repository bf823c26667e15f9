"""Policies: when a canvas answer passes, what happens when it does not, and the escalation.

Three frozen values, one concern each:

- `GatePolicy`: the thresholds a read must pass and how it is read (temperature, samples,
  re-reads, the abstain label, order views), with overrides per question;
- `OutcomePolicy`: what happens when the gate is not passed, one action per cause
  (`uncertain`, `abstained`, `engine_fault`, `over_budget`, `target_fault`) from one vocabulary,
  `ACTIONS`: `escalate`, `answer`, `fallback`, `raise`, `review`;
- `Escalation`: where an escalated question goes (target, output mode, prompt, timeout),
  what it may spend (`EscalationBudget` and the meter that counts it), the escalation rate it
  holds (`Controller` and the state that keeps its offsets), whether a borderline
  question's target call starts beside its re-reads (`Hedge`), the circuit breaker that keeps a
  dead target from being called on every decision and an engine outage from flooding it
  (`Breaker` and its state, `canvasroute.router._breaker`), and whether each question's
  threshold is certified on the live traffic (`Audit`, `canvasroute.router._audit`).

A decision's gate is resolved once per question, in one order (`resolve_gate`): the model's
policy (in code or a policy file, per-question fits included), then each override layer in
turn (`serve`/`eval` flags, `Runtime.context.gate`, the request's own keys); a layer replaces
the fields it names, for every question, per-question fits included.

The policy file (`canvasroute calibrate` writes it, `load_policy` reads it) is a `GatePolicy`
as JSON: `{"format": "canvasroute.policy/1", "policy": {...}, "calibration": {...}}`.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from canvasroute.engine import CalibrationError, DecisionError
from canvasroute.engine._compat import keep_removed, warn_moved, with_kept

__all__ = ["ACTIONS", "AUDIT_THRESHOLDS", "POLICY_FORMAT", "Action", "Audit", "Breaker", "Certificate",
           "ControlSetting", "Controller", "Escalation", "EscalationBudget", "EscalationOutput", "GatePolicy", "Hedge",
           "LiveFigures", "LiveSetting", "OutcomePolicy", "check_fallbacks", "load_policy", "policy_from_dict",
           "policy_to_dict", "resolve_gate", "save_policy"]

MAX_SAMPLES = 32
"""Reads of one question in a decision, first reads and re-reads each (vLLM's gateway caps samples there too)."""
MAX_REREADS = MAX_SAMPLES - 1
MAX_ORDER_VIEWS = 2

Action = Literal["escalate", "answer", "fallback", "raise", "review"]
"""What happens to a question the gate did not pass (one vocabulary for every cause)."""
ACTIONS: tuple[str, ...] = get_args(Action)
EscalationOutput = Literal["auto", "json_schema", "function_calling", "json_mode", "text"]
"""How a chat-model target answers: `auto` (its own structured output, a JSON reply in text
when it has none), a `with_structured_output` method by name, or `text`."""


class FrozenMapping(Mapping[str, "GatePolicy"]):
    """A read-only, hashable mapping (so a policy with overrides hashes and can be a cache key)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, GatePolicy] | None = None) -> None:
        self._data = dict(data or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> GatePolicy:
        return self._data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)  # the dict's own: `for_question` runs per question per gate

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self._data == dict(other)

    def __repr__(self) -> str:
        return repr(self._data)


class Figures(Protocol):
    """What the gate reads of one slot's distribution (a `SlotStats`)."""

    @property
    def normalized_entropy(self) -> float: ...
    @property
    def entropy(self) -> float: ...
    @property
    def confidence(self) -> float: ...
    @property
    def margin(self) -> float: ...
    @property
    def label_mass(self) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Certificate:
    """What a risk-controlled calibration proved about one gate (`canvasroute calibrate --max-error`).

    The gate that holds it passes a canvas answer only when its normalized entropy is at most the
    gate's `max_normalized_entropy` (the certified threshold); with probability at least
    `confidence` over the draw of the calibration rows, the error rate of the answers it passes
    (those not escalated) is at most `max_error` (`canvasroute.router.calibration.certify_threshold`
    states the test and its conditions). `asked` set: the rows could not prove the bound asked
    for, and this is the looser one they do prove. `family > 1`: the bound holds for that many
    questions at once. `certified=False`: the rows proved nothing; the gate then passes nothing
    (`fallback="escalate"`, every answer escalates) or gates on its own thresholds and claims
    nothing (`fallback="threshold"`), and its words say which.

    Example:
        ```python
        GatePolicy(max_normalized_entropy=0.31, certificate=Certificate(
            max_error=0.05, confidence=0.9, rows=400, escalation_rate=0.22))
        ```
    """

    max_error: float
    """The bound on the error rate of the answers the gate passes."""
    confidence: float
    """The probability, over the calibration rows, that the bound holds."""
    rows: int
    """Calibration rows the certificate rests on."""
    escalation_rate: float
    """Share of the calibration rows the gate does not pass (what the bound costs)."""
    certified: bool = True
    """False: no bound was proved; what the gate does then is `fallback`'s."""
    method: str = "learn-then-test"
    """How the bound was proved (the calibration's docstring cites it; `live-dkelly`: live
    certification, `canvasroute.router._audit`)."""
    asked: float | None = None
    """The bound the calibration asked for, when the rows proved only the looser `max_error`
    (`calibrate(uncertified="looser")`); None: `max_error` is what was asked."""
    fallback: Literal["escalate", "threshold"] = "escalate"
    """Uncertified only: `escalate` passes nothing (every answer escalates); `threshold` gates on
    the gate's own thresholds, uncertified, and says so in its words."""
    family: int = 1
    """Questions certified together: the bound holds for all of them at once with probability
    `confidence` (each tested at `(1 - confidence) / family`, Bonferroni)."""
    live: LiveFigures | None = field(default=None, compare=False, repr=False)
    """A live certificate's figures as they stand now (`Audit`); None: an offline one. Left out of
    comparisons and `repr` (so of cache keys): they move with every labelled row."""

    def __post_init__(self) -> None:
        for name in ("max_error", "escalation_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Certificate.{name} must be within [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"Certificate.confidence must be within (0, 1), got {self.confidence}")
        for name in ("rows", "family"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "family"):
                raise ValueError(f"Certificate.{name} must be an integer >= {int(name == 'family')}, got {value!r}")
        if self.asked is not None and not 0.0 < self.asked < 1.0:
            raise ValueError(f"Certificate.asked must be within (0, 1) or None, got {self.asked}")
        if self.fallback not in ("escalate", "threshold"):
            raise ValueError(f"Certificate.fallback must be 'escalate' or 'threshold', got {self.fallback!r}")

    @property
    def passes_nothing(self) -> bool:
        """Whether the gate holding it passes no answer (uncertified, `fallback="escalate"`)."""
        return not self.certified and self.fallback == "escalate"

    @property
    def text(self) -> str:
        """What it proved, in words: `certified: error <= 5% at 90%, 400 rows, 22% escalated`,
        `certified: error <= 8.1% at 90% (asked 5%), ...`, `... at 90% for 3 questions jointly, ...`,
        or `uncertified: 40 rows cannot certify error <= 5% at 90%` (`; gated on its own threshold`
        when it falls back to the gate's own thresholds); a live certificate's (`Audit`) its own."""
        if self.live is not None:
            return self.live.text(self)
        joint = f" for {self.family} questions jointly" if self.family > 1 else ""
        if not self.certified:
            own = "; gated on its own threshold" if self.fallback == "threshold" else ""
            return (f"uncertified: {self.rows} rows cannot certify error <= {_percent(self.max_error)} at "
                    f"{_percent(self.confidence)}{joint}{own}")
        asked = f" (asked {_percent(self.asked)})" if self.asked is not None else ""
        return (f"certified: error <= {_percent(self.max_error)} at {_percent(self.confidence)}{joint}{asked}, "
                f"{self.rows} rows, {_percent(self.escalation_rate, 3)} escalated")


def _percent(x: float, digits: int = 4) -> str:
    """`0.05` as `5%`, `0.025` as `2.5%`."""
    return f"{x * 100:.{digits}g}%"


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveFigures:
    """What live certification (`Audit`) shows of one gate now: a live `Certificate`'s moving part.

    What it certifies is disagreement with the labeller (the escalation target, or the people
    of the review lane), not ground truth: with people as labellers, their error rate.
    """

    labeller: str
    """Whose labels the rows carry: the escalation target's name, or `reviewers` (people)."""
    bound: float
    """The anytime-valid upper bound, now, on the disagreement rate of the answers this threshold
    passes (1 with no rows)."""
    rows: int
    """Labelled rows the bound rests on, every worker's, since the last reset."""
    audits: int
    """Audits spent on this question so far, every worker's (labeller calls for passed answers)."""
    epoch: int = 1
    """1, plus one per drift alarm (each alarm resets the rows: `canvasroute.router._audit`)."""

    def text(self, cert: Certificate) -> str:
        """`certified live: disagreement with gemma <= 5% at 90% (bound 3.2%), 412 rows, 37
        audits`, or `uncertified live: 37 rows cannot certify disagreement with gemma <= 5% at
        90% yet (bound 12%), 3 audits`."""
        claim = f"disagreement with {self.labeller} <= {_percent(cert.max_error)} at {_percent(cert.confidence)}"
        tail = f", {self.audits} audits" + (f", {self.epoch - 1} drift alarm(s)" if self.epoch > 1 else "")
        bound = f"bound {_percent(self.bound, 3)}"
        if cert.certified:
            return f"certified live: {claim} ({bound}), {self.rows} rows{tail}"
        return f"uncertified live: {self.rows} rows cannot certify {claim} yet ({bound}){tail}"


@dataclass(frozen=True, kw_only=True, slots=True)
class GatePolicy:
    """When a canvas answer passes, and how its question is read.

    A question is uncertain when any configured threshold is crossed; `None` turns a check
    off. Every question is read `samples` times (1: one read), uncertain ones are re-read
    `rereads` more times with fresh noise and gated again on the mean distribution. Read k
    of a canvas uses noise seed `seed + 7919 k`, first reads and re-reads alike. What happens
    to a question still uncertain is the model's `OutcomePolicy`.

    Example:
        ```python
        GatePolicy(max_normalized_entropy=0.5, per_question={"team": GatePolicy(min_margin=0.3)})
        ```
    """

    max_normalized_entropy: float | None = 0.5
    """Entropy over ln K (0 = certain, 1 = uniform) above which a question is uncertain."""

    max_entropy: float | None = None
    """Entropy in nats above which a question is uncertain."""

    min_confidence: float | None = None
    """Probability of the chosen label below which a question is uncertain."""

    min_margin: float | None = None
    """Gap between the top two labels' probabilities below which a question is uncertain."""

    min_label_mass: float | None = None
    """Share of the model's probability on the labels at all (off-template answers) below
    which a question is uncertain. Setting it makes the model's default reads unconstrained
    (`ReadOptions.constrained`): a constrained read cannot measure it."""

    temperature: float = 1.0
    """Divides the canvas log-probabilities before the softmax over labels (> 1 softens
    overconfident reads); fitted per question by `canvasroute calibrate`."""

    samples: int = 1
    """Reads of every question before the gate, each with fresh noise (their mean
    distribution is gated; `agreement` and `stderr` come with it). 1: one read; N: N fixed
    reads whatever they say (vLLM's gateway's `samples: N`)."""

    rereads: int = 3
    """Extra reads with fresh noise for questions still uncertain after their `samples`
    (0 turns re-reading off; `samples=1, rereads=0` is exactly one read)."""

    reread_above: float | None = None
    """Entropy in nats above which a question is re-read even when the gate passes it (vLLM's
    gateway's `auto_threshold`). It asks for more reads only: whether the answer then passes
    is still the thresholds' call. None: only questions the gate does not pass are re-read."""

    abstain: bool = False
    """Offer one more label in the question's slot, "none of these / can't tell". When it
    wins the question is not passed, with cause `abstained` (`OutcomePolicy.abstained`)."""

    order_views: int = 0
    """Extra listings of a Choice's options in cyclically shifted label order, as extra
    slots of the same canvas (0 off, at most 2); the aligned distributions are averaged
    against first-label bias. One forward pass, no extra read; a longer canvas."""

    per_question: Mapping[str, GatePolicy] = field(default_factory=FrozenMapping)
    """Overrides by question id; an override replaces the whole policy for that question
    (stored read-only, so the policy hashes)."""

    certificate: Certificate | None = None
    """What a risk-controlled calibration proved about this gate (`Certificate`; None: nothing).
    Informational for the gate's figures, except that an uncertified one whose fallback is
    `escalate` passes nothing; an escalation-rate controller never loosens a certified gate
    unless told."""

    def __post_init__(self) -> None:
        if not isinstance(self.per_question, Mapping):
            raise TypeError(f"per_question must be a mapping, got {type(self.per_question).__name__}")
        object.__setattr__(self, "per_question", FrozenMapping(self.per_question))
        if not 0 <= self.order_views <= MAX_ORDER_VIEWS:
            raise ValueError(f"order_views must be within 0..{MAX_ORDER_VIEWS}, got {self.order_views}")
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise ValueError(f"samples must be within 1..{MAX_SAMPLES}, got {self.samples}")
        if not 0 <= self.rereads <= MAX_REREADS:
            raise ValueError(f"rereads must be within 0..{MAX_REREADS}, got {self.rereads}")
        for name in ("max_normalized_entropy", "min_confidence", "min_margin", "min_label_mass"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if not 0.0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature}")
        for name in ("max_entropy", "reread_above"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.certificate is not None and not isinstance(self.certificate, Certificate):
            raise TypeError(f"certificate must be a Certificate, got {type(self.certificate).__name__}")
        for qid, override in self.per_question.items():
            if not isinstance(override, GatePolicy):
                raise TypeError(f"per_question[{qid!r}] must be a GatePolicy, got {type(override).__name__}")
            if override.per_question:
                raise ValueError(f"per_question[{qid!r}] has overrides of its own; "
                                 "an override is one question's policy")

    def for_question(self, question_id: str) -> GatePolicy:
        """The policy that applies to one question."""
        found: GatePolicy = self.per_question.get(question_id, self)
        return found

    @property
    def gate_text(self) -> str:
        """What this gate passes, in words: `H/lnK <= 0.5` (thresholds joined by `, `; `none`),
        with what its certificate proved: `H/lnK <= 0.31 (certified: error <= 5% at 90%, 400
        rows, 22% escalated)`, or `nothing (uncertified: 40 rows cannot certify ...)`."""
        tests = (("H/lnK", "<=", self.max_normalized_entropy), ("H", "<=", self.max_entropy),
                 ("confidence", ">=", self.min_confidence), ("margin", ">=", self.min_margin),
                 ("label mass", ">=", self.min_label_mass))
        text = ", ".join(f"{name} {op} {value:g}" for name, op, value in tests if value is not None) or "none"
        if self.certificate is None:
            return text
        return f"{'nothing' if self.certificate.passes_nothing else text} ({self.certificate.text})"

    @property
    def uses_label_mass(self) -> bool:
        """Whether any question's gate reads label mass (`min_label_mass`, here or in an override)."""
        return self.min_label_mass is not None or any(p.min_label_mass is not None
                                                      for p in self.per_question.values())

    def with_overrides(self, **changes: Any) -> GatePolicy:
        """A copy with some fields changed, for every question: each per-question override gets
        the same changes (a flag or a `Runtime.context` gate means every question's gate).

        `per_question=` among the changes replaces the overrides instead (a mapping of
        policies, or of field dicts applied over this policy's own per-question entry).

        A certificate speaks for the gate it was proved on: a change to any field of a gate
        whose certificate certified a bound drops the certificate (the gate no longer claims
        it), unless `certificate=` is among the changes; an uncertified certificate stays
        (no override makes a gate pass answers its rows could not certify).
        """
        if unknown := sorted(set(changes) - _GATE_FIELDS):
            raise ValueError(f"unknown GatePolicy fields {unknown}; fields are {sorted(_GATE_FIELDS)}")
        per_question: Mapping[str, Any] | None = changes.pop("per_question", None)
        if per_question is not None:
            base = {qid: self.for_question(qid) for qid in per_question}
            overrides = {qid: p if isinstance(p, GatePolicy) else _changed(base[qid], {"per_question": {}, **dict(p)})
                         for qid, p in per_question.items()}
        else:
            overrides = {qid: _changed(p, changes) for qid, p in self.per_question.items()}
        return _changed(self, {**changes, "per_question": overrides})

    def crossed(self, stats: Figures) -> list[str]:
        """Names of the thresholds a distribution crosses (empty: it passes); `uncertified` when
        the gate's certificate proved nothing and it passes no answer (`Certificate.passes_nothing`)."""
        out = []
        if self.certificate is not None and self.certificate.passes_nothing:
            out.append("uncertified")
        if self.max_normalized_entropy is not None and stats.normalized_entropy > self.max_normalized_entropy:
            out.append("max_normalized_entropy")
        if self.max_entropy is not None and stats.entropy > self.max_entropy:
            out.append("max_entropy")
        if self.min_confidence is not None and stats.confidence < self.min_confidence:
            out.append("min_confidence")
        if self.min_margin is not None and stats.margin < self.min_margin:
            out.append("min_margin")
        if self.min_label_mass is not None and stats.label_mass < self.min_label_mass:
            out.append("min_label_mass")
        return out


_GATE_FIELDS = frozenset(f.name for f in fields(GatePolicy))
GATE_REMOVED = {
    "on_unsure": ("the model's OutcomePolicy(uncertain=...), when it has no escalate_to (with one, 0.1 "
                  "escalated: leave it out)", ("answer", "fallback", "raise", "review")),
    "on_abstain": ("the model's OutcomePolicy(abstained=...)", ("escalate", "fallback")),
}
"""0.1's outcome keywords of a gate, accepted until 0.3.0 (`canvasroute.router._compat` maps them)."""
keep_removed(GatePolicy, **GATE_REMOVED)


def _changed(gate: GatePolicy, changes: Mapping[str, Any]) -> GatePolicy:
    """`replace(gate, **changes)`, dropping a certified certificate when a field it rests on moves."""
    out = replace(gate, **changes)
    cert = gate.certificate
    if cert is not None and cert.certified and "certificate" not in changes and any(
            getattr(out, f) != getattr(gate, f) for f in _GATE_FIELDS - {"per_question", "certificate"}):
        out = replace(out, certificate=None)
    return out


def resolve_gates(policy: GatePolicy, layer: GatePolicy | Mapping[str, Any] | None,
                  question_ids: Iterable[str]) -> tuple[GatePolicy, dict[str, GatePolicy]]:
    """`resolve_gate(policy, layer)` and the gate of each question, in one pass (what a request holds)."""
    gate = resolve_gate(policy, layer)
    overrides = gate.per_question._data if isinstance(gate.per_question, FrozenMapping) else gate.per_question
    return gate, {qid: overrides.get(qid, gate) for qid in question_ids}


def resolve_gate(policy: GatePolicy, *layers: GatePolicy | Mapping[str, Any] | None) -> GatePolicy:
    """The gate one decision is held to: `policy`, then each layer in order (None: skipped).

    A `GatePolicy` layer replaces everything before it; a mapping of fields replaces those
    fields for every question (`GatePolicy.with_overrides`).

    Raises:
        ValueError: a mapping naming a field `GatePolicy` does not have.
        TypeError: a layer that is neither.
    """
    for layer in layers:
        if layer is None:
            continue
        if isinstance(layer, GatePolicy):
            policy = layer
        elif isinstance(layer, Mapping):
            policy = policy.with_overrides(**layer) if layer else policy
        else:
            raise TypeError(f"a gate override is a GatePolicy or a dict of its fields, not {type(layer).__name__}")
    return policy


@dataclass(frozen=True, kw_only=True, slots=True)
class OutcomePolicy:
    """What happens to a question the gate did not pass, by cause.

    Every cause takes an action from one vocabulary (`ACTIONS`): `escalate` to the escalation
    target; `answer` with the canvas's best option, flagged (path `unsure`); `fallback` to the
    question's declared option (path `fallback`); `raise` a typed error (`UnsureAnswer`,
    `BudgetExhausted`, the engine fault itself); `review`: the canvas answer, which a decision
    node sends to a human through `interrupt()`. The cause is on every report (`cause`), in
    traces and on the dashboard.

    Example:
        ```python
        OutcomePolicy(uncertain="review", engine_fault="fallback", fallback={"team": "billing"})
        ```
    """

    uncertain: Action = "escalate"
    """A read that crossed a threshold after its re-reads. `escalate` with no escalation target
    answers from the canvas instead (path `unsure`; the model warns once that it does)."""

    abstained: Literal["escalate", "fallback", "answer"] = "escalate"
    """The abstain label won (`GatePolicy.abstain`), however narrowly; `answer` takes the best
    real option. `escalate` needs an escalation target."""

    engine_fault: Literal["escalate", "fallback", "raise"] = "escalate"
    """The engine failed for this question: never a cheap answer. `escalate` with no target raises;
    past the breaker's cap on what engine faults may escalate (`Breaker.fault_escalations`) the
    question is over budget (`over_budget`: its fallback, or `BudgetExhausted`)."""

    over_budget: Literal["answer", "fallback", "raise"] = "answer"
    """Escalation was wanted but the budget is spent (an engine fault over budget never answers
    from nothing: it takes its fallback, or raises)."""

    target_fault: Literal["answer", "fallback", "raise"] = "answer"
    """Escalation was wanted but the target failed (`EscalationError`: unreachable, timed out,
    answering errors or garbage), or its breaker is open so it was not called (`BreakerOpen`):
    `answer` from the canvas (path `unsure`, the target's fault named in `escalation_error`),
    `fallback`, or `raise` the target's error. An engine fault whose escalation failed never
    answers from nothing: it takes its fallback (`fallback`), or raises naming both faults."""

    fallback: Mapping[str, str] = field(default_factory=dict)
    """The fallback option per question id (for every `fallback` action)."""

    def __post_init__(self) -> None:
        allowed = {"uncertain": ACTIONS, "abstained": ("escalate", "fallback", "answer"),
                   "engine_fault": ("escalate", "fallback", "raise"), "over_budget": ("answer", "fallback", "raise"),
                   "target_fault": ("answer", "fallback", "raise")}
        for name, choices in allowed.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"OutcomePolicy.{name} must be one of {', '.join(choices)}, "
                                 f"not {getattr(self, name)!r}")
        if not isinstance(self.fallback, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.fallback.items()):
            raise TypeError("OutcomePolicy.fallback maps question ids to option names")
        object.__setattr__(self, "fallback", dict(self.fallback))
        if not self.fallback and (wanted := [n for n in allowed if getattr(self, n) == "fallback"]):
            raise ValueError(f"OutcomePolicy({', '.join(f'{n}={chr(39)}fallback{chr(39)}' for n in wanted)}) needs "
                             "fallback={question id: option}")

    def __hash__(self) -> int:
        return hash((self.uncertain, self.abstained, self.engine_fault, self.over_budget, self.target_fault,
                     tuple(sorted(self.fallback.items()))))


@dataclass(frozen=True, kw_only=True, slots=True)
class EscalationBudget:
    """A cap on escalations, so an engine fault or a drift cannot buy unbounded AR calls.
    What a question past it answers is `OutcomePolicy.over_budget`.

    Example:
        ```python
        EscalationBudget(max_per_window=100, window_s=60)
        ```
    """

    max_per_window: int | None = None
    """Escalated questions allowed per rolling window (None: no window cap)."""

    window_s: float = 60.0
    """Length of the rolling window in seconds."""

    max_per_thread: int | None = None
    """Escalated questions allowed per LangGraph thread (None: no per-thread cap)."""

    def __post_init__(self) -> None:
        for name in ("max_per_window", "max_per_thread"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")


keep_removed(EscalationBudget, when_spent=(  # 0.1's, accepted until 0.3.0 (`canvasroute.router._compat` maps it)
    "the model's OutcomePolicy(over_budget=...) ('keep' is 'answer')", ("keep", "answer", "fallback", "raise")))


@dataclass(frozen=True, kw_only=True, slots=True)
class Controller:
    """An escalation rate to hold: each question's entropy threshold moves online so that the
    share of its answers the gate does not pass stays at `target` (a set point; a budget is a cap).

    The controller moves `GatePolicy.max_normalized_entropy` by a per-question offset, one
    bounded step per decision (adaptive conformal inference: `canvasroute.router._control`).
    It holds a rate, not an error bound; a certified gate it only tightens unless
    `loosen_certified`. Its state lives outside this value (`Escalation.controller_state`).

    Example:
        ```python
        Escalation(ChatOpenAI(model="gemma-3-27b"), controller=Controller(target=0.2))
        ```
    """

    target: float
    """The escalation rate to hold, within (0, 1): the share of a question's answers the gate does
    not pass (they escalate, or go where the outcome policy sends them)."""
    step: float = 0.02
    """The learning rate: each decision moves a question's offset by `step * (escalated - target)`,
    so by at most `step * max(target, 1 - target)`."""
    max_offset: float = 0.3
    """How far the controller may move a threshold either way (and never outside [0, 1])."""
    loosen_certified: bool = False
    """Let the controller raise a certified gate's threshold (`GatePolicy.certificate`) past its
    certified value, which voids the certificate's bound. False: a certified gate only tightens."""
    resolution: float = 0.01
    """Offsets are applied in steps of this grid (a decision cache's keys repeat while the
    controller holds still); the gate's own threshold is never rounded: at offset 0 a gate is
    gated at exactly its threshold, a certified one keeping its certificate. 0: not rounded."""
    decay: float = 0.02
    """Weight of each decision in the realised rate the controller reports (an exponential moving
    average: 0.02 weighs about the last 50 decisions). Reported only; the update is `step`'s."""
    sync_every: int = 4
    """A shared state (a graph store's) reads the other workers' offsets and writes its own after
    this many decisions, or `sync_s` seconds, whichever comes first (state in one process: always)."""
    sync_s: float = 1.0
    """Seconds at most between two syncs of a shared state (checked when a decision ends)."""

    def __post_init__(self) -> None:
        checks = (("target", 0.0 < self.target < 1.0, "within (0, 1)"),
                  ("step", 0.0 < self.step <= 0.5, "within (0, 0.5]"),
                  ("max_offset", 0.0 <= self.max_offset <= 1.0, "within [0, 1]"),
                  ("resolution", 0.0 <= self.resolution <= 0.1, "within [0, 0.1]"),
                  ("decay", 0.0 < self.decay <= 1.0, "within (0, 1]"),
                  ("sync_s", 0.0 < self.sync_s < math.inf, "a positive number of seconds"))
        for name, ok, what in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                raise ValueError(f"Controller.{name} must be {what}, got {value!r}")
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"Controller.sync_every must be an integer >= 1, got {self.sync_every!r}")
        if not isinstance(self.loosen_certified, bool):
            raise ValueError(f"Controller.loosen_certified must be a bool, got {self.loosen_certified!r}")


@dataclass(frozen=True, slots=True)
class ControlSetting:
    """What an escalation-rate controller set for one question of one decision (`DecisionRequest.controlled`)."""

    base: float
    """The gate's own threshold (`max_normalized_entropy`)."""
    threshold: float
    """The threshold the decision was gated with."""
    low: float
    """The lowest offset this question may take here."""
    high: float
    """The highest offset (0 for a certified gate, unless `loosen_certified`)."""


@dataclass(frozen=True, slots=True)
class LiveSetting:
    """What live certification set for one question of one decision (`DecisionRequest.live`)."""

    threshold: float | None
    """The certified threshold the gate passed at (None: nothing certified, the gate passed nothing)."""
    index: int
    """Its candidate's index in `Audit.thresholds` (-1: none)."""
    epoch: int
    """The question's epoch (1, plus one per drift alarm)."""
    rate: float
    """The chance this decision's coin samples the question."""
    free: bool = False
    """Its label comes free: it passes nothing, and its answers escalate to the target that labels
    (so a sampled one needs no audit, and no audit slot)."""
    sampled: bool | None = None
    """Whether the coin sampled it (None: not drawn yet: a node cache key's request)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hedge:
    """Hedged escalation: a borderline question's target call starts beside its re-reads.

    A question is borderline when its first read (its `samples`) crossed the gate, and every
    threshold it crossed by at most `band`, each measured on its own 0..1 figure: normalized
    entropy over `max_normalized_entropy`; confidence, margin and label mass under
    `min_confidence`, `min_margin`, `min_label_mass`; entropy over `max_entropy` in units of
    ln K. A question far over the gate is re-read, then escalated, as without a hedge; so is one
    that cannot be re-read, a two-read (routed) question, and any question whose uncertain
    outcome is not `escalate`. Whichever settles a hedged question first answers it: re-reads
    the gate passes (path `reread`), or the target (path `escalated`); the loser is cancelled.
    `canvasroute.router._hedge` holds the rules (batching, budgets, faults, traces).

    Example:
        ```python
        Escalation(ChatOpenAI(model="gemma-3-27b"), hedge=Hedge(band=0.1))
        ```
    """

    band: float = 0.1
    """How far past its threshold a first read may be and still be borderline (0..1 figures)."""
    after_s: float = 0.0
    """Seconds the re-reads run alone before the target starts beside them (0: at once); a
    question the re-reads settle within it costs no target call (a classic hedged request)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.band <= 1.0:
            raise ValueError(f"Hedge.band must be within (0, 1], got {self.band}")
        if not 0.0 <= self.after_s < math.inf:
            raise ValueError(f"Hedge.after_s must be a finite number of seconds >= 0, got {self.after_s}")

    def borderline(self, gate: GatePolicy, stats: Figures) -> bool:
        """Whether a read the gate did not pass crossed it by at most `band` on every threshold it crossed."""
        crossed = gate.crossed(stats)
        return bool(crossed) and all(_excess(gate, stats, name) <= self.band for name in crossed)


def _excess(gate: GatePolicy, stats: Figures, threshold: str) -> float:
    """How far a read is past one threshold it crossed, on a 0..1 figure (`uncertified`: out of reach)."""
    if threshold == "max_normalized_entropy":
        return stats.normalized_entropy - (gate.max_normalized_entropy or 0.0)
    if threshold == "max_entropy":  # entropy > max_entropy >= 0: K > 1, and entropy / normalized entropy is ln K
        return (stats.entropy - (gate.max_entropy or 0.0)) * stats.normalized_entropy / stats.entropy
    if threshold == "min_confidence":
        return (gate.min_confidence or 0.0) - stats.confidence
    if threshold == "min_margin":
        return (gate.min_margin or 0.0) - stats.margin
    if threshold == "min_label_mass":
        return (gate.min_label_mass or 0.0) - stats.label_mass
    return math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class Breaker:
    """A circuit breaker on the escalation target: a dead target is not called on every decision,
    and an engine outage cannot send it every decision either.

    The target: `failures` failed calls in a row (network or target failures; each within
    `window_s` of the last, a call that answers resets the count) open the breaker. While it is
    open no decision calls the target: each question that wanted it takes `OutcomePolicy.target_fault`
    at once (by default the canvas answer, path `unsure`, `BreakerOpen` named). After `cooldown_s`
    it is half open: one decision's call probes the target (the others still do not call it);
    an answer closes the breaker, a failure opens it for another `cooldown_s`.

    The engine: engine faults may escalate at most `fault_escalations` questions per `window_s`;
    past that cap an engine fault is over budget (`OutcomePolicy.over_budget`: its fallback, or
    `BudgetExhausted`), never a cheap answer. Both are counted in this process, per model
    (`canvasroute.router._breaker` says why). Every change of state is logged (WARNING), marked on
    the decide span (`canvasroute.guard`) and counted (`canvasroute.guards`), and so is every
    decision a guard kept from the target.

    Example:
        ```python
        Escalation(ChatOpenAI(model="gemma-3-27b"), breaker=Breaker(failures=3, cooldown_s=10))
        Escalation(target, breaker=Breaker(fault_escalations=None))   # engine faults escalate uncapped
        ```
    """

    failures: int = 5
    """Failed target calls in a row that open the breaker (within `window_s` of each other)."""
    window_s: float = 30.0
    """Seconds over which failures add up, and the engine-fault cap's rolling window."""
    cooldown_s: float = 30.0
    """Seconds an open breaker keeps decisions off the target before one call probes it."""
    fault_escalations: int | None = 30
    """Questions engine faults may escalate per `window_s` (None: no cap). Default: 30 per 30 s, one
    a second: a restart of the engine rides through; an outage adds at most that to the target's load."""

    def __post_init__(self) -> None:
        for name in ("failures", "fault_escalations"):
            value = getattr(self, name)
            if value is None and name == "fault_escalations":
                continue
            least = 1 if name == "failures" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Breaker.{name} must be an integer >= {least}, got {value!r}")
        for name in ("window_s", "cooldown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
                raise ValueError(f"Breaker.{name} must be a positive number of seconds, got {value!r}")


AUDIT_THRESHOLDS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""The candidate thresholds live certification tests by default: H/lnK 0.05, 0.10, ..., 1.0."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Audit:
    """Live certification: a share of the answers the gate passes is also labelled, in the
    background, and each question's threshold moves to the loosest one the labelled rows certify.

    Per question, each candidate threshold in `thresholds` (strict to loose, fixed in advance) has
    an anytime-valid e-process for "the answers it passes disagree with the labeller more than
    `max_error`"; the gate passes at the loosest candidate whose e-process and every stricter
    one's reject that at level 1 - `confidence` (fixed-sequence testing), holds at every moment
    (Ville's inequality), and tightens at once when the evidence breaks: a drift detector resets
    the question (`canvasroute.router._audit` states the test, what it certifies and under which
    assumptions). Until some candidate is certified the gate passes nothing: every answer escalates,
    and the target's answers are the rows. What is certified is disagreement with the labeller (the
    escalation target, or the people of the review lane), not ground truth unless people label.
    Live thresholds need one set of reads per decision: questions with re-reads are not certified live.

    Example:
        ```python
        Escalation(ChatOpenAI(model="gemma-3-27b"), audit=Audit(rate=0.02, max_error=0.05),
                   budget=EscalationBudget(max_per_window=600, window_s=60))
        ```
    """

    rate: float
    """Share of the answers the gate passes that are also sent to the labeller, within (0, 1]
    (each audit is one labelled row; it spends the escalation budget like an escalation)."""
    max_error: float = 0.05
    """The disagreement rate to certify for the answers the gate passes, within (0, 1)."""
    confidence: float = 0.9
    """With this probability, at every moment, no certified threshold's disagreement rate exceeds
    `max_error` (per question, while the traffic is stationary), within (0, 1)."""
    labels: Literal["target", "review"] = "target"
    """Who labels: the escalation target (asked as an escalation asks, its answers to escalated
    questions counting too), or people through `reviewer` (the review lane)."""
    reviewer: Any = None
    """The labeller for `labels="review"`: a `canvasroute.harness.AuditInbox` (people answer its
    items), or any `canvasroute.router._audit.Labeller`."""
    thresholds: tuple[float, ...] = AUDIT_THRESHOLDS
    """Candidate H/lnK thresholds, strictly increasing within (0, 1], tested strict to loose."""
    max_pending: int = 64
    """Audits reserved or in flight at once (per worker); a decision that finds them all taken is
    not sampled (counted as `dropped`), so the background work stays bounded."""
    timeout: float | None = None
    """Seconds one audit may take (None: the escalation's timeout for the target, an hour for the
    review lane). An audit that times out counts as a disagreement."""
    alarm: float = 100.0
    """The drift detector's threshold (e-CUSUMs on the certified threshold's rows: while its rate
    holds, false alarms come at most once per this many of its rows on average, far fewer while it
    is under `max_error`); an alarm resets the question (it passes nothing until certified again)."""
    sync_every: int = 4
    """A shared state (a graph store's) reads the other workers' rows and writes its own after this
    many decisions, or `sync_s` seconds, whichever comes first (state in one process: always)."""
    sync_s: float = 1.0
    """Seconds at most between two syncs of a shared state (checked when a decision ends)."""
    seed: int | None = None
    """Seeds the draw of which decisions are audited (None: fresh randomness; the draw never looks
    at the decision)."""

    def __post_init__(self) -> None:
        checks = (("rate", 0.0 < self.rate <= 1.0, "within (0, 1]"),
                  ("max_error", 0.0 < self.max_error < 1.0, "within (0, 1)"),
                  ("confidence", 0.0 < self.confidence < 1.0, "within (0, 1)"),
                  ("alarm", 1.0 < self.alarm < math.inf, "a finite number > 1"),
                  ("sync_s", 0.0 < self.sync_s < math.inf, "a positive number of seconds"))
        for name, ok, what in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                raise ValueError(f"Audit.{name} must be {what}, got {value!r}")
        if self.timeout is not None and not 0.0 < self.timeout < math.inf:
            raise ValueError(f"Audit.timeout must be a positive number of seconds or None, got {self.timeout!r}")
        for name in ("max_pending", "sync_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Audit.{name} must be an integer >= 1, got {value!r}")
        if self.labels not in ("target", "review"):
            raise ValueError(f"Audit.labels must be 'target' or 'review', got {self.labels!r}")
        if self.labels == "review" and self.reviewer is None:
            raise ValueError("Audit(labels='review') needs reviewer= (e.g. canvasroute.harness.AuditInbox())")
        if self.labels == "target" and self.reviewer is not None:
            raise ValueError("Audit.reviewer is for labels='review'")
        grid = self.thresholds
        if isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
            raise ValueError(f"Audit.thresholds must be a sequence of numbers, got {grid!r}")
        object.__setattr__(self, "thresholds", grid := tuple(float(t) for t in grid))
        if not grid or any(not 0.0 < t <= 1.0 for t in grid) or any(a >= b for a, b in itertools.pairwise(grid)):
            raise ValueError(f"Audit.thresholds must be strictly increasing within (0, 1], got {grid!r}")

    @property
    def delta(self) -> float:
        """1 - `confidence`: the chance, per question, that some certified threshold is wrong at some moment."""
        return 1.0 - self.confidence


@dataclass(frozen=True, slots=True)
class Escalation:
    """Where the questions the gate did not pass go, and what they may spend.

    `CanvasDecisionModel(escalate_to=...)` takes a bare target or an `Escalation`.

    Example:
        ```python
        Escalation(ChatOpenAI(model="gemma-3-27b"), budget=EscalationBudget(max_per_window=100))
        ```
    """

    target: Any
    """A chat model (`BaseChatModel`), a `Runnable` over messages, or a decision model
    (`BaseDecisionModel`: langchain-openai's `OpenAIDecisions`, `SystemOneDecisionModel`, ...)."""
    _: KW_ONLY
    output: EscalationOutput = "auto"
    """How a chat-model target answers: its structured output (`auto`), a
    `with_structured_output` method by name, or `text` (a JSON reply in text)."""
    prompt: Any = None
    """A `ChatPromptTemplate` over `{state}`, `{questions}`, `{keys}` (and `{instructions}`),
    for chat targets (None: `ESCALATION_PROMPT`)."""
    timeout: float = 60.0
    """Seconds one escalation call may take."""
    budget: EscalationBudget | None = None
    """Cap on escalations (None: unbounded)."""
    meter: Any = None
    """The `BudgetMeter` counting `budget` (None: one in this process; a decision node with a
    graph store counts in the store)."""
    name: str | None = None
    """Names this escalation's budget (and controller) in a shared store (default: the target's
    name and the budget), so two models with budgets of their own keep their own counts."""
    controller: Controller | None = None
    """The escalation rate to hold (`Controller`: a set point, beside the budget's cap; None: the
    thresholds stay as the gate says)."""
    controller_state: Any = None
    """The `ControllerState` keeping the controller's offsets (None: one in this process; a
    decision node with a graph store keeps them in the store, shared by every worker)."""
    hedge: Hedge | None = None
    """Start the target beside a borderline question's re-reads (`Hedge`; None: re-reads first)."""
    breaker: Breaker | None = field(default_factory=Breaker)
    """The circuit breaker on the target and the cap on what engine faults escalate (`Breaker`,
    on by default; None: the target is called for every escalation, engine faults uncapped)."""
    breaker_state: Any = field(default=None, compare=False)
    """The `BreakerState` keeping the breaker's counts (None: one per model, in this process; not
    compared: two escalations set up alike are equal whatever their breakers have seen)."""
    audit: Audit | None = None
    """Live certification (`Audit`): a share of the passed answers labelled in the background, each
    question's threshold the loosest the labelled rows certify (None: the thresholds as the gate says)."""
    audit_state: Any = None
    """The `LiveState` keeping the audits' rows (None: one in this process; a decision node with a
    graph store keeps them in the store, shared by every worker)."""

    def __post_init__(self) -> None:
        if self.output not in get_args(EscalationOutput):
            raise ValueError(f"Escalation.output must be one of {', '.join(get_args(EscalationOutput))}")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"Escalation.timeout must be a positive number of seconds, got {self.timeout}")
        if self.budget is not None and not isinstance(self.budget, EscalationBudget):
            raise TypeError(f"Escalation.budget must be an EscalationBudget, not {type(self.budget).__name__}")
        if self.meter is not None and self.budget is None:
            raise ValueError("Escalation.meter needs budget= (the caps it counts against)")
        if self.controller is not None and not isinstance(self.controller, Controller):
            raise TypeError(f"Escalation.controller must be a Controller, not {type(self.controller).__name__}")
        if self.controller_state is not None and self.controller is None:
            raise ValueError("Escalation.controller_state needs controller= (the rate it holds)")
        if self.hedge is not None and not isinstance(self.hedge, Hedge):
            raise TypeError(f"Escalation.hedge must be a Hedge, not {type(self.hedge).__name__}")
        if self.breaker is not None and not isinstance(self.breaker, Breaker):
            raise TypeError(f"Escalation.breaker must be a Breaker, not {type(self.breaker).__name__}")
        if self.breaker_state is not None and self.breaker is None:
            raise ValueError("Escalation.breaker_state needs breaker= (the breaker it counts for)")
        if self.audit is not None and not isinstance(self.audit, Audit):
            raise TypeError(f"Escalation.audit must be an Audit, not {type(self.audit).__name__}")
        if self.audit_state is not None and self.audit is None:
            raise ValueError("Escalation.audit_state needs audit= (what it certifies)")


def check_fallbacks(options: Mapping[str, tuple[str, ...]], gates: Mapping[str, GatePolicy],
                    outcomes: OutcomePolicy, has_target: bool) -> None:
    """Before anything is read: every fallback names an option, every question an uncertain or
    abstained read, or a failed escalation (`target_fault='fallback'`), sends to its fallback has
    one, and every abstaining question has somewhere to go. (An engine fault or a spent budget
    with no fallback option for its question raises when it happens: an engine fault never becomes
    a cheap answer.)

    Raises:
        DecisionError: naming the question and what it lacks.
    """
    for qid, option in outcomes.fallback.items():
        if qid in options and option not in options[qid]:
            raise DecisionError(f"fallback {option!r} is not an option of {qid!r}",
                                hint=f"one of {list(options[qid])[:8]}")
    wants = ["uncertain"] if outcomes.uncertain == "fallback" else []
    if has_target and outcomes.target_fault == "fallback" and "escalate" in (
            outcomes.uncertain, outcomes.abstained, outcomes.engine_fault):
        wants.append("target_fault")  # any question may escalate, and its escalation may fail
    if not (wants or (outcomes.abstained != "answer" and any(g.abstain for g in gates.values()))
            or outcomes.fallback):
        return
    for qid in options:
        abstains = gates[qid].abstain
        if abstains and outcomes.abstained == "escalate" and not has_target:
            raise DecisionError(f"question {qid!r} may abstain and OutcomePolicy.abstained='escalate', but there "
                                "is no escalation target", hint="set escalate_to=, or abstained='fallback'")
        needs = [*wants, *(["abstained"] if abstains and outcomes.abstained == "fallback" else [])]
        if needs and qid not in outcomes.fallback:
            raise DecisionError(f"question {qid!r} may take a fallback ({', '.join(needs)}='fallback'), but has no "
                                "fallback option", hint="add it to OutcomePolicy(fallback={...})")


# -- the policy file ---------------------------------------------------------------------

POLICY_FORMAT = "canvasroute.policy/1"
_MOVED_DEFAULTS = {"on_unsure": "answer", "on_abstain": "escalate"}
"""Keys 0.1's policy files held (at every level, default or not), and the value that means what
the 0.2 defaults mean (dropped at load)."""


def policy_to_dict(policy: GatePolicy) -> dict[str, Any]:
    """A `GatePolicy` as plain JSON values (nested `per_question` included)."""
    out: dict[str, Any] = {f.name: getattr(policy, f.name) for f in fields(GatePolicy)
                           if f.name not in ("per_question", "certificate")}
    if policy.certificate is not None:
        out["certificate"] = {f.name: getattr(policy.certificate, f.name) for f in fields(Certificate)
                              if f.name != "live"}  # (a live certificate's figures are of the moment)
    if policy.per_question:
        out["per_question"] = {qid: policy_to_dict(p) for qid, p in policy.per_question.items()}
    return out


def policy_from_dict(data: Mapping[str, Any]) -> GatePolicy:
    """The inverse of `policy_to_dict`; unknown keys and bad values raise `CalibrationError`.

    A 0.1 file's `on_unsure` / `on_abstain` keys load until 0.3.0, with a `DeprecationWarning`:
    at their defaults (what 0.1's `calibrate` wrote) they mean what 0.2's defaults mean and are
    dropped; other values are kept as `GatePolicy(on_unsure=...)` keeps them, for the model's
    `OutcomePolicy` (`canvasroute.router._compat`)."""
    if found := _moved_keys(data):
        warn_moved("policy file", {key: GATE_REMOVED[key][0] for key in sorted(found)})
    return _policy_from_dict(data)


def _moved_keys(data: Any) -> set[str]:
    if not isinstance(data, Mapping):
        return set()
    inner = data.get("per_question")
    found = set(data) & _MOVED_DEFAULTS.keys()
    return found.union(*map(_moved_keys, inner.values())) if isinstance(inner, Mapping) else found


def _policy_from_dict(data: Mapping[str, Any]) -> GatePolicy:
    if not isinstance(data, Mapping):
        raise CalibrationError(f"a policy is a JSON object, not {type(data).__name__}")
    moved = {k: data[k] for k in _MOVED_DEFAULTS if k in data and data[k] != _MOVED_DEFAULTS[k]}
    data = {k: v for k, v in data.items() if k not in _MOVED_DEFAULTS}
    if unknown := set(data) - _GATE_FIELDS:
        raise CalibrationError(f"unknown policy keys {sorted(unknown)}; known: {sorted(_GATE_FIELDS)}")
    values = dict(data)
    per_question = values.pop("per_question", None) or {}
    if not isinstance(per_question, Mapping):
        raise CalibrationError("per_question must map question ids to policies")
    try:
        if (certificate := values.pop("certificate", None)) is not None:
            if not isinstance(certificate, Mapping):
                raise CalibrationError("certificate must be a JSON object")
            values["certificate"] = Certificate(**certificate)
        return with_kept(GatePolicy, {**values, "per_question": {str(k): _policy_from_dict(v)
                                                                 for k, v in per_question.items()}}, moved)
    except CalibrationError:
        raise
    except (TypeError, ValueError) as exc:
        raise CalibrationError(f"invalid policy: {exc}") from exc


def save_policy(path: str | Path, policy: GatePolicy, calibration: Mapping[str, Any] | None = None) -> Path:
    """Write a policy file: `{"format", "policy", "calibration"}` (the last is informational)."""
    path = Path(path)
    doc = {"format": POLICY_FORMAT, "policy": policy_to_dict(policy), "calibration": dict(calibration or {})}
    path.write_text(json.dumps(_clean(doc), indent=2, allow_nan=False) + "\n")
    return path


def load_policy(path: str | Path) -> GatePolicy:
    """Read a policy file written by `canvasroute calibrate` (or by hand).

    Example:
        ```python
        model = CanvasDecisionModel(engine=engine, policy=load_policy("policy.json"))
        ```
    """
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CalibrationError(f"cannot read policy file {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"policy file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, Mapping) or doc.get("format") != POLICY_FORMAT:
        raise CalibrationError(f"{path} is not a policy file (expected \"format\": \"{POLICY_FORMAT}\")")
    return policy_from_dict(doc.get("policy") or {})


def _clean(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, NaN and infinities become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
