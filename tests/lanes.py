"""The graphs several test modules route through: START -> triage (the decision node) -> billing | tech -> END,
and the one-node graph START -> triage -> END."""

from __future__ import annotations

from typing import Annotated, Any

from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from canvasroute.harness import merge_decisions

LANES = {"billing": "billing", "tech": "tech"}
"""The triage question's options and the node each routes to."""


class State(TypedDict, total=False):
    ticket: str
    docs: dict[str, str]
    doc: str
    doc_id: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def lanes(node: Any, **compile_kwargs: Any) -> Any:
    """START -> triage (the node) -> billing | tech -> END, compiled with `compile_kwargs`
    (`cache_policy=` goes to the triage node)."""
    builder = StateGraph(State)
    builder.add_node("triage", node, cache_policy=compile_kwargs.pop("cache_policy", None))
    builder.add_edge(START, "triage")
    for lane in LANES.values():
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    return builder.compile(**compile_kwargs)


def one_node_graph(node: Any, **compile: Any) -> Any:
    """START -> triage (the node) -> END over `State`, compiled with `compile` (with a `cache`, the node's
    own `cache_policy()`)."""
    builder = StateGraph(State)
    builder.add_node("triage", node, **({"cache_policy": node.cache_policy()} if "cache" in compile else {}))
    builder.add_edge(START, "triage")
    builder.add_edge("triage", END)
    return builder.compile(**compile)
