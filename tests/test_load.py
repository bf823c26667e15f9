"""Load: 10,000 decisions at concurrency 256 through bounded queues, memory bounded.

The path is the production one: `CanvasDecisionModel` -> `VLLMServerEngine`
(`max_concurrency=64` requests in flight) -> HTTP -> the instant loopback server in its
own process (so the server's CPU is not the test's). A bounded `asyncio.Queue` feeds 256
workers, so at most 256 decisions exist at once. No timing is asserted: counts,
conservation and memory are.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from conftest import fresh_tracer_provider
from deadlines import patience
from langchain_core.decisions import Choice, Noul, Score

from canvasroute.engine import Connection, Limits, VLLMServerEngine
from canvasroute.engine.testing import LoopbackVLLM, spawn
from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy

QUESTIONS = {
    "team": Choice(instructions="Which team should handle this ticket?",
                   criteria={"billing": None, "technical": None, "account": None, "sales": None, "other": None}),
    "urgent": Noul(instructions="Does the customer need an answer within the hour?"),
    "severity": Score(instructions="How badly is the customer affected?",
                      criteria=["not at all", "a little", "badly", "cannot work"]),
}
DECISIONS = 10_000
CONCURRENCY = 256
MAX_IN_FLIGHT_REQUESTS = 64
RSS_GROWTH_BOUND_MB = 64
"""Resident memory may grow at most this much between decision 1,000 and 10,000."""


@contextmanager
def recording_sdk_without_export() -> Iterator[None]:
    """A fresh global SDK tracer provider with no processor: every span is recorded with
    all its attributes, then dropped, so memory measures the library, not an exporter
    (an in-memory exporter another test left installed would keep all 20,000 spans)."""
    with fresh_tracer_provider():
        yield


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
async def test_ten_thousand_decisions_at_concurrency_256_with_bounded_memory():
    with spawn() as server, recording_sdk_without_export():
        engine = VLLMServerEngine(Connection(server.url, limits=Limits(max_concurrency=MAX_IN_FLIGHT_REQUESTS),
                                             retries=2))
        model = CanvasDecisionModel(engine=engine, policy=GatePolicy(), outcomes=OutcomePolicy(engine_fault="raise"))
        queue: asyncio.Queue[int | None] = asyncio.Queue(maxsize=2 * CONCURRENCY)
        outcomes: Counter[str] = Counter()
        answers: Counter[str] = Counter()
        live = peak_live = 0
        rss: dict[str, float] = {}

        async def produce() -> None:
            for i in range(DECISIONS):
                await queue.put(i)  # blocks while the queue is full: bounded
            for _ in range(CONCURRENCY):
                await queue.put(None)

        async def work() -> None:
            nonlocal live, peak_live
            while (i := await queue.get()) is not None:
                live += 1
                peak_live = max(peak_live, live)
                resp = await model.adecide(f"Ticket #{i}: I was charged twice, please refund.", QUESTIONS)
                live -= 1
                outcomes["/".join(sorted({r.path for r in resp.reads.values()}))] += 1
                answers[resp.answers["team"].choice] += 1
                done = sum(outcomes.values())
                if done == 1_000:
                    gc.collect()
                    rss["warm"] = rss_mb()

        await asyncio.gather(produce(), *(work() for _ in range(CONCURRENCY)))
        gc.collect()
        rss["end"] = rss_mb()
        async with httpx.AsyncClient(timeout=patience(5)) as http:
            stats = (await http.get(f"{server.url}/_loopback/stats")).json()

        assert outcomes == Counter({"canvas": DECISIONS})  # none lost, none re-read or escalated
        assert sum(answers.values()) == DECISIONS and len(answers) == 1  # fixed rows: one answer
        assert peak_live == CONCURRENCY and live == 0
        assert stats["reads"] == engine.requests_sent == DECISIONS  # one read per decision, no retries
        assert engine.connection.in_flight == 0 and engine.pending_fetches == 0  # every slot released
        idle, open_lanes = engine.connection.lanes
        assert 0 < idle == open_lanes <= MAX_IN_FLIGHT_REQUESTS  # clients bounded, all back
        assert len(model._memo.planner.plans) == 1 and engine.cached_prompts < 100  # caches hold plans, not states
        growth = rss["end"] - rss["warm"]
        assert growth < RSS_GROWTH_BOUND_MB, f"RSS grew {growth:.1f} MB over {DECISIONS - 1000} decisions"
        await engine.aclose()


async def test_a_cold_burst_plans_once_and_discovers_once():
    """256 decisions arriving together on a fresh engine send the discovery requests and
    the planning `/tokenize` calls of ONE decision, not 256 times as many."""
    async with LoopbackVLLM() as server:
        single = VLLMServerEngine(server.url)
        await CanvasDecisionModel(engine=single).adecide("first ticket", QUESTIONS)
        one = Counter(server.requests)
        server.requests.clear()

        burst = VLLMServerEngine(Connection(server.url, limits=Limits(max_concurrency=MAX_IN_FLIGHT_REQUESTS)))
        model = CanvasDecisionModel(engine=burst)
        results = await asyncio.gather(*(model.adecide(f"ticket {i}", QUESTIONS) for i in range(CONCURRENCY)))
        assert len(results) == CONCURRENCY
        assert server.requests["/v1/models"] == one["/v1/models"] == 1
        assert server.requests["/tokenize"] == one["/tokenize"]
        assert server.requests["/v1/chat/completions"] == CONCURRENCY
        await single.aclose()
        await burst.aclose()


def test_the_bench_command_reports_its_figures_as_json(capsys):
    """`canvasroute bench --quick --json` (fast sections): figures present, shapes right."""
    from canvasroute.apps.cli import main

    assert main(["bench", "--quick", "--json", "--only", "overhead,packing", "--vllm-url", ""]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True and report["machine"]["cpus"] >= 1
    overhead = report["sections"]["overhead"]
    paths = {row["path"] for row in overhead["rows"]}
    assert {"CanvasDecisionModel.decide", "LangGraph 1-node graph (decision_node)"} <= paths
    assert all(0 < row["p50 us"] <= row["p99 us"] for row in overhead["rows"])
    assert overhead["profile"]["by_area"] and overhead["profile"]["top"]
    packing = {row["node"]: row for row in report["sections"]["packing"]["rows"]}
    assert packing["triage: Choice5+Noul+Score4"]["reads"] == 1  # three questions, one canvas
    assert packing["16 Nouls"]["reads"] == 2 and packing["16 Nouls"]["questions/read"] == 8
    assert "--vllm-url" in " ".join(report["sections"]["packing"]["notes"])


@pytest.mark.slow
def test_the_bench_measures_every_http_client_candidate_through_the_same_engine(capsys):
    """`canvasroute bench --quick --only clients` (issue #23): each candidate at each level, CPU beside the choice."""
    from canvasroute.apps.bench.lanes import CLIENTS
    from canvasroute.apps.cli import main

    assert main(["bench", "--quick", "--json", "--only", "clients", "--vllm-url", ""]) == 0
    section = json.loads(capsys.readouterr().out)["sections"]["clients"]
    rows = {(row["client"], row["concurrency"]): row for row in section["rows"]}
    assert {client for client, _ in rows} == set(CLIENTS) and {c for _, c in rows} == {1, 16, 64}
    assert all(row["reads/s"] > 0 and row["client CPU us/read"] > 0 for row in rows.values())
    assert all(rows[("llhttp", c)]["CPU vs llhttp"] == 1 for c in (1, 16, 64))
    assert set(section["best"]) == set(CLIENTS)
    assert any(note.startswith("goal: >= 3,000 reads/s") for note in section["notes"])
