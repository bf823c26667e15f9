"""Figure 12: the certified gate's error against its bound, and what it keeps, on simulated
streams with known truth.

`canvasroute calibrate --max-error A --confidence C` certifies a threshold per question
(`canvasroute.router.calibration.certify_threshold`: fixed-sequence testing over thresholds
ordered strict to loose, the exact binomial p-value, every row): with probability at least C
over the calibration rows, the error rate of the answers the gate passes is at most A. This
section checks that claim where the truth is known, and measures what it costs, beside the
split-half test it replaced (`certify_split`) and the naive threshold, on the same rows.

The generator (one row = one read of one 4-option question):

- a latent difficulty `d ~ U(0, 1)` and a lead option drawn uniformly;
- logits `z_k = lead (1 - d) [k = lead option] + N(0, 0.5^2)`; the gold answer is drawn from
  `softmax(z)` (the truth), the canvas reads `softmax(sharpen z)`;
- so a row's normalized entropy and its chance of being wrong both rise with `d`, and that
  chance is known exactly: `P(wrong) = 1 - softmax(z)[argmax z]`.

Two streams: `overconfident` (lead 7, sharpen 1.5: passing everything errs 20 %, most reads are
easy) and `calibrated` (lead 4.5, sharpen 1: the canvas's probabilities are the truth's; passing
everything errs 30 % and the oracle keeps about a fifth of the reads at 5 %).

Per draw, `n` fresh rows are calibrated four ways: `split` is `certify_split` (the fit half
orders the thresholds, the check half tests them); `all rows` is `certify_threshold` on every
row, escalating everything when uncertified; `all rows, looser` is the same test with
`uncertified="looser"` (an uncertified question keeps the walk's first threshold at the error its
rows prove, so its violations count against that stated bound); `naive` is the loosest threshold
whose rows err at most A, no correction (what `entropy_threshold(target_accuracy=1 - A)` picks). Temperature
is off (T = 1) throughout: the tests see a fixed score. Each threshold is measured on a held-out
pool no calibration saw: its risk (the mean `P(wrong)` of the pool rows it passes: what the bound
is about) and its coverage (the pool share it passes). A violation is a draw whose risk exceeds
the bound its certificate states. Beside them: the oracle's coverage (the loosest threshold whose
pool risk is at most A: what a gate knowing the truth keeps) and the limit (the most coverage one
threshold chosen in advance can expect from a binomial test on all `n` rows: its coverage times
the chance the test certifies it, at the best such threshold).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Any

from canvasroute.router import calibration as cm

from .common import Section

__all__ = ["GATES", "STREAMS", "Pool", "Stream", "measure", "run_risk"]

MAX_ERROR, CONFIDENCE = 0.05, 0.9
OPTIONS = 4
SIZES = (60, 500, 2000)
GATES = ("split", "all rows", "all rows, looser", "naive")
"""The gates each draw calibrates (module docstring)."""


@dataclass(frozen=True, slots=True)
class Stream:
    """The simulated reads (module docstring): `lead` scales how sure an easy read is,
    `sharpen` how overconfident the canvas is (1: calibrated)."""

    lead: float = 7.0
    sharpen: float = 1.5

    def read(self, rng: random.Random) -> tuple[float, bool, float]:
        """One read: its normalized entropy (`cm.normalized_entropy` of the canvas), whether the
        canvas's answer is the gold one, and its true chance of being wrong."""
        d, lead = rng.random(), rng.randrange(OPTIONS)
        z = [rng.gauss(0.0, 0.5) + (self.lead * (1.0 - d) if k == lead else 0.0) for k in range(OPTIONS)]
        truth = _softmax(z)
        canvas = _softmax([self.sharpen * x for x in z])
        top = max(range(OPTIONS), key=canvas.__getitem__)
        u, gold = rng.random(), 0
        while gold < OPTIONS - 1 and u >= truth[gold]:  # the gold answer, drawn from the truth
            u -= truth[gold]
            gold += 1
        return cm.normalized_entropy(canvas), gold == top, 1.0 - truth[top]


