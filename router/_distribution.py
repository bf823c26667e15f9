"""Distribution math for one answer slot.

For a slot with K labels and a row of log-probabilities `lp`:

- every label id must be in the row: a missing one is a malformed row
  (`EngineResponseError`, which fails expensive like any engine fault), never filled in;
- `p = softmax(lp[labels] / T)`, the distribution over labels only, at temperature `T`
  (1 = as read; `canvasroute calibrate` fits one per question);
- `label_mass = sum(exp(lp[labels]))`, how much of the model's mass fell on labels;
- `entropy = -sum(p ln p)` in nats; `normalized_entropy = entropy / ln K` (0 when K = 1);
- `margin = p(top) - p(second)`;
- `confidence = p(top)`, the probability of the chosen label (for re-reads: its mean
  over reads, as vLLM's gateway does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from canvasroute.engine import EngineResponseError


@dataclass(frozen=True, slots=True)
class SlotStats:
    """Probabilities over one slot's labels and the figures the gate reads (computed once)."""

    probs: tuple[float, ...]
    label_mass: float
    reads: int = 1
    agreement: float | None = None
    """Share of reads whose argmax equals the final answer (re-reads only)."""
    stderr: float | None = None
    """Standard error of the chosen label's probability across reads (re-reads only)."""
    argmax_is_label: bool | None = None
    """Whether the row's most likely token was one of the labels (of the first read)."""
    top: int = field(init=False, compare=False, repr=False)
    """Index of the most likely label (the first, on a tie)."""
    entropy: float = field(init=False, compare=False, repr=False)
    normalized_entropy: float = field(init=False, compare=False, repr=False)
    margin: float = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        probs, log, put = self.probs, math.log, object.__setattr__
        entropy = -sum([p * log(p) for p in probs if p > 0.0])
        best = max(probs)
        top = probs.index(best)  # the first, on a tie
        k = len(probs)
        put(self, "top", top)
        put(self, "entropy", entropy)
        put(self, "normalized_entropy", entropy / log(k) if k > 1 else 0.0)
        put(self, "margin", best - max(probs[:top] + probs[top + 1:]) if k > 1 else 1.0)

    @property
    def confidence(self) -> float:
        return self.probs[self.top]


def slot_stats(row: Mapping[int, float], label_ids: Sequence[int], temperature: float = 1.0) -> SlotStats:
    """Label-normalized probabilities from one row of log-probabilities, at `temperature`."""
    if not temperature > 0.0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    try:
        lps = [row[i] for i in label_ids]
    except KeyError as exc:
        raise EngineResponseError(f"a slot row lacks label id {exc.args[0]} (a row must hold every requested "
                                  "label id)") from None
    exp = math.exp
    mass = sum([exp(lp) for lp in lps])  # before the all--inf case below: that mass is 0
    top = max(lps)
    if top == -math.inf:
        lps, top = [0.0] * len(lps), 0.0
    weights = [exp((lp - top) / temperature) for lp in lps]
    total = sum(weights)
    return SlotStats(tuple([w / total for w in weights]), min(1.0, mass),
                     argmax_is_label=max(row, key=row.__getitem__) in label_ids)


def aggregate(reads: Sequence[SlotStats]) -> SlotStats:
    """Mean distribution over several reads of one slot, with agreement and stderr."""
    if len(reads) == 1:
        return reads[0]
    n, k = len(reads), len(reads[0].probs)
    mean = tuple(sum(r.probs[j] for r in reads) / n for j in range(k))
    top = max(range(k), key=mean.__getitem__)
    agreement = sum(r.top == top for r in reads) / n
    tops = [r.probs[top] for r in reads]
    mu = sum(tops) / n
    stderr = math.sqrt(sum((x - mu) ** 2 for x in tops) / (n - 1) / n)
    mass = sum(r.label_mass for r in reads) / n
    return SlotStats(mean, mass, reads=n, agreement=agreement, stderr=stderr,
                     argmax_is_label=reads[0].argmax_is_label)
