"""Policies: when a canvas answer is trusted, re-read, escalated, or budgeted."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from canvasroute.engine import DecisionError

from ._distribution import SlotStats

MAX_SAMPLES = 32
"""Reads of one question in a decision, first reads and re-reads each (vLLM's gateway caps samples there too)."""
MAX_REREADS = MAX_SAMPLES - 1
MAX_ORDER_VIEWS = 2


class FrozenMapping(Mapping[str, "GatePolicy"]):
    """A read-only, hashable mapping (so a policy with overrides hashes and can be a cache key)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, GatePolicy] = ()) -> None:  # type: ignore[assignment]
        self._data = dict(data)
        self._hash: int | None = None

    def __getitem__(self, key: str) -> GatePolicy:
        return self._data[key]

    def get(self, key: str, default: GatePolicy | None = None) -> GatePolicy | None:  # type: ignore[override]
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
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __repr__(self) -> str:
        return repr(self._data)


@dataclass(frozen=True, kw_only=True, slots=True)
class GatePolicy:
    """Thresholds that decide whether a canvas answer is confident.

    A question is uncertain when any configured threshold is crossed; `None` turns a
    check off. Every question is read `samples` times (1: one read), uncertain ones are
    re-read `rereads` more times with fresh noise, gated again on the mean distribution,
    and escalated if still uncertain. Read k of a canvas uses noise seed `seed + 7919 k`,
    first reads and re-reads alike.

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
    (`CanvasDecisionModel.constrained`): a constrained read cannot measure it."""

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

    abstain: bool = False
    """Offer one more label in the question's slot, "none of these / can't tell". When it
    wins the question takes path `abstained` and goes where `on_abstain` says."""

    on_abstain: Literal["escalate", "fallback"] = "escalate"
    """An abstained question escalates (under the budget; needs `escalate_to`) or takes
    the model's `fallback` option for it."""

    on_unsure: Literal["answer", "fallback", "raise", "review"] = "answer"
    """What a question still uncertain after its re-reads answers when nothing can answer it
    instead (the model has no `escalate_to`); its path is `unsure` whatever this says.
    `answer` (default): the canvas answer, flagged `confident=False`; `fallback`: the model's
    `fallback` option for it; `raise`: `UnsureAnswer`; `review`: the canvas answer, and a
    decision node sends it to a human through `interrupt()` (its `review=`, else `ReviewPolicy()`)."""

    order_views: int = 0
    """Extra listings of a Choice's options in cyclically shifted label order, as extra
    slots of the same canvas (0 off, at most 2); the aligned distributions are averaged
    against first-label bias. One forward pass, no extra read; a longer canvas."""

    per_question: Mapping[str, GatePolicy] = field(default_factory=FrozenMapping)
    """Overrides by question id; an override replaces the whole policy for that question
    (stored read-only, so the policy hashes)."""

    def __post_init__(self) -> None:
        if not isinstance(self.per_question, Mapping):
            raise TypeError(f"per_question must be a mapping, got {type(self.per_question).__name__}")
        object.__setattr__(self, "per_question", FrozenMapping(self.per_question))
        if not 0 <= self.order_views <= MAX_ORDER_VIEWS:
            raise ValueError(f"order_views must be within 0..{MAX_ORDER_VIEWS}, got {self.order_views}")
        if self.on_abstain not in ("escalate", "fallback"):
            raise ValueError(f"on_abstain must be escalate or fallback, not {self.on_abstain!r}")
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise ValueError(f"samples must be within 1..{MAX_SAMPLES}, got {self.samples}")
        if self.on_unsure not in ("answer", "fallback", "raise", "review"):
            raise ValueError(f"on_unsure must be answer, fallback, raise or review, not {self.on_unsure!r}")
        if not 0 <= self.rereads <= MAX_REREADS:
            raise ValueError(f"rereads must be within 0..{MAX_REREADS}, got {self.rereads}")
        for name in ("max_normalized_entropy", "min_confidence", "min_margin", "min_label_mass"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if not 0.0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature}")
        if self.max_entropy is not None and self.max_entropy < 0:
            raise ValueError(f"max_entropy must be >= 0, got {self.max_entropy}")
        for qid, override in self.per_question.items():
            if not isinstance(override, GatePolicy):
                raise TypeError(f"per_question[{qid!r}] must be a GatePolicy, got {type(override).__name__}")

    def for_question(self, question_id: str) -> GatePolicy:
        """The policy that applies to one question."""
        return self.per_question.get(question_id, self)

    @property
    def gate_text(self) -> str:
        """What this gate passes, in words: `H/lnK <= 0.5` (thresholds joined by `, `; `none`)."""
        tests = (("H/lnK", "<=", self.max_normalized_entropy), ("H", "<=", self.max_entropy),
                 ("confidence", ">=", self.min_confidence), ("margin", ">=", self.min_margin),
                 ("label mass", ">=", self.min_label_mass))
        return ", ".join(f"{name} {op} {value:g}" for name, op, value in tests if value is not None) or "none"

    @property
    def uses_label_mass(self) -> bool:
        """Whether any question's gate reads label mass (`min_label_mass`, here or in an override)."""
        return self.min_label_mass is not None or any(p.min_label_mass is not None
                                                      for p in self.per_question.values())

    def with_overrides(self, **changes: object) -> GatePolicy:
        """A copy with some fields changed (e.g. from `Runtime.context`)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def crossed(self, stats: SlotStats) -> list[str]:
        """Names of the thresholds this distribution crosses (empty: confident)."""
        out = []
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


@dataclass(frozen=True, kw_only=True, slots=True)
class EscalationBudget:
    """A cap on escalations, so an engine fault or a drift cannot buy unbounded AR calls.

    Example:
        ```python
        EscalationBudget(max_per_window=100, window_s=60, when_spent="keep")
        ```
    """

    max_per_window: int | None = None
    """Escalated questions allowed per rolling window (None: no window cap)."""

    window_s: float = 60.0
    """Length of the rolling window in seconds."""

    max_per_thread: int | None = None
    """Escalated questions allowed per LangGraph thread (None: no per-thread cap)."""

    when_spent: Literal["keep", "fallback", "raise"] = "keep"
    """`keep`: answer from the canvas, flagged `over_budget`; `fallback`: the configured
    fallback label; `raise`: raise `BudgetExhausted`."""

    def __post_init__(self) -> None:
        for name in ("max_per_window", "max_per_thread"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.when_spent not in ("keep", "fallback", "raise"):
            raise ValueError(f"when_spent must be keep, fallback or raise, not {self.when_spent!r}")


def check_fallbacks(specs: Mapping[str, Any], policy: GatePolicy, has_target: bool, fallback: Mapping[str, str]) -> None:
    """Before anything is read: every fallback is an option of its question, and every
    question that may abstain or stay unsure has somewhere to go (a target or a fallback)."""
    for qid, option in fallback.items():
        if qid in specs and option not in specs[qid].options:
            raise DecisionError(f"fallback {option!r} is not an option of {qid!r}",
                                hint=f"one of {list(specs[qid].options)[:8]}")
    if policy.on_unsure != "fallback" and not policy.abstain and not policy.per_question:
        return
    for qid in specs:
        p = policy.for_question(qid)
        if p.abstain and p.on_abstain == "escalate" and not has_target:
            raise DecisionError(f"question {qid!r} may abstain and on_abstain='escalate', but the model "
                                "has no escalate_to", hint="set escalate_to, or on_abstain='fallback'")
        for name, wanted in (("on_abstain", p.abstain and p.on_abstain == "fallback"),
                             ("on_unsure", p.on_unsure == "fallback" and not has_target)):
            if wanted and qid not in fallback:
                raise DecisionError(f"question {qid!r} has {name}='fallback', but no fallback option",
                                    hint="add it to fallback=")