STREAMS = {"overconfident": Stream(lead=7.0, sharpen=1.5), "calibrated": Stream(lead=4.5, sharpen=1.0)}


def _softmax(z: list[float]) -> tuple[float, ...]:
    top = max(z)
    w = [math.exp(x - top) for x in z]
    total = sum(w)
    return tuple(x / total for x in w)


class Pool:
    """Held-out rows, by normalized entropy: the risk and coverage of any threshold, the oracle's
    coverage, and the single-threshold limit."""

    def __init__(self, stream: Stream, size: int, rng: random.Random) -> None:
        rows = sorted((score, wrong) for score, _, wrong in (stream.read(rng) for _ in range(size)))
        self.scores = [s for s, _ in rows]
        self.cum = [0.0]
        for _, wrong in rows:
            self.cum.append(self.cum[-1] + wrong)

    def at(self, threshold: float | None) -> tuple[float, float]:
        """(risk of the passed rows, coverage); None passes nothing: (0, 0)."""
        m = bisect.bisect_right(self.scores, threshold) if threshold is not None else 0
        return (self.cum[m] / m if m else 0.0), m / len(self.scores)

    def oracle(self) -> float:
        """The coverage of the loosest threshold whose pool risk is at most the bound."""
        return max((m for m in range(1, len(self.scores) + 1) if self.cum[m] <= MAX_ERROR * m), default=0) / len(
            self.scores)

    def limit(self, n: int, points: int = 40) -> float:
        """The most coverage a threshold chosen in advance can expect from one binomial test on
        `n` rows: `max over thresholds of coverage * P(certified)`, the passed count drawn
        `Binomial(n, coverage)` and its errors `Binomial(passed, risk)`."""
        critical = _critical(n)
        best, size = 0.0, len(self.scores)
        top = max(1, round(self.oracle() * size))
        for i in range(1, points + 1):
            m_pool = max(1, top * i // points)
            c, r = m_pool / size, self.cum[m_pool] / m_pool
            spread = 6.0 * math.sqrt(n * c * (1.0 - c)) + 2.0
            chance = 0.0
            for m in range(max(1, int(n * c - spread)), min(n, int(n * c + spread)) + 1):
                if critical[m] >= 0:
                    chance += _pmf(m, n, c) * cm.binomial_cdf(critical[m], m, r)
            best = max(best, c * chance)
        return best


def _critical(n: int) -> list[int]:
    """For every passed count m up to n, the most errors a binomial test at the bound certifies (-1: none)."""
    delta, k, out = 1.0 - CONFIDENCE, -1, [-1]
    for m in range(1, n + 1):
        while k + 1 < m and cm.binomial_cdf(k + 1, m, MAX_ERROR) <= delta:
            k += 1
        out.append(k)
    return out


def _pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return float(k == (n if p >= 1.0 else 0))
    return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
                    + (n - k) * math.log1p(-p))


