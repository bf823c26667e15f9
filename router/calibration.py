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
  `1 - rate` quantile of entropies for a target escalation rate (RouteLLM's rule). Both
  describe the rows they were fitted on, and promise nothing about the next ones.
- **Certified threshold.** With a bound instead (`calibrate(max_error=A, confidence=C)`):
  the loosest threshold for which, with probability at least C over the rows, the error rate
  of the answers the gate passes is at most A: fixed-sequence testing over thresholds ordered
  strict to loose, each with the exact binomial p-value, on every row (`certify_threshold`
  states the test, its guarantee and the condition it rests on, and cites the papers). Rows
  that cannot certify A: the error they do prove, stated as such, or the gate's own threshold
  uncertified, or a gate that passes nothing, as `uncertified` says. The gate holds the proof
  as a `Certificate`. The pieces are small on purpose (`candidate_thresholds`,
  `binomial_p_value`, `clopper_pearson_upper`, `fixed_sequence`), so another test of the same
  thresholds can share them; `certify_split` is the split-half test it replaces, kept to compare.

Every figure a gate compares (normalized entropy at a temperature) is computed by the router's
own `tempered` and `normalized_entropy` (`router._read`) from the T = 1 distribution a read
reports: a threshold certified at one row's entropy is the float the live gate computes for
that read.

The result is a `GatePolicy` with a `per_question` override per calibrated question,
written and read as JSON by `save_policy` / `load_policy` (`router._policy_file`).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from typing import Any, Literal, get_args

from canvasroute.engine.errors import CalibrationError

from ._policy import Certificate, GatePolicy, _percent
from ._read import normalized_entropy as normalized_entropy  # the gate's own: calibration computes what it compares
from ._read import tempered as tempered

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


def nll(samples: Sequence[Labelled], temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the gold options at temperature T."""
    if not samples:
        raise CalibrationError("no labelled rows")
    return -sum(_log_softmax(_logits(s.probabilities), temperature)[s.gold] for s in samples) / len(samples)


def _argmax(probs: Sequence[float]) -> int:
    return max(range(len(probs)), key=probs.__getitem__)


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


# -- risk control: a certified threshold (fixed-sequence testing on every row) -------------

RISK_METHOD = "fixed-sequence testing on every row: exact binomial p-values, thresholds strict to loose"
"""`Certificate.method` of a threshold `certify_threshold` certified."""
SPLIT_METHOD = "learn-then-test: binomial p-values, fixed sequence ordered on the fit split"
"""`Certificate.method` of `certify_split` (the split-half test `calibrate --max-error` ran before, kept to compare)."""
Uncertified = Literal["looser", "threshold", "escalate"]
"""What a question gets when its rows cannot certify the bound asked for (`certify_threshold`)."""
UNCERTIFIED: tuple[str, ...] = get_args(Uncertified)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """`P(Binomial(n, p) <= k)`, exact for any n: the terms from the one at `k` down (or, past
    the mean, one minus the upper tail from `k + 1` up), each from its neighbour, until they no
    longer count."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    if k <= n * p:
        return min(1.0, _tail(k, n, p, down=True))
    return min(1.0, max(0.0, 1.0 - _tail(k + 1, n, p, down=False)))


def _tail(i: int, n: int, p: float, *, down: bool) -> float:
    """`sum P(Binomial(n, p) = j)` for j from i down to 0 (`down`) or up to n, i on the far side
    of the mean so that the terms only shrink."""
    q = 1.0 - p
    term = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
                    + (n - i) * math.log1p(-p))
    total = term
    if down:
        odds = q / p
        for j in range(i, 0, -1):
            term *= j / (n - j + 1) * odds
            total += term
            if term <= total * 1e-17:
                break
    else:
        odds = p / q
        for j in range(i, n):
            term *= (n - j) / (j + 1) * odds
            total += term
            if term <= total * 1e-17:
                break
    return total


def binomial_p_value(errors: int, passed: int, max_error: float) -> float:
    """The exact binomial p-value of `H0: error rate > max_error`, from `errors` wrong among
    `passed` answers: `P(Binomial(passed, max_error) <= errors)` (1 when nothing passed). The
    test the one-sided Clopper-Pearson bound inverts (`clopper_pearson_upper`)."""
    return binomial_cdf(errors, passed, max_error)


def clopper_pearson_upper(errors: int, passed: int, confidence: float) -> float:
    """The one-sided Clopper-Pearson upper bound on an error rate: `u` with
    `P(Binomial(passed, u) <= errors) = 1 - confidence` (a hair above: the bisection keeps the
    valid side), so every rate above it is rejected at `1 - confidence`; 1 when `errors == passed`
    (nothing passed, or all of it wrong)."""
    if not 0.0 < confidence < 1.0:
        raise CalibrationError(f"confidence must be within (0, 1), got {confidence}")
    if errors >= passed:
        return 1.0
    delta, lo, hi = 1.0 - confidence, 0.0, 1.0
    for _ in range(64):
        mid = (lo + hi) / 2
        if binomial_cdf(errors, passed, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def rows_needed(max_error: float, confidence: float) -> int:
    """The fewest passed rows that can certify any threshold: all of them right, and
    `(1 - max_error) ** m <= 1 - confidence` (45 for error <= 5 % at 90 %)."""
    _check_risk(max_error, confidence)
    m = math.ceil(math.log(1.0 - confidence) / math.log1p(-max_error))
    return m + ((1.0 - max_error) ** m > 1.0 - confidence)  # in case rounding put the ceiling one short


def start_rows(max_error: float, confidence: float) -> int:
    """The fewest passed rows that could be certified with one of them wrong (77 for error <= 5 %
    at 90 %): where `certify_threshold`'s walk starts by default. It depends on the bound alone,
    never on the rows: stricter starts (`rows_needed`, all right) stop the walk at the first wrong
    answer among the surest reads; looser ones skip thresholds a real question could certify
    (`canvasroute bench --only risk` measures both)."""
    m = rows_needed(max_error, confidence)
    delta, hi = 1.0 - confidence, 2 * m
    while binomial_cdf(1, hi, max_error) > delta:
        hi *= 2
    while m < hi:  # the least m with P(Binomial(m, max_error) <= 1) <= delta (it falls as m grows)
        mid = (m + hi) // 2
        m, hi = (m, mid) if binomial_cdf(1, mid, max_error) <= delta else (mid + 1, hi)
    return m


def _check_risk(max_error: float, confidence: float) -> None:
    if not 0.0 < max_error < 1.0:
        raise CalibrationError(f"max_error must be within (0, 1), got {max_error}")
    if not 0.0 < confidence < 1.0:
        raise CalibrationError(f"confidence must be within (0, 1), got {confidence}")


def candidate_thresholds(scores: Iterable[float]) -> list[float]:
    """The thresholds a certificate may take, strict to loose: the distinct scores (normalized
    entropies, clipped to [0, 1]) ascending, and 1. The order depends on the scores alone, never
    on whether the answers were right."""
    return sorted({min(1.0, max(0.0, s)) for s in scores} | {1.0})


def fixed_sequence(p_values: Iterable[float], delta: float) -> int:
    """Fixed-sequence testing: how many hypotheses, in their given order, are rejected at `delta`
    (the walk stops at the first p-value above it; the iterable is read no further). With the
    order fixed before the data and each p-value valid, the chance of rejecting any true
    hypothesis is at most `delta`, however the p-values depend on each other: the first true one
    must be rejected first, at level `delta`."""
    rejected = 0
    for p in p_values:
        if p > delta:
            break
        rejected += 1
    return rejected


@dataclass(frozen=True, slots=True, kw_only=True)
class RiskFit:
    """A threshold certified for one question (`certify_threshold`), and what the test saw."""

    max_error: float
    """The bound the certificate states: the one asked for (`asked`), or with `fallback="looser"`
    the looser one the rows prove at the first threshold tested."""
    asked: float
    """The bound asked for."""
    confidence: float
    """The probability, over the rows, that the bound holds (for all `family` questions at once)."""
    certified: bool
    """False: no bound was proved; the gate passes nothing (`escalate`) or keeps its own threshold."""
    threshold: float
    """The gate's `max_normalized_entropy`: the certified threshold; with `fallback="threshold"`
    the gate's own (1 when it has none); 0 with `escalate`."""
    rows: int
    """Rows the test ran on (every row of the question)."""
    passed: int
    """Rows `threshold` passes (0 with `escalate`)."""
    errors: int
    """Wrong answers among them."""
    escalation_rate: float
    """Share of the rows the gate does not pass (1 with `escalate`)."""
    p_value: float
    """The certified threshold's p-value at the bound asked for (otherwise that of the first
    threshold tested; 1 when none was)."""
    tested: int
    """Thresholds tested, up to and including the first that failed."""
    rows_needed: int
    """The fewest passed rows, all right, that could certify the bound asked for (`rows_needed`)."""
    note: str
    """What happened, in words."""
    family: int = 1
    """Questions certified together (each tested at `(1 - confidence) / family`)."""
    start: int = 0
    """Rows the first threshold tested passes (0: none was tested)."""
    fallback: Literal["none", "looser", "threshold", "escalate"] = "none"
    """`none`: the bound asked for was certified; otherwise what the question got instead."""
    method: str = RISK_METHOD
    """How it was tested (`Certificate.method`)."""

    @property
    def error_rate(self) -> float | None:
        """Errors over passed rows (None when none passed)."""
        return self.errors / self.passed if self.passed else None

    def certificate(self) -> Certificate:
        """The `Certificate` a gate with this threshold carries."""
        return Certificate(max_error=self.max_error, confidence=self.confidence, rows=self.rows,
                           escalation_rate=self.escalation_rate, certified=self.certified, method=self.method,
                           asked=self.asked if self.fallback == "looser" else None,
                           fallback="threshold" if self.fallback == "threshold" else "escalate", family=self.family)


def _counts(rows: Sequence[tuple[float, bool]]) -> tuple[list[float], list[int]]:
    """Scores in order, and the wrong answers among the first m of them, for every m."""
    ranked = sorted(rows, key=lambda r: r[0])
    wrong = [0]
    for _, ok in ranked:
        wrong.append(wrong[-1] + (not ok))
    return [s for s, _ in ranked], wrong


def certify_threshold(rows: Sequence[tuple[float, bool]], *, max_error: float, confidence: float,
                      candidates: Sequence[float] | None = None, start: int | None = None, family: int = 1,
                      uncertified: Uncertified = "looser", own_threshold: float | None = None) -> RiskFit:
    """The loosest entropy threshold whose passed answers err at most `max_error`, with
    probability at least `confidence` over the draw of `rows`: fixed-sequence testing on every row.

    Rows are `(normalized entropy, answered right)`; a threshold `lam` passes the rows with
    entropy `<= lam`. Its risk `R(lam) = P(wrong | entropy <= lam)` is the error rate of the
    answers it passes (0 when it passes none).

    **One threshold's test.** Of the `m` rows `lam` passes, `k` are wrong. For a `lam` fixed
    before the rows are drawn, given `m` those rows are `m` independent draws of a passed read,
    so `k ~ Binomial(m, R(lam))`, and `p(lam) = P(Binomial(m, max_error) <= k)` is a valid
    p-value for `H0: R(lam) > max_error` given every `m`, so also unconditionally (`m = 0`:
    `p = 1`). It is the exact binomial tail (`binomial_p_value`, the test the Clopper-Pearson
    bound inverts): no approximation is paid for, where Hoeffding's bound is far looser at small
    error rates; betting bounds (Waudby-Smith & Ramdas) pay for validity at every sample size,
    which live audits need and a fixed calibration set does not.

    **The walk.** The candidates are ordered strict to loose before any label is read: the
    rows' distinct entropies and 1 (`candidate_thresholds`), or `candidates`. The walk starts at
    the first candidate passing `start` rows (default `start_rows`: the fewest that could be
    certified with one of them wrong, 77 at 5 % / 90 %; with fewer rows than that, `rows_needed`,
    the fewest that could be certified at all; `start=0`: the first candidate), tests each at
    `delta = (1 - confidence) / family` on every row, and stops at the first `p > delta`; the
    last that passed is certified. No fit split chooses the order, so no row is spent on it.

    **What is exact, and under what condition.** With candidates and start fixed before the
    rows (`candidates=` a grid, `start=0`), this is textbook fixed-sequence testing: the chance
    of certifying any threshold whose risk exceeds `max_error` is at most `delta` whatever `R`
    is, because the first such candidate on the walk must pass its own test first. The default
    candidates and start are the rows' own entropies: chosen without the labels, but not fixed
    in advance. The bound is then exact when `R` does not fall as the threshold loosens (the
    surer a read, the likelier it is right: what gating on entropy presumes) and is continuous:
    the first candidate with `R > max_error` is the first row past the fixed point where `R`
    crosses `max_error`, and the rows it passes are the rows at or below that point, a
    fixed-threshold sample whose risk is `max_error`. Where `R` dips (a band of confidently
    wrong reads) or jumps at a tie, it is not proved; the simulations of tests/test_certified.py
    measure violations below `delta` there too.

    **When nothing passed** (`uncertified`):
    - `looser`: the first threshold tested (with fewer rows than `rows_needed`: the loosest), at
      the error its rows do prove there, the Clopper-Pearson bound at `1 - delta` rounded up,
      which the certificate states beside the bound asked for (`Certificate.asked`). No level is
      spent on it: it is claimed only where the bound asked for failed on that same threshold,
      so either claim failing is the one event "the Clopper-Pearson bound at that threshold is
      below its risk", of probability at most `delta`. Rows that prove nothing there (every one
      wrong) fall back to `threshold`;
    - `threshold`: `own_threshold` (the gate's own), uncertified, and its words say so;
    - `escalate`: the gate passes nothing (threshold 0), every answer escalates.

    **The guarantee, stated.** With probability at least `confidence` over the draw of the rows,
    the expected error rate of the answers the gate passes is at most the stated `max_error`:
    per question; with `family = Q`, for the Q questions at once (Bonferroni, each at
    `delta / Q`). It needs the rows and the live reads to be independent draws from one
    distribution (the same model, engine, prompt, question and traffic); a finite batch of
    passed answers scatters around the rate; drift voids it.

    References: Bauer, "Multiple testing in clinical trials" (1991), fixed-sequence testing;
    Clopper, Pearson, "The use of confidence or fiducial limits illustrated in the case of the
    binomial" (1934); Angelopoulos, Bates, Candès, Jordan, Lei, "Learn then Test: Calibrating
    predictive algorithms to achieve risk control" (2021); Geifman, El-Yaniv, "Selective
    classification for deep neural networks" (2017), the binomial bound on the rows a selective
    threshold passes; Jung, Brahman, Choi, "Trust or Escalate: LLM judges with provable
    guarantees for human agreement" (ICLR 2025), selective answers with an escalation.

    Example:
        ```python
        rows = [(i / 400, i < 200 or i % 4 >= 2) for i in range(400)]  # above 0.5, half are wrong
        fit = certify_threshold(rows, max_error=0.05, confidence=0.9)
        fit.certified, fit.threshold, fit.escalation_rate   # True, 0.5275, 0.47
        ```
    """
    _check_risk(max_error, confidence)
    if isinstance(family, bool) or not isinstance(family, int) or family < 1:
        raise CalibrationError(f"family must be an integer >= 1, got {family!r}")
    if uncertified not in UNCERTIFIED:
        raise CalibrationError(f"uncertified must be one of {', '.join(UNCERTIFIED)}, got {uncertified!r}")
    delta = (1.0 - confidence) / family
    need = rows_needed(max_error, 1.0 - delta)
    scores_, wrong = _counts(rows)
    n = len(scores_)
    if candidates is None:
        cands = candidate_thresholds(scores_)
    else:
        cands = list(candidates)
        if any(not 0.0 <= c <= 1.0 for c in cands) or any(b <= a for a, b in pairwise(cands)):
            raise CalibrationError("candidates must be thresholds within [0, 1], strictly increasing (strict to loose)")
    passes = [bisect.bisect_right(scores_, lam) for lam in cands]
    if start is None:
        start = start_rows(max_error, 1.0 - delta) if n >= start_rows(max_error, 1.0 - delta) else need
    first = next((j for j, m in enumerate(passes) if m >= start), None)

    def p_values() -> Iterator[float]:
        for j in range(first if first is not None else len(cands), len(cands)):
            yield binomial_p_value(wrong[passes[j]], passes[j], max_error)

    certified = fixed_sequence(p_values(), delta)
    tested = certified + (first is not None and first + certified < len(cands))
    words = f"error <= {_percent(max_error)} at {_percent(confidence)}" + (
        f" for {family} questions jointly" if family > 1 else "")
    common: dict[str, Any] = {"asked": max_error, "confidence": confidence, "rows": n, "tested": tested,
                              "rows_needed": need, "family": family,
                              "start": passes[first] if first is not None else 0}
    if first is not None and certified:
        j = first + certified - 1
        m, k = passes[j], wrong[passes[j]]
        p = binomial_p_value(k, m, max_error)
        return RiskFit(**common, max_error=max_error, certified=True, threshold=cands[j], passed=m, errors=k,
                       escalation_rate=1.0 - m / n, p_value=p,
                       note=f"certified {words}: H/lnK <= {cands[j]:.4g} passes {m} of {n} rows, {k} wrong "
                            f"(p = {p:.2g} <= {delta:.2g}; {tested} thresholds tested from the first passing "
                            f"{passes[first]} rows)")
    if first is None:
        at = len(cands) - 1 if cands and n else None  # too few rows to test: the loosest, for `looser`
        p = 1.0
        note = (f"{n} rows: certifying {words} needs at least {need} passed rows, all of them right" if n < need else
                f"no candidate passes the {start} rows the walk starts at ({n} rows)")
    else:
        at = first
        m, k = passes[first], wrong[passes[first]]
        p = binomial_p_value(k, m, max_error)
        note = (f"no threshold passed: the first tested, H/lnK <= {cands[first]:.4g}, passes {m} of {n} rows with "
                f"{k} wrong (p = {p:.2g} > {delta:.2g})")
    if uncertified == "looser" and at is not None:
        m, k = passes[at], wrong[passes[at]]
        bound = min(1.0, math.ceil(clopper_pearson_upper(k, m, 1.0 - delta) * 1e4) / 1e4)  # rounded up: still valid
        if bound < 1.0:  # its rows prove something
            return RiskFit(**common, max_error=bound, certified=True, threshold=cands[at], passed=m, errors=k,
                           escalation_rate=1.0 - m / n, p_value=p, fallback="looser",
                           note=f"{note}; certified instead at the error its rows prove: H/lnK <= {cands[at]:.4g} "
                                f"passes {m} rows, {k} wrong: error <= {_percent(bound)} at {_percent(confidence)}")
    if uncertified in ("threshold", "looser"):  # `looser` without rows that prove anything
        lam = 1.0 if own_threshold is None else own_threshold
        m = bisect.bisect_right(scores_, lam)
        return RiskFit(**common, max_error=max_error, certified=False, threshold=lam, passed=m, errors=wrong[m],
                       escalation_rate=1.0 - m / n if n else 1.0, p_value=p, fallback="threshold",
                       note=f"{note}; the gate keeps its own threshold, uncertified")
    return RiskFit(**common, max_error=max_error, certified=False, threshold=0.0, passed=0, errors=0,
                   escalation_rate=1.0, p_value=p, fallback="escalate", note=f"{note}; the gate passes nothing")


def certify_split(fit: Sequence[tuple[float, bool]], check: Sequence[tuple[float, bool]], *,
                  max_error: float, confidence: float) -> RiskFit:
    """The split-half certificate `certify_threshold` replaces, kept to compare (`bench --only risk`):
    Learn then Test on a split. The candidates are the `fit` rows' entropies (and 1); the
    sequence starts at the candidate with the smallest p-value on the `fit` rows and walks
    looser, testing each at `1 - confidence` on the `check` rows with `binomial_p_value` and
    stopping at the first that fails. The fit rows alone choose the sequence, so the bound holds
    over the check rows whatever `R` is; the price is half the rows. Nothing passed: the gate
    passes nothing."""
    _check_risk(max_error, confidence)
    delta, need = 1.0 - confidence, rows_needed(max_error, confidence)
    fit_scores, fit_wrong = _counts(fit)
    scores_, wrong = _counts(check)
    candidates = candidate_thresholds(fit_scores)

    def evidence(lam: float, ranked: list[float], errs: list[int]) -> tuple[int, int, float]:
        m = bisect.bisect_right(ranked, lam)
        return m, errs[m], binomial_p_value(errs[m], m, max_error)

    on_fit = [evidence(lam, fit_scores, fit_wrong)[2] for lam in candidates]
    begin = min(range(len(candidates)), key=lambda j: (on_fit[j], -j))  # ties: the looser
    n, best, tested = len(check), None, 0
    first: tuple[int, int, float] | None = None
    for lam in candidates[begin:]:
        m, k, p = evidence(lam, scores_, wrong)
        tested += 1
        first = first or (m, k, p)
        if p > delta:
            break
        best = (lam, m, k, p)
    words = f"error <= {_percent(max_error)} at {_percent(confidence)}"
    assert first is not None
    if best is None:
        m, k, p = first
        lam, passed, errors = 0.0, 0, 0
        note = (f"{n} check rows: certifying {words} needs at least {need} passed rows, all of them right"
                if n < need else
                f"no threshold passed: the first tested, H/lnK <= {candidates[begin]:.3g}, passes {m} of {n} "
                f"check rows with {k} wrong (p = {p:.2g} > {delta:.2g})")
    else:
        lam, passed, errors, p = best
        note = (f"certified {words}: H/lnK <= {lam:.3g} passes {passed} of {n} check rows, {errors} wrong "
                f"(p = {p:.2g} <= {delta:.2g}; {tested} thresholds tested)")
    return RiskFit(max_error=max_error, asked=max_error, confidence=confidence, certified=best is not None,
                   threshold=lam, rows=n, passed=passed, errors=errors,
                   escalation_rate=1.0 - passed / n if n else 1.0, p_value=p, tested=tested, rows_needed=need,
                   note=note, start=first[0], fallback="none" if best is not None else "escalate",
                   method=SPLIT_METHOD)


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
    risk: RiskFit | None = None
    """With `max_error`: the certified threshold and what its test saw (None without)."""
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
    rows = list(samples)
    random.Random(seed).shuffle(rows)
    cut = split_sizes(len(rows), holdout)[0]
    return rows[:cut], rows[cut:]


def split_sizes(rows: int, holdout: float = 0.5) -> tuple[int, int]:
    """How many (fit, check) rows `split` makes of `rows` rows (at least one of each, from 2 rows)."""
    if not 0.0 < holdout < 1.0:
        raise CalibrationError(f"holdout must be within (0, 1), got {holdout}")
    cut = min(rows - 1, max(1, round(rows * (1.0 - holdout))))
    return cut, rows - cut


def calibrate(samples: Iterable[Labelled], *, base: GatePolicy | None = None, holdout: float = 0.5, seed: int = 0,
              target_accuracy: float | None = None, target_escalation: float | None = None,
              max_error: float | None = None, confidence: float = 0.9, uncertified: Uncertified = "looser",
              joint: bool = False) -> Calibration:
    """Fit a temperature (and, with a target, a threshold) per question; build the policy.

    Questions with fewer than `MIN_ROWS` rows keep T = 1 and the base threshold. A question the
    rows fit gets a gate of its own, built on the base's gate for it; a `Certificate` that gate
    held speaks for another gate once the fit moved its threshold or temperature, or when the
    question only inherited the base's default gate, and it is dropped.

    With `max_error` the threshold is certified instead (`certify_threshold`, on every row of
    the question): with probability at least `confidence` over its rows, the error rate of the
    answers its gate passes is at most `max_error`. No temperature is fitted (the labels would
    then choose the score the test ranks by): the gate keeps the base's (fit one on other rows
    first, and certify over that policy). Each certified gate reads once (`samples=1`,
    `rereads=0`) and tests `max_normalized_entropy` only, the gate the certificate is about, and
    holds the `Certificate`. A question whose rows cannot certify `max_error` gets what
    `uncertified` says: `looser` (the default) the error its rows do prove at the walk's first
    threshold, stated as such; `threshold` its base gate, uncertified and said so; `escalate` a
    gate that passes nothing. Questions the rows never asked keep their base gate; one without a
    certificate of its own gets one that says it is uncertified (`escalate`: and passes
    nothing). The bound holds per question; `joint=True` makes it hold for all the rows'
    questions at once (each tested at `(1 - confidence) / Q`, Bonferroni).
    """
    base = base or GatePolicy()
    if sum(x is not None for x in (target_accuracy, target_escalation, max_error)) > 1:
        raise CalibrationError("give at most one of target_accuracy, target_escalation and max_error")
    if max_error is not None:
        _check_risk(max_error, confidence)
    if uncertified not in UNCERTIFIED:
        raise CalibrationError(f"uncertified must be one of {', '.join(UNCERTIFIED)}, got {uncertified!r}")
    by_question: dict[str, list[Labelled]] = defaultdict(list)
    for s in samples:
        by_question[s.question_id].append(s)
    if not by_question:
        raise CalibrationError("no labelled rows", hint="check the data file, or --limit")
    if max_error is not None:
        return _certified(by_question, base, max_error, confidence, uncertified, len(by_question) if joint else 1)
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
        old = base.for_question(qid)
        changes: dict[str, Any] = {"temperature": t, "per_question": {}}
        if thr is not None:
            changes["max_normalized_entropy"] = thr.threshold
        gate = replace(old, **changes)
        if gate.certificate is not None and (qid not in base.per_question or gate.temperature != old.temperature
                                             or gate.max_normalized_entropy != old.max_normalized_entropy):
            gate = replace(gate, certificate=None)  # proved on another gate (or the base's default): not this one
        overrides[qid] = gate
    policy = replace(base, per_question={**base.per_question, **overrides})
    return Calibration(questions=results, policy=policy, samples=splits)


_CERTIFIED_GATE: dict[str, Any] = {"samples": 1, "rereads": 0, "reread_above": None, "max_entropy": None,
                                   "min_confidence": None, "min_margin": None, "min_label_mass": None}
"""What a certified gate is, besides its threshold: one read, one test (the reads the rows were)."""


def _certified(by_question: dict[str, list[Labelled]], base: GatePolicy, max_error: float, confidence: float,
               uncertified: Uncertified, family: int) -> Calibration:
    """`calibrate(max_error=...)`: every question's gate certified on all its rows, and the gates
    of the questions the rows never asked marked uncertified."""
    results: dict[str, QuestionCalibration] = {}
    splits: dict[str, tuple[list[Labelled], list[Labelled]]] = {}
    overrides: dict[str, GatePolicy] = {}
    for qid, rows in sorted(by_question.items()):
        gate = base.for_question(qid)
        t = gate.temperature
        _, ok, ent = scores(rows, t)
        risk = certify_threshold(list(zip(ent, ok, strict=True)), max_error=max_error, confidence=confidence,
                                 family=family, uncertified=uncertified, own_threshold=gate.max_normalized_entropy)
        results[qid] = QuestionCalibration(
            question_id=qid, rows=len(rows), fit_rows=0, check_rows=len(rows), temperature=None, threshold=None,
            accuracy=accuracy(rows), ece_before=ece(rows), ece_after=ece(rows, t),
            check_escalation_rate=risk.escalation_rate,
            check_canvas_accuracy=None if risk.error_rate is None else 1.0 - risk.error_rate, risk=risk,
            note=f"T = {t:g}, the base gate's: a certificate needs a score its own rows did not fit")
        splits[qid] = ([], list(rows))
        if risk.fallback == "threshold":
            overrides[qid] = replace(gate, per_question={}, certificate=risk.certificate())
        else:
            overrides[qid] = replace(gate, **_CERTIFIED_GATE, max_normalized_entropy=risk.threshold,
                                     certificate=risk.certificate(), per_question={})
    fallback: Literal["escalate", "threshold"] = "escalate" if uncertified == "escalate" else "threshold"
    unasked = Certificate(max_error=max_error, confidence=confidence, rows=0, escalation_rate=1.0, certified=False,
                          method=RISK_METHOD, fallback=fallback, family=family)

    def marked(gate: GatePolicy) -> GatePolicy:
        """A gate the rows never tested: what an earlier calibration proved about it stands; one
        that holds no certificate says it is uncertified (and, with `escalate`, passes nothing)."""
        if gate.certificate is not None:
            return replace(gate, per_question={})
        if fallback == "escalate":
            return replace(gate, **_CERTIFIED_GATE, max_normalized_entropy=0.0, certificate=unasked, per_question={})
        return replace(gate, certificate=unasked, per_question={})

    kept = {qid: marked(g) for qid, g in base.per_question.items() if qid not in overrides}
    policy = replace(marked(base), per_question={**kept, **overrides})
    return Calibration(questions=results, policy=policy, samples=splits)
