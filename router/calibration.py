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
  the loosest threshold for which, with probability at least C over the check rows, the
  error rate of the answers the gate passes is at most A (Learn then Test:
  `certify_threshold` states the test and the exact guarantee, and cites the papers). Too
  few rows to certify anything: the gate passes nothing rather than claim a bound. The gate
  holds the proof as a `Certificate`.

The result is a `GatePolicy` with a `per_question` override per calibrated question,
written and read as JSON by `save_policy` / `load_policy` (`router._policy_file`).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from canvasroute.engine.errors import CalibrationError

from ._policy import Certificate, GatePolicy, _percent

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


# -- risk control: a certified threshold (Learn then Test) -------------------------------

RISK_METHOD = "learn-then-test: binomial p-values, fixed sequence ordered on the fit split"
"""`Certificate.method` of a threshold `certify_threshold` certified."""


def binomial_cdf(k: int, n: int, p: float) -> float:
    """`P(Binomial(n, p) <= k)`, summed in log space (exact for any n)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq, top = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms = [top - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    peak = max(terms)
    return min(1.0, math.exp(peak) * sum(math.exp(t - peak) for t in terms))


def rows_needed(max_error: float, confidence: float) -> int:
    """The fewest passed rows that can certify any threshold: all of them right, and
    `(1 - max_error) ** m <= 1 - confidence` (45 for error <= 5 % at 90 %)."""
    _check_risk(max_error, confidence)
    m = math.ceil(math.log(1.0 - confidence) / math.log1p(-max_error))
    return m + ((1.0 - max_error) ** m > 1.0 - confidence)  # in case rounding put the ceiling one short


def _check_risk(max_error: float, confidence: float) -> None:
    if not 0.0 < max_error < 1.0:
        raise CalibrationError(f"max_error must be within (0, 1), got {max_error}")
    if not 0.0 < confidence < 1.0:
        raise CalibrationError(f"confidence must be within (0, 1), got {confidence}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RiskFit:
    """A threshold certified for one question (`certify_threshold`), and what the test saw."""

    max_error: float
    """The bound asked for: the error rate of the answers the gate passes."""
    confidence: float
    """The probability, over the check rows, that the bound holds."""
    certified: bool
    """False: no threshold passed the test; the gate passes nothing."""
    threshold: float
    """The certified `max_normalized_entropy`: the loosest threshold that passed (0 when none did)."""
    rows: int
    """Check rows the test ran on."""
    passed: int
    """Check rows the certified threshold passes (0 when uncertified)."""
    errors: int
    """Wrong answers among them."""
    escalation_rate: float
    """Share of the check rows the certified gate does not pass (1 when uncertified)."""
    p_value: float
    """The certified threshold's p-value (uncertified: that of the first threshold tested)."""
    tested: int
    """Thresholds tested, up to and including the first that failed."""
    rows_needed: int
    """The fewest passed rows, all right, that could certify anything (`rows_needed`)."""
    note: str
    """What happened, in words."""

    @property
    def error_rate(self) -> float | None:
        """Errors over passed check rows (None when none passed)."""
        return self.errors / self.passed if self.passed else None

    def certificate(self) -> Certificate:
        """The `Certificate` a gate with this threshold carries."""
        return Certificate(max_error=self.max_error, confidence=self.confidence, rows=self.rows,
                           escalation_rate=self.escalation_rate, certified=self.certified, method=RISK_METHOD)


def _counts(rows: Sequence[tuple[float, bool]]) -> tuple[list[float], list[int]]:
    """Scores in order, and the wrong answers among the first m of them, for every m."""
    ranked = sorted(rows, key=lambda r: r[0])
    wrong = [0]
    for _, ok in ranked:
        wrong.append(wrong[-1] + (not ok))
    return [s for s, _ in ranked], wrong


