"""What a decision leaves behind in state: plain-dict records, and the reducer that merges them.

A record is `{answer, path, result, read, timing}`. Everything but `timing` follows from
the node's inputs and seed, so replays reproduce it; `timing` (wall clock) does not, and no
other decision ever reads it: `answers_only` turns records in a later decision's inputs
into their answers. A fan-out branch groups its records by branch key
(`{question_id: {branch: record}}`, `canvasroute.harness._fanout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from canvasroute.router import CanvasResponse
from canvasroute.router import telemetry as tm

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
    """State reducer for the decisions key: later records replace earlier ones per question
    id, and per question id and branch for fan-out branches (`{question_id: {branch: record}}`),
    so every branch of a `Send` fan-out keeps its record.

    Needed when several decision nodes write the same key, above all from parallel
    branches of one superstep (without a reducer LangGraph rejects concurrent writes).

    Example:
        ```python
        class State(TypedDict):
            ticket: str
            decisions: Annotated[dict, merge_decisions]
        ```
    """
    out = dict(left or {})
    for qid, value in (right or {}).items():
        before = out.get(qid)
        out[qid] = {**before, **value} if _is_group(before) and _is_group(value) else value
    return out


def _is_group(value: Any) -> bool:
    """A fan-out question's records by branch key (a mapping of records, not a record)."""
    return (isinstance(value, Mapping) and not is_record(value)
            and all(is_record(v) for v in value.values()))


def trace_route(attributes: Mapping[str, Any], goto: str | None) -> None:
    """A `route <node>` span naming where the graph went (the dashboard's edge traffic)."""
    if goto is not None:
        node = attributes.get(tm.GRAPH_NODE, "")
        with tm.span(f"{tm.OPERATION_ROUTE} {node}", {**attributes, tm.ROUTE_DESTINATION: goto}):
            pass
