"""Bench section `affinity`: prefix-cache hit rate on two real vLLM replicas, rendezvous vs round-robin.

Each mode runs the same number of fresh decisions (a nonce in every state, so neither
mode finds the other's prompts cached) through `VLLMServerEngine([url1, url2])`; every
decision reads 1 + `REREADS` times (a gate nothing passes). The hit rate is the change
of `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` (tokens), summed
over both servers' `/metrics`, during the mode. `server requests` counts the requests the
servers finished meanwhile: more than `reads` means someone else was using them too.
"""

from __future__ import annotations

import asyncio
import re
import uuid

import httpx

from canvasroute.engine import Connection, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, TRIAGE, Section

REREADS = 3
_METRIC = re.compile(r"^(vllm:prefix_cache_hits_total|vllm:prefix_cache_queries_total|"
                     r"vllm:request_success_total)\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)


def metrics(urls: list[str]) -> dict[str, float]:
    """Prefix-cache hits and queries (tokens) and finished requests, summed over `urls`."""
    out = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0,
           "vllm:request_success_total": 0.0}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for name, value in _METRIC.findall(text):
            out[name] += float(value)
    return out


async def _mode(urls: list[str], affinity: bool, decisions: int) -> dict[str, float | int | str | None]:
    engine = VLLMServerEngine(Connection(urls, timeout=120), affinity=affinity)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.0, rereads=REREADS))
    nonce = uuid.uuid4().hex[:12]
    await engine.info()
    before, sent = metrics(urls), engine.requests_sent
    for i in range(decisions):
        await model.adecide(f"[{nonce}-{i}] {TICKETS[i % len(TICKETS)]}", NODES[TRIAGE])
    after, reads = metrics(urls), engine.requests_sent - sent
    await engine.aclose()
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    return {"routing": "rendezvous (affinity)" if affinity else "round-robin", "decisions": decisions,
            "reads": reads, "server requests": int(after["vllm:request_success_total"]
                                                    - before["vllm:request_success_total"]),
            "hit tokens": int(hits), "queried tokens": int(queried),
            "hit rate": round(hits / queried, 3) if queried else None}


def run_affinity(urls: list[str], quick: bool) -> Section:
    section = Section("affinity", "6. Prefix affinity on two real vLLM replicas: prefix-cache hit rate",
                      ["routing", "decisions", "reads", "server requests", "hit tokens", "queried tokens",
                       "hit rate"])
    if len(urls) < 2:
        section.skipped = "needs two servers: pass --affinity-urls URL1,URL2 or set CANVASROUTE_AFFINITY_URLS"
        return section
    decisions = 6 if quick else 16
    try:
        for affinity in (True, False):
            section.rows.append(asyncio.run(_mode(urls[:2], affinity, decisions)))
    except Exception as exc:  # noqa: BLE001 - a bench row, not a test: say why and go on
        section.skipped = f"{type(exc).__name__}: {exc}"
        return section
    section.notes += [
        f"each decision reads 1 + {REREADS} times with one prompt; with affinity all its reads go to one "
        "replica, round-robin alternates them, so re-reads land where the prompt is not yet cached",
        "hit tokens / queried tokens from vllm:prefix_cache_hits_total and vllm:prefix_cache_queries_total "
        "(both servers); the system prompt is shared by every decision, so both modes hit on it",
    ]
    return section
