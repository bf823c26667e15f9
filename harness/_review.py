"""The human review lane: uncertain answers that were not escalated go to a person.

The node calls LangGraph's `interrupt()` with the pending answers; the graph pauses
(a checkpointer is required: without one the node refuses to run) and resumes with
`Command(resume=<option>)`, or `Command(resume={question_id: option})` when several
questions are under review. With `interrupt="human_interrupt"` the payload and the
resume are LangGraph's prebuilt `HumanInterrupt` / `HumanResponse` (Agent Inbox's
shape; see `canvasroute.harness._inbox`).

A node reviews what its `review=` policy says, and (without one) every question when the
model's outcome policy says `uncertain="review"` (`review_for`). A question other questions
depend on (`depends_on`) is never reviewed: its children are asked on the canvas's answer,
before a human could change it, so the node refuses that combination with `DecisionError`.

Durable decisions: a node that may pause for review re-runs from its start when the thread
resumes, in whatever process resumes it. Its decision (canvas read, re-reads, escalation)
therefore runs inside a LangGraph `task` (`durable`): the task's result is checkpointed before
the `interrupt()`, and a resume, here or in another process, gets that result back instead of
reading and escalating again. The task's input is a key into this process's table of pending
calls, and its output the response as JSON with the decision set's id. What each run spent:
the paused run read (its `canvasroute.review` event says so, under that id); the resume spent
nothing (its response is a replay, `replayed == "checkpoint"`, whose `original` is the read), and
the records it writes keep the paused run's read under the same id, so a thread's records and
its events total the read once. One case still pays twice: LangGraph numbers the
tasks a node calls without resetting the count when its `RetryPolicy` re-runs the node, so a
decision that failed, was retried by the node and then paused for review is read once more on
resume (with the engine owning retries, `retry_on`, a node re-runs only for a fault no engine
retried).

Agent Inbox: with `ReviewPolicy(interrupt="human_interrupt")` the node interrupts with a list of
one `HumanInterrupt` (the TypedDict `langgraph.prebuilt.interrupt` ships): `action_request`
(the model's answers), `config` (accept, edit, respond, ignore all allowed) and a description
(questions, options, odds); it resumes with a `HumanResponse` (or a list holding one, as Agent
Inbox sends it): `accept` (the proposed answers, path `human`), `edit` with another option per
question (questions left out keep the proposal), `response` with text naming an option (one
question under review), or `ignore` (the model's answers stand with their own path).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langgraph.func import task
from langgraph.types import interrupt

from canvasroute.engine import DecisionError
from canvasroute.router import CanvasResponse, DecisionRequest, ReadReport, Totals

from ._records import REVIEW_EVENT


@dataclass(frozen=True, kw_only=True, slots=True)
class ReviewPolicy:
    """When a decision node asks a human instead of acting on an unsure answer.

    An answer goes to review when the gate did not pass it (`confident` is False) and it
    was not escalated: uncertain with no escalation target, over the escalation budget,
    or a fallback label after an engine fault. Frozen and hashable, like LangGraph's own
    policies.

    Example:
        ```python
        decision_node(model, questions, route=("team", teams), review=ReviewPolicy())
        graph.invoke(ticket, config)                      # pauses: result["__interrupt__"]
        graph.invoke(Command(resume="billing"), config)   # the human's option, path "human"
        ```
    """

    questions: frozenset[str] | None = None
    """Question ids a human may review, e.g. `frozenset({"team"})` (None: every question of the node)."""

    include_state: bool = True
    """Put the decision state into the interrupt payload, so the reviewer sees what was asked."""

    interrupt: Literal["canvasroute", "human_interrupt"] = "canvasroute"
    """The interrupt's shape: canvasroute's own payload (resume with an option or
    `{question_id: option}`), or LangGraph's prebuilt `HumanInterrupt` that Agent Inbox reads
    (resume with a `HumanResponse`: accept, edit with another option, response, ignore)."""

    def __post_init__(self) -> None:
        if self.questions is not None and not (
                isinstance(self.questions, frozenset) and all(isinstance(q, str) for q in self.questions)):
            raise TypeError("ReviewPolicy.questions is a frozenset of question ids, e.g. frozenset({'team'}), "
                            f"not {type(self.questions).__name__}")
        if not isinstance(self.include_state, bool):
            raise TypeError(f"ReviewPolicy.include_state is a bool, not {type(self.include_state).__name__}")
        if self.interrupt not in ("canvasroute", "human_interrupt"):
            raise ValueError(f"ReviewPolicy.interrupt is 'canvasroute' or 'human_interrupt', not {self.interrupt!r}")

    def needs_review(self, report: ReadReport) -> bool:
        """Whether one answer goes to a human."""
        eligible = self.questions is None or report.question_id in self.questions
        return eligible and not report.confident and report.path not in ("skipped", "escalated")


def review(policy: ReviewPolicy, node: str, response: CanvasResponse, request: DecisionRequest) -> dict[str, str]:
    """Interrupt for the answers under review; returns the human's option per question.

    Raises LangGraph's `GraphInterrupt` on the first run (never catch it); on resume,
    returns the validated resume value.
    """
    specs = request.questions.specs
    options = {qid: spec.options for qid, spec in specs.items()}
    questions, state = request.questions.asked, request.state.value
    pending = pending_review(policy, response)
    if not pending:
        return {}
    if policy.interrupt == "human_interrupt":
        asking = human_interrupt(node, response, pending, options, questions,
                                 state if policy.include_state else None)
        return human_response(interrupt(asking), response, pending, options)
    payload: dict[str, Any] = {
        "type": REVIEW_EVENT,
        "node": node,
        "questions": {qid: _item(response.reads[qid], options[qid], questions[qid]) for qid in pending},
    }
    if policy.include_state:
        payload["state"] = state
    return _validate(interrupt(payload), pending, options)


def pending_review(policy: ReviewPolicy, response: CanvasResponse) -> list[str]:
    """The questions of `response` that go to a human."""
    return [qid for qid, r in response.reads.items() if policy.needs_review(r)]


def _item(report: ReadReport, options: tuple[str, ...], question: Any) -> dict[str, Any]:
    return {
        "instructions": getattr(question, "instructions", None),
        "options": list(options),
        "answer": report.answer,
        "probabilities": dict(report.probabilities),
        "path": report.path,
        "normalized_entropy": report.normalized_entropy,
        "crossed": list(report.crossed),
        "cause": report.cause,
        "error": report.error,
    }


def _validate(value: Any, pending: list[str], options: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        if len(pending) != 1:
            raise DecisionError(f"{len(pending)} questions are under review ({pending}); "
                                "resume with {question_id: option}")
        value = {pending[0]: value}
    if not isinstance(value, Mapping):
        raise DecisionError(f"resume a review with an option or {{question_id: option}}, not {type(value).__name__}")
    missing = [qid for qid in pending if qid not in value]
    extra = [qid for qid in value if qid not in pending]
    if missing or extra:
        raise DecisionError(f"the review needs exactly the questions {pending}; missing {missing}, unexpected {extra}")
    chosen = {}
    for qid, given in value.items():
        option = str(given)
        if option not in options[qid]:
            raise DecisionError(f"{option!r} is not an option of {qid!r}; options: {list(options[qid])}")
        chosen[qid] = option
    return chosen


def review_for(review: ReviewPolicy | None, request: DecisionRequest, node: str) -> ReviewPolicy:
    """What a node run sends to a human (it has `review=`, or its outcome policy says
    `uncertain="review"`): its `review=`, else every question. A question others depend on is
    refused."""
    review = review if review is not None else ReviewPolicy()
    check_parents_unreviewed(node, request.questions.depends.parent_ids, review.questions)
    return review


def check_parents_unreviewed(node: str, parents: frozenset[str], reviewed: frozenset[str] | None) -> None:
    """Refuse a review of a parent question (`parents`: every question another depends on;
    `reviewed`: the ids a review may take, None: all)."""
    refused = sorted(p for p in parents if reviewed is None or p in reviewed)
    if refused:
        raise DecisionError(
            f"{node}: review and depends_on do not combine for the parent question(s) {refused}: their children "
            "are asked on the canvas's answer before a reviewer could change it",
            hint="review only questions no other question depends on (ReviewPolicy(questions=...)), or drop "
                 "depends_on")


# -- Agent Inbox's HumanInterrupt ------------------------------------------------------------

ALLOW = {"allow_accept": True, "allow_edit": True, "allow_respond": True, "allow_ignore": True}


def human_interrupt(node: str, response: CanvasResponse, pending: Sequence[str],
                    options: Mapping[str, tuple[str, ...]], questions: Mapping[str, Any],
                    state: Any | None) -> list[dict[str, Any]]:
    """The interrupt value: one `HumanInterrupt` for the decision set's answers under review."""
    lines = [f"The decision node `{node}` is unsure. Accept its answers, edit them (pick another option), "
             "respond with an option, or ignore the review."]
    for qid in pending:
        report = response.reads[qid]
        odds = ", ".join(f"`{o}` {report.probabilities.get(o, 0.0):.0%}" for o in options[qid])
        instructions = getattr(questions[qid], "instructions", None) or qid
        lines.append(f"- **{qid}**: {instructions} Options: {odds}. Proposed: `{report.answer}` "
                     f"(path {report.path}).")
    if state is not None:
        lines.append(f"\nWhat was decided on:\n\n{state if isinstance(state, str) else repr(state)}")
    return [{
        "action_request": {"action": f"Review {node}", "args": {qid: response.reads[qid].answer for qid in pending}},
        "config": dict(ALLOW),
        "description": "\n".join(lines),
    }]


