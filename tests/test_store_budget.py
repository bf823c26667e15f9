"""Escalation budgets shared by worker processes through a real PostgresStore.

Each worker (tests/budget_worker.py) is its own Python process running many concurrent
graph runs whose decision node wants to escalate every time; the graphs are compiled
with a `PostgresStore` in the suite's PostgreSQL, so the node counts its model's budget
there (`StoreBudgetMeter`). The window and per-thread caps hold in total, refunds free
capacity for other processes, and what the store holds is exactly what escalated.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections import Counter
from typing import Any

import pytest
from conftest import ROOT
from deadlines import Watch, finish
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres import PostgresStore
from services import PYTHON, child_env

from canvasroute.harness import StoreBudgetMeter
from canvasroute.router import BudgetMeter, EscalationBudget

WORKER = str(ROOT / "tests" / "budget_worker.py")


@pytest.fixture(scope="module")
def store_dsn(postgres_dsn: str) -> str:
    """The suite's PostgreSQL with the store's tables (set up once, before the workers race)."""
    with PostgresStore.from_conn_string(postgres_dsn) as store:
        store.setup()
    return postgres_dsn


def _spawn(dsn: str, scope: str, n: int, per_window: int, per_thread: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, WORKER, dsn, scope, str(n), str(per_window), str(per_thread), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def _result(proc: subprocess.Popen) -> dict[str, Any]:
    out, err = finish(proc, Watch(proc.pid, cpu_s=120, idle_s=120, what="the budget worker"))
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def _granted_in_store(dsn: str, scope: str) -> list[dict[str, Any]]:
    with PostgresStore.from_conn_string(dsn) as store:
        items = store.search(("canvasroute", "budget", scope, "window"), limit=10_000)
    return [i.value for i in items]


@pytest.mark.services
def test_two_workers_never_exceed_the_shared_window_or_thread_cap(store_dsn: str) -> None:
    scope, cap, per_thread = f"shared-{uuid.uuid4().hex[:8]}", 10, 2
    # 2 processes x 48 concurrent decisions = 96 wanting to escalate; each worker's first 3 escalations fail (refunded)
    workers = [_spawn(store_dsn, scope, 48, cap, per_thread) for _ in range(2)]
    results = [_result(w) for w in workers]
    escalated = [t for r in results for t in r["escalated"]]
    assert len(escalated) <= cap, f"{len(escalated)} escalations in a window of {cap}"
    assert Counter(escalated)["hot"] <= per_thread, "the per-thread cap was exceeded across workers"
    assert len(escalated) >= cap // 2, f"only {len(escalated)} of {cap} granted: the meter starves"
    assert sum(r["failed"] for r in results) >= 1, "no escalation failed, so no refund was exercised"
    # the store holds exactly the escalations that happened: grants refunded on failure are gone
    held = _granted_in_store(store_dsn, scope)
    assert len(held) == len(escalated)
    assert {v["state"] for v in held} <= {"granted"}


@pytest.mark.services
def test_a_refund_in_one_process_frees_budget_for_another(store_dsn: str) -> None:
    scope, cap = f"refund-{uuid.uuid4().hex[:8]}", 6
    first = _result(_spawn(store_dsn, scope, 24, cap, 100, "--fail-all"))
    assert first["escalated"] == [] and first["failed"] >= 1, first  # granted, failed, refunded
    assert _granted_in_store(store_dsn, scope) == []
    second = _result(_spawn(store_dsn, scope, 24, cap, 100))
    # its first 3 escalations fail; the rest fill the whole window the first process gave back
    assert len(second["escalated"]) == cap, second


async def test_store_meter_counts_like_the_in_memory_one_in_a_single_process() -> None:
    meter = StoreBudgetMeter(InMemoryStore(), EscalationBudget(max_per_window=5, window_s=60, max_per_thread=3))
    assert isinstance(meter, BudgetMeter)
    assert [await meter.take(2, t) for t in ("a", "a", "b", "c")] == [2, 1, 2, 0]
    await meter.refund(1, "a")
    assert await meter.take(3, "c") == 1
    assert meter.snapshot() == {"granted": 5, "refused": 5, "refunded": 1, "in_window": 5}


def test_store_meter_rejects_what_is_not_a_store() -> None:
    with pytest.raises(TypeError, match="BaseStore"):
        StoreBudgetMeter({}, EscalationBudget(max_per_window=1))  # type: ignore[arg-type]
