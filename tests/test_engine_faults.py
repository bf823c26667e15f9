"""With the engine down, every decision is escalated, falls back, or raises as configured.

None is answered from nothing (no canvas/reread path without a read), none hangs (each
decision is bounded by `deadlines.bounded`), none is lost (N concurrent decisions end
in exactly N outcomes). Faults: a closed port (connection refused), an
`httpx.MockTransport` answering 500, a transport that sleeps past the read timeout, a
real socket that accepts and never answers, and (against the REAL vLLM server) a server
that plans fine but whose reads fail.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from deadlines import bounded, patience
from langchain_core.decisions import Choice, Noul
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda

from canvasroute.engine import (
    BudgetExhausted,
    CanvasRouteError,
    Connection,
    EngineTimeout,
    EngineUnavailable,
    EscalationError,
    Retries,
    VLLMServerEngine,
)
from canvasroute.engine.testing import FailingPaths, SleepingTransport
from canvasroute.router import (
    CanvasDecisionModel,
    CanvasResponse,
    Escalation,
    EscalationBudget,
    OutcomePolicy,
)

N = 8
QUESTIONS = {
    "team": Choice(instructions="Which team owns this ticket?", criteria={"billing": None, "tech": None}),
    "urgent": Noul(instructions="Does it need an answer today?"),
}
FALLBACK = {"team": "tech", "urgent": "yes"}
DEADLINE = 20.0
"""Seconds any one decision may take before the test calls it hung (a quiet machine's: `bounded` stretches them)."""


class Target:
    """An escalation target (a Runnable) answering every asked question, counting calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail
        self.runnable = RunnableLambda(self._reply, name="big-model")

    def _reply(self, messages):
        asked = re.findall(r'^Question "([^"]+)"', messages[-1].content, re.MULTILINE)
        self.calls.append(asked)
        if self.fail:
            raise ConnectionError("the big model is down too")
        return AIMessage(json.dumps({q: {"team": "billing", "urgent": "no"}[q] for q in asked}))


def make_model(engine, mode: str, target: Target | None = None, budget: EscalationBudget | None = None,
               **outcomes: Any) -> CanvasDecisionModel:
    """A model whose engine faults take `mode` (`outcomes`: `OutcomePolicy`'s other fields)."""
    if mode == "fallback":
        return CanvasDecisionModel(engine=engine, outcomes=OutcomePolicy(engine_fault="fallback", fallback=FALLBACK))
    escalation = Escalation(target.runnable, budget=budget) if target else None
    return CanvasDecisionModel(engine=engine, escalate_to=escalation, outcomes=OutcomePolicy(engine_fault=mode,
                                                                                            **outcomes))


def outcome(result: CanvasResponse | BaseException) -> str:
    """How one decision ended; anything untyped (or a hang) fails the test."""
    if isinstance(result, CanvasRouteError):
        return type(result).__name__
    if isinstance(result, TimeoutError):
        pytest.fail(f"a decision hung past {DEADLINE}s")
    if isinstance(result, BaseException):
        raise result
    paths = {r.path for r in result.reads.values()}
    if paths & {"canvas", "reread"}:
        return "answered"
    for r in result.reads.values():  # escalated or fallback: the engine fault is on record
        assert r.error is not None and not r.confident
    return "+".join(sorted(paths))


async def decide_all(model: CanvasDecisionModel, n: int = N) -> Counter:
    """n concurrent decisions (distinct states), each bounded; counts how each ended."""
    results = await asyncio.gather(
        *(bounded(model.adecide(f"ticket {i}: I was charged twice.", QUESTIONS), DEADLINE)
          for i in range(n)), return_exceptions=True)
    counts = Counter(outcome(r) for r in results)
    assert sum(counts.values()) == n  # none lost
    return counts


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: connecting is refused


EXPECTED = {
    # mode, has target -> outcome of every decision
    ("escalate", True): "escalated",
    ("escalate", False): None,  # the typed engine error (filled per fault)
    ("raise", True): None,
    ("fallback", False): "fallback",
}


def expected(mode: str, has_target: bool, error: type[Exception]) -> str:
    return EXPECTED[(mode, has_target)] or error.__name__


CASES = list(EXPECTED)


# -- a cold engine: never reached --------------------------------------------------------------


@pytest.mark.parametrize("mode, has_target", CASES)
async def test_connection_refused(mode, has_target):
    target = Target() if has_target else None
    engine = VLLMServerEngine(Connection(f"http://127.0.0.1:{closed_port()}",
                                         retries=Retries(max_retries=1, backoff=0.001)))
    model = make_model(engine, mode, target)
    counts = await decide_all(model)
    assert counts == Counter({expected(mode, has_target, EngineUnavailable): N})
    if mode == "escalate" and has_target:
        assert target.calls == [["team", "urgent"]] * N  # one call per decision, both questions
    elif target:
        assert target.calls == []
    await engine.aclose()


async def test_the_escalated_report_records_the_fault():
    target = Target()
    engine = VLLMServerEngine(Connection(f"http://127.0.0.1:{closed_port()}", retries=0))
    resp = await bounded(make_model(engine, "escalate", target).adecide("hi", QUESTIONS), DEADLINE)
    assert resp.canvas_reads == 0 and resp.usage["input_tokens"] == 0
    for qid, answer in (("team", "billing"), ("urgent", "no")):
        r = resp.reads[qid]
        assert (r.path, r.answer, r.reads, r.confident, r.escalation_model) == (
            "escalated", answer, 0, False, "big-model")
        assert r.error.startswith("EngineUnavailable") and "is the server running at this URL" in r.error
        assert r.canvas_probabilities is None and r.entropy is None
    await engine.aclose()


@pytest.mark.parametrize("mode, has_target", CASES)
async def test_http_500_everywhere(mode, has_target):
    seen = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] += 1
        return httpx.Response(500, json={"error": {"message": "internal error"}})

    target = Target() if has_target else None
    engine = VLLMServerEngine(Connection("http://127.0.0.1:9", retries=Retries(max_retries=2, backoff=0.001),
                                         transport=httpx.MockTransport(handler)))
    counts = await decide_all(make_model(engine, mode, target))
    assert counts == Counter({expected(mode, has_target, EngineUnavailable): N})
    # concurrent decisions share one discovery (single flight); each attempt made its 1 + 2 retries
    assert seen["/v1/models"] >= 3 and seen["/v1/models"] % 3 == 0
    await engine.aclose()


@pytest.mark.parametrize("mode, has_target", CASES)
async def test_a_transport_that_sleeps_past_the_timeout(mode, has_target):
    target = Target() if has_target else None
    transport = SleepingTransport()
    engine = VLLMServerEngine(Connection("http://127.0.0.1:9", timeout=0.2,
                                         retries=Retries(max_retries=1, backoff=0.001), transport=transport))
    counts = await decide_all(make_model(engine, mode, target))
    assert counts == Counter({expected(mode, has_target, EngineTimeout): N})
    assert transport.requests >= 2 and transport.requests % 2 == 0  # each discovery: 1 try + 1 retry
    await engine.aclose()


@contextmanager
def black_hole() -> Iterator[str]:
    """A real TCP listener that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.mark.parametrize("mode", ["escalate", "raise"])
async def test_a_real_socket_that_never_answers(mode):
    target = Target()
    with black_hole() as url:
        engine = VLLMServerEngine(Connection(url, timeout=0.3, retries=0))
        counts = await decide_all(make_model(engine, mode, target), n=4)
        await engine.aclose()
    assert counts == Counter({"escalated" if mode == "escalate" else "EngineTimeout": 4})


# -- budgets and a failing escalation while the engine is down ------------------------------------


async def test_engine_down_with_a_answer_budget_escalates_what_it_may_and_raises_the_rest():
    target = Target()
    engine = VLLMServerEngine(Connection(f"http://127.0.0.1:{closed_port()}", retries=0))
    model = make_model(engine, "escalate", target, budget=EscalationBudget(max_per_window=6))
    counts = await decide_all(model)
    # 2 questions per decision: 3 decisions fit the budget; the rest cannot keep a canvas answer
    assert counts == Counter({"escalated": 3, "BudgetExhausted": N - 3})
    assert model.budget_counters["granted"] == 6 and len(target.calls) == 3
    await engine.aclose()


async def test_engine_down_with_a_fallback_budget_falls_back_past_it():
    target = Target()
    engine = VLLMServerEngine(Connection(f"http://127.0.0.1:{closed_port()}", retries=0))
    model = make_model(engine, "escalate", target, budget=EscalationBudget(max_per_window=4), fallback=FALLBACK,
                       over_budget="fallback")
    counts = await decide_all(model)
    assert counts == Counter({"escalated": 2, "fallback": N - 2})
    await engine.aclose()


async def test_engine_down_and_escalation_down_raise_escalation_errors():
    target = Target(fail=True)
    engine = VLLMServerEngine(Connection(f"http://127.0.0.1:{closed_port()}", retries=0))
    counts = await decide_all(make_model(engine, "escalate", target))
    assert counts == Counter({"EscalationError": N})
    assert len(target.calls) == N  # sent once: the target owns its transport retries
    assert issubclass(EscalationError, CanvasRouteError) and issubclass(BudgetExhausted, CanvasRouteError)
    await engine.aclose()


# -- a REAL vLLM server that plans fine, then fails its reads ------------------------------------------


def reads_fail(fault: str) -> FailingPaths:
    """Discovery and /tokenize reach the real server; canvas reads (chat) get `fault`."""
    return FailingPaths({"/v1/chat/completions"}, status=500 if fault == "500" else None,
                        message="CUDA error: an illegal memory access")


@pytest.mark.vllm
@pytest.mark.parametrize("fault, error", [("500", EngineUnavailable), ("sleep", EngineTimeout)])
@pytest.mark.parametrize("mode, has_target", CASES)
async def test_real_server_plans_then_reads_fail(vllm_url, fault, error, mode, has_target):
    target = Target() if has_target else None
    transport = reads_fail(fault)
    retries = 1 if fault == "500" else 0  # a timeout costs the full 2 s (stretched) per try
    info = await VLLMServerEngine(vllm_url).info()  # discovery (one real read) with the default timeout
    # 2 s of a quiet machine: a read that sleeps times out, a /tokenize the busy real server answers does not
    engine = VLLMServerEngine(Connection(vllm_url, timeout=patience(2.0),
                                         retries=Retries(max_retries=retries, backoff=0.001),
                                         transport=transport),
                              canvas_width=info.canvas_width, vocab_size=info.vocab_size)
    model = make_model(engine, mode, target)
    assert (await engine.info()).model == info.model  # the rest of discovery against the real server works
    counts = await decide_all(model)
    assert counts == Counter({expected(mode, has_target, error): N})
    assert transport.failed == (1 + retries) * N  # every decision read (and retried) before it gave up
    if mode == "escalate" and has_target:
        assert target.calls == [["team", "urgent"]] * N
    await engine.aclose()


@pytest.mark.vllm
async def test_real_server_faulty_reads_are_reported_on_the_escalated_answers(vllm_url):
    target = Target()
    engine = VLLMServerEngine(Connection(vllm_url, retries=0, transport=reads_fail("500")))
    resp = await bounded(make_model(engine, "escalate", target).adecide("hi", QUESTIONS), DEADLINE)
    assert resp.canvas_reads == 1  # the first read was attempted (and failed); no re-reads
    for r in resp.reads.values():
        assert r.path == "escalated" and r.reads == 0 and r.labels  # the plan (labels) was made
        assert "HTTP 500" in r.error and "illegal memory access" in r.error
    assert math.isclose(sum(resp.answers["team"].probabilities.values()), 1.0)
    await engine.aclose()
