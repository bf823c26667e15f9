"""LangGraph integration: decisions as graph nodes and edges.

- `decision_node`: a node that answers its questions in one canvas read and returns
  `Command(goto=..., update={"decisions": ...})` (the primary shape); run by `Send`
  branches it keeps one record per branch (`branch=`).
- `route_on`: a path function for `add_conditional_edges` (for graphs that already
  route with edges).
- `ReviewPolicy`: send unsure, unescalated answers to a human via `interrupt()` (canvasroute's
  payload, or LangGraph's prebuilt `HumanInterrupt` that Agent Inbox reads); the decision is
  a checkpointed task, so a resume anywhere never reads or escalates again.
- `DECISION_EVENT`, `REVIEW_EVENT`: the custom-stream and callback events of a decision.
- `merge_decisions`: the state reducer for the decisions key.
- `NodeCache`: LangGraph's node cache, minus the decisions a fault or a budget refusal
  produced (`builder.compile(cache=NodeCache(InMemoryCache()))`).
- `retry_on`: the `RetryPolicy` predicate that retries transient faults only.
- `StoreBudgetMeter`: escalation budgets counted in a LangGraph store, shared by workers
  (a node whose graph has a store uses one for its model's budget).
- `StoreControllerState`: an escalation-rate controller's offsets kept in a LangGraph store,
  shared by workers (a node whose graph has a store uses one for its model's controller).
- `StoreLiveState`: live certification's labelled rows kept in a LangGraph store, shared by
  workers (likewise for its model's `Audit`); `AuditInbox`: people label audited answers (the
  review lane as live certification's labeller), in a store any process can answer from.

The applications built on this layer (CLI, server, bench, eval, calibrate, dashboard,
demo) live above it, in `canvasroute.apps`.

Names are imported on first use, so `canvasroute --help` does not load LangGraph.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._audit_inbox import AuditInbox
    from ._context import decision_seed
    from ._edge import DecisionEdge, route_on
    from ._node import DecisionNode, decision_node, retry_on
    from ._node_cache import NodeCache
    from ._records import DECISION_EVENT, REVIEW_EVENT, merge_decisions, run_totals
    from ._review import TASK_NAME as DECISION_TASK
    from ._review import ReviewPolicy
    from ._store_budget import StoreBudgetMeter
    from ._store_control import StoreControllerState, StoreLiveState

__all__ = [
    "DECISION_EVENT",
    "DECISION_TASK",
    "REVIEW_EVENT",
    "AuditInbox",
    "DecisionEdge",
    "DecisionNode",
    "NodeCache",
    "ReviewPolicy",
    "StoreBudgetMeter",
    "StoreControllerState",
    "StoreLiveState",
    "decision_node",
    "decision_seed",
    "merge_decisions",
    "retry_on",
    "route_on",
    "run_totals",
]

_LAZY = {
    "DECISION_EVENT": "._records",
    "DECISION_TASK": "._review",
    "REVIEW_EVENT": "._records",
    "AuditInbox": "._audit_inbox",
    "DecisionEdge": "._edge",
    "DecisionNode": "._node",
    "NodeCache": "._node_cache",
    "ReviewPolicy": "._review",
    "StoreBudgetMeter": "._store_budget",
    "StoreControllerState": "._store_control",
    "StoreLiveState": "._store_control",
    "decision_node": "._node",
    "decision_seed": "._context",
    "merge_decisions": "._records",
    "retry_on": "._node",
    "route_on": "._edge",
    "run_totals": "._records",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(_LAZY[name], __name__), "TASK_NAME" if name == "DECISION_TASK" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canvasroute.harness' has no attribute {name!r}")
