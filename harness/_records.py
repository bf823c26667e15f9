"""What a decision leaves behind: plain-dict records in state, the reducer that merges them, and its events.

A record is `{answer, path, result, read, timing}`. Everything but `timing` follows from
the node's inputs and seed, so replays reproduce it; `timing` (wall clock, the decision set's
id, what it spent and whether it was replayed: see `entries` and `run_totals`) does not, and no
other decision ever reads it: `answers_only` turns records in a later decision's inputs
into their answers. A fan-out branch groups its records by branch key
(`{question_id: {branch: record}}`, see `decision_node`'s `branch=`).

Events: one payload per decision set reaches two places, LangGraph's custom stream
(`stream_mode="custom"`, `get_stream_writer`) and the callback system as a custom event
(`astream_events` shows it as `on_custom_event`, named by its `type`; LangSmith and other
callback tracers record it). Types: `canvasroute.decision` (`DECISION_EVENT`: a decision set
is final: answers, paths, entropies, where the graph goes, its `tally` and `totals`) and
`canvasroute.review` (`REVIEW_EVENT`: a decision set waits for a human, sent once, by the run
that decided it, as the review's `interrupt()` pauses it, with what that run spent). The `messages` stream shows no
decision: a decision is not a chat message, and the models a decision calls are tagged `nostream`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from langchain_core.callbacks import adispatch_custom_event, dispatch_custom_event
from langchain_core.runnables import RunnableConfig
from langgraph.config import get_stream_writer

from canvasroute.engine import GraphSetupError
from canvasroute.router import CanvasResponse, DecisionRequest, Replay, Tally, Totals
from canvasroute.router import telemetry as tm

DECISION_EVENT = "canvasroute.decision"
REVIEW_EVENT = "canvasroute.review"

RECORD_KEYS = frozenset({"answer", "path", "result", "read", "timing", "shadow", "history"})
"""The keys of one decision record in graph state (`shadow` only in shadow mode, `history` only
with a node's `history=`)."""
_STABLE_KEYS = RECORD_KEYS - {"timing", "shadow", "history"}
_UNSTABLE = {"latency_s"}
"""The report field a replay does not reproduce (kept under `timing`)."""


def entries(response: CanvasResponse, human: Mapping[str, str], decision: str | None = None, *,
            spent: Totals | None = None) -> dict[str, dict[str, Any]]:
    """One JSON-able entry per question, for graph state and checkpoints.

    `answer` and `path` are what the graph acted on (`path` is `human` when a reviewer
    chose); `result` (the langchain-core answer) and `read` (the `ReadReport` without its
    latency) describe the model's own answer; `timing` holds what a replay does not reproduce:
    the wall-clock `latency_s`; the decision set's id (`decision`, one per node run, so
    `run_totals` counts each set once) and what it spent (`totals`, `Totals.as_dict()`: `spent`,
    by default what `response` spent); how it came back when it was not decided now
    (`replayed`: None or a `Replay`) and what it spent when it was decided (`original`: None
    unless replayed).
    """
    totals = (spent if spent is not None else Totals.of(response)).as_dict()
    original = response.original.as_dict() if response.original is not None else None
    decision = decision or uuid.uuid4().hex
    out = {}
    for qid, report in response.reads.items():
        answer = response.answers.get(qid)
        out[qid] = {
            "answer": human.get(qid, report.answer),
            "path": "human" if qid in human else report.path,
            "result": None if answer is None else answer.__pydantic_serializer__.to_python(answer, mode="json"),
            "read": report.__pydantic_serializer__.to_python(report, mode="json", exclude=_UNSTABLE),
            "timing": {"latency_s": report.latency_s, "decision": decision, "totals": totals,
                       "replayed": response.replayed, "original": original},
        }
    return out


def replayed_record(record: Mapping[str, Any], how: Replay, decision: str) -> dict[str, Any]:
    """`record` as replayed now (`how`) under the decision id `decision`: it spent nothing
    (`totals` all zero), and what it spent when it was decided is its `original`."""
    timing = dict(record.get("timing") or {})
    original = timing.get("original") or timing.get("totals")
    timing.update(decision=decision, totals=Totals().as_dict(), replayed=how, original=original)
    return {**record, "timing": timing}


def run_totals(source: Any) -> Totals:
    """What a graph run's decisions spent, summed without any SDK: decision sets, reads,
    canvases, escalations, tokens and seconds (`Totals`: a replay spends nothing).

    `source` is the run's decision records (`state["decisions"]`, flat, by fan-out branch, or
    with `history=`: every iteration the records kept counts), or its events (the custom
    stream's `canvasroute.decision` and `canvasroute.review` chunks, or `astream_events`' data).
    Each decision set counts once, under its decision id, however many questions or places
    carry it: an id always carries the same totals.

    The two agree on every path: over the runs of a thread, the events and the records that
    keep every decision set (one node run per question, or `history=`) total the same.

    - A plain run, a `Send` fan-out (a record per branch, each branch its own set), a loop with
      `history=`: each node run's set, as read.
    - A `RetryPolicy` retry: a failed attempt finished no set; only the attempt that returned counts.
    - A review: the paused run read, and its `canvasroute.review` event counts that read; the
      resume reads nothing (its decision event says `replayed: "checkpoint"`, totals zero) and
      the records it writes keep the paused run's read under the review event's id.
    - A `DecisionCache` hit inside a node: its event and records spent nothing (`replayed:
      "decision_cache"`).
    - A `NodeCache` hit: the node did not run and sent no event; its records are replayed
      (`replayed: "node_cache"`, totals zero, a new id).
    - A replay from a checkpoint (time travel): the nodes after it run again and really read.
    - A `route_on` edge writes no record: its decision sets count in the events only.

    As invariants: a response or a decision event with `replayed` set totals `Totals()`, and so
    does a record a cache replayed (`decision_cache`, `node_cache`; a review's record, `checkpoint`,
    keeps its paused run's read); over a thread's runs, `run_totals(events) == run_totals(records)`
    for records that keep every decision set, and their `reads` and `escalations` are the canvas
    reads and escalated questions of the attempts that returned or paused.

    Example:
        ```python
        out = graph.invoke({"ticket": "..."})
        run_totals(out["decisions"]).reads, run_totals(out["decisions"]).escalations
        ```
    """
    seen: dict[str, Totals] = {}
    for totals in _sets(source):
        seen.setdefault(totals[0], totals[1])
    return sum(seen.values(), Totals())


def _sets(value: Any) -> Iterator[tuple[str, Totals]]:
    """(decision id, totals) of every decision set in `value`."""
    if isinstance(value, Mapping):
        if value.get("type") in (DECISION_EVENT, REVIEW_EVENT) and isinstance(value.get("totals"), Mapping):
            yield str(value.get("decision") or id(value)), Totals.from_dict(value["totals"])
            return
        if is_record(value):
            timing = value.get("timing") or {}
            if isinstance(timing.get("totals"), Mapping):
                yield str(timing.get("decision")), Totals.from_dict(timing["totals"])
            for earlier in value.get("history") or ():
                yield from _sets(earlier)
            return
        for v in value.values():
            yield from _sets(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _sets(v.get("data", v) if isinstance(v, Mapping) and "event" in v else v)


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
        if isinstance(before, Mapping) and before and value and _is_group(before) != _is_group(value):
            raise GraphSetupError(
                f"question {qid!r} is written both as one record and as fan-out records by branch (branch=): "
                "one would replace the other", hint="give the two nodes' questions distinct ids, or write "
                "them under distinct output_key values")
        out[qid] = {**before, **value} if isinstance(before, Mapping) and _is_group(before) and _is_group(value) \
            else value
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


# -- events ------------------------------------------------------------------------------


def event(kind: str, node: str, goto: str | None, decided: Mapping[str, Mapping[str, Any]],
          request: DecisionRequest, *, spent: tuple[str, Totals] | None = None, **more: Any) -> dict[str, Any]:
    """The payload of one decision event (plain JSON values): answers, paths, entropies, its
    `tally`, its decision id and `totals` (reads, canvases, escalations, tokens, seconds: the
    records', or `spent`, the run's own id and totals where they differ: a review's resume),
    how it was replayed (`replayed`) and what it spent when decided (`original`)."""
    branch = request.identity.branch
    timing = next(iter(decided.values()))["timing"] if decided else {}
    if spent is not None:
        timing = {**timing, "decision": spent[0], "totals": spent[1].as_dict()}
    return {
        "type": kind,
        "node": node,
        **({"decision": timing["decision"]} if "decision" in timing else {}),
        **({"branch": branch} if branch is not None else {}),
        "goto": goto,
        "seed": request.identity.seed,
        "answers": {qid: d["answer"] for qid, d in decided.items()},
        "paths": {qid: d["path"] for qid, d in decided.items()},
        "entropies": {qid: d["read"]["entropy"] for qid, d in decided.items()},
        "normalized_entropies": {qid: d["read"]["normalized_entropy"] for qid, d in decided.items()},
        "tally": Tally.of([d["read"] for d in decided.values()]).as_dict(),
        **({"totals": timing["totals"]} if "totals" in timing else {}),
        **({"replayed": timing.get("replayed"), "original": timing.get("original")} if timing else {}),
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
