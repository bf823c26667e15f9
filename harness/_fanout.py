"""Fan-out: one decision node run once per `Send`, one record per branch.

Map-reduce sends one branch per item to the same decision node in one superstep
(`[Send("grade", {"doc": d}) for d in docs]`). Every branch asks the same question ids,
so flat records would overwrite each other. A branch's records are therefore grouped
under its key, `{question_id: {branch: record}}`, and `merge_decisions` merges the groups:

- the key is `branch(state)` (or `state[branch]`) when the node has `branch=`, e.g. a
  document id; then the node's records are always grouped, Send or not;
- otherwise, for a node run by a `Send`, the Send's position among the step's Sends
  (`"0"`, `"1"`, ...): stable across replays and resumes;
- a node run by an ordinary edge writes flat `{question_id: record}`.

Two branches of one superstep with the same key would overwrite each other: the second
raises `DecisionError` instead (keys are claimed per superstep, in this process).

Concurrent branches read concurrently: on an in-process engine (`TransformersEngine`,
the embedded one) their reads share its micro-batches; on `VLLMServerEngine` each
branch is its own request on its own connection (up to `max_concurrency`), which vLLM's
scheduler batches on the server.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig

from canvasroute.engine import DecisionError

__all__ = ["Branch", "BranchKeys", "branch_key", "grouped"]

Branch = str | Callable[[Any], Any] | None
"""What names a fan-out branch: a state key, a function of the node's input, or None."""

_PUSH = "__pregel_push"
"""LangGraph's trigger of a task started by a `Send`."""


def branch_key(branch: Branch, state: Any, config: RunnableConfig) -> str | None:
    """The key this run's records are grouped under (None: flat records)."""
    if branch is not None:
        value = branch(state) if callable(branch) else (
            state[branch] if isinstance(state, Mapping) else getattr(state, branch))
        if value is None or (isinstance(value, str) and not value):
            raise DecisionError(f"branch= gave {value!r}: a fan-out branch needs a non-empty key")
        return str(value)
    metadata = config.get("metadata") or {}
    path = metadata.get("langgraph_path")
    if tuple(metadata.get("langgraph_triggers") or ()) == (_PUSH,) and path and len(path) > 1:
        return str(path[1])
    return None


def grouped(decided: dict[str, dict[str, Any]], key: str | None) -> dict[str, Any]:
    """`decided` as the node writes it: flat, or each record under its branch key."""
    return decided if key is None else {qid: {key: record} for qid, record in decided.items()}


class BranchKeys:
    """The branch keys claimed per superstep, so two branches never share one."""

    def __init__(self, size: int = 4096) -> None:
        self._claims: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def claim(self, node: str, step: str | None, key: str, task: str | None) -> None:
        """Record that `task` writes branch `key` in superstep `step` (its checkpoint id);
        raise when another task of the same step already does."""
        if step is None or task is None:
            return
        with self._lock:
            owner = self._claims.setdefault((step, key), task)
            self._claims.move_to_end((step, key))
            while len(self._claims) > self._size:
                self._claims.popitem(last=False)
        if owner != task:
            raise DecisionError(f"two branches of decision node {node!r} in one step have the branch key {key!r}: "
                                "their records would overwrite each other",
                                hint="make branch= give each branch its own key (e.g. a document id)")
