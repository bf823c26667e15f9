"""What reading each question without its neighbours costs (`ReadOptions.isolate`), side by side.

Two engines, each decision set read jointly (`isolate="none"`: one canvas) and apart (`"all"`:
one canvas per question; on a causal engine the state first, so the reads share its prefix),
interleaved in rounds so a load change moves both alike:

- the embedded SmolLM2-135M (causal: `auto` isolates there), 4 mixed questions about a ticket;
- a real vLLM DiffusionGemma server (`--vllm-url`; bidirectional: `auto` isolates sets of 2-4
  yes/no questions), 3 yes/no questions.

Per row: canvas reads per decision set, median and p95 milliseconds, and (in-process) the
prompt tokens the engine's prefix cache reused. Each round uses fresh tickets, so no decision
is a cache hit of an earlier one; the prefix cache is warm with the node's own prompts.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from langchain_core.decisions import Choice, Noul, Score

from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import TICKETS, Section

__all__ = ["run_isolation"]

MIXED = {
    "urgent": Noul(instructions="Does the customer need an answer today?"),
    "team": Choice(instructions="Which team owns this ticket?", criteria={"billing": None, "technical": None,
                                                                          "account": None}),
    "refund": Noul(instructions="Does the customer ask for money back?"),
    "severity": Score(instructions="How severe is the problem?", criteria=["minor", "major", "blocking"]),
}
YES_NO = {q: Noul(instructions=text) for q, text in (
    ("urgent", "Does the customer need an answer today?"), ("refund", "Does the customer ask for money back?"),
    ("angry", "Is the customer angry?"))}
ONE_READ = GatePolicy(max_normalized_entropy=None, rereads=0)


def run_isolation(vllm_url: str | None, quick: bool) -> Section:
    rounds = 3 if quick else 12
    section = Section("isolation", "10. Isolated reads vs one joint canvas (ReadOptions.isolate), per decision set",
                      ["engine", "questions", "isolate", "reads", "p50 ms", "p95 ms", "prefix tokens reused",
                       "ms vs joint"])
    engines: list[tuple[str, Any, dict[str, Any]]] = []
    try:
        from canvasroute.engine import embedded_engine

        engines.append(("SmolLM2-135M in-process (causal)", embedded_engine(), MIXED))
    except Exception as exc:  # noqa: BLE001 - the wheel or torch is missing: say so
        section.notes.append(f"embedded engine skipped: {type(exc).__name__}: {exc}")
    if vllm_url:
        from canvasroute.engine import VLLMServerEngine

        engines.append(("vLLM CPU server, tiny DiffusionGemma", VLLMServerEngine(vllm_url), YES_NO))
    else:
        section.notes.append("vLLM rows skipped: no --vllm-url")
    if not engines:
        section.skipped = "no engine to measure"
        return section
    for label, engine, questions in engines:
        try:
            section.rows += asyncio.run(_measure(label, engine, questions, rounds))
        finally:
            asyncio.run(engine.aclose())
    section.notes += [
        f"{rounds} rounds of fresh tickets, joint and isolated interleaved; medians over rounds",
        "isolate='auto' (the default) is 'all' on the causal engine and for the vLLM row's 3 yes/no questions",
        "decision quality is not measured here: both models are near chance (the tiny DiffusionGemma is random)",
    ]
    return section


async def _measure(label: str, engine: Any, questions: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    model = CanvasDecisionModel(engine=engine, policy=ONE_READ)
    modes = ("none", "all")
    times: dict[str, list[float]] = {m: [] for m in modes}
    reads: dict[str, int] = {}
    reused: dict[str, int] = dict.fromkeys(modes, 0)
    for m in modes:  # warm: plans, tokenizer caches, the node's prompt prefixes
        await model.adecide("warm-up ticket", questions, read={"isolate": m})
    for r in range(rounds):
        for m in (modes if r % 2 else reversed(modes)):
            before = getattr(engine, "prefix_tokens_reused", 0)
            start = time.perf_counter()
            resp = await model.adecide(f"[{r}] {TICKETS[r % len(TICKETS)]}", questions, read={"isolate": m})
            times[m].append((time.perf_counter() - start) * 1000)
            reads[m] = resp.canvas_reads
            reused[m] += getattr(engine, "prefix_tokens_reused", 0) - before
    joint = statistics.median(times["none"])
    return [{"engine": label, "questions": len(questions), "isolate": m, "reads": reads[m],
             "p50 ms": statistics.median(times[m]), "p95 ms": _p95(times[m]),
             "prefix tokens reused": reused[m] // rounds if hasattr(engine, "prefix_tokens_reused") else None,
             "ms vs joint": statistics.median(times[m]) / joint} for m in modes]


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
