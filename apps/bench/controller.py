"""`canvasroute bench --only controller`: an escalation-rate controller holding its target after a drift.

The stream (`DriftStream`, seeded, its ground truth known): decision i asks two questions about
"ticket i", `urgent` (a Noul) and `team` (a 3-option Choice, its true option drawn uniformly).
The canvas's normalized entropy for each question is drawn from a Beta distribution whose mean
shifts at decision `drift`: `urgent` Beta(3, 7) -> Beta(5, 5) (mean 0.3 -> 0.5: harder tickets),
`team` Beta(5, 5) -> Beta(3, 6) (mean 0.5 -> 0.33: easier ones). The engine
(`FunctionEngine`) reads each slot as a distribution with exactly that normalized entropy,
its mass on the true option. Each question's base threshold is its pre-drift stream's
(1 - target) quantile, as a calibration on the old traffic would set it; after the drift the
ideal threshold is the post-drift stream's quantile, known from the generator.

Four workers on ONE real LangGraph store (`InMemoryStore`), concurrently, each its own
`CanvasDecisionModel` over its own engine, escalating to an instant `ScriptedTarget`, each with
its own `StoreControllerState` in one scope, as four processes would each make one; the
workers take the stream's decisions in turn. The same stream without the controller runs
beside it. One read per question (`rereads=0`): the gate's verdict is the threshold's.

Per question and run: the realised escalation rate over the `window` decisions before the
drift and over the last `window`; the decisions after the drift until the rate over the last
`window` decisions after it is within +-2 points of the target and stays there to the end, and
until a decision is gated within 0.02 of the ideal threshold; the escalations the drift cost
beyond the target; the threshold the controller ended at, beside the ideal.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from langchain_core.decisions import Choice, Noul
from langgraph.store.memory import InMemoryStore

from canvasroute.engine import CanvasRead, FunctionEngine
from canvasroute.harness import StoreControllerState
from canvasroute.router import CanvasDecisionModel, Controller, Escalation, GatePolicy
from canvasroute.router.testing import ScriptedTarget

from .common import Section

__all__ = ["QUESTIONS", "DriftStream", "StreamRun", "entropy_probs", "off_windows", "reached", "run_controller",
           "run_stream", "settled", "stream_engine"]

QUESTIONS = {"urgent": Noul(instructions="Does the customer need an answer within the hour?"),
             "team": Choice(instructions="Which team owns this ticket?",
                            criteria={"billing": None, "technical": None, "account": None})}
"""The two questions of every decision."""
SHAPES = {"urgent": ((3.0, 7.0), (5.0, 5.0)), "team": ((5.0, 5.0), (3.0, 6.0))}
"""Each question's Beta (a, b) before and after the drift."""
_TICKET = re.compile(r"ticket (\d+)")
_GATE = re.compile(r"H/lnK <= ([0-9.]+)")


def entropy_probs(h: float, k: int, top: int = 0) -> list[float]:
    """A distribution over `k` options with normalized entropy `h` (0..1): mass p on option
    `top`, the rest shared evenly (p found by bisection; the entropy falls as p grows)."""
    def entropy(p: float) -> float:
        rest = (1.0 - p) / (k - 1)
        terms = [p, *([rest] * (k - 1))]
        return -math.fsum(q * math.log(q) for q in terms if q > 0) / math.log(k)

    low, high = 1.0 / k, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if entropy(mid) > h else (low, mid)
    p = (low + high) / 2
    return [p if i == top else (1.0 - p) / (k - 1) for i in range(k)]


