"""Where a decision runs in a graph, and the request it becomes there.

Read once per node (or edge) run from the `RunnableConfig` and LangGraph's `Runtime`
(`graph_call`), so the node and the edge adapter build their `DecisionRequest` the same way
(`GraphCall.request`): the run's model (`Runtime.context.decision_model`), its gate
(`Runtime.context.gate`, applied over the model's policy for every question), the seed of
where it runs, the thread, span attributes, and the graph store's budget meter and
escalation-rate controller state and live certification's rows.

Also what a node can tell about the graph running it: a checkpointer (a review lane pauses
with `interrupt()`, which only a checkpointed graph can resume) and its state keys (a node's
records go to its `output_key`, which LangGraph drops without a word when the state schema
has no such key).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.constants import CONF, CONFIG_KEY_CHECKPOINTER
from langgraph.errors import EmptyChannelError
from langgraph.runtime import get_runtime

from canvasroute.engine import GraphSetupError
from canvasroute.router import (
    CanvasDecisionModel,
    DecisionRequest,
    GatePolicy,
    parse_questions,
    question_set_key,
    read_state,
)
from canvasroute.router._request import site_seed
from canvasroute.router.telemetry import GEN_AI_CONVERSATION_ID, GRAPH_NODE

from ._records import answers_only
from ._store_budget import store_meter
from ._store_control import store_controller, store_live

Inputs = str | Callable[[Any], Any] | None
"""What a decision reads: None (the graph state, minus the output key), a state key,
or a function of the state."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphCall:
    """One decision's place in a graph run and the settings that apply to it."""

    node: str
    """The graph node the decision runs in (the source node, for an edge)."""
    namespace: str
    """`checkpoint_ns` with task ids removed (`outer|inner`): stable across replays."""
    thread_id: str | None
    """The LangGraph thread, for per-thread escalation budgets and span attributes."""
    task_id: str | None
    """The task id (identical when an interrupted task re-runs on resume)."""
    checkpoint_id: str | None
    """The checkpoint the step started from: one per superstep."""
    model: CanvasDecisionModel
    """The decision model for this run (`Runtime.context.decision_model` wins)."""
    store: Any
    """The graph's store (`Runtime.store`), where the model's budget is counted and its controller's
    offsets kept; None: none."""
    gate: GatePolicy | Mapping[str, Any] | None
    """The run's gate layer from `Runtime.context.gate` (a policy, or fields over the model's); None: none."""
    attributes: dict[str, str]
    """Span attributes naming the graph node and thread."""

    def request(self, site: str, questions: Mapping[str, Any], decision_state: Any, *,
                depends_on: Mapping[str, Any] | None = None, read: Any = None,
                branch: str | None = None) -> DecisionRequest:
        """The decision this run makes at `site` (a node's or an edge's name): seeded by where it
        runs, what it asks and reads; the run's gate; the store's budget meter and controller state;
        the branch."""
        request = self.model.request(decision_state, questions, read=read, depends_on=depends_on, gate=self.gate,
                                     thread_id=self.thread_id, attributes=self.attributes, site=(self.namespace, site))
        if self.store is not None:
            request = request.metered(store_meter(self.model, self.store))
            request = request.controlled_by(store_controller(self.model, self.store))
            request = request.audited_by(store_live(self.model, self.store))
        return request if branch is None else replace(request, identity=replace(request.identity, branch=branch))


def graph_call(config: RunnableConfig, model: CanvasDecisionModel, default_name: str) -> GraphCall:
    """Read node, thread and namespace from `config`, and overrides from `Runtime.context`."""
    configurable = config.get("configurable") or {}
    metadata = config.get("metadata") or {}
    runtime = _runtime()
    info = getattr(runtime, "execution_info", None)
    node = str(metadata.get("langgraph_node") or default_name)
    ns = info.checkpoint_ns if info is not None else configurable.get("checkpoint_ns", "")
    thread = info.thread_id if info is not None and info.thread_id is not None else configurable.get("thread_id")
    context = getattr(runtime, "context", None)
    chosen = _from_context(context, "decision_model")
    if chosen is not None and not isinstance(chosen, CanvasDecisionModel):
        raise TypeError(f"Runtime.context decision_model must be a CanvasDecisionModel, not {type(chosen).__name__}")
    chosen = chosen or model
    thread_id = None if thread is None else str(thread)
    attributes = {GRAPH_NODE: node} if thread_id is None else {GRAPH_NODE: node, GEN_AI_CONVERSATION_ID: thread_id}
    return GraphCall(
        node=node,
        namespace=strip_task_ids(ns) or node,
        thread_id=thread_id,
        task_id=info.task_id if info is not None else None,
        checkpoint_id=info.checkpoint_id if info is not None else None,
        model=chosen,
        store=getattr(runtime, "store", None),
        gate=_gate(_from_context(context, "gate")),
        attributes=attributes,
    )


def child_config(config: RunnableConfig) -> RunnableConfig:
    """The model call's config: a child run of the node, tagged off the messages stream."""
    return {**config, "tags": [*(config.get("tags") or []), "nostream"]}


