"""The figures of `canvasroute eval`: AUROC, risk-coverage, and the measured threshold sweep.

Everything works on `Item`s, one per labelled question, holding what each arm answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Item", "SweepPoint", "auroc", "mix_accuracy", "risk_coverage", "sweep"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    """One labelled question across the three arms."""

    row: int
    question_id: str
    gold: str
    canvas_answer: str
    normalized_entropy: float
    """Of the single gate-off canvas read (at the policy's temperature)."""
    target_answer: str | None = None
    """The escalation target's answer on its own (None: no target, or it failed)."""
    cascade_answer: str | None = None
    cascade_path: str | None = None

    @property
    def canvas_ok(self) -> bool:
        return self.canvas_answer == self.gold

    @property
    def target_ok(self) -> bool:
        return self.target_answer == self.gold


def auroc(scores: Sequence[float], positives: Sequence[bool]) -> float | None:
    """Area under the ROC curve of `scores` for detecting `positives` (ties count half).

    The probability that a random positive scores above a random negative; None when
    either class is empty. Here: normalized entropy detecting canvas errors.
    """
    pos = [s for s, p in zip(scores, positives, strict=True) if p]
    neg = [s for s, p in zip(scores, positives, strict=True) if not p]
    if not pos or not neg:
        return None
    # rank-sum (Mann-Whitney U) with average ranks for ties: O(n log n)
    ordered = sorted(scores)
    rank: dict[float, float] = {}
    i = 0
    while i < len(ordered):
        j = i
        while j < len(ordered) and ordered[j] == ordered[i]:
            j += 1
        rank[ordered[i]] = (i + j + 1) / 2  # mean of 1-based ranks i+1..j
        i = j
    u = sum(rank[s] for s in pos) - len(pos) * (len(pos) + 1) / 2
    return u / (len(pos) * len(neg))


def risk_coverage(items: Sequence[Item]) -> list[tuple[float, float]]:
    """`(coverage, risk)` of answering the least uncertain canvas reads first.

    Coverage is the share answered from the canvas, risk the error rate among them;
    questions with equal entropy enter together. Starts at full coverage's complement
    order: the first point covers the most certain group.
    """
    ranked = sorted(items, key=lambda it: it.normalized_entropy)
    n, wrong, out = len(ranked), 0, []
    for k, it in enumerate(ranked, 1):
        wrong += not it.canvas_ok
        if k < n and ranked[k].normalized_entropy == it.normalized_entropy:
            continue
        out.append((k / n, wrong / k))
    return out


@dataclass(frozen=True, slots=True)
class SweepPoint:
    threshold: float | None
    """`max_normalized_entropy`: above it a question escalates (None: escalate all)."""
    escalation_rate: float
    accuracy: float
    """Measured: the target's answer where escalated, the canvas answer elsewhere."""
    oracle_accuracy: float
    """If every escalation were right (calibrate's old curve), for comparison."""
    escalations: int


def mix_accuracy(items: Sequence[Item], threshold: float) -> tuple[float, int]:
    """Accuracy and escalations of the gate `normalized_entropy > threshold` on single reads."""
    right, escalated = 0, 0
    for it in items:
        if it.normalized_entropy > threshold:
            escalated += 1
            right += it.target_ok
        else:
            right += it.canvas_ok
    return right / len(items), escalated


def sweep(items: Sequence[Item], thresholds: Sequence[float] | None = None) -> list[SweepPoint]:
    """The gate at each threshold (default: every distinct entropy, plus escalate-all),
    from the measured canvas and target answers, lowest escalation rate first."""
    if not items:
        return []
    if thresholds is None:
        values = sorted({it.normalized_entropy for it in items})
        thresholds = [-1e-9, *values]
    points = []
    for t in thresholds:
        acc, esc = mix_accuracy(items, t)
        oracle = sum(1 if it.normalized_entropy > t else it.canvas_ok for it in items) / len(items)
        points.append(SweepPoint(None if t < 0 else t, esc / len(items), acc, oracle, esc))
    return sorted(points, key=lambda p: (p.escalation_rate, -(-1.0 if p.threshold is None else p.threshold)))
