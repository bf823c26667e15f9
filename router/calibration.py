"""Calibration: per-question temperatures, ECE and entropy thresholds from labelled reads.

A labelled read is the canvas distribution over one question's options, as read
(temperature 1), and the gold option. Per question:

- **Temperature scaling.** `p_T = softmax(log p / T)`; T > 1 softens, T < 1 sharpens,
  the argmax (and so accuracy) never changes. T minimizes the negative log-likelihood
  on one split (golden-section search over log T; NLL is convex in 1/T) and is kept only
  if, on the other split, neither NLL nor ECE gets worse; otherwise T = 1.
- **ECE.** Expected calibration error over 15 equal-width confidence bins:
  `sum_b n_b / n * |accuracy_b - confidence_b|`, confidence = probability of the argmax.
- **Threshold.** A `max_normalized_entropy` for the gate, on the tempered distributions:
  the largest one whose canvas-answered questions reach a target accuracy, or the
  `1 - rate` quantile of entropies for a target escalation rate (RouteLLM's rule).

The result is a `GatePolicy` with a `per_question` override per calibrated question,
written and read as JSON by `save_policy` / `load_policy` (`router._policy_file`).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from canvasroute.engine.errors import CalibrationError

from ._policy import GatePolicy

ECE_BINS = 15
MIN_ROWS = 4
"""Fewer labelled rows than this for a question: no fit (T = 1, base threshold)."""
TEMPERATURE_BOUNDS = (0.05, 20.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Labelled:
    """One canvas read of one question with its gold answer."""

    question_id: str
    probabilities: tuple[float, ...]
    """Canvas distribution over the options, as read (temperature 1)."""
    gold: int
    """Index of the gold option."""

    def __post_init__(self) -> None:
        if len(self.probabilities) < 2:
            raise CalibrationError(f"{self.question_id!r}: a distribution needs at least two options")
        if not 0 <= self.gold < len(self.probabilities):
            raise CalibrationError(f"{self.question_id!r}: gold index {self.gold} is not an option")
        if any(not p >= 0.0 for p in self.probabilities) or sum(self.probabilities) <= 0.0:
            raise CalibrationError(f"{self.question_id!r}: probabilities must be >= 0 and not all 0")


# -- the math --------------------------------------------------------------------------


def _logits(probs: Sequence[float]) -> list[float]:
    return [math.log(p) if p > 0.0 else -745.0 for p in probs]  # exp(-745) is the smallest double


def _log_softmax(logits: Sequence[float], temperature: float) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    lse = top + math.log(sum(math.exp(x - top) for x in scaled))
    return [x - lse for x in scaled]


def tempered(probs: Sequence[float], temperature: float) -> tuple[float, ...]:
    """`softmax(log p / T)`: the distribution at temperature T."""
    return tuple(math.exp(x) for x in _log_softmax(_logits(probs), temperature))


def nll(samples: Sequence[Labelled], temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the gold options at temperature T."""
    if not samples:
        raise CalibrationError("no labelled rows")
    return -sum(_log_softmax(_logits(s.probabilities), temperature)[s.gold] for s in samples) / len(samples)


def _argmax(probs: Sequence[float]) -> int:
    return max(range(len(probs)), key=probs.__getitem__)


def normalized_entropy(probs: Sequence[float]) -> float:
    """Entropy over ln K (0 = certain, 1 = uniform)."""
    h = -sum(p * math.log(p) for p in probs if p > 0.0)
    return h / math.log(len(probs)) if len(probs) > 1 else 0.0


@dataclass(frozen=True, slots=True)
class Bin:
    """One confidence bin of a reliability diagram."""

    low: float
    high: float
    count: int
    confidence: float
    """Mean confidence of the bin's rows (NaN when empty)."""
    accuracy: float
    """Share of the bin's rows answered right (NaN when empty)."""


