"""The human review lane: uncertain answers that were not escalated go to a person.

The node calls LangGraph's `interrupt()` with the pending answers; the graph pauses
(a checkpointer is required: without one the node refuses to run) and resumes with
`Command(resume=<option>)`, or `Command(resume={question_id: option})` when several
questions are under review. With `interrupt="human_interrupt"` the payload and the
resume are LangGraph's prebuilt `HumanInterrupt` / `HumanResponse` (Agent Inbox's
shape; see `canvasroute.harness._inbox`).

A node reviews what its `review=` policy says, and (without one) the questions whose gate
says `on_unsure="review"` (`review_for`). A question other questions depend on
(`depends_on`) is never reviewed: its children are asked on the canvas's answer, before a
human could change it, so the node refuses that combination with `DecisionError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from langgraph.types import interrupt

from canvasroute.engine import DecisionError
from canvasroute.router import CanvasResponse, GatePolicy, ReadReport

from ._inbox import human_interrupt, human_response
from ._stream import REVIEW_EVENT


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
        return (eligible and not report.confident and report.path != "skipped"
                and report.escalation_model is None)  # escalated (or abstained, then escalated): answered


def review(policy: ReviewPolicy, node: str, response: CanvasResponse, options: Mapping[str, tuple[str, ...]],
           questions: Mapping[str, Any], state: Any) -> dict[str, str]:
    """Interrupt for the answers under review; returns the human's option per question.

    Raises LangGraph's `GraphInterrupt` on the first run (never catch it); on resume,
    returns the validated resume value.
    """
    pending = pending_review(policy, response)
    if not pending:
        return {}
    if policy.interrupt == "human_interrupt":
        request = human_interrupt(node, response, pending, options, questions,
                                  state if policy.include_state else None)
        return human_response(interrupt(request), response, pending, options)
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
        "over_budget": report.over_budget,
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
    for qid, option in value.items():
        option = str(option)
        if option not in options[qid]:
            raise DecisionError(f"{option!r} is not an option of {qid!r}; options: {list(options[qid])}")
        chosen[qid] = option
    return chosen


def check_parents_unreviewed(node: str, depends_on: Mapping[str, Any] | None, reviewed: frozenset[str] | None) -> None:
    """Refuse a review of a parent question (`reviewed`: the ids a review may take; None: all)."""
    parents = sorted({parent for parent, _ in (depends_on or {}).values() if reviewed is None or parent in reviewed})
    if parents:
        raise DecisionError(
            f"{node}: review and depends_on do not combine for the parent question(s) {parents}: their children "
            "are asked on the canvas's answer before a reviewer could change it",
            hint="review only questions no other question depends on (ReviewPolicy(questions=...), and "
                 "on_unsure other than 'review' for parents), or drop depends_on")


def review_for(review: ReviewPolicy | None, gate: GatePolicy, question_ids: Iterable[str],
               depends_on: Mapping[str, Any] | None, node: str) -> ReviewPolicy | None:
    """What a node run sends to a human: its `review=`, else the questions whose gate says
    `on_unsure="review"` (a `depends_on` parent among them is refused); None: nothing."""
    if review is not None:
        return review
    reviewed = frozenset(q for q in question_ids if gate.for_question(q).on_unsure == "review")
    if not reviewed:
        return None
    check_parents_unreviewed(node, depends_on, reviewed)
    return ReviewPolicy(questions=reviewed)