def certify_threshold(fit: Sequence[tuple[float, bool]], check: Sequence[tuple[float, bool]], *,
                      max_error: float, confidence: float) -> RiskFit:
    """The loosest entropy threshold whose passed answers err at most `max_error`, with
    probability at least `confidence` over the `check` rows (Learn then Test).

    Rows are `(normalized entropy, answered right)`; a threshold `lam` passes the rows with
    entropy `<= lam`. Its risk is `R(lam) = P(wrong | entropy <= lam)`, the error rate of the
    answers it passes (0 when it passes none). The test of one threshold: of the `m` check rows
    it passes, `k` are wrong; given `m`, those rows are `m` independent draws of a passed read,
    so `k ~ Binomial(m, R(lam))`, and `p(lam) = P(Binomial(m, max_error) <= k)` is a valid
    p-value for `H0: R(lam) > max_error` given every `m`, so also unconditionally (`m = 0`:
    `p = 1`). The candidates are the fit rows' entropies (and 1); the sequence starts at the
    candidate with the smallest p-value on the fit rows and walks looser, testing each at
    `delta = 1 - confidence` on the check rows and stopping at the first `p > delta`. The fit
    rows alone choose the sequence, so fixed-sequence testing holds the family-wise error at
    `delta` whatever the dependence between the p-values: with probability at least
    `confidence`, every threshold that passed has `R(lam) <= max_error`, the loosest (the one
    returned) included. No threshold passed: `certified=False` (the gate passes nothing).

    The guarantee needs the check rows and the live reads to be independent draws from one
    distribution, independent of the fit rows; it is about the expected error rate of the
    passed answers (a finite batch of them scatters around it), for this question alone.

    References: Angelopoulos, Bates, Candès, Jordan, Lei, "Learn then Test: Calibrating
    predictive algorithms to achieve risk control" (2021), fixed-sequence testing; Bates,
    Angelopoulos, Lei, Malik, Jordan, "Distribution-free, risk-controlling prediction sets"
    (2021), the binomial tail bound; Laufer-Goldshtein, Fisch, Barzilay, Jaakkola, "Efficiently
    controlling multiple risks with Pareto Testing" (2023), the sequence chosen on a split of its
    own; Jung, Brahman, Choi, "Trust or Escalate: LLM judges with provable guarantees for human
    agreement" (ICLR 2025), selective answers with an escalation.

    Example:
        ```python
        rows = [(i / 400, i < 200 or i % 4 >= 2) for i in range(400)]  # above 0.5, half are wrong
        fit = certify_threshold(rows[::2], rows[1::2], max_error=0.05, confidence=0.9)
        fit.certified, fit.threshold, fit.escalation_rate   # True, 0.51, 0.49
        ```
    """
    _check_risk(max_error, confidence)
    delta, need = 1.0 - confidence, rows_needed(max_error, confidence)
    fit_scores, fit_wrong = _counts(fit)
    scores_, wrong = _counts(check)
    candidates = sorted({min(1.0, max(0.0, s)) for s in fit_scores} | {1.0})

    def evidence(lam: float, ranked: list[float], errs: list[int]) -> tuple[int, int, float]:
        m = bisect.bisect_right(ranked, lam)
        return m, errs[m], binomial_cdf(errs[m], m, max_error)

    on_fit = [evidence(lam, fit_scores, fit_wrong)[2] for lam in candidates]
    start = min(range(len(candidates)), key=lambda j: (on_fit[j], -j))  # ties: the looser
    n, best, tested = len(check), None, 0
    first: tuple[int, int, float] | None = None
    for lam in candidates[start:]:
        m, k, p = evidence(lam, scores_, wrong)
        tested += 1
        first = first or (m, k, p)
        if p > delta:
            break
        best = (lam, m, k, p)
    words = f"error <= {_percent(max_error)} at {_percent(confidence)}"
    if best is None:
        assert first is not None
        m, k, p = first
        lam, passed, errors = 0.0, 0, 0
        note = (f"{n} check rows: certifying {words} needs at least {need} passed rows, all of them right"
                if n < need else
                f"no threshold passed: the first tested, H/lnK <= {candidates[start]:.3g}, passes {m} of {n} "
                f"check rows with {k} wrong (p = {p:.2g} > {delta:.2g})")
    else:
        lam, passed, errors, p = best
        note = (f"certified {words}: H/lnK <= {lam:.3g} passes {passed} of {n} check rows, {errors} wrong "
                f"(p = {p:.2g} <= {delta:.2g}; {tested} thresholds tested)")
    return RiskFit(max_error=max_error, confidence=confidence, certified=best is not None, threshold=lam, rows=n,
                   passed=passed, errors=errors, escalation_rate=1.0 - passed / n if n else 1.0, p_value=p,
                   tested=tested, rows_needed=need, note=note)


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


