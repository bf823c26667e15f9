"""The supervisor, LangGraph's multi-agent tutorial ported: its pick of the next worker is a canvas read.

```
START -> supervisor -.-> researcher | coder | END        researcher -> supervisor    coder -> supervisor
```

The tutorial's supervisor asks an LLM for its `Router` schema (`next: Literal[...]`) and returns
`Command(goto=...)`; here that pick is a decision node on `questions_from_schema(Router)`, reading
the conversation (`MessagesState`) under the tutorial's system prompt. The workers, ReAct agents
with a search tool and a Python REPL in the tutorial, are STAND-INs: plain functions, so the
example runs offline. The route takes the state too: after `MAX_TURNS` worker turns it finishes,
whatever the pick (the tutorial leans on the recursion limit).

Reads per run: one decision set per supervisor turn (so n worker turns cost n + 1 sets), one
canvas read each when the gate passes it (up to `GatePolicy.rereads` more when not); `history=`
keeps every turn's record, so `run_totals(out["decisions"])` counts them all. With
`review=ReviewPolicy()` and a checkpointer an unsure pick waits for a person
(`Command(resume="coder")`), and the resume reads nothing again.
Run it: `python -m examples.supervisor [vLLM URL]`.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, RetryPolicy
from typing_extensions import TypedDict

from canvasroute import (
    CanvasDecisionModel,
    ReviewPolicy,
    decision_node,
    merge_decisions,
    questions_from_schema,
    retry_on,
    run_totals,
)

from . import EMBEDDED_NOTE, make_model

MEMBERS = ("researcher", "coder")
MAX_TURNS = 4
SYSTEM_PROMPT = (f"You are a supervisor tasked with managing a conversation between the following workers: "
                 f"{', '.join(MEMBERS)}. Given the following user request, respond with the worker to act next. "
                 "Each worker will perform a task and respond with their results and status. When finished, "
                 "respond with FINISH.")
SAMPLE_REQUESTS = ("What's the square root of 42?", "Find the GDP of France in 2023, then plot it.")


class Router(TypedDict):
    """Worker to route to next. If no workers needed, route to FINISH."""

    next: Literal["researcher", "coder", "FINISH"]


class State(MessagesState):
    decisions: Annotated[dict[str, Any], merge_decisions]


def next_worker(decisions: dict[str, Any], state: State) -> str:
    """The supervisor's pick; END for FINISH, and once the workers have had `MAX_TURNS` turns."""
    pick, turns = decisions["next"]["answer"], sum(m.name in MEMBERS for m in state["messages"])
    return END if pick == "FINISH" or turns >= MAX_TURNS else pick


def researcher(state: State) -> Command[Literal["supervisor"]]:
    """STAND-IN for the research agent (web search): a note on the request."""
    note = f"Research notes on: {state['messages'][0].text}"
    return Command(goto="supervisor", update={"messages": [HumanMessage(note, name="researcher")]})


def coder(state: State) -> Command[Literal["supervisor"]]:
    """STAND-IN for the coder agent (Python REPL): the code it would run."""
    code = f"print(answer({state['messages'][0].text!r}))"
    return Command(goto="supervisor", update={"messages": [HumanMessage(f"Ran: {code}", name="coder")]})


def build_graph(model: CanvasDecisionModel, *, review: ReviewPolicy | None = None,
                checkpointer: BaseCheckpointSaver[Any] | None = None) -> CompiledStateGraph[Any]:
    supervisor = decision_node(model, questions_from_schema(Router), inputs="messages",
                               read={"instructions": SYSTEM_PROMPT}, route=next_worker,
                               destinations=(*MEMBERS, END), history=MAX_TURNS, review=review)
    builder = StateGraph(State)
    builder.add_edge(START, "supervisor")
    builder.add_node("supervisor", supervisor, retry_policy=RetryPolicy(retry_on=retry_on))
    builder.add_node("researcher", researcher)
    builder.add_node("coder", coder)
    return builder.compile(checkpointer=checkpointer)


def main(engine_url: str | None = None) -> list[dict[str, Any]]:
    """Run each sample request and print who worked, in order, and what the picks cost."""
    if engine_url is None:
        print(EMBEDDED_NOTE)
    graph = build_graph(make_model(engine_url))
    results = []
    for request in SAMPLE_REQUESTS:
        out = graph.invoke({"messages": [("user", request)]})
        workers = [m.name for m in out["messages"] if m.name in MEMBERS]
        totals = run_totals(out["decisions"])
        results.append({"request": request, "workers": workers, "totals": totals, "decisions": out["decisions"]})
        print(f"{request} -> {' -> '.join(workers) or 'FINISH'} ({totals.decisions} picks, {totals.reads} reads)")
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
