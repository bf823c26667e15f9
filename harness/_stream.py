"""Decision events for every way a LangGraph run is streamed.

One payload per decision set reaches two places: LangGraph's custom stream
(`stream_mode="custom"`, `get_stream_writer`) and the callback system as a custom event
(`astream_events` shows it as `on_custom_event`, named by its `type`; LangSmith and other
callback tracers record it). Types:

- `canvasroute.decision` (`DECISION_EVENT`): a decision set is final (answers, paths,
  entropies, where the graph goes, and its `tally`: `Tally.as_dict()` of the model's reads,
  the counts the demo's console and the dashboard show);
- `canvasroute.review` (`REVIEW_EVENT`): a decision set waits for a human, sent just
  before the review `interrupt()` (once: a resume does not send it again).

The `messages` stream shows no decision: a decision is not a chat message, and the
models a decision calls (the escalation target) are tagged `nostream` so their JSON never
streams into a chat UI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.callbacks import adispatch_custom_event, dispatch_custom_event
from langchain_core.runnables import RunnableConfig
from langgraph.config import get_stream_writer

from canvasroute.router import Tally

__all__ = ["DECISION_EVENT", "REVIEW_EVENT", "aemit", "emit", "event"]

DECISION_EVENT = "canvasroute.decision"
REVIEW_EVENT = "canvasroute.review"


def event(kind: str, node: str, goto: str | None, decided: Mapping[str, Mapping[str, Any]], seed: int, *,
          branch: str | None = None, **more: Any) -> dict[str, Any]:
    """The payload of one decision event (plain JSON values)."""
    return {
        "type": kind,
        "node": node,
        **({"branch": branch} if branch is not None else {}),
        "goto": goto,
        "seed": seed,
        "answers": {qid: d["answer"] for qid, d in decided.items()},
        "paths": {qid: d["path"] for qid, d in decided.items()},
        "entropies": {qid: d["read"]["entropy"] for qid, d in decided.items()},
        "normalized_entropies": {qid: d["read"]["normalized_entropy"] for qid, d in decided.items()},
        "tally": Tally.of(d["read"] for d in decided.values()).as_dict(),
        **more,
    }


def emit(payload: Mapping[str, Any], config: RunnableConfig | None, observed: bool = True) -> None:
    """Send `payload` to the custom stream and, when a callback handler listens (`observed`),
    as a custom callback event."""
    _write(payload)
    if observed and _has_parent_run(config):
        dispatch_custom_event(payload["type"], dict(payload), config=config)


async def aemit(payload: Mapping[str, Any], config: RunnableConfig | None, observed: bool = True) -> None:
    """`emit` from async code (async callback handlers, e.g. `astream_events`, need it)."""
    _write(payload)
    if observed and _has_parent_run(config):
        await adispatch_custom_event(payload["type"], dict(payload), config=config)


def _write(payload: Mapping[str, Any]) -> None:
    try:
        writer = get_stream_writer()
    except RuntimeError:  # outside a graph run: nobody is listening
        return
    writer(dict(payload))


def _has_parent_run(config: RunnableConfig | None) -> bool:
    """A custom callback event needs the run it belongs to (a graph step's callback manager)."""
    callbacks = (config or {}).get("callbacks")
    return getattr(callbacks, "parent_run_id", None) is not None