def _halves(rows: list[tuple[float, bool]], seed: int) -> tuple[list[tuple[float, bool]], list[tuple[float, bool]]]:
    """A seeded half/half split (as `calibrate` split the rows before)."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[: len(rows) // 2], rows[len(rows) // 2:]


def _naive(rows: list[tuple[float, bool]]) -> float | None:
    """The loosest threshold whose rows err at most the bound, no correction (ties pass together;
    `entropy_threshold(target_accuracy=1 - A)` on the rows' scores); None when none does."""
    ranked, best, wrong = sorted(rows), None, 0
    for k, (score, right) in enumerate(ranked, 1):
        wrong += not right
        if (k == len(ranked) or ranked[k][0] != score) and wrong <= MAX_ERROR * k + 1e-12:
            best = score
    return best


def measure(n: int, draws: int, pool: Pool, stream: Stream, seed: int, name: str = "") -> list[dict[str, Any]]:
    """The four gates (`GATES`) over `draws` calibrations of the same `n` rows each: one result row per gate."""
    rng = random.Random(seed)
    results: dict[str, list[tuple[bool, float, float, float]]] = {g: [] for g in GATES}
    for draw in range(draws):
        rows = [(score, right) for score, right, _ in (stream.read(rng) for _ in range(n))]
        split = cm.certify_split(*_halves(rows, draw), max_error=MAX_ERROR, confidence=CONFIDENCE)
        results["split"].append((split.certified, *pool.at(split.threshold if split.certified else None), MAX_ERROR))
        every = cm.certify_threshold(rows, max_error=MAX_ERROR, confidence=CONFIDENCE, uncertified="looser")
        strict = every.fallback == "none"
        results["all rows"].append((strict, *pool.at(every.threshold if strict else None), MAX_ERROR))
        results["all rows, looser"].append((every.certified, *pool.at(every.threshold if every.certified else None),
                                            every.max_error))
        naive = _naive(rows)
        results["naive"].append((naive is not None, *pool.at(naive), MAX_ERROR))
    oracle, limit = pool.oracle(), pool.limit(n)
    out = []
    for gate, found in results.items():
        risks = sorted(r for _, r, _, _ in found)
        out.append({"stream": name, "rows": n, "gate": gate, "draws": draws,
                    "certified": sum(c for c, _, _, _ in found) / draws,
                    "violations": sum(r > bound + 1e-12 for _, r, _, bound in found) / draws,
                    "allowed": round(1.0 - CONFIDENCE, 9), "mean risk": sum(risks) / draws,
                    "p90 risk": risks[int(0.9 * (draws - 1))], "coverage": sum(c for _, _, c, _ in found) / draws,
                    "oracle": oracle, "limit": limit})
    return out


def run_risk(quick: bool) -> Section:
    section = Section("risk", f"12. Certified gate (error <= {MAX_ERROR:.0%} at {CONFIDENCE:.0%}): violations and "
                              "coverage, every row vs the split half vs naive, simulated streams with known truth",
                      ["stream", "rows", "gate", "draws", "certified", "violations", "allowed", "mean risk",
                       "p90 risk", "coverage", "oracle", "limit"])
    draws, size = (50, 50_000) if quick else (200, 200_000)
    need, first = cm.rows_needed(MAX_ERROR, CONFIDENCE), cm.start_rows(MAX_ERROR, CONFIDENCE)
    for s, (name, stream) in enumerate(STREAMS.items()):
        pool = Pool(stream, size, random.Random(12 + s))
        for i, n in enumerate(SIZES):
            section.rows += measure(n, draws, pool, stream, seed=1000 + 10 * s + i, name=name)
        section.notes.append(f"{name}: passing everything errs {pool.at(1.0)[0]:.1%}; the oracle keeps "
                             f"{pool.oracle():.1%} of the reads at {MAX_ERROR:.0%}")
    section.notes += [
        "certified: share of draws that certified a threshold (naive: that reached one); mean and p90 risk over draws",
        f"violations: share of draws whose passed answers' error rate on the {size:,}-row held-out pool (mean true "
        "P(wrong) of the pool rows they pass) exceeds the bound the certificate states (the looser one, for "
        "`all rows, looser` draws that fell back); allowed: 1 - confidence",
        "coverage: share of the pool the gate passes, mean over draws (an uncertified gate passes nothing); oracle: "
        "the loosest threshold whose pool risk is within the bound; limit: the most coverage one threshold chosen "
        "in advance can expect from a binomial test on all the rows",
        f"split: the check half tests (certifying anything needs {need} passed check rows, all right); all rows: "
        f"every row tests, the walk starting at the threshold passing {first} rows (one may be wrong)",
        "naive: the loosest threshold whose calibration rows err at most the bound, no correction",
    ]
    section.extra.update(max_error=MAX_ERROR, confidence=CONFIDENCE, pool=size, rows_needed=need, start_rows=first,
                         streams={name: {"lead": s.lead, "sharpen": s.sharpen, "options": OPTIONS}
                                  for name, s in STREAMS.items()})
    return section