@dataclass(frozen=True, slots=True)
class DriftStream:
    """The seeded stream: each decision's normalized entropy and true option, per question."""

    n: int
    """Decisions in the stream."""
    drift: int
    """The first decision drawn from the shifted distributions."""
    seed: int = 0
    shapes: dict[str, tuple[tuple[float, float], tuple[float, float]]] = field(default_factory=lambda: dict(SHAPES))
    entropy: dict[str, list[float]] = field(init=False)
    truth: dict[str, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        entropy: dict[str, list[float]] = {}
        truth: dict[str, list[int]] = {}
        for qid, (before, after) in self.shapes.items():
            k = 2 if isinstance(QUESTIONS.get(qid), Noul) else 3
            entropy[qid] = [rng.betavariate(*(before if i < self.drift else after)) for i in range(self.n)]
            truth[qid] = [rng.randrange(k) for _ in range(self.n)]
        object.__setattr__(self, "entropy", entropy)
        object.__setattr__(self, "truth", truth)

    def quantile(self, qid: str, q: float, after: bool) -> float:
        """The `q` quantile of a question's normalized entropy before (or after) the drift."""
        values = sorted(self.entropy[qid][self.drift:] if after else self.entropy[qid][:self.drift])
        return values[min(len(values) - 1, int(q * len(values)))]


def stream_engine(stream: DriftStream) -> FunctionEngine:
    """A `FunctionEngine` reading "ticket i" as the stream says: every slot's row carries each
    question's labels (yes/no for `urgent`, A/B/C for `team`) with decision i's distribution."""
    def rows(read: CanvasRead) -> list[dict[int, float]]:
        found = _TICKET.search(read.messages[-1]["content"])
        assert found is not None, "the stream engine reads states 'ticket <i>'"
        i = int(found.group(1))
        row: dict[int, float] = {}
        for qid, labels in (("urgent", ("yes", "no")), ("team", ("A", "B", "C"))):
            probs = entropy_probs(stream.entropy[qid][i], len(labels), stream.truth[qid][i])
            row.update({engine.token_id(label): math.log(max(p, 1e-12))
                        for label, p in zip(labels, probs, strict=True)})
        return [row] * len(read.slots)

    engine = FunctionEngine(rows, model="drift-stream", keep_reads=False)
    return engine


def settled(escalated: Sequence[bool], drift: int, target: float, window: int, tolerance: float = 0.02) -> int | None:
    """Decisions after `drift` until the realised rate over the last `window` decisions after the
    drift (all of them, while fewer) is within `tolerance` of `target` and stays there to the end
    (None: it never does). Only decisions after the drift count: the old traffic cannot dilute it."""
    last_out, total = None, 0
    for t in range(drift, len(escalated)):
        total += escalated[t] - (escalated[t - window] if t - window >= drift else 0)
        if abs(total / min(window, t - drift + 1) - target) > tolerance:
            last_out = t
    if last_out is None:
        return 0
    return None if last_out == len(escalated) - 1 else last_out + 1 - drift


def reached(thresholds: Sequence[float], drift: int, ideal: float, within: float = 0.02) -> int | None:
    """Decisions after `drift` until a decision is gated within `within` of the `ideal` threshold."""
    return next((t - drift for t in range(drift, len(thresholds)) if abs(thresholds[t] - ideal) <= within), None)


def off_windows(escalated: Sequence[bool], start: int, target: float, window: int, tolerance: float = 0.02) -> float:
    """Share of the `window`-decision windows ending after `start` whose rate is off `target` by more
    than `tolerance` (one window per decision)."""
    total, off, count = sum(escalated[start - window:start]), 0, 0
    for t in range(start, len(escalated)):
        total += escalated[t] - escalated[t - window]
        off += abs(total / window - target) > tolerance
        count += 1
    return off / count if count else 0.0


@dataclass(slots=True)
class StreamRun:
    """What the workers did with a stream: per question and decision, whether the gate did not
    pass it and the threshold it was held to."""

    escalated: dict[str, list[bool]]
    thresholds: dict[str, list[float]]
    seconds: float
    syncs: int
    """Reads of the store, over every worker."""


async def run_stream(stream: DriftStream, base: dict[str, float], controller: Controller | None,
                     workers: int) -> StreamRun:
    """`workers` models on one `InMemoryStore`, each with its own `StoreControllerState` (none
    without a controller), taking the stream's decisions in turn, concurrently; gated at `base`."""
    store = InMemoryStore()
    models = []
    for _ in range(workers):
        target = ScriptedTarget(script={"urgent": "yes", "team": "billing"})
        state = StoreControllerState(store, controller, scope="bench") if controller is not None else None
        escalation = Escalation(target, controller=controller, controller_state=state)
        models.append(CanvasDecisionModel(engine=stream_engine(stream), escalate_to=escalation, policy=GatePolicy(
            rereads=0, per_question={qid: GatePolicy(max_normalized_entropy=t, rereads=0) for qid, t in base.items()})))
    escalated = {qid: [False] * stream.n for qid in QUESTIONS}
    thresholds = {qid: [0.0] * stream.n for qid in QUESTIONS}
    turn = iter(range(stream.n))

    async def worker(model: CanvasDecisionModel) -> None:
        for i in turn:
            response = await model.adecide(f"ticket {i}", QUESTIONS)
            for qid, report in response.reads.items():
                escalated[qid][i] = not report.confident
                found = _GATE.match(report.gate or "")
                thresholds[qid][i] = float(found.group(1)) if found else math.nan

    start = time.perf_counter()
    await asyncio.gather(*(worker(m) for m in models))
    seconds = time.perf_counter() - start
    syncs = sum(m.controller_counters.get("syncs", 0) for m in models)
    return StreamRun(escalated, thresholds, seconds, syncs)


def run_controller(quick: bool) -> Section:
    n, drift, window = (3000, 1000, 500) if quick else (8000, 2000, 500)
    controller, workers = Controller(target=0.2), 4
    section = Section("controller", f"13. Escalation-rate controller after a drift: {workers} workers on one "
                      "LangGraph store, target 20 %", ["question", "gate", "rate before", "rate after",
                                                       "settled after", "at ideal after", "windows off",
                                                       "excess escalations", "threshold", "ideal", "dec/s"])
    stream = DriftStream(n, drift, seed=35)
    base = {qid: stream.quantile(qid, 1 - controller.target, after=False) for qid in QUESTIONS}
    runs = {"on": asyncio.run(run_stream(stream, base, controller, workers)),
            "off": asyncio.run(run_stream(stream, base, None, workers))}
    for qid in QUESTIONS:
        ideal = stream.quantile(qid, 1 - controller.target, after=True)
        oracle = [h > (ideal if i >= drift else base[qid]) for i, h in enumerate(stream.entropy[qid])]
        for name, esc, held, run in (("on", runs["on"].escalated[qid], runs["on"].thresholds[qid], runs["on"]),
                                     ("off", runs["off"].escalated[qid], runs["off"].thresholds[qid], runs["off"]),
                                     ("oracle", oracle, None, None)):
            after = esc[drift:]
            tail = held[n - window:] if held is not None else [ideal]
            section.rows.append({
                "question": qid, "gate": {"on": "controller", "off": "fixed (base)", "oracle": "fixed at ideal"}[name],
                "rate before": round(sum(esc[drift - window:drift]) / window, 3),
                "rate after": round(sum(esc[n - window:]) / window, 3),
                "settled after": settled(esc, drift, controller.target, window),
                "at ideal after": reached(held, drift, ideal) if held is not None else 0,
                "windows off": round(off_windows(esc, drift + window, controller.target, window), 3),
                "excess escalations": round(sum(after) - controller.target * len(after)),
                "threshold": round(sum(tail) / len(tail), 3), "ideal": round(ideal, 3),
                "dec/s": round(n / run.seconds) if run is not None else None,
            })
    section.extra.update({"decisions": n, "drift_at": drift, "window": window, "workers": workers,
                          "controller": {"target": controller.target, "step": controller.step,
                                         "max_offset": controller.max_offset, "sync_every": controller.sync_every,
                                         "resolution": controller.resolution},
                          "base_thresholds": {q: round(t, 3) for q, t in base.items()},
                          "store_reads": runs["on"].syncs})
    section.notes += [
        f"stream: {n} decisions, drift at decision {drift}; normalized entropy per question from a Beta whose mean "
        "shifts at the drift (urgent Beta(3,7) -> Beta(5,5), team Beta(5,5) -> Beta(3,6)); seed 35",
        f"rates over {window}-decision windows: before = the {window} decisions before the drift, after = the last "
        f"{window}; 'settled after' = decisions after the drift until the rate over the last {window} decisions "
        "after it (all of them, while fewer) is within +-2 points of the target and stays there to the end (- : "
        "never); 'at ideal after' = decisions after the drift until one is gated within 0.02 of the ideal threshold "
        "(- : never); excess = escalations after the drift beyond target x decisions",
        f"'windows off' = share of the {window}-decision windows ending {window} or more decisions after the drift "
        "whose rate is off the target by more than 2 points: the noise a window carries (a binomial 500-window at "
        "exactly 20 % is off +-2 points about a quarter of the time; the oracle row shows the stream's own)",
        f"threshold = the mean threshold the gate held over the last {window} decisions; ideal = the post-drift "
        "stream's 80 % quantile (what a calibration on the new traffic would set; the oracle gates at it from the "
        "drift on, knowing the drift); base thresholds: " + ", ".join(f"{q} {t:.3f}" for q, t in base.items()),
        f"{workers} workers in one process, one InMemoryStore, each its own StoreControllerState "
        f"(sync_every={controller.sync_every}: {runs['on'].syncs} reads of the store in all); instant target "
        "(ScriptedTarget), FunctionEngine rows: the figures are the algorithm's, not a model's quality",
    ]
    return section
