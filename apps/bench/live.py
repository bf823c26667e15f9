"""`canvasroute bench --only live`: live certification on generated streams with known truth.

The generators (`LiveStream`, seeded): decision i has one question whose canvas read has normalized
entropy `S ~ Uniform(0, 1)`, and its canvas answer disagrees with the labeller (here: is wrong; the
labeller answers the truth) with probability `p_i(S) = min(1, c_i S^2)`. So a threshold `l` passes a
share `l` of the decisions, and their disagreement rate is, exactly,

    r_i(l) = c_i l^2 / 3                     while c_i l^2 <= 1
    r_i(l) = 1 - 2 / (3 l sqrt(c_i))          beyond (where the chance of a disagreement is 1)

- `stationary`: c = 0.6 throughout (r(0.5) = 5 %: the oracle threshold at a 5 % target is 0.5);
- `abrupt`: c = 0.6, then 1.8 from decision `drift` on (r(0.5) jumps to 15 %; the oracle, to 0.25);
- `slow`: c = 0.6 until `drift`, rising linearly to 1.8 over the next `ramp` decisions.

Two runs, side by side:

1. The statistics, over `runs` seeded repetitions per stream: the live state the model uses
   (`InMemoryLiveState`) fed exactly what a deployed gate would see (each decision's coin drawn
   first, its row counted when sampled: an audit if the gate passed it, a free escalated label if
   not), with the labels answered at once. Per run: whether the certified threshold in use ever had a
   true disagreement rate over the target (the guarantee: at most 1 - confidence of the runs on the
   stationary stream), the share of decisions during which it did, the realised disagreement among
   the passed decisions, the coverage (share passed) after 1k and 10k decisions beside the oracle's
   (the loosest candidate whose true rate is within the target), audits per decision, and, after a
   drift, the decisions until the threshold in use is within the target again.
2. End to end, one run of the abrupt stream: 4 `CanvasDecisionModel` workers on one LangGraph store
   (`InMemoryStore`), each with its own `StoreLiveState` (as four processes would), a `FunctionEngine`
   reading each decision's distribution, an instant `ScriptedTarget` answering the truth as target and
   labeller, an escalation budget; audits in the background. Its figures are the same algorithm's
   through every stage of a real decision.

FunctionEngine rows and an instant target: the figures are the algorithm's, not a model's quality.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from langchain_core.decisions import Noul
from langgraph.store.memory import InMemoryStore

from canvasroute.engine import CanvasRead, FunctionEngine
from canvasroute.harness import StoreLiveState
from canvasroute.router import Audit, CanvasDecisionModel, Escalation, EscalationBudget, GatePolicy, InMemoryLiveState
from canvasroute.router._audit import LiveSetting
from canvasroute.router.testing import ScriptedTarget

from .common import Section
from .controller import entropy_probs

__all__ = ["AUDIT", "LiveStream", "RunFigures", "oracle", "run_live", "simulate", "true_rate"]

AUDIT = Audit(rate=0.05, max_error=0.05, confidence=0.9)
"""The audit of the runs (5 % of passed answers audited; certify <= 5 % disagreement at 90 %; the
statistics rows also run it at 20 %)."""
RATES = (0.05, 0.2)
QUESTION = {"urgent": Noul(instructions="Does the customer need an answer within the hour?")}
_TICKET = re.compile(r"ticket (\d+)")


def true_rate(c: float, threshold: float) -> float:
    """The exact disagreement rate of the decisions `threshold` passes at severity `c`."""
    edge = 1.0 / math.sqrt(c)
    if threshold <= edge:
        return c * threshold ** 2 / 3.0
    return (threshold - 2.0 * edge / 3.0) / threshold  # (c e^3 / 3 + l - e) / l with c e^2 = 1


def oracle(c: float, audit: Audit = AUDIT) -> float | None:
    """The loosest candidate threshold whose true rate is within the target at severity `c` (None: none)."""
    fits = [t for t in audit.thresholds if true_rate(c, t) <= audit.max_error]
    return max(fits) if fits else None


@dataclass(frozen=True, slots=True)
class LiveStream:
    """A seeded stream: per decision its score, whether its canvas answer is wrong, its severity."""

    kind: str
    """`stationary`, `abrupt` or `slow`."""
    n: int
    drift: int
    ramp: int = 0
    seed: int = 0
    high: float = 1.8
    """The severity after the drift."""
    scores: list[float] = field(init=False)
    wrong: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        scores = [rng.random() for _ in range(self.n)]
        wrong = [rng.random() < min(1.0, self.severity(i) * s * s) for i, s in enumerate(scores)]
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "wrong", wrong)

    def severity(self, i: int) -> float:
        """c_i: 0.6, then (abrupt) `high` from `drift`, or (slow) rising to `high` over `ramp` decisions."""
        if self.kind == "stationary" or i < self.drift:
            return 0.6
        if self.kind == "abrupt":
            return self.high
        return 0.6 + (self.high - 0.6) * min(1.0, (i - self.drift) / self.ramp)


@dataclass(slots=True)
class RunFigures:
    """What one run of a stream did, per decision: the threshold in use (None: nothing passed)."""

    thresholds: list[float | None]
    passed: list[bool]
    audits: int
    alarms: int


def simulate(stream: LiveStream, audit: Audit = AUDIT, seed: int = 0) -> RunFigures:
    """The live state fed a stream as a deployed gate would feed it (labels answered at once)."""
    state = InMemoryLiveState(replace(audit, seed=seed))
    grid = audit.thresholds
    thresholds: list[float | None] = []
    passed: list[bool] = []
    audits = 0
    for i in range(stream.n):
        index, epoch = state.certified("q")
        threshold = grid[index] if index >= 0 else None
        drawn, ticket = state.draw({"q": LiveSetting(threshold, index, epoch, state.rate("q", free=True), index < 0)})
        score, wrong = stream.scores[i], stream.wrong[i]
        ok = threshold is not None and score <= threshold
        if drawn["q"].sampled:
            audits += ok
            state.enqueue({"q": (score, wrong)}, done=True)
        if ticket is not None:
            ticket.release()
        thresholds.append(threshold)
        passed.append(ok)
    return RunFigures(thresholds, passed, audits, state.counts["alarms"])


def _violating(stream: LiveStream, run: RunFigures, audit: Audit) -> list[bool]:
    return [t is not None and true_rate(stream.severity(i), t) > audit.max_error for i, t in enumerate(run.thresholds)]


def _coverage(run: RunFigures, at: int) -> float | None:
    """The share the threshold in use at decision `at` passes (Uniform scores: the threshold itself)."""
    if at > len(run.thresholds):
        return None
    t = run.thresholds[at - 1]
    return t if t is not None else 0.0


def _to_tighten(stream: LiveStream, violating: Sequence[bool]) -> int | None:
    """Decisions from the first violating one after the drift until the threshold in use is within the
    target again and stays so to the end (None: never)."""
    first = next((i for i in range(stream.drift, stream.n) if violating[i]), None)
    if first is None:
        return 0
    last = max(i for i in range(first, stream.n) if violating[i])
    return None if last == stream.n - 1 else last + 1 - first


def _row(kind: str, stream_args: dict[str, int], runs: int, audit: Audit) -> dict[str, object]:
    ever, share, realised, cov1, cov10, audits, tighten, alarms, first = [], [], [], [], [], [], [], [], []
    worst = []
    for r in range(runs):
        stream = LiveStream(kind, seed=1000 + r, **stream_args)
        run = simulate(stream, audit, seed=r)
        bad = _violating(stream, run, audit)
        worst.append(max((true_rate(stream.severity(i), t) for i, t in enumerate(run.thresholds) if t is not None),
                         default=0.0))
        ever.append(any(bad))
        share.append(sum(bad) / stream.n)
        passed = sum(run.passed)
        realised.append(sum(w for w, p in zip(stream.wrong, run.passed, strict=True) if p) / passed if passed else 0.0)
        cov1.append(_coverage(run, 1000))
        cov10.append(_coverage(run, 10_000))
        audits.append(run.audits / stream.n)
        alarms.append(run.alarms)
        first.append(next((i for i, t in enumerate(run.thresholds) if t is not None), None))
        if kind != "stationary":
            tighten.append(_to_tighten(stream, bad))
    before, after = oracle(0.6, audit), oracle(1.8, audit)
    done = [t for t in tighten if t is not None]
    return {
        "stream": kind, "audit rate": audit.rate, "runs": runs,
        "ever over target": round(sum(ever) / runs, 3),
        "worst true rate": round(statistics.median(worst), 4),
        "time over target": round(statistics.fmean(share), 4),
        "realised error": round(statistics.fmean(realised), 4),
        "coverage 1k": _mean(cov1), "coverage 10k": _mean(cov10),
        "oracle": f"{before:g}" if kind == "stationary" else f"{before:g} -> {after:g}",
        "first certified": _median([f for f in first if f is not None]),
        "audits/decision": round(statistics.fmean(audits), 4),
        "alarms": round(statistics.fmean(alarms), 2),
        "to tighten": (_median(done) if done else None) if kind != "stationary" else None,
        "never tightened": (len(tighten) - len(done)) if kind != "stationary" else None,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return round(statistics.fmean(found), 3) if found else None


def _median(values: Sequence[int]) -> int | None:
    return round(statistics.median(values)) if values else None


# -- end to end --------------------------------------------------------------------------------


def stream_engine(stream: LiveStream) -> FunctionEngine:
    """Reads "ticket i" as the stream says: a yes/no distribution with normalized entropy S_i, its mass
    on the wrong option when decision i's canvas answer is wrong (the truth is always `yes`)."""
    def rows(read: CanvasRead) -> list[dict[int, float]]:
        found = _TICKET.search(read.messages[-1]["content"])
        assert found is not None, "the live stream engine reads states 'ticket <i>'"
        i = int(found.group(1))
        yes, no = entropy_probs(stream.scores[i], 2, 1 if stream.wrong[i] else 0)
        return [{engine.token_id("yes"): math.log(max(yes, 1e-12)),
                 engine.token_id("no"): math.log(max(no, 1e-12))}] * len(read.slots)

    engine = FunctionEngine(rows, model="live-stream", keep_reads=False)
    return engine


