"""Support-ticket triage: team, urgency and severity in ONE canvas read, then route.

```
START -> triage -.-> billing | technical | account | on_call -> END
```

`triage` asks three questions about the ticket in one read. Urgent, severe tickets go
to `on_call`; the rest to their team. Run it: `canvasroute demo`, or
`python -m examples.triage [vLLM URL]` from the repository.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from langchain_core.decisions import Choice, Noul, Score
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import RetryPolicy
from pydantic import JsonValue
from typing_extensions import TypedDict

from canvasroute.harness import decision_node, merge_decisions, retry_on
from canvasroute.router import CanvasDecisionModel

from .model import EMBEDDED_NOTE, make_model

TEAMS: dict[str, JsonValue] = {
    "billing": "payments, invoices, refunds, subscriptions",
    "technical": "bugs, errors, crashes, outages",
    "account": "login, password, profile, access",
}
QUESTIONS = {
    "team": Choice(instructions="Which team should handle this support ticket?", criteria=TEAMS),
    "urgent": Noul(instructions="Does the customer need an answer within the hour?"),
    "severity": Score(instructions="How badly is the customer affected?",
                      criteria=["not at all", "a little", "badly", "cannot work at all"]),
}
SAMPLE_TICKETS = (
    "I was charged twice for my subscription this month. Please refund one payment.",
    "Our whole team gets a 500 error on every page since this morning. Nothing works!",
    "How do I change the email address on my profile?",
)


class TicketState(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict[str, Any], merge_decisions]
    handled_by: str


def route(decisions: dict[str, Any]) -> str:
    """Urgent and at least `badly` affected: on call; otherwise the ticket's team."""
    if decisions["urgent"]["answer"] == "yes" and int(decisions["severity"]["answer"]) >= 2:
        return "on_call"
    return str(decisions["team"]["answer"])


def build_graph(model: CanvasDecisionModel, *, on_call: bool = True,
                checkpointer: BaseCheckpointSaver[Any] | None = None
                ) -> CompiledStateGraph[TicketState, None, TicketState, TicketState]:
    """The triage graph; `on_call=False` routes on the team alone (no on-call lane)."""
    if on_call:
        triage = decision_node(model, QUESTIONS, inputs="ticket", route=route, destinations=[*TEAMS, "on_call"])
    else:
        triage = decision_node(model, QUESTIONS, inputs="ticket", route=("team", {t: t for t in TEAMS}))
    builder = StateGraph(TicketState)
    builder.add_node("triage", triage, retry_policy=RetryPolicy(max_attempts=3, retry_on=retry_on))
    builder.add_edge(START, "triage")
    for lane in [*TEAMS, "on_call"] if on_call else TEAMS:
        builder.add_node(lane, _handler(lane))
        builder.add_edge(lane, END)
    return builder.compile(checkpointer=checkpointer)


def _handler(lane: str) -> Any:
    def handle(state: TicketState) -> dict[str, str]:
        return {"handled_by": lane}

    handle.__name__ = lane
    return handle


def run_samples(model: CanvasDecisionModel, tickets: Sequence[str] = SAMPLE_TICKETS, *,
                progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Triage each ticket; per ticket the lane taken and, per question, answer, path, entropy
    and its whole `read` (the `ReadReport` as JSON).

    `progress(1)` is called after each ticket.
    """
    graph = build_graph(model)
    results = []
    for ticket in tickets:
        out = graph.invoke({"ticket": ticket})
        if progress is not None:
            progress(1)
        results.append({
            "ticket": ticket,
            "handled_by": out["handled_by"],
            "decisions": {qid: {"answer": d["answer"], "path": d["path"],
                                "normalized_entropy": d["read"]["normalized_entropy"],
                                "probabilities": d["read"]["probabilities"], "confident": d["read"]["confident"],
                                "escalation_model": d["read"]["escalation_model"], "read": d["read"]}
                          for qid, d in out["decisions"].items()},
        })
    return results


def main(engine_url: str | None = None) -> list[dict[str, Any]]:
    """Triage the sample tickets on a vLLM server (or the embedded CPU model) and print them."""
    if engine_url is None:
        print(EMBEDDED_NOTE)
    results = run_samples(make_model(engine_url))
    for r in results:
        answers = ", ".join(f"{q}={d['answer']} ({d['path']})" for q, d in r["decisions"].items())
        print(f"{r['handled_by']:>9}  {answers}  <- {r['ticket'][:50]}")
    return results

