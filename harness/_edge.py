"""`route_on`: a conditional-edge adapter for graphs that already route with edges."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config

from canvasroute.engine import UnsupportedQuestion
from canvasroute.engine._compat import moved_keywords, renaming
from canvasroute.router import CanvasDecisionModel, CanvasResponse, DecisionRequest, ReadOptions, read_options
from canvasroute.router._request import schema_decision

from ._context import GraphCall, Inputs, child_config, graph_call, select_inputs
from ._node import check_path_map
from ._records import DECISION_EVENT, aemit, emit, entries, event, trace_route

_READ_OPTIONS = {"read_options": "read"}
"""0.1's name of `read` (until 0.3.0)."""


class DecisionEdge(Runnable[Any, str]):
    """A conditional-edge path function that returns the chosen option of one question.

    Build it with `route_on(...)`.
    """

    @moved_keywords(_READ_OPTIONS, renaming("DecisionEdge", _READ_OPTIONS))
    def __init__(self, model: CanvasDecisionModel, question: Any, path_map: Mapping[Any, str], *,
                 inputs: Inputs, question_id: str | None, read: ReadOptions | Mapping[str, Any] | None = None) -> None:
        if not isinstance(model, CanvasDecisionModel):
            raise TypeError(f"model must be a CanvasDecisionModel, not {type(model).__name__}")
        if isinstance(question, type):  # a schema of one field: its question, its docstring as instructions
            asked, read = schema_decision(question, read)
            if len(asked) != 1:
                raise UnsupportedQuestion(
                    f"route_on asks one question, and {question.__name__} has {len(asked)} fields ({', '.join(asked)})",
                    hint=f"decision_node(model, {question.__name__}, route=(field, {{option: node}})) asks them all")
            (name, question), = asked.items()
            question_id = name if question_id is None else question_id
        question_id = "route" if question_id is None else question_id
        if not isinstance(path_map, Mapping) or not path_map:
            raise TypeError("route_on needs an explicit path_map {option: node}, so the graph draws its real edges")
        if any(not isinstance(k, str) for k in path_map):
            raise ValueError("path_map keys are option names as strings (Score levels too: '0', '1', ...)")
        built = model.request("", {question_id: question}, read=read)
        check_path_map(question_id, built.questions.specs[question_id].options, path_map, "path_map")
        self.model = model
        self.question = question
        self.question_id = question_id
        self.path_map = dict(path_map)
        self.inputs = inputs
        self.read = read_options(read)
        self.name = f"route_on_{question_id}"

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        """Decide synchronously and return the chosen option."""
        return self._call_with_config(self._decide, input, ensure_config(config))  # type: ignore[arg-type]

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        """Decide asynchronously and return the chosen option."""
        return await self._acall_with_config(self._adecide, input, ensure_config(config))  # type: ignore[arg-type]

    # LangGraph runs a branch's path without setting the config context (it does for nodes);
    # `_call_with_config` sets it, so the runtime, stream writer and tracing work here too.

    def _decide(self, state: Any, config: RunnableConfig) -> str:
        call, request = self._prepare(state, config)
        response = call.model.invoke(_input(request), child_config(config))  # type: ignore[arg-type]
        option, payload = self._finish(call, request, response)
        emit(payload, config)
        return option

    async def _adecide(self, state: Any, config: RunnableConfig) -> str:
        call, request = self._prepare(state, config)
        response = await call.model.ainvoke(_input(request), child_config(config))  # type: ignore[arg-type]
        option, payload = self._finish(call, request, response)
        await aemit(payload, config)
        return option

    def _prepare(self, state: Any, config: RunnableConfig) -> tuple[GraphCall, DecisionRequest]:
        call = graph_call(config, self.model, str(self.name))
        return call, call.request(str(self.name), {self.question_id: self.question}, select_inputs(state, self.inputs),
                                  read=self.read)

    def _finish(self, call: GraphCall, request: DecisionRequest,
                response: CanvasResponse) -> tuple[str, dict[str, Any]]:
        decided = entries(response, {})
        option = decided[self.question_id]["answer"]
        trace_route(call.attributes, self.path_map[option])
        return option, event(DECISION_EVENT, call.node, self.path_map[option], decided, request)


def _input(request: DecisionRequest) -> dict[str, Any]:
    return {"state": request.state.value, "questions": request.questions.asked, "request": request}


@moved_keywords(_READ_OPTIONS, renaming("route_on", _READ_OPTIONS))
def route_on(model: CanvasDecisionModel, question: Any, path_map: Mapping[str, str], *,
             inputs: Inputs = None, question_id: str | None = None,
             read: ReadOptions | Mapping[str, Any] | None = None) -> DecisionEdge:
    """A path function for `add_conditional_edges` that routes on one canvas-read question.

    The adapter for graphs that already branch with conditional edges. Prefer
    `decision_node`: a conditional edge runs inside its source node's task, so it cannot
    write the decision into state, and it has no cache, retry or timeout policy of its
    own (a transient engine fault fails the source node's task).

    Args:
        model: The decision model (`Runtime.context` overrides apply as for nodes, and a
            graph store counts its budget as a node's would).
        question: One `Noul`, `Choice` or `Score`, or a schema of one field (a pydantic model
            or TypedDict class: the field is the question, its name the question id, the
            schema's docstring the instructions unless `read` gives its own).
        path_map: `{option: node}` for every option (explicit, so the drawing shows only
            these targets). Noul options are `yes`/`no`, Score levels `"0"`, `"1"`...
        inputs: What the model reads: None (the whole state), a state key, or a function.
        question_id: The question's id in spans and decision events (default: a schema's
            field name, else `"route"`).
        read: How the canvas is read (`ReadOptions` or a dict of its fields).

    Returns:
        A `DecisionEdge` returning the chosen option; pass the same `path_map` to LangGraph.

    Example:
        ```python
        paths = {"yes": "answer", "no": "rewrite"}
        builder.add_conditional_edges("retrieve", route_on(model, Noul(instructions="Relevant?"), paths), paths)
        ```
    """
    return DecisionEdge(model, question, path_map, inputs=inputs, question_id=question_id, read=read)


__all__ = ["DecisionEdge", "route_on"]
