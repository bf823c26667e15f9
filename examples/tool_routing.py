"""Tool routing: one Choice picks the tool for the user's last message.

```
START -> pick_tool -.-> calculator | clock | search | respond -> END
```

Run it: `python -m examples.tool_routing [vLLM URL]`.
"""

from __future__ import annotations

import ast
import operator
import re
import sys
from datetime import UTC, datetime
from typing import Annotated, Any

from langchain_core.decisions import Choice
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import RetryPolicy

from canvasroute import CanvasDecisionModel, decision_node, merge_decisions, retry_on

from . import EMBEDDED_NOTE, make_model

TOOLS = {
    "calculator": "arithmetic on numbers in the message",
    "clock": "the current date or time",
    "search": "a fact to look up",
    "respond": "chit-chat that needs no tool",
}
FACTS = {"capital of france": "Paris", "boiling point of water": "100 °C at sea level"}
SAMPLE_MESSAGES = ("What is 17 * 23?", "What time is it?", "What is the capital of France?", "Hi there!")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


class ToolState(MessagesState):
    decisions: Annotated[dict, merge_decisions]


def last_message(state: ToolState) -> str:
    return state["messages"][-1].text


def calculator(state: ToolState) -> dict[str, list[AIMessage]]:
    """Evaluate the first arithmetic expression in the message (numbers and + - * / only)."""
    match = re.search(r"[-+*/().\d\s]*\d[-+*/().\d\s]*", last_message(state))
    try:
        reply = str(_evaluate(ast.parse(match.group().strip(), mode="eval").body)) if match else None
    except (SyntaxError, ValueError, ZeroDivisionError):
        reply = None
    return {"messages": [AIMessage(reply or "I found no arithmetic to do.")]}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("not arithmetic")


def clock(state: ToolState) -> dict[str, list[AIMessage]]:
    return {"messages": [AIMessage(datetime.now(UTC).strftime("It is %H:%M UTC on %Y-%m-%d."))]}


def search(state: ToolState) -> dict[str, list[AIMessage]]:
    """Look the message up in a tiny offline fact table (a stand-in for a search tool)."""
    text = last_message(state).lower()
    found = next((fact for key, fact in FACTS.items() if key in text), "I could not find that.")
    return {"messages": [AIMessage(found)]}


def respond(state: ToolState) -> dict[str, list[AIMessage]]:
    return {"messages": [AIMessage("Hello! Ask me a sum, the time, or a fact.")]}


def build_graph(model: CanvasDecisionModel) -> CompiledStateGraph:
    pick_tool = decision_node(
        model, {"tool": Choice(instructions="Which tool answers the user's last message?", criteria=TOOLS)},
        inputs=last_message, route=("tool", {tool: tool for tool in TOOLS}))
    builder = StateGraph(ToolState)
    builder.add_node("pick_tool", pick_tool, retry_policy=RetryPolicy(retry_on=retry_on))
    builder.add_edge(START, "pick_tool")
    for tool in (calculator, clock, search, respond):
        builder.add_node(tool)
        builder.add_edge(tool.__name__, END)
    return builder.compile()


def main(engine_url: str | None = None) -> list[dict[str, Any]]:
    """Route each sample message to a tool and print the reply."""
    if engine_url is None:
        print(EMBEDDED_NOTE)
    graph = build_graph(make_model(engine_url))
    results = []
    for text in SAMPLE_MESSAGES:
        out = graph.invoke({"messages": [HumanMessage(text)]})
        tool = out["decisions"]["tool"]
        results.append({"message": text, "tool": tool["answer"], "path": tool["path"],
                        "reply": out["messages"][-1].text})
        print(f"{text:<32} -> {tool['answer']:<10} ({tool['path']}): {out['messages'][-1].text}")
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