async def end_to_end(stream: LiveStream, audit: Audit, workers: int,
                     budget: EscalationBudget) -> tuple[dict[str, object], dict[str, int]]:
    """`workers` models on one `InMemoryStore`, each its own `StoreLiveState`, taking the stream's
    decisions in turn, concurrently; the target answers the truth (`yes`). The row's figures, and the
    budget's (granted, refused: escalations and audits; audits dropped for it)."""
    store = InMemoryStore()
    models, states = [], []
    for _ in range(workers):
        state = StoreLiveState(store, audit, scope="bench")
        states.append(state)
        escalation = Escalation(ScriptedTarget(script={"urgent": "yes"}), audit=audit, audit_state=state,
                                budget=budget)
        models.append(CanvasDecisionModel(engine=stream_engine(stream), escalate_to=escalation,
                                          policy=GatePolicy(max_normalized_entropy=0.5, rereads=0)))
    thresholds: list[float | None] = [None] * stream.n
    passed = [False] * stream.n
    turn = iter(range(stream.n))
    gate = re.compile(r"H/lnK <= ([0-9.]+) \(certified live")

    async def worker(model: CanvasDecisionModel) -> None:
        for i in turn:
            report = (await model.adecide(f"ticket {i}", QUESTION)).reads["urgent"]
            found = gate.match(report.gate or "")
            thresholds[i] = float(found.group(1)) if found else None
            passed[i] = report.confident

    start = time.perf_counter()
    await asyncio.gather(*(worker(m) for m in models))
    for state in states:
        await state.drain()
    seconds = time.perf_counter() - start
    bad = [t is not None and true_rate(stream.severity(i), t) > audit.max_error for i, t in enumerate(thresholds)]
    counted = sum(passed)
    counts = [s.counts for s in states]
    meters = [m.budget_counters for m in models]
    spent = {"granted": sum(m["granted"] for m in meters), "refused": sum(m["refused"] for m in meters),
             "dropped_budget": sum(c["dropped_budget"] for c in counts)}
    return {
        "stream": f"{stream.kind} (end to end, {workers} workers)", "audit rate": audit.rate, "runs": 1,
        "ever over target": float(any(bad)),
        "worst true rate": round(max((true_rate(stream.severity(i), t) for i, t in enumerate(thresholds)
                                      if t is not None), default=0.0), 4),
        "time over target": round(sum(bad) / stream.n, 4),
        "realised error": round(sum(w for w, p in zip(stream.wrong, passed, strict=True) if p) / counted, 4)
        if counted else 0.0,
        "coverage 1k": _coverage(RunFigures(thresholds, passed, 0, 0), 1000),
        "coverage 10k": _coverage(RunFigures(thresholds, passed, 0, 0), 10_000),
        "oracle": f"{oracle(0.6, audit):g} -> {oracle(1.8, audit):g}",
        "first certified": next((i for i, t in enumerate(thresholds) if t is not None), None),
        "audits/decision": round(sum(c["audits"] for c in counts) / stream.n, 4),
        "alarms": sum(c["alarms"] for c in counts),
        "to tighten": _to_tighten(stream, bad),
        "never tightened": None,
        "dec/s": round(stream.n / seconds),
    }, spent