def reliability(confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS) -> list[Bin]:
    """Rows grouped by confidence into `bins` equal-width bins `(i/bins, (i+1)/bins]`."""
    if len(confidences) != len(correct):
        raise CalibrationError("confidences and correct differ in length")
    groups: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for c, ok in zip(confidences, correct, strict=True):
        groups[min(bins - 1, max(0, math.ceil(c * bins) - 1))].append((c, bool(ok)))
    out = []
    for i, g in enumerate(groups):
        n = len(g)
        out.append(Bin(i / bins, (i + 1) / bins, n, sum(c for c, _ in g) / n if n else math.nan,
                       sum(ok for _, ok in g) / n if n else math.nan))
    return out


def expected_calibration_error(confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS) -> float:
    """ECE: `sum_b n_b / n * |accuracy_b - confidence_b|` over equal-width bins."""
    if not confidences:
        raise CalibrationError("no rows to measure ECE on")
    n = len(confidences)
    return sum(b.count / n * abs(b.accuracy - b.confidence) for b in reliability(confidences, correct, bins) if b.count)


def scores(samples: Sequence[Labelled], temperature: float) -> tuple[list[float], list[bool], list[float]]:
    """Confidence, correctness and normalized entropy of every row at temperature T."""
    conf, ok, ent = [], [], []
    for s in samples:
        p = tempered(s.probabilities, temperature)
        top = _argmax(p)
        conf.append(p[top])
        ok.append(top == s.gold)
        ent.append(normalized_entropy(p))
    return conf, ok, ent


def ece(samples: Sequence[Labelled], temperature: float = 1.0, bins: int = ECE_BINS) -> float:
    """ECE of labelled rows at temperature T."""
    conf, ok, _ = scores(samples, temperature)
    return expected_calibration_error(conf, ok, bins)


