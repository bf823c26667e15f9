"""What a decision leaves behind: plain-dict state entries and a custom-stream event."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langgraph.config import get_stream_writer

from router import CanvasResponse

DECISION_EVENT = "canvasroute.decision"


def entries(response: CanvasResponse, human: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """One JSON-able entry per question, for graph state and checkpoints.

    `answer` and `path` are what the graph acted on (`path` is `human` when a reviewer
    chose); `result` (the langchain-core answer) and `read` (the `ReadReport`) describe
    the model's own answer.
    """
    out = {}
    for qid, report in response.reads.items():
        out[qid] = {
            "answer": human.get(qid, report.answer),
            "path": "human" if qid in human else report.path,
            "result": response.answers[qid].model_dump(mode="json"),
            "read": report.model_dump(mode="json"),
        }
    return out


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


def emit(node: str, goto: str | None, decided: Mapping[str, Mapping[str, Any]], seed: int) -> None:
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
    })