def strip_task_ids(checkpoint_ns: str) -> str:
    """`outer:<task id>|inner:<task id>` -> `outer|inner` (task ids change on replay)."""
    return "|".join(part.split(":", 1)[0] for part in checkpoint_ns.split("|") if part)


def decision_seed(namespace: str, site: str, questions: Mapping[str, Any], state: Any) -> int:
    """The noise seed of one decision in a graph: a hash of where it runs (the node's namespace
    and its node or edge), what it asks, and what it reads (`canvasroute.router._request.site_seed`,
    which the node's request computes from its own rendering of the state).

    The same node asking the same questions about the same state reads the same noise,
    so re-running a thread, replaying it from a checkpoint, resuming it after an
    interrupt, or starting a fresh thread with the same input takes the same branch on
    the same engine. The thread id is deliberately left out: it would make identical
    inputs in different threads read differently.
    """
    specs = parse_questions(questions)
    key = question_set_key(questions) or json.dumps({qid: s.question.model_dump(mode="json")
                                                     for qid, s in specs.items()})
    return site_seed((namespace, site), specs, key, read_state(state)[0])


def select_inputs(state: Any, inputs: Inputs, exclude: str | None = None) -> Any:
    """The decision state: a key of the graph state, a function of it, or all of it.

    Earlier decisions in it are reduced to their answers (`answers_only`), so nothing
    time- or run-dependent reaches this decision's seed or prompt.
    """
    return answers_only(_select(state, inputs, exclude))


def _select(state: Any, inputs: Inputs, exclude: str | None) -> Any:
    if callable(inputs):
        return inputs(state)
    if isinstance(inputs, str):
        if isinstance(state, Mapping):
            if inputs not in state:
                raise KeyError(f"the graph state has no key {inputs!r} to decide on")
            return state[inputs]
        return getattr(state, inputs)
    if hasattr(state, "model_dump"):
        state = state.model_dump()
    if isinstance(state, Mapping):
        return {k: v for k, v in state.items() if k != exclude}
    return state


def _runtime() -> Any:
    try:
        return get_runtime()
    except (RuntimeError, KeyError):  # called outside a graph run
        return None


def _from_context(context: Any, key: str) -> Any:
    if context is None:
        return None
    if isinstance(context, Mapping):
        return context.get(key)
    return getattr(context, key, None)


def _gate(value: Any) -> GatePolicy | Mapping[str, Any] | None:
    if value is None or isinstance(value, (GatePolicy, Mapping)):
        return value
    raise TypeError(f"Runtime.context gate must be a GatePolicy or a dict of its fields, not {type(value).__name__}")


# -- what a node can tell about the graph ----------------------------------------------------
_READ = "__pregel_read"
"""The step's state reader in its config (LangGraph's `CONFIG_KEY_READ`; not public)."""


def has_checkpointer(config: RunnableConfig) -> bool:
    """Whether the running graph saves checkpoints (its own, or a parent graph's)."""
    return (config.get(CONF) or {}).get(CONFIG_KEY_CHECKPOINTER) is not None


def check_review(config: RunnableConfig, node: str) -> None:
    """Refuse a review lane that could never be resumed: no checkpointer (or no graph at all)."""
    if not has_checkpointer(config):
        raise GraphSetupError(f"decision node {node!r} has a review lane, but the graph has no checkpointer: "
                              "its interrupt() could never be resumed",
                              hint="compile with a checkpointer, e.g. builder.compile(checkpointer=InMemorySaver())")


def state_lacks(config: RunnableConfig, key: str) -> bool | None:
    """True when the running graph's state has no key `key`, False when it has, None when
    this cannot be told (outside a graph run, or a reader this LangGraph does not have)."""
    read = (config.get(CONF) or {}).get(_READ)
    if read is None:
        return None
    try:
        read(key, False)
    except KeyError:
        return True
    except Exception:  # noqa: BLE001 - a reader that works differently: no warning rather than a wrong one
        return None
    return False


def graph_value(config: RunnableConfig, key: str) -> Any:
    """The running graph's value of state key `key` as this step began (what a node run by an
    ordinary edge gets in its input; a `Send` branch gets only its payload). None when it has
    none yet, or when this cannot be read (outside a graph run, a reader this LangGraph does not
    have)."""
    read = (config.get(CONF) or {}).get(_READ)
    if read is None:
        return None
    try:
        return read(key, False)
    except (KeyError, EmptyChannelError, TypeError):  # no such key, no value yet, a reader that works differently
        return None


def warn_dropped(node: str, key: str) -> None:
    """Say once that a node's records are dropped, and how to keep them."""
    warnings.warn(f"decision node {node!r} writes its records to the state key {key!r}, which the graph's state "
                  f"schema does not have: LangGraph drops them. Add `{key}: Annotated[dict, merge_decisions]` "
                  "to the state (or pass output_key= naming a key it has).", UserWarning, stacklevel=3)