def accuracy(samples: Sequence[Labelled]) -> float:
    """Share of rows whose canvas argmax is the gold option (temperature never changes it)."""
    if not samples:
        raise CalibrationError("no labelled rows")
    return sum(_argmax(s.probabilities) == s.gold for s in samples) / len(samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class TemperatureFit:
    """A temperature fitted on one split and checked on the other."""

    temperature: float
    """The temperature to use: the fitted one if accepted, else 1."""
    fitted: float
    """The NLL minimizer on the fit split."""
    accepted: bool
    reason: str
    nll_fit: tuple[float, float]
    """Fit-split NLL at T = 1 and at the fitted T."""
    nll_check: tuple[float, float]
    """Check-split NLL at T = 1 and at the fitted T."""
    ece_check: tuple[float, float]
    """Check-split ECE at T = 1 and at the fitted T."""


def fit_temperature(fit: Sequence[Labelled], check: Sequence[Labelled], *,
                    bounds: tuple[float, float] = TEMPERATURE_BOUNDS, tol: float = 1e-6) -> TemperatureFit:
    """Minimize NLL over T on `fit`; keep T only if `check` NLL and ECE do not get worse."""
    if not fit or not check:
        raise CalibrationError("temperature fitting needs rows in both splits")
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = nll(fit, math.exp(c)), nll(fit, math.exp(d))
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = nll(fit, math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = nll(fit, math.exp(d))
    t = math.exp((a + b) / 2)
    nll_check = (nll(check, 1.0), nll(check, t))
    ece_check = (ece(check, 1.0), ece(check, t))
    if nll_check[1] > nll_check[0] + 1e-12:
        accepted, reason = False, "held-out NLL got worse"
    elif ece_check[1] > ece_check[0] + 1e-12:
        accepted, reason = False, "held-out ECE got worse"
    else:
        accepted, reason = True, "held-out NLL and ECE did not get worse"
    if min(abs(math.log(t) - lo), abs(math.log(t) - hi)) < 1e-3:
        reason += f" (T at the search bound {t:.3g}: the reads are close to uniform or to one-hot)"
    return TemperatureFit(temperature=t if accepted else 1.0, fitted=t, accepted=accepted, reason=reason,
                          nll_fit=(nll(fit, 1.0), nll(fit, t)), nll_check=nll_check, ece_check=ece_check)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """The gate at one entropy threshold: escalate rows whose normalized entropy exceeds it."""

    threshold: float
    escalation_rate: float
    canvas_accuracy: float | None
    """Accuracy of the rows the canvas answers (None when it answers none)."""
    routed_accuracy: float
    """Accuracy if every escalated row were answered right (an upper bound)."""


def escalation_curve(samples: Sequence[Labelled], temperature: float = 1.0) -> list[CurvePoint]:
    """Accuracy against escalation rate for every distinct threshold, from 0 % escalated up."""
    if not samples:
        raise CalibrationError("no labelled rows")
    _, ok, ent = scores(samples, temperature)
    rows = sorted(zip(ent, ok, strict=True), key=lambda r: r[0])
    n = len(rows)
    points = [CurvePoint(0.0, 1.0, None, 1.0)] if rows[0][0] > 0.0 else []  # escalate everything
    right = 0
    for k, (e, good) in enumerate(rows, 1):
        right += good
        if k < n and rows[k][0] == e:
            continue  # ties escalate together
        points.append(CurvePoint(e, 1.0 - k / n, right / k, (right + n - k) / n))
    return points[::-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class ThresholdFit:
    """A `max_normalized_entropy` chosen for a target, and what it gives on the fit rows."""

    threshold: float
    target: str
    """`accuracy=0.9`, `escalation=0.2`."""
    escalation_rate: float
    canvas_accuracy: float | None
    reachable: bool
    """False when no threshold meets an accuracy target (the threshold then escalates all)."""


def entropy_threshold(samples: Sequence[Labelled], temperature: float = 1.0, *,
                      target_accuracy: float | None = None, target_escalation: float | None = None) -> ThresholdFit:
    """The gate threshold for a target accuracy of canvas answers or a target escalation rate."""
    if (target_accuracy is None) == (target_escalation is None):
        raise CalibrationError("give exactly one of target_accuracy and target_escalation")
    if not samples:
        raise CalibrationError("no labelled rows")
    if target_escalation is not None:
        if not 0.0 <= target_escalation <= 1.0:
            raise CalibrationError(f"target escalation must be within [0, 1], got {target_escalation}")
        _, ok, ent = scores(samples, temperature)
        ranked = sorted(ent)
        keep = round((1.0 - target_escalation) * len(ranked))
        threshold = min(1.0, ranked[keep - 1]) if keep else 0.0
        kept = [good for e, good in zip(ent, ok, strict=True) if e <= threshold]
        return ThresholdFit(threshold=threshold, target=f"escalation={target_escalation:g}",
                            escalation_rate=1.0 - len(kept) / len(ent),
                            canvas_accuracy=sum(kept) / len(kept) if kept else None, reachable=True)
    assert target_accuracy is not None
    if not 0.0 <= target_accuracy <= 1.0:
        raise CalibrationError(f"target accuracy must be within [0, 1], got {target_accuracy}")
    met = [p for p in escalation_curve(samples, temperature)
           if p.canvas_accuracy is not None and p.canvas_accuracy >= target_accuracy - 1e-12]
    if not met:
        return ThresholdFit(threshold=0.0, target=f"accuracy={target_accuracy:g}", escalation_rate=1.0,
                            canvas_accuracy=None, reachable=False)
    best = min(met, key=lambda p: p.escalation_rate)
    return ThresholdFit(threshold=min(1.0, best.threshold), target=f"accuracy={target_accuracy:g}",
                        escalation_rate=best.escalation_rate, canvas_accuracy=best.canvas_accuracy, reachable=True)


# -- per question, and the policy -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class QuestionCalibration:
    """Everything fitted and measured for one question."""

    question_id: str
    rows: int
    fit_rows: int
    check_rows: int
    temperature: TemperatureFit | None
    """None when there were too few rows to fit."""
    threshold: ThresholdFit | None
    """None without a target."""
    accuracy: float
    """Canvas argmax accuracy on all rows (any temperature)."""
    ece_before: float
    """Check-split ECE at T = 1 (all rows when too few to split)."""
    ece_after: float
    """Check-split ECE at the chosen temperature."""
    check_escalation_rate: float | None = None
    """Share of check rows the chosen threshold escalates."""
    check_canvas_accuracy: float | None = None
    """Accuracy of the check rows the canvas answers at the chosen threshold."""
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Per-question calibration results and the policy they make."""

    questions: dict[str, QuestionCalibration]
    policy: GatePolicy
    samples: dict[str, tuple[list[Labelled], list[Labelled]]] = field(repr=False, default_factory=dict)
    """The (fit, check) split of each question, for plots."""

    def summary(self) -> dict[str, Any]:
        """JSON-able figures per question (stored in the policy file)."""
        return {qid: asdict(q) for qid, q in self.questions.items()}


def split(samples: Sequence[Labelled], holdout: float = 0.5, seed: int = 0) -> tuple[list[Labelled], list[Labelled]]:
    """A seeded shuffle cut into (fit, check); `holdout` is the check share."""
    if not 0.0 < holdout < 1.0:
        raise CalibrationError(f"holdout must be within (0, 1), got {holdout}")
    rows = list(samples)
    random.Random(seed).shuffle(rows)
    cut = min(len(rows) - 1, max(1, round(len(rows) * (1.0 - holdout))))
    return rows[:cut], rows[cut:]


def calibrate(samples: Iterable[Labelled], *, base: GatePolicy | None = None, holdout: float = 0.5, seed: int = 0,
              target_accuracy: float | None = None, target_escalation: float | None = None) -> Calibration:
    """Fit a temperature (and, with a target, a threshold) per question; build the policy.

    Questions with fewer than `MIN_ROWS` rows keep T = 1 and the base threshold.
    """
    base = base or GatePolicy()
    if target_accuracy is not None and target_escalation is not None:
        raise CalibrationError("give at most one of target_accuracy and target_escalation")
    by_question: dict[str, list[Labelled]] = defaultdict(list)
    for s in samples:
        by_question[s.question_id].append(s)
    if not by_question:
        raise CalibrationError("no labelled rows", hint="check the data file, or --limit")
    results: dict[str, QuestionCalibration] = {}
    splits: dict[str, tuple[list[Labelled], list[Labelled]]] = {}
    overrides: dict[str, GatePolicy] = {}
    targeted = target_accuracy is not None or target_escalation is not None
    for qid, rows in sorted(by_question.items()):
        if len(rows) < MIN_ROWS:
            e = ece(rows)
            results[qid] = QuestionCalibration(
                question_id=qid, rows=len(rows), fit_rows=0, check_rows=0, temperature=None, threshold=None,
                accuracy=accuracy(rows), ece_before=e, ece_after=e, note=f"fewer than {MIN_ROWS} rows: not fitted")
            splits[qid] = (rows, [])
            continue
        fit, check = split(rows, holdout, seed)
        splits[qid] = (fit, check)
        tfit = fit_temperature(fit, check)
        t = tfit.temperature
        thr = entropy_threshold(fit, t, target_accuracy=target_accuracy,
                                target_escalation=target_escalation) if targeted else None
        limit = thr.threshold if thr else base.for_question(qid).max_normalized_entropy
        check_rate = check_acc = None
        if limit is not None:
            _, ok, ent = scores(check, t)
            kept = [good for e, good in zip(ent, ok, strict=True) if e <= limit]
            check_rate = 1.0 - len(kept) / len(check)
            check_acc = sum(kept) / len(kept) if kept else None
        results[qid] = QuestionCalibration(
            question_id=qid, rows=len(rows), fit_rows=len(fit), check_rows=len(check), temperature=tfit,
            threshold=thr, accuracy=accuracy(rows), ece_before=tfit.ece_check[0], ece_after=ece(check, t),
            check_escalation_rate=check_rate, check_canvas_accuracy=check_acc)
        changes: dict[str, Any] = {"temperature": t, "per_question": {}}
        if thr is not None:
            changes["max_normalized_entropy"] = thr.threshold
        overrides[qid] = replace(base.for_question(qid), **changes)
    policy = replace(base, per_question={**base.per_question, **overrides})
    return Calibration(questions=results, policy=policy, samples=splits)
