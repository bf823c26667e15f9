"""Prefix affinity on two real vLLM CPU servers (the second one started by the suite).

A decision's reads share one session key (`session_key` of its prompt): with affinity
(the default for several URLs) the first read and every re-read go to one replica, where
the prompt's prefix is cached; round-robin alternates them. Counted from each server's
own `/metrics` (`vllm:request_success_total`), not from the client.
"""

from __future__ import annotations

import re
import uuid

import httpx
import pytest
from deadlines import patience
from langchain_core.decisions import Choice, Noul

from canvasroute.engine import Connection, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy

QUESTIONS = {"team": Choice(instructions="Which team owns this?", criteria={"billing": None, "tech": None}),
             "urgent": Noul(instructions="Is it urgent?")}
UNSURE = GatePolicy(max_normalized_entropy=0.0, rereads=3)
"""A gate nothing passes: every decision reads 1 + 3 times."""
_FINISHED = re.compile(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)


def finished(url: str) -> int:
    return int(sum(float(v) for v in _FINISHED.findall(httpx.get(f"{url}/metrics", timeout=patience(10)).text)))


async def reads_per_server(urls: list[str], affinity: bool) -> list[int]:
    engine = VLLMServerEngine(Connection(urls, timeout=patience(120)), affinity=affinity)
    try:
        await engine.info()  # discovery first: only the decision's reads are counted below
        before = [finished(u) for u in urls]
        resp = await CanvasDecisionModel(engine=engine, policy=UNSURE).adecide(
            f"[{uuid.uuid4().hex[:8]}] I was charged twice this month.", QUESTIONS)
        assert resp.canvas_reads == 4
        return [finished(u) - b for u, b in zip(urls, before, strict=True)]
    finally:
        await engine.aclose()


@pytest.mark.vllm
async def test_affinity_keeps_a_decisions_reads_on_one_real_replica(vllm_url, second_vllm_url):
    urls = [vllm_url, second_vllm_url]
    assert sorted(await reads_per_server(urls, affinity=True)) == [0, 4]
    assert await reads_per_server(urls, affinity=False) == [2, 2]