def run_live(quick: bool) -> Section:
    runs, n, drift, ramp = (6, 12_000, 6_000, 3_000) if quick else (25, 30_000, 10_000, 10_000)
    e2e_n = 8_000 if quick else 20_000
    audit = AUDIT
    budget = EscalationBudget(max_per_window=100_000, window_s=3600)
    section = Section("live", "15. Live certification on generated streams with known truth: target <= 5 % "
                      "disagreement at 90 %, 5 % or 20 % of passed answers audited",
                      ["stream", "audit rate", "runs", "ever over target", "worst true rate", "time over target",
                       "realised error", "coverage 1k", "coverage 10k", "oracle", "first certified", "audits/decision",
                       "alarms", "to tighten", "never tightened"])
    router_log = logging.getLogger("canvasroute.router")
    level = router_log.level
    router_log.setLevel(logging.ERROR)  # the simulated drift alarms are counted in the rows, not logged
    try:
        for rate in RATES:
            for kind in ("stationary", "abrupt", "slow"):
                section.rows.append(_row(kind, {"n": n, "drift": drift, "ramp": ramp}, runs,
                                         replace(audit, rate=rate)))
    finally:
        router_log.setLevel(level)
    e2e, budget_figures = asyncio.run(end_to_end(LiveStream("abrupt", e2e_n, e2e_n // 2, seed=7), audit, 4, budget))
    section.rows.append(e2e)
    section.extra.update({"audit": {"rate": audit.rate, "max_error": audit.max_error, "confidence": audit.confidence,
                                    "alarm": audit.alarm, "thresholds": list(audit.thresholds)},
                          "streams": {"n": n, "drift_at": drift, "ramp": ramp, "runs": runs, "end_to_end_n": e2e_n},
                          "end_to_end_budget": {"max_per_window": budget.max_per_window, "window_s": budget.window_s,
                                                **budget_figures}})
    section.notes += [
        "generators: S ~ Uniform(0,1) per decision; the canvas answer disagrees with the labeller with probability "
        "min(1, c S^2); stationary c = 0.6 (oracle threshold 0.5 at 5 %); abrupt c 0.6 -> 1.8 at decision "
        f"{drift} (oracle 0.5 -> 0.25); slow: c rising linearly 0.6 -> 1.8 over decisions {drift}..{drift + ramp}; "
        f"{n} decisions per run, {runs} seeded runs per stream; the end-to-end run: {e2e_n} decisions, drift at "
        f"{e2e_n // 2}",
        "'ever over target' = share of runs in which the certified threshold in use had, at some decision, a true "
        "disagreement rate over 5 % (the guarantee: <= 10 % of the runs on the stationary stream; after a drift it "
        "measures the detection delay, not a failure of the bound); 'worst true rate' = median over runs of the "
        "highest true rate a threshold in use had; 'time over target' = share of decisions gated at a threshold "
        "over the target; 'realised error' = disagreement among the decisions the gate passed",
        "coverage = share of decisions the threshold in use passes after 1k and 10k decisions (0 while nothing is "
        "certified; the scores are uniform, so it is the threshold), beside the oracle's; 'first certified' = "
        "median decision at which a threshold was first certified (every answer escalates before, its label "
        "free); audits/decision = labeller calls for passed answers per decision",
        "'to tighten' = median decisions from the first decision after the drift gated at a threshold over the "
        "target until the threshold in use is within it and stays so (an e-CUSUM alarm resets the question, or the "
        "e-value itself loses the threshold); 'never tightened' = runs where that did not happen by the end",
        "end to end: 4 CanvasDecisionModel workers on one InMemoryStore (StoreLiveState each, sync_every=4), "
        "FunctionEngine rows, an instant ScriptedTarget answering the truth (target and labeller), audits in the "
        f"background (5 % audit rate); escalation budget {budget.max_per_window} per {budget.window_s:g} s: "
        f"{budget_figures['granted']} granted (escalations and audits), {budget_figures['refused']} refused; "
        "the figures are the algorithm's, not a model's quality",
    ]
    return section