def rows_for_check(check: int, holdout: float = 0.5) -> int:
    """The fewest labelled rows whose `split` leaves at least `check` check rows (what a
    certificate's `rows_needed` asks of the whole data set)."""
    rows = max(2, check)
    while split_sizes(rows, holdout)[1] < check:
        rows += 1
    return rows


def calibrate(samples: Iterable[Labelled], *, base: GatePolicy | None = None, holdout: float = 0.5, seed: int = 0,
              target_accuracy: float | None = None, target_escalation: float | None = None,
              max_error: float | None = None, confidence: float = 0.9) -> Calibration:
    """Fit a temperature (and, with a target, a threshold) per question; build the policy.

    Questions with fewer than `MIN_ROWS` rows keep T = 1 and the base threshold.

    With `max_error` the threshold is certified instead (`certify_threshold`): per question,
    with probability at least `confidence` over its check rows, the error rate of the answers
    its gate passes is at most `max_error`. The temperature is then fitted and checked on the
    fit split alone (halved), so nothing the test sees chose the score it tests. Each
    question's gate reads once (`samples=1`, `rereads=0`) and tests `max_normalized_entropy`
    only, the gate the certificate is about, and holds the `Certificate`; a question whose rows
    certify nothing, and the policy's base gate (questions the rows never asked), hold
    `Certificate(certified=False)` and pass nothing. The bound holds per question: for all Q
    questions at once, ask each for `1 - (1 - confidence) / Q` (Bonferroni).
    """
    base = base or GatePolicy()
    if sum(x is not None for x in (target_accuracy, target_escalation, max_error)) > 1:
        raise CalibrationError("give at most one of target_accuracy, target_escalation and max_error")
    if max_error is not None:
        _check_risk(max_error, confidence)
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
        if max_error is not None:
            results[qid], splits[qid], overrides[qid] = _certify(qid, rows, base.for_question(qid), holdout, seed,
                                                                 max_error, confidence)
            continue
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
    if max_error is not None:
        nobody = Certificate(max_error=max_error, confidence=confidence, rows=0, escalation_rate=1.0, certified=False,
                             method=RISK_METHOD)
        # every question the rows did not certify passes nothing, those the base policy named too
        base = replace(base, **_CERTIFIED_GATE, max_normalized_entropy=0.0, certificate=nobody, per_question={})
    policy = replace(base, per_question={**base.per_question, **overrides})
    return Calibration(questions=results, policy=policy, samples=splits)


_CERTIFIED_GATE: dict[str, Any] = {"samples": 1, "rereads": 0, "reread_above": None, "max_entropy": None,
                                   "min_confidence": None, "min_margin": None, "min_label_mass": None}
"""What a certified gate is, besides its threshold: one read, one test (the reads the rows were)."""


def _certify(qid: str, rows: list[Labelled], base: GatePolicy, holdout: float, seed: int, max_error: float,
             confidence: float) -> tuple[QuestionCalibration, tuple[list[Labelled], list[Labelled]], GatePolicy]:
    """One question's certified gate: temperature on the fit split, the test on the check split."""
    fit, check = split(rows, holdout, seed) if len(rows) >= 2 else ([], list(rows))
    tfit = None
    if len(fit) >= MIN_ROWS:
        tfit = fit_temperature(*split(fit, 0.5, seed))
    t = tfit.temperature if tfit else 1.0

    def pairs(part: Sequence[Labelled]) -> list[tuple[float, bool]]:
        _, ok, ent = scores(part, t)
        return list(zip(ent, ok, strict=True))

    risk = certify_threshold(pairs(fit), pairs(check), max_error=max_error, confidence=confidence)
    note = "" if tfit else f"fewer than {MIN_ROWS} fit rows: T = 1"
    result = QuestionCalibration(
        question_id=qid, rows=len(rows), fit_rows=len(fit), check_rows=len(check), temperature=tfit, threshold=None,
        accuracy=accuracy(rows), ece_before=ece(check), ece_after=ece(check, t),
        check_escalation_rate=risk.escalation_rate,
        check_canvas_accuracy=None if risk.error_rate is None else 1.0 - risk.error_rate, risk=risk, note=note)
    gate = replace(base, **_CERTIFIED_GATE, temperature=t, max_normalized_entropy=risk.threshold,
                   certificate=risk.certificate(), per_question={})
    return result, (fit, check), gate