def human_response(value: Any, response: CanvasResponse, pending: Sequence[str],
                   options: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """The human's option per reviewed question from a `HumanResponse` (empty: ignored)."""
    if isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]  # Agent Inbox resumes with a list of one response
    kind = value.get("type") if isinstance(value, Mapping) else None
    proposed = {qid: str(response.reads[qid].answer) for qid in pending}
    if kind == "accept":
        return proposed
    if kind == "ignore":
        return {}
    if kind == "edit":
        request = value.get("args")
        edited = request.get("args") if isinstance(request, Mapping) else None
        if not isinstance(edited, Mapping):
            raise DecisionError("an edit resumes with {'type': 'edit', 'args': {'action': ..., "
                                "'args': {question_id: option}}}")
        unknown = sorted(set(edited) - set(pending))
        if unknown:
            raise DecisionError(f"the edit names questions not under review: {unknown}; under review: {list(pending)}")
        return {qid: _option(qid, edited.get(qid, proposed[qid]), options) for qid in pending}
    if kind == "response":
        if len(pending) != 1:
            raise DecisionError(f"{len(pending)} questions are under review ({list(pending)}); a text response "
                                "can answer only one", hint="resume with an edit naming an option per question")
        return {pending[0]: _option(pending[0], value.get("args"), options)}
    raise DecisionError(f"resume a human_interrupt review with a HumanResponse of type accept, edit, response or "
                        f"ignore, not {value!r}")


