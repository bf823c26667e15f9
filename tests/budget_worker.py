"""A worker process for the shared-budget tests (tests/test_store_budget.py).

    python tests/budget_worker.py DSN SCOPE N_DECISIONS MAX_PER_WINDOW MAX_PER_THREAD [--fail-all]

Runs N_DECISIONS graph runs at once (asyncio.gather), each a decision node whose every
question wants to escalate (the engine reads 50/50), in a graph compiled with a real
`PostgresStore` (set up by the test), so the node counts its model's budget there. Every 4th decision runs in
the thread `hot`, the others in a thread of their own. The escalation target fails its
first FAIL_FIRST calls (all with --fail-all); a failed escalation's grant is refunded.
Prints JSON: the threads whose escalation happened, and how many escalation calls failed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from typing import Any

from langchain_core.decisions import Choice
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from langgraph.graph import START, StateGraph
from langgraph.store.postgres import PostgresStore
from typing_extensions import TypedDict

from canvasroute.engine import EscalationError, FunctionEngine
from canvasroute.harness import decision_node
from canvasroute.router import CanvasDecisionModel, Escalation, EscalationBudget, GatePolicy, OutcomePolicy

FAIL_FIRST = 3
"""The first escalation calls of each worker fail (their grants are refunded)."""
TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})


class State(TypedDict, total=False):
    ticket: str
    decisions: dict


def main(dsn: str, scope: str, n: int, per_window: int, per_thread: int, fail_all: bool) -> dict[str, Any]:
    escalated: list[str] = []
    failed = 0

    async def target(messages: Any, config: Any = None) -> AIMessage:
        nonlocal failed
        await asyncio.sleep(0.02)  # an escalation takes a while: decisions overlap
        if fail_all or failed < FAIL_FIRST:
            failed += 1
            raise RuntimeError("escalation target down")
        return AIMessage(json.dumps({"team": "tech"}))

    engine = FunctionEngine(lambda read: [{i: math.log(0.5) for i in read.label_ids}] * len(read.slots))
    budget = EscalationBudget(max_per_window=per_window, window_s=3600, max_per_thread=per_thread)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0),
                                escalate_to=Escalation(RunnableLambda(target), budget=budget, name=scope),
                                outcomes=OutcomePolicy(over_budget="answer"))
    builder = StateGraph(State)
    builder.add_node("triage", decision_node(model, {"team": TEAM}, inputs="ticket"))
    builder.add_edge(START, "triage")

    async def one(graph: Any, i: int) -> None:
        thread = "hot" if i % 4 == 0 else f"t{i}-{os.getpid()}"
        ticket = f"ticket {i}"
        try:
            out = await graph.ainvoke({"ticket": ticket}, {"configurable": {"thread_id": thread}})
        except EscalationError:
            return
        if out["decisions"]["team"]["path"] == "escalated":
            escalated.append(thread)

    async def run() -> None:
        with PostgresStore.from_conn_string(dsn) as store:
            graph = builder.compile(store=store)
            await asyncio.gather(*(one(graph, i) for i in range(n)))

    asyncio.run(run())
    return {"escalated": escalated, "failed": failed}


if __name__ == "__main__":
    dsn, scope, n, window, thread, *rest = sys.argv[1:]
    json.dump(main(dsn, scope, int(n), int(window), int(thread), "--fail-all" in rest), sys.stdout)
