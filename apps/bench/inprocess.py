"""In-process throughput: 8 sequential vs 8 concurrent triage decisions on the embedded
SmolLM2-135M (CPU, float32), with the engine's prompt cache (a new prompt is prefilled
on top of the longest cached prompt it starts with, so decisions of one node prefill only
their state) and without any (`prompt_cache_size=0`: every prompt prefilled in full).

Each engine runs the sequential batch on one set of fresh tickets and the concurrent
batch on another; the other engine runs them the other way round, so every answer is
checked against the same state decided by the other engine in the other mode.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, TRIAGE, Section

__all__ = ["run_inprocess"]

N = 8
TARGET = 3.0


def run_inprocess(quick: bool) -> Section:
    runs = 1 if quick else 3
    section = Section("inprocess", f"7. In-process decisions/s, {N} sequential vs {N} concurrent, SmolLM2-135M "
                                   f"on CPU, triage (median of {runs})",
                      ["prompt cache", "sequential /s", "concurrent /s", "concurrent/sequential",
                       "forward passes", "prefix tokens reused"])
    try:
        from canvasroute.engine import TransformersEngine, embedded_engine
        cached = embedded_engine()  # ExtraMissing without torch: before torch is imported here
        import torch
    except Exception as exc:  # noqa: BLE001 - wheel or torch missing: say so
        section.skipped = f"embedded model unavailable: {type(exc).__name__}: {exc}"
        return section
    full = TransformersEngine(cached.model, cached.tokenizer, name="no-cache", prompt_cache_size=0)
    try:
        rates, identical = asyncio.run(_measure(cached, full, runs))
    finally:
        asyncio.run(cached.aclose())
        asyncio.run(full.aclose())
    for label, eng in (("prefix reuse (default)", cached), ("none (prompt_cache_size=0)", full)):
        seq, con = (statistics.median(rates[label, mode]) for mode in ("seq", "con"))
        section.rows.append({"prompt cache": label, "sequential /s": seq, "concurrent /s": con,
                             "concurrent/sequential": con / seq, "forward passes": eng.forward_passes,
                             "prefix tokens reused": getattr(eng, "prefix_tokens_reused", None)})
    ratio = section.rows[0]["concurrent/sequential"]
    over_old = section.rows[0]["concurrent /s"] / section.rows[1]["sequential /s"]
    section.notes += [
        f"answers identical across engines and modes: {identical}",
        f"target: >= {TARGET:g}x decisions/s at {N} concurrent over {N} sequential: default engine "
        f"{ratio:.2f}x ({'met' if ratio >= TARGET else 'NOT met'}); its concurrent rate over the no-cache "
        f"sequential path: {over_old:.2f}x",
        "one warm-up decision per engine first: the default engine then holds the node's system prompt, "
        "as it does after a node's first decision",
        f"torch threads: {torch.get_num_threads()}; float32; fresh tickets for every batch",
    ]
    return section


async def _measure(cached: Any, full: Any, runs: int) -> tuple[dict[tuple[str, str], list[float]], bool]:
    questions = NODES[TRIAGE]
    policy = GatePolicy(max_normalized_entropy=None, rereads=0)
    models = {"prefix reuse (default)": CanvasDecisionModel(engine=cached, policy=policy),
              "none (prompt_cache_size=0)": CanvasDecisionModel(engine=full, policy=policy)}
    rates: dict[tuple[str, str], list[float]] = {(k, m): [] for k in models for m in ("seq", "con")}
    answers: dict[tuple[str, str], list[Any]] = {}
    for i, model in enumerate(models.values()):
        await model.adecide(f"warm-up ticket {i}", questions)
    identical = True
    for r in range(runs):
        sets = [[f"{TICKETS[(r * 2 * N + j) % len(TICKETS)]} (ticket #{r}-{s}-{j})" for j in range(N)]
                for s in range(2)]
        for (label, model), (seq_states, con_states) in zip(models.items(), (sets, sets[::-1]), strict=True):
            t = time.perf_counter()
            seq = [await model.adecide(s, questions) for s in seq_states]
            rates[label, "seq"].append(N / (time.perf_counter() - t))
            t = time.perf_counter()
            con = await asyncio.gather(*(model.adecide(s, questions) for s in con_states))
            rates[label, "con"].append(N / (time.perf_counter() - t))
            answers[label, "seq"], answers[label, "con"] = [_answers(x) for x in seq], [_answers(x) for x in con]
        a, b = models
        identical &= answers[a, "seq"] == answers[b, "con"] and answers[a, "con"] == answers[b, "seq"]
    return rates, identical


def _answers(resp: Any) -> dict[str, Any]:
    return {qid: read.answer for qid, read in resp.reads.items()}