def _option(qid: str, value: Any, options: Mapping[str, tuple[str, ...]]) -> str:
    """The option a reviewer named: exactly (stripped), else case-folded when that names one option."""
    text = str(value).strip() if isinstance(value, str | int) and not isinstance(value, bool) else None
    if text is not None and text in options[qid]:
        return text
    folded = [o for o in options[qid] if text is not None and o.casefold() == text.casefold()]
    if len(folded) != 1:
        raise DecisionError(f"{value!r} is not an option of {qid!r}; options: {list(options[qid])}")
    return folded[0]


# -- durable decisions ------------------------------------------------------------------

TASK_NAME = "canvasroute_decision"
"""The checkpointed task a review node's decision runs in. LangGraph shows a node's tasks in the
`updates` and `tasks` stream modes under their names (its hidden tag applies to nodes, not to the
tasks a node calls), so those two modes show one entry named this beside the node's own; `values`,
`custom`, `messages`, `debug` and `checkpoints` do not. Filter it out with
`if DECISION_TASK not in chunk` (`canvasroute.harness.DECISION_TASK`)."""

_calls: dict[str, Callable[[], Any]] = {}
_lock = threading.Lock()


def _take(key: str) -> Callable[[], Any]:
    with _lock:
        return _calls.pop(key)


def _decide(key: str) -> dict[str, Any]:
    return {"decision": uuid.uuid4().hex, "response": _take(key)().model_dump(mode="json")}


async def _adecide(key: str) -> dict[str, Any]:
    return {"decision": uuid.uuid4().hex, "response": (await _take(key)()).model_dump(mode="json")}


# langgraph's `task` overloads take no function mypy can match (ParamSpec over `Never`): one ignore each
_decision: Any = task(name=TASK_NAME)(_decide)  # type: ignore[arg-type]
_adecision: Any = task(name=TASK_NAME)(_adecide)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """A review node's decision as this run has it (what `durable` returns)."""

    response: CanvasResponse
    """The decision: a replay (`replayed == "checkpoint"`, nothing spent) when a resume got it back."""
    decision: str
    """The decision set's id, given when it was decided: its records and its review event carry it."""
    spent: Totals
    """What the run that decided it spent (the records keep it: the paused run's read, on a resume)."""
    fresh: bool
    """Whether it was decided in this run (False: a resume got it back from the checkpoint)."""


def durable(decide: Callable[[], CanvasResponse]) -> Checkpointed:
    """Run `decide` as a checkpointed task: its decision, decided now or (a resume) replayed."""
    start = time.perf_counter()
    key = _register(decide)
    try:
        data = _decision(key).result()
    finally:
        ran = _unregister(key)
    return _checkpointed(data, ran, time.perf_counter() - start)


async def adurable(decide: Callable[[], Awaitable[CanvasResponse]]) -> Checkpointed:
    """`durable` for async code."""
    start = time.perf_counter()
    key = _register(decide)
    try:
        data = await _adecision(key)
    finally:
        ran = _unregister(key)
    return _checkpointed(data, ran, time.perf_counter() - start)


def _checkpointed(data: Mapping[str, Any], fresh: bool, latency_s: float) -> Checkpointed:
    if "response" not in data:  # a task checkpointed before decision sets had ids: the response alone
        data = {"decision": uuid.uuid4().hex, "response": data}
    response = CanvasResponse.model_validate(data["response"])
    spent = Totals.of(response)
    if not fresh:
        response = response.replay("checkpoint", latency_s)
    return Checkpointed(response, str(data["decision"]), spent, fresh)


def _register(decide: Callable[[], Any]) -> str:
    key = uuid.uuid4().hex
    with _lock:
        _calls[key] = decide
    return key


def _unregister(key: str) -> bool:
    """Drop the pending call; True when the task took it (it ran in this process now)."""
    with _lock:
        return _calls.pop(key, None) is None
