"""Figure 14: hedged escalation (`Escalation(hedge=Hedge(...))`) against none, on one simulated stream.

The generator (seeded, the same stream for every arm): each decision is one yes/no question about
its own ticket, read by a `FunctionEngine` whose reads sleep (real `asyncio` sleeps), and escalated
to a target (an async Runnable answering JSON) that sleeps too. Per decision, drawn once:

- its first read: borderline (p(yes) 0.7, H/lnK 0.881, over the gate `H/lnK <= 0.8` by 0.081,
  within the band 0.1) with probability `BORDERLINE`, far over (p 0.5, H/lnK 1.0) with `FAR`,
  else confident (p 0.98);
- a borderline read's one re-read settles it (p 0.98: the mean passes) with probability `SETTLE`,
  else it reads 0.7 again and the question escalates; a far read's re-read reads 0.5 again;
- every engine read's latency is lognormal (median `READ_MS`, sigma 0.25), every target call's
  lognormal (median `TARGET_MS`, sigma 0.5): about a fifth of a GPU canvas read (~40 ms) and of a
  27B model's JSON answer (~400 ms), so the run is short; only the ratios carry over. Two
  regimes: an idle engine (reads 8 ms, a tenth of the target) and a loaded one (40 ms, half).

Arms: no hedge; `Hedge(band=0.1)`; `Hedge(band=0.1, after_s=...)` (the target starts only if the
re-read has not ended by its median latency). Each arm decides through its own model,
`CONCURRENCY` decisions at a time, the arms deciding each slice of the stream at the same time (a
stall of the machine hits every arm alike). The engine and the target have unlimited capacity (no
queueing), so what extra target calls would cost a loaded target is not measured. Latency is
each decision's wall time (`adecide`), in the simulated milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import Noul
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda

from canvasroute.engine import CanvasRead, FunctionEngine
from canvasroute.router import CanvasDecisionModel, Escalation, GatePolicy, Hedge, ReadOptions

from .common import Section, percentile

__all__ = ["run_hedge"]

BORDERLINE, FAR, SETTLE = 0.3, 0.15, 0.5
"""Shares: first reads within the band, far over the gate; borderline reads a re-read settles."""
READS_MS = {"idle": 8.0, "loaded": 40.0}
"""Median simulated latency of one engine read, by regime."""
TARGET_MS = 80.0
"""Median simulated latency of one target call."""
CONCURRENCY = 8
GATE = GatePolicy(max_normalized_entropy=0.8, rereads=1)
QUESTION = {"urgent": Noul(instructions="Does the customer need an answer today?")}
_TICKET = re.compile(r"ticket (\d+)")


@dataclass(frozen=True, slots=True)
class Draw:
    """One decision of the stream: what its reads say and how long each call takes."""

    kind: str
    """`borderline`, `far` or `confident` (its first read)."""
    settles: bool
    """A borderline read whose re-read passes the gate."""
    first_s: float
    reread_s: float
    target_s: float
    says: str
    """What the target answers (yes or no, even odds): an answer the hedge changed shows."""

    @property
    def group(self) -> str:
        if self.kind == "borderline":
            return "borderline, re-read settles" if self.settles else "borderline, escalates"
        return "far over, escalates" if self.kind == "far" else "confident"


def stream(n: int, read_ms: float, seed: int = 35) -> list[Draw]:
    """The simulated stream (the module docstring states its generator)."""
    rng = random.Random(seed)

    def ms(median: float, sigma: float) -> float:
        return median * math.exp(rng.gauss(0.0, sigma)) / 1e3

    out = []
    for _ in range(n):
        u = rng.random()
        kind = "borderline" if u < BORDERLINE else "far" if u < BORDERLINE + FAR else "confident"
        out.append(Draw(kind, rng.random() < SETTLE, ms(read_ms, 0.25), ms(read_ms, 0.25), ms(TARGET_MS, 0.5),
                        rng.choice(("yes", "no"))))
    return out


def _model(draws: list[Draw], hedge: Hedge | None) -> CanvasDecisionModel:
    reads: dict[int, int] = {}

    def which(text: str) -> int:
        found = _TICKET.search(text)
        assert found is not None
        return int(found.group(1))

    async def rows(read: CanvasRead) -> list[dict[int, float]]:
        i = which(" ".join(m["content"] for m in read.messages))
        k = reads[i] = reads.get(i, 0) + 1
        d = draws[i]
        await asyncio.sleep(d.first_s if k == 1 else d.reread_s)
        p = (0.7 if d.kind == "borderline" else 0.5 if d.kind == "far" else 0.98) if k == 1 else (
            0.98 if d.kind == "confident" or (d.kind == "borderline" and d.settles) else
            0.7 if d.kind == "borderline" else 0.5)
        return [{engine.token_id("yes"): math.log(p), engine.token_id("no"): math.log(1 - p)}] * len(read.slots)

    async def target(messages: Any) -> AIMessage:
        d = draws[which(messages[-1].text)]
        await asyncio.sleep(d.target_s)
        return AIMessage(json.dumps({"urgent": d.says}))

    engine = FunctionEngine(rows, model="simulated-canvas", keep_reads=False)
    return CanvasDecisionModel(engine=engine, policy=GATE, read=ReadOptions(isolate="none"),
                               escalate_to=Escalation(RunnableLambda(target, name="simulated-target"), hedge=hedge))


async def _arms(draws: list[Draw], hedges: dict[str, Hedge | None], rounds: int) -> dict[str, tuple[list[float],
                                                                                                  list[Any]]]:
    """Each arm's latency and response per decision: the stream in `rounds` slices, every arm
    deciding each slice at the same time as the others, so a stall of the machine hits all alike."""
    models = {name: _model(draws, hedge) for name, hedge in hedges.items()}
    out: dict[str, tuple[list[float], list[Any]]] = {name: ([0.0] * len(draws), [None] * len(draws))
                                                      for name in hedges}
    limits = {name: asyncio.Semaphore(CONCURRENCY) for name in hedges}

    async def one(name: str, i: int) -> None:
        async with limits[name]:
            start = time.perf_counter()
            out[name][1][i] = await models[name].adecide(f"ticket {i}: I was charged twice; please refund me.",
                                                         QUESTION)
            out[name][0][i] = time.perf_counter() - start

    size = math.ceil(len(draws) / rounds)
    for r in range(rounds):
        ids = range(r * size, min(len(draws), (r + 1) * size))
        await asyncio.gather(*(one(name, i) for i in ids for name in hedges))
    return out


def run_hedge(quick: bool) -> Section:
    n = 120 if quick else 600
    section = Section("hedge", "14. Hedged escalation vs none on a simulated stream (latency in simulated ms)",
                      ["engine", "arm", "decisions", "n", "p50 ms", "p99 ms", "target calls", "extra calls",
                       "hedges", "cancelled", "answers changed"])
    groups = ["borderline, escalates", "borderline, re-read settles"]
    for regime, read_ms in READS_MS.items():
        draws = stream(n, read_ms)
        arms = {"no hedge": None, "Hedge(band=0.1)": Hedge(band=0.1),
                f"Hedge(band=0.1, after_s={read_ms:g} ms)": Hedge(band=0.1, after_s=read_ms / 1e3)}
        results = asyncio.run(_arms(draws, arms, rounds=6 if quick else 30))
        base = results["no hedge"][1]
        base_calls = sum(r.totals.target_calls for r in base)
        over = [i for i, d in enumerate(draws) if d.kind != "confident"]
        far = [i for i, d in enumerate(draws) if d.kind == "far"]
        engine = f"{regime}, reads {read_ms:g} ms"
        for name, (lat, resp) in results.items():
            calls = sum(r.totals.target_calls for r in resp)
            section.rows.append({
                "engine": engine, "arm": name, "decisions": "borderline or over the gate", "n": len(over),
                "p50 ms": percentile([lat[i] for i in over], 50) * 1e3,
                "p99 ms": percentile([lat[i] for i in over], 99) * 1e3, "target calls": calls,
                "extra calls": calls - base_calls, "hedges": sum(r.totals.hedges for r in resp),
                "cancelled": sum(r.totals.hedges_cancelled for r in resp),
                "answers changed": sum(a.reads["urgent"].answer != b.reads["urgent"].answer
                                       for a, b in zip(resp, base, strict=True))})
            for group in groups:
                ids = [i for i, d in enumerate(draws) if d.group == group]
                section.rows.append({
                    "engine": engine, "arm": name, "decisions": group, "n": len(ids),
                    "p50 ms": percentile([lat[i] for i in ids], 50) * 1e3,
                    "p99 ms": percentile([lat[i] for i in ids], 99) * 1e3,
                    "target calls": sum(resp[i].totals.target_calls for i in ids),
                    "hedges": sum(resp[i].totals.hedges for i in ids)})
        section.notes.append(f"{engine}: the {len(far)} far over the gate (never hedged, the control) p50 "
                             + ", ".join(f"{percentile([lat[i] for i in far], 50) * 1e3:.0f}"
                                         for lat, _ in results.values()) + " ms in the three arms")
    section.notes += [
        f"{n} decisions per engine, one yes/no question each, {CONCURRENCY} at a time per arm, the arms side by side; "
        f"first reads: {BORDERLINE:.0%} within the band of the gate H/lnK <= 0.8, {FAR:.0%} far over, the rest "
        f"confident; a re-read settles {SETTLE:.0%} of the borderline ones (apps/bench/hedge.py states the "
        "generator)",
        f"latencies lognormal: engine read median as shown (sigma 0.25), target call median {TARGET_MS:g} ms "
        "(sigma 0.5), real asyncio sleeps; engine and target with unlimited capacity (no queueing)",
        "extra calls: target calls beyond the no-hedge arm's (a hedge the re-reads beat after its call went out; "
        "one they beat before it was sent is no call); "
        "answers changed: decisions whose answer differs from the no-hedge arm's (a borderline question the "
        "target answered first though its re-read would have settled it)",
        "a simulation of the library's race, not of a model: it says what hedging trades (latency of escalated "
        "decisions for target calls), not whether either answer is right",
    ]
    section.extra["generator"] = {"borderline": BORDERLINE, "far": FAR, "settle": SETTLE, "reads_ms": READS_MS,
                                  "target_ms": TARGET_MS, "sigma_read": 0.25, "sigma_target": 0.5, "seed": 35,
                                  "concurrency": CONCURRENCY, "gate": GATE.gate_text, "rereads": GATE.rereads}
    return section
