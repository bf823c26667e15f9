"""Durable decisions: a review node's read and escalation run as a LangGraph task.

A node that may pause for review re-runs from its start when the thread resumes, in
whatever process resumes it. Its decision (canvas read, re-reads, escalation) therefore
runs inside a LangGraph `task`: the task's result is checkpointed before the
`interrupt()`, and a resume, here or in another process, gets that result back instead of
reading and escalating again. So a resume never pays for the escalation twice and always
takes the branch the human reviewed. The task shows as `canvasroute_decision` in the
`tasks`, `debug` and `updates` streams.

The task's input is a key into this process's table of pending calls (plain text: any
stream serializer can write it), and its output the response as JSON.

One case still pays twice: LangGraph numbers the tasks a node calls without resetting the
count when its `RetryPolicy` re-runs the node, so a decision that failed, was retried by the
node and then paused for review is read (and escalated) once more on resume. With the
engine owning retries (`retry_on`, `canvasroute.harness._retry`) a node re-runs only for a
fault no engine retried.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from langgraph.func import task

from canvasroute.router import CanvasResponse

__all__ = ["adurable", "durable"]

TASK_NAME = "canvasroute_decision"

_calls: dict[str, Callable[[], Any]] = {}
_lock = threading.Lock()


def _take(key: str) -> Callable[[], Any]:
    with _lock:
        return _calls.pop(key)


@task(name=TASK_NAME)
def _decision(key: str) -> dict[str, Any]:
    return _take(key)().model_dump(mode="json")


@task(name=TASK_NAME)
async def _adecision(key: str) -> dict[str, Any]:
    return (await _take(key)()).model_dump(mode="json")


def durable(decide: Callable[[], CanvasResponse]) -> tuple[CanvasResponse, bool]:
    """Run `decide` as a checkpointed task; returns its response and whether it ran now
    (False: replayed from the checkpoint on a resume)."""
    key = _register(decide)
    try:
        data = _decision(key).result()
    finally:
        ran = _unregister(key)
    return CanvasResponse.model_validate(data), ran


async def adurable(decide: Callable[[], Awaitable[CanvasResponse]]) -> tuple[CanvasResponse, bool]:
    """`durable` for async code."""
    key = _register(decide)
    try:
        data = await _adecision(key)
    finally:
        ran = _unregister(key)
    return CanvasResponse.model_validate(data), ran


def _register(decide: Callable[[], Any]) -> str:
    key = uuid.uuid4().hex
    with _lock:
        _calls[key] = decide
    return key


def _unregister(key: str) -> bool:
    """Drop the pending call; True when the task took it (it ran in this process now)."""
    with _lock:
        return _calls.pop(key, None) is None
