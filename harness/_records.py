"""What a decision leaves behind: plain-dict state entries and a custom-stream event.

A record is `{answer, path, result, read, timing}`. Everything but `timing` follows from
the node's inputs and seed, so replays reproduce it; `timing` (wall clock) does not, and no
other decision ever reads it: `answers_only` turns records in a later decision's inputs
into their answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langgraph.config import get_stream_writer

from canvasroute.router import CanvasResponse
from canvasroute.router import telemetry as tm

DECISION_EVENT = "canvasroute.decision"


RECORD_KEYS = frozenset({"answer", "path", "result", "read", "timing", "shadow"})
"""The keys of one decision record in graph state (`shadow` only in shadow mode)."""
_STABLE_KEYS = RECORD_KEYS - {"timing", "shadow"}
_UNSTABLE = frozenset({"latency_s"})
"""The report field a replay does not reproduce (kept under `timing`)."""


def entries(response: CanvasResponse, human: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """One JSON-able entry per question, for graph state and checkpoints.

    `answer` and `path` are what the graph acted on (`path` is `human` when a reviewer
    chose); `result` (the langchain-core answer) and `read` (the `ReadReport` without its
    latency) describe the model's own answer; `timing` holds the wall-clock `latency_s`,
    the one part a replay does not reproduce.
    """
    out = {}
    for qid, report in response.reads.items():
        answer = response.answers.get(qid)
        out[qid] = {
            "answer": human.get(qid, report.answer),
            "path": "human" if qid in human else report.path,
            "result": None if answer is None else answer.__pydantic_serializer__.to_python(answer, mode="json"),
            "read": report.__pydantic_serializer__.to_python(report, mode="json", exclude=_UNSTABLE),
            "timing": {"latency_s": report.latency_s},
        }
    return out


def answers_only(value: Any) -> Any:
    """`value` with every mapping of decision records replaced by `{question_id: answer}`
    (and a record on its own by its answer).

    What a decision reads of earlier decisions: their answers, never their timings or read
    figures, so a later node's seed and prompt are the same in every run and replay.
    Mappings and lists are searched; anything else is returned as is.
    """
    if isinstance(value, Mapping):
        if is_record(value):
            return value["answer"]
        cleaned = {k: answers_only(v) for k, v in value.items()}
        return value if all(cleaned[k] is v for k, v in value.items()) else cleaned
    if isinstance(value, list | tuple):
        cleaned_items = [answers_only(v) for v in value]
        if all(a is b for a, b in zip(cleaned_items, value, strict=True)):
            return value
        return tuple(cleaned_items) if isinstance(value, tuple) else cleaned_items
    return value


def is_record(value: Any) -> bool:
    """Whether `value` is one decision record (the keys `entries` writes)."""
    return isinstance(value, Mapping) and _STABLE_KEYS <= value.keys() <= RECORD_KEYS


def merge_decisions(left: Mapping[str, Any] | None, right: Mapping[str, Any] | None) -> dict[str, Any]:
    """State reducer for the decisions key: later entries replace earlier ones per question id.

    Needed when several decision nodes write the same key, above all from parallel
    branches of one superstep (without a reducer LangGraph rejects concurrent writes).

    Example:
        ```python
        class State(TypedDict):
            ticket: str
            decisions: Annotated[dict, merge_decisions]
        ```
    """
    return {**(left or {}), **(right or {})}


def emit(node: str, goto: str | None, decided: Mapping[str, Mapping[str, Any]], seed: int,
         shadow: Mapping[str, Any] | None = None) -> None:
    """Write one event per decision set to LangGraph's custom stream (`stream_mode="custom"`)."""
    try:
        writer = get_stream_writer()
    except RuntimeError:  # outside a graph run: nobody is listening
        return
    writer({
        "type": DECISION_EVENT,
        "node": node,
        "goto": goto,
        "seed": seed,
        "answers": {qid: d["answer"] for qid, d in decided.items()},
        "paths": {qid: d["path"] for qid, d in decided.items()},
        "entropies": {qid: d["read"]["entropy"] for qid, d in decided.items()},
        "normalized_entropies": {qid: d["read"]["normalized_entropy"] for qid, d in decided.items()},
        **({"shadow": dict(shadow)} if shadow is not None else {}),
    })


def trace_route(attributes: Mapping[str, Any], goto: str | None) -> None:
    """A `route <node>` span naming where the graph went (the dashboard's edge traffic)."""
    if goto is not None:
        node = attributes.get(tm.GRAPH_NODE, "")
        with tm.span(f"{tm.OPERATION_ROUTE} {node}", {**attributes, tm.ROUTE_DESTINATION: goto}):
            pass
