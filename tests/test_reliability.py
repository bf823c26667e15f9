"""Reliability: engine faults under `CanvasDecisionModel`, the real vLLM server killed
mid-run, replicas losing a member, and secrets that never leak.

Every decision must end in exactly one of: answered (canvas/reread), escalated (the
GenericFakeChatModel target), fallback, or a typed `CanvasRouteError`, as configured;
none may hang (each is bounded by `wait_for`) and none may be lost (outcomes counted).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from conftest import _free_port, fresh_tracer_provider
from deadlines import bounded, patience
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from canvasroute.engine import (
    CanvasRouteError,
    Connection,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    Limits,
    Retries,
    Timeout,
    VLLMServerEngine,
)
from canvasroute.engine.testing import Fault, LoopbackVLLM, spawn
from canvasroute.router import CanvasDecisionModel, CanvasResponse, GatePolicy, OutcomePolicy

QUESTIONS = {
    "team": Choice(instructions="Which team should handle this ticket?",
                   criteria={"billing": "invoices, refunds", "technical": "bugs, outages", "account": None,
                             "sales": None, "other": None}),
    "urgent": Noul(instructions="Does the customer need an answer within the hour?"),
    "severity": Score(instructions="How badly is the customer affected?",
                      criteria=["not at all", "a little", "badly", "cannot work"]),
}
ESCALATED_REPLY = '{"team": "billing", "urgent": "yes", "severity": "2"}'
FALLBACK = {"team": "other", "urgent": "yes", "severity": "3"}
TICKET = "I was charged twice this month and nobody answers my emails."
MODES = ("escalate", "raise", "fallback")


def escalation_target() -> GenericFakeChatModel:
    return GenericFakeChatModel(messages=itertools.cycle([AIMessage(ESCALATED_REPLY)]))


def make_model(engine, mode: str, **kwargs) -> CanvasDecisionModel:
    if mode == "fallback":
        return CanvasDecisionModel(engine=engine,
                                   **kwargs,
                                   outcomes=OutcomePolicy(engine_fault="fallback", fallback=FALLBACK))
    return CanvasDecisionModel(engine=engine,
                               escalate_to=escalation_target(),
                               **kwargs,
                               outcomes=OutcomePolicy(engine_fault=mode))


def outcome(result: CanvasResponse | BaseException) -> str:
    """One word per decision: how it ended."""
    if isinstance(result, CanvasRouteError):
        return type(result).__name__
    if isinstance(result, BaseException):
        raise result  # anything untyped is a bug
    paths = {r.path for r in result.reads.values()}
    assert set(result.answers) == set(QUESTIONS)
    if paths <= {"canvas", "reread"}:
        return "answered"
    errors = {r.error for r in result.reads.values()}
    return f"{'/'.join(sorted(paths))}" + ("+error" if errors != {None} else "")


async def decide_all(model: CanvasDecisionModel, n: int, limit_s: float = 60) -> Counter[str]:
    """n concurrent decisions, each bounded by `limit_s` seconds (stretched: `bounded`); how each ended, counted."""
    async def one(i: int):
        try:
            return await bounded(model.adecide(f"{TICKET} (#{i})", QUESTIONS), limit_s, what="a decision")
        except CanvasRouteError:
            raise
        except TimeoutError:
            return "hung"

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    assert "hung" not in results, "a decision hung"
    return Counter(outcome(r) for r in results)


# -- fault injection against the loopback server -----------------------------------------------

FAULTS = {
    # name: (fault, error class it becomes)
    "429": (Fault(status=429), EngineOverloaded),
    "503": (Fault(status=503), EngineOverloaded),
    "500": (Fault(status=500), EngineUnavailable),
    "400": (Fault(status=400), EngineRequestError),
    "malformed JSON": (Fault(body=b'{"choices": [{"logprobs": '), EngineResponseError),
    "not an object": (Fault(body=b'"ok"'), EngineResponseError),
    "missing rows": (Fault(rows_delta=-1), EngineResponseError),
    "extra rows": (Fault(rows_delta=3), EngineResponseError),
    "NaN logprobs": (Fault(logprob=math.nan), EngineResponseError),
    "inf logprobs": (Fault(logprob=math.inf), EngineResponseError),
    "positive logprobs": (Fault(logprob=0.7), EngineResponseError),
    "read timeout": (Fault(delay=5.0), EngineTimeout),
    "connection dropped": (Fault(drop=True), EngineUnavailable),
}
N = 6


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FAULTS))
async def test_every_fault_ends_escalated_fallback_or_typed_error(name, mode):
    fault, error = FAULTS[name]
    async with LoopbackVLLM() as server:
        # only the read-timeout fault needs a short read timeout; the others get room, so a slow
        # CI core (two of them, the suite running) never turns a healthy reply into a retry
        timeout = 0.5 if error is EngineTimeout else patience(10.0)
        retries = Retries(max_retries=1, backoff=0.001)
        engine = VLLMServerEngine(Connection(server.url, timeout=timeout, retries=retries))
        model = make_model(engine, mode)
        assert outcome(await model.adecide(TICKET, QUESTIONS)) == "answered"  # healthy first
        server.inject(fault, times=None)
        before, sent = server.reads, engine.requests_sent
        counts = await decide_all(model, N)
        expected = {"escalate": "escalated+error", "raise": error.__name__, "fallback": "fallback+error"}[mode]
        assert counts == Counter({expected: N})
        # transient faults were retried once; a refused or unreadable answer was not
        attempts = 2 if error.retryable else 1
        assert engine.requests_sent - sent == N * attempts
        # every request the server received is an attempt the engine counted: a dropped one (the
        # server had it) is never sent again by the lane on its own (defect 10, issue #28)
        assert server.reads - before == N * attempts
        await engine.aclose()


async def test_escalated_reports_name_the_fault_and_the_target():
    async with LoopbackVLLM() as server:
        engine = VLLMServerEngine(Connection(server.url, retries=0))
        model = make_model(engine, "escalate")
        await model.adecide(TICKET, QUESTIONS)
        server.inject(Fault(status=500), times=None)
        resp = await model.adecide(TICKET, QUESTIONS)
        for report in resp.reads.values():
            assert report.path == "escalated" and report.error.startswith("EngineUnavailable")
            assert report.escalation_model == "GenericFakeChatModel" and report.canvas_probabilities is None
        assert resp.answers["team"].choice == "billing" and resp.answers["urgent"].noul == 1.0
        await engine.aclose()


async def test_transient_faults_then_recovery_answer_from_the_canvas():
    async with LoopbackVLLM() as server:
        engine = VLLMServerEngine(Connection(server.url, retries=Retries(max_retries=3, backoff=0.001)))
        model = make_model(engine, "raise")
        await engine.info()
        server.inject(Fault(status=429), times=1)
        server.inject(Fault(drop=True), times=1)
        server.inject(Fault(status=502), times=1)
        resp = await model.adecide(TICKET, QUESTIONS)
        # the server had the dropped request, so the lane does not send it again by itself: each of
        # the four reads on the server is an attempt the engine counted (defect 10, issue #28)
        assert outcome(resp) == "answered" and server.reads == 4 and engine.requests_sent == 4
        await engine.aclose()


async def test_a_slow_server_within_the_timeout_still_answers():
    async with LoopbackVLLM() as server:
        engine = VLLMServerEngine(Connection(server.url, timeout=patience(5), retries=0))
        model = make_model(engine, "raise")
        server.inject(Fault(delay=0.2), times=None)
        assert await decide_all(model, N) == Counter({"answered": N})
        await engine.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_connection_refused_after_the_server_went_away(mode):
    server = LoopbackVLLM()
    await server.start()
    engine = VLLMServerEngine(Connection(server.url,
                                         retries=Retries(max_retries=2, backoff=0.001, replica_cooldown=0.01)))
    model = make_model(engine, mode)
    assert outcome(await model.adecide(TICKET, QUESTIONS)) == "answered"
    await server.close()
    expected = {"escalate": "escalated+error", "raise": "EngineUnavailable", "fallback": "fallback+error"}[mode]
    assert await decide_all(model, N) == Counter({expected: N})
    await engine.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_an_engine_never_reached_ends_as_configured(mode):
    """No server was ever reached (no discovery, no plan): still escalated, fallback or raised."""
    engine = VLLMServerEngine(Connection(f"http://127.0.0.1:{_free_port()}",
                                         retries=Retries(max_retries=1, backoff=0.001)))
    expected = {"escalate": "escalated+error", "raise": "EngineUnavailable", "fallback": "fallback+error"}[mode]
    assert await decide_all(make_model(engine, mode), N) == Counter({expected: N})


async def test_a_connect_timeout_is_an_engine_timeout():
    attempts = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        attempts[request.url.path] += 1
        raise httpx.ConnectTimeout("connect timed out", request=request)

    engine = VLLMServerEngine(Connection("http://vllm.test:8000", retries=Retries(max_retries=2, backoff=0.001),
                                         transport=httpx.MockTransport(handler)))
    with pytest.raises(EngineTimeout, match="connect timed out"):
        await make_model(engine, "raise").adecide(TICKET, QUESTIONS)
    assert attempts["/v1/models"] == 3
    resp = await make_model(engine, "escalate").adecide(TICKET, QUESTIONS)
    assert outcome(resp) == "escalated+error"
    assert all(r.error.startswith("EngineTimeout") for r in resp.reads.values())


# -- replicas -----------------------------------------------------------------------------------


def _stats(url: str) -> int:
    return httpx.get(f"{url}/_loopback/stats", timeout=patience(5)).json()["reads"]


async def test_replicas_share_reads_and_survive_losing_one_mid_run():
    with spawn() as a, spawn() as b:
        engine = VLLMServerEngine(Connection([a.url, b.url], limits=Limits(max_concurrency=16),
                                             retries=Retries(max_retries=3, backoff=0.01, replica_cooldown=30)))
        model = make_model(engine, "raise")  # any unanswered read would raise here
        assert await decide_all(model, 200) == Counter({"answered": 200})
        spread = (_stats(a.url), _stats(b.url))
        assert sum(spread) == 200 and min(spread) >= 80, spread  # round-robin: roughly even

        done = Counter()
        killed_at = None

        async def worker(ids: Iterator[int]) -> None:
            nonlocal killed_at
            for i in ids:
                resp = await bounded(model.adecide(f"{TICKET} (#{i})", QUESTIONS), 30, what="a decision")
                done[outcome(resp)] += 1
                if killed_at is None and sum(done.values()) >= 100:
                    killed_at = sum(done.values())
                    a.kill()  # SIGKILL mid-run: open connections reset, new ones refused

        ids = iter(range(400))
        await asyncio.gather(*(worker(ids) for _ in range(32)))
        assert killed_at == 100 and done == Counter({"answered": 400})
        assert a.proc.returncode == -signal.SIGKILL
        assert _stats(b.url) - spread[1] >= 300  # everything after the kill went to b
        await engine.aclose()


# -- the real vLLM server, killed while decisions are in flight --------------------------------


@pytest.mark.vllm
async def test_real_vllm_killed_mid_run_every_decision_accounted_for(spare_vllm):
    url, pid = spare_vllm.url, spare_vllm.pid
    engine = VLLMServerEngine(Connection(url, timeout=Timeout(read=patience(20), connect=patience(2)),
                                         retries=Retries(max_retries=2, backoff=0.05, replica_cooldown=0.5)))
    models = {mode: make_model(engine, mode, policy=GatePolicy(rereads=2)) for mode in MODES}
    for model in models.values():  # discovery and plans, while the server is up
        await model.adecide(TICKET, QUESTIONS)
    per_mode = 6

    async def one(mode: str, i: int):
        try:
            return mode, await bounded(models[mode].adecide(f"{TICKET} (#{i})", QUESTIONS), 120, what="a decision")
        except CanvasRouteError as exc:
            return mode, exc
        except TimeoutError:
            return mode, "hung"
        except Exception as exc:  # noqa: BLE001 - counted below; untyped ones fail the test
            return mode, exc

    tasks = [asyncio.ensure_future(one(mode, i)) for mode in MODES for i in range(per_mode)]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    os.kill(pid, signal.SIGKILL)  # the API server dies with reads in flight
    in_flight_at_kill = len(pending)
    results = [await t for t in tasks]

    assert in_flight_at_kill > 0
    ends: dict[str, Counter[str]] = {mode: Counter() for mode in MODES}
    for mode, result in results:
        assert result != "hung"
        ends[mode][outcome(result)] += 1
    assert sum(sum(c.values()) for c in ends.values()) == len(MODES) * per_mode  # none lost
    allowed = {
        "escalate": {"answered", "escalated", "escalated+error", "canvas/escalated", "escalated/reread",
                     "canvas/escalated+error", "escalated/reread+error", "canvas/escalated/reread",
                     "canvas/escalated/reread+error"},
        "raise": {"answered", "escalated", "canvas/escalated", "escalated/reread", "canvas/escalated/reread",
                  "EngineUnavailable", "EngineTimeout"},
        "fallback": {"answered", "fallback+error", "canvas/fallback+error", "fallback/reread+error",
                     "canvas/fallback/reread+error"},
    }
    for mode in MODES:
        assert set(ends[mode]) <= allowed[mode], (mode, ends[mode])
    faulted = sum(n for c in ends.values() for k, n in c.items() if "error" in k or k.startswith("Engine"))
    assert faulted >= in_flight_at_kill // 2  # the kill reached decisions in flight
    # after the crash, new decisions still end as configured (no hang, typed)
    after = await decide_all(models["escalate"], 3, limit_s=60)
    assert after == Counter({"escalated+error": 3})
    await engine.aclose()


# -- secrets ------------------------------------------------------------------------------------

SECRET = "sk-canvasroute-SECRET-4711"


@contextmanager
def span_exporter() -> Iterator[InMemorySpanExporter]:
    """A fresh global SDK tracer provider for this block (restores the previous one)."""
    exporter = InMemorySpanExporter()
    with fresh_tracer_provider(exporter):
        yield exporter


def _errors_text(exc: BaseException) -> str:
    parts = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts += [str(exc), repr(exc), str(getattr(exc, "hint", "")), repr(exc.args)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


async def test_the_api_key_never_reaches_spans_logs_or_errors(caplog):
    caplog.set_level(logging.DEBUG)
    seen_errors: list[str] = []
    with span_exporter() as exporter:
        async with LoopbackVLLM() as server:
            engine = VLLMServerEngine(Connection(server.url, api_key=SECRET, timeout=0.5,
                                                 retries=Retries(max_retries=1, backoff=0.001)))
            escalating = make_model(engine, "escalate")
            raising = make_model(engine, "raise")
            await escalating.adecide(TICKET, QUESTIONS)
            for fault in (Fault(status=401), Fault(status=500), Fault(delay=2), Fault(drop=True),
                          Fault(body=b"not json"), Fault(logprob=math.nan)):
                server.clear()
                server.inject(fault, times=None)
                await escalating.adecide(TICKET, QUESTIONS)
                with pytest.raises(CanvasRouteError) as info:
                    await raising.adecide(TICKET, QUESTIONS)
                seen_errors.append(_errors_text(info.value))
            assert {h.get("authorization") for h in server.headers} == {f"Bearer {SECRET}"}  # it was sent
            url = server.url
        with pytest.raises(EngineUnavailable) as info:  # the server is gone now
            await raising.adecide(TICKET, QUESTIONS)
        seen_errors.append(_errors_text(info.value))
        seen_errors.append(repr(engine) + repr(raising))
        spans = exporter.get_finished_spans()
    assert len(spans) > 10 and any(s.status.status_code.name == "ERROR" for s in spans)
    dumped = "\n".join(s.to_json() for s in spans)
    assert url in dumped or "127.0.0.1" in dumped  # spans do carry request details...
    assert SECRET not in dumped  # ...but never the key
    assert SECRET not in caplog.text and "Bearer" not in caplog.text
    assert len(seen_errors) == 8 and not any(SECRET in text for text in seen_errors)
    assert all(SECRET not in json.dumps(r.msg if isinstance(r.msg, str) else str(r.msg)) for r in caplog.records)
    await engine.aclose()
