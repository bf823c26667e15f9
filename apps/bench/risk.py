"""Figure 12: the certified gate's error against its bound, on a simulated stream with known truth.

`canvasroute calibrate --max-error A --confidence C` certifies a threshold per question
(`canvasroute.router.calibration.certify_threshold`, Learn then Test): with probability at
least C over the calibration rows, the error rate of the answers the gate passes is at most A.
This section checks that claim where the truth is known, beside the naive threshold.

The generator (one row = one read of one 4-option question):

- a latent difficulty `d ~ U(0, 1)` and a lead option drawn uniformly;
- logits `z_k = 7 (1 - d) [k = lead] + N(0, 0.5^2)`; the gold answer is drawn from
  `softmax(z)` (the truth), the canvas reads `softmax(1.5 z)` (overconfident);
- so a row's normalized entropy and its chance of being wrong both rise with `d`, and that
  chance is known exactly: `P(wrong) = 1 - softmax(z)[argmax z]`.

Per draw, `n` fresh rows are calibrated as `calibrate` does (a seeded half/half split: the fit
half orders the thresholds, the check half tests them; temperature off, T = 1, since the test
sees a fixed score either way), and the naive threshold is fitted on all `n` (the loosest whose
passed rows err at most A, no correction: `entropy_threshold(target_accuracy=1 - A)`). Each
threshold is then measured on a held-out pool of rows that no calibration saw: its risk (the
mean `P(wrong)` of the pool rows it passes: the error rate of its passed answers, which is what
the bound is about) and its escalation rate (the pool rows it does not pass; an uncertified gate
escalates all). A violation is a draw whose risk exceeds A; the certified gate's violation
frequency should be at most 1 - C, the naive one's is not bounded. `n` below
`2 rows_needed(A, C)` cannot certify anything (the check half is too small): that row shows
the gate escalating everything rather than claiming a bound.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Any

from canvasroute.router import Labelled
from canvasroute.router import calibration as cm

from .common import Section

__all__ = ["Stream", "run_risk"]

MAX_ERROR, CONFIDENCE = 0.05, 0.9
OPTIONS = 4


@dataclass(frozen=True, slots=True)
class Stream:
    """The simulated reads (module docstring): `lead` scales how sure an easy read is,
    `sharpen` how overconfident the canvas is."""

    lead: float = 7.0
    sharpen: float = 1.5

    def row(self, rng: random.Random) -> tuple[Labelled, float]:
        """One read with its gold answer, and its true chance of being wrong."""
        d, lead = rng.random(), rng.randrange(OPTIONS)
        z = [rng.gauss(0.0, 0.5) + (self.lead * (1.0 - d) if k == lead else 0.0) for k in range(OPTIONS)]
        truth = _softmax(z)
        canvas = _softmax([self.sharpen * x for x in z])
        gold = rng.choices(range(OPTIONS), weights=truth)[0]
        top = max(range(OPTIONS), key=canvas.__getitem__)
        return Labelled(question_id="q", probabilities=canvas, gold=gold), 1.0 - truth[top]


def _softmax(z: list[float]) -> tuple[float, ...]:
    top = max(z)
    w = [math.exp(x - top) for x in z]
    total = sum(w)
    return tuple(x / total for x in w)


class Pool:
    """Held-out rows, by normalized entropy: the risk and escalation rate of any threshold."""

    def __init__(self, stream: Stream, size: int, rng: random.Random) -> None:
        rows = sorted((cm.normalized_entropy(r.probabilities), wrong)
                      for r, wrong in (stream.row(rng) for _ in range(size)))
        self.scores = [s for s, _ in rows]
        self.cum = [0.0]
        for _, wrong in rows:
            self.cum.append(self.cum[-1] + wrong)

    def at(self, threshold: float | None) -> tuple[float, float]:
        """(risk of the passed rows, escalation rate); None passes nothing: (0, 1)."""
        m = bisect.bisect_right(self.scores, threshold) if threshold is not None else 0
        return (self.cum[m] / m if m else 0.0), 1.0 - m / len(self.scores)


def _pairs(rows: list[Labelled]) -> list[tuple[float, bool]]:
    _, ok, ent = cm.scores(rows, 1.0)
    return list(zip(ent, ok, strict=True))


def measure(n: int, draws: int, pool: Pool, stream: Stream, seed: int) -> list[dict[str, Any]]:
    """Both gates over `draws` calibrations of `n` rows: one result row each."""
    rng = random.Random(seed)
    gates: dict[str, list[tuple[bool, float, float]]] = {"certified (LTT)": [], "naive": []}
    for draw in range(draws):
        rows = [stream.row(rng)[0] for _ in range(n)]
        fit, check = cm.split(rows, 0.5, draw)
        risk = cm.certify_threshold(_pairs(fit), _pairs(check), max_error=MAX_ERROR, confidence=CONFIDENCE)
        gates["certified (LTT)"].append((risk.certified, *pool.at(risk.threshold if risk.certified else None)))
        naive = cm.entropy_threshold(rows, 1.0, target_accuracy=1.0 - MAX_ERROR)
        gates["naive"].append((naive.reachable, *pool.at(naive.threshold if naive.reachable else None)))
    out = []
    for name, results in gates.items():
        risks = sorted(r for _, r, _ in results)
        out.append({"rows": n, "gate": name, "draws": draws, "found": sum(c for c, _, _ in results) / draws,
                    "violations": sum(r > MAX_ERROR for r in risks) / draws, "allowed": round(1.0 - CONFIDENCE, 9),
                    "mean risk": sum(risks) / draws, "p90 risk": risks[int(0.9 * (draws - 1))],
                    "escalated": sum(e for _, _, e in results) / draws})
    return out


def run_risk(quick: bool) -> Section:
    section = Section("risk", f"12. Certified gate (error <= {MAX_ERROR:.0%} at {CONFIDENCE:.0%}) vs naive threshold, "
                              "simulated stream with known truth",
                      ["rows", "gate", "draws", "found", "violations", "allowed", "mean risk", "p90 risk",
                       "escalated"])
    stream = Stream()
    draws, size = (50, 50_000) if quick else (200, 200_000)
    pool = Pool(stream, size, random.Random(12))
    need = cm.rows_needed(MAX_ERROR, CONFIDENCE)
    sizes = (60, 500, 2000)
    for i, n in enumerate(sizes):
        section.rows += measure(n, draws, pool, stream, seed=1000 + i)
    full = pool.at(1.0)
    section.notes += [
        "found: share of draws that gave a threshold (certified, for LTT; one the rows reach, for naive); "
        "mean and p90 risk over draws",
        "violations: share of draws whose passed answers' error rate on the held-out pool (mean true P(wrong) of "
        f"the {size:,} pool rows they pass) exceeds {MAX_ERROR:.0%}; allowed: 1 - confidence",
        f"escalated: share of the pool the gate does not pass (an uncertified gate escalates all); passing "
        f"everything errs {full[0]:.1%}",
        f"certifying anything needs {need} passed check rows, all right: {sizes[0]} rows (a {sizes[0] // 2}-row "
        "check half) never certify, and every answer escalates",
        "naive: the loosest threshold whose calibration rows err at most the bound, no correction",
    ]
    section.extra.update(max_error=MAX_ERROR, confidence=CONFIDENCE, pool=size, rows_needed=need,
                         stream={"lead": stream.lead, "sharpen": stream.sharpen, "options": OPTIONS})
    return section
