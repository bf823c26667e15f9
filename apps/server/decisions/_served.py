"""Serving `/v1/decisions`: a parsed request as a decision's inputs, the decision back as answers.

Pure functions between the wire (`WireRequest`, `QuestionResult`) and the library (the state,
questions and images `CanvasDecisionModel.request` takes; a `CanvasResponse` or any
langchain-core `ClassifierResponse`):

- `decision_inputs(request)`: the transcript as the state (tool calls and their outputs written
  out, `[image N]` where an image is), every image in order (the input's, then each question's,
  whose instructions say `[image N]` for them), the questions keyed by id.
- `question_results(request, response, refuse_unsure=)`: one `QuestionResult` per question. A
  question the escalation target refused is a refusal; with `refuse_unsure`, so is one on path
  `unsure` (the gate did not pass it and nothing answered it instead). Otherwise the answer and
  its distribution, as `/v1/systemone` answers it.
- `usage_of(response)`: token usage with every detail field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import Choice, Noul, Score

from ._wire import QuestionResult, Usage, WireRequest

__all__ = ["DecisionInputs", "decision_inputs", "question_results", "refusal_kind", "usage_of"]


@dataclass(frozen=True, slots=True)
class DecisionInputs:
    """What one `/v1/decisions` request asks a decision model."""

    state: str
    """The input as one transcript (text input as it is)."""
    images: tuple[str, ...]
    """Every image, in order: the input's, then each question's (`[image N]` is `images[N-1]`)."""
    questions: dict[str, Noul | Choice | Score]
    """Question id -> langchain-core question, in question order (instructions naming their images)."""


def decision_inputs(request: WireRequest) -> DecisionInputs:
    """The state, images and questions of a canvas decision for `request`.

    The state is the transcript (`WireRequest.text`), so a canvas reads tool calls, their
    arguments and their outputs as written, not only the messages' text. A question's own
    images are read with the decision, after the input's, and its instructions end with their
    `[image N]` markers.
    """
    images = list(request.images)
    questions: dict[str, Noul | Choice | Score] = {}
    for q in request.questions:
        if not q.images:
            questions[q.id] = q.question
            continue
        marks = []
        for url in q.images:
            images.append(url)
            marks.append(f"[image {len(images)}]")
        questions[q.id] = q.question.model_copy(update={"instructions": f"{q.instructions}\n{' '.join(marks)}"})
    return DecisionInputs(state=request.text, images=tuple(images), questions=questions)


def question_results(request: WireRequest, response: Any, *, refuse_unsure: bool = False,
                     refused: str | None = None) -> dict[str, QuestionResult]:
    """Per question id, what `render` writes for it.

    Args:
        request: The parsed request.
        response: The decision's response: a `CanvasResponse` (its read reports say who
            answered), or any langchain-core `ClassifierResponse`; None with `refused`.
        refuse_unsure: Refuse a question on path `unsure` instead of answering the canvas's
            best option.
        refused: Every question is refused, for this reason (a decision model that raised
            `ModelRefusalError`).
    """
    if refused is not None:
        return {q.id: QuestionResult(refusal=refused) for q in request.questions}
    reads: Mapping[str, Any] = getattr(response, "reads", None) or {}
    answers: Mapping[str, Any] = getattr(response, "answers", None) or {}
    refusals: Mapping[str, str] = getattr(response, "refusals", None) or {}  # a SystemOneResponse's
    out: dict[str, QuestionResult] = {}
    for q in request.questions:
        report = reads.get(q.id)
        if report is not None:
            out[q.id] = _from_report(report, refuse_unsure)
        elif q.id in answers:
            out[q.id] = _from_answer(answers[q.id])
        elif q.id in refusals:
            out[q.id] = QuestionResult(refusal=f"the decision model refused it: {refusals[q.id]}")
        else:
            out[q.id] = QuestionResult(refusal="the decision model gave no answer")
    return out


def refusal_kind(report: Any, refuse_unsure: bool) -> str | None:
    """Why a question with this read report is a refusal on `/v1/decisions`: `escalation_refused`
    (the target refused it), with `refuse_unsure` `target_fault` (path `unsure` because its
    escalation failed) or `unsure` (path `unsure` otherwise); None: it is answered."""
    if report.refusal is not None:
        return "escalation_refused"
    if refuse_unsure and report.path == "unsure":
        return "target_fault" if report.cause == "target_fault" else "unsure"
    return None


def _from_report(report: Any, refuse_unsure: bool) -> QuestionResult:
    kind = refusal_kind(report, refuse_unsure)
    if kind == "escalation_refused":
        return QuestionResult(refusal=f"the escalation target refused it: {report.refusal}")
    if kind == "target_fault":
        return QuestionResult(refusal=f"the gate did not pass it and its escalation failed: {report.escalation_error}")
    if kind == "unsure":
        return QuestionResult(refusal=f"the gate did not pass it ({report.cause}) and nothing answered it instead")
    confidence = report.escalation_confidence if report.path == "escalated" else None
    return QuestionResult(answer=report.answer, probabilities=report.probabilities, confidence=confidence)


def _from_answer(answer: Any) -> QuestionResult:
    """A langchain-core answer (a decision model other than a canvas model)."""
    if answer.type == "noul":
        p = float(answer.noul)
        return QuestionResult(answer="yes" if p >= 0.5 else "no", probabilities={"yes": p, "no": 1.0 - p})
    if answer.type == "choice":
        return QuestionResult(answer=answer.choice, probabilities=dict(answer.probabilities) or None,
                              confidence=answer.confidence)
    probs = {str(level): float(p) for level, p in answer.probabilities.items()}
    top = max(probs, key=probs.__getitem__) if probs else str(round(answer.score))
    return QuestionResult(answer=top, probabilities=probs or None, confidence=answer.confidence)


def usage_of(response: Any) -> Usage:
    """The response's token usage; reasoning tokens are the thoughts' (`think`)."""
    usage: Mapping[str, Any] = getattr(response, "usage", None) or {}
    diagnostics = getattr(response, "diagnostics", None)
    thought = sum(t.tokens for t in diagnostics.thoughts) if diagnostics is not None else 0
    return Usage(input_tokens=int(usage.get("input_tokens", 0)), output_tokens=int(usage.get("output_tokens", 0)),
                 reasoning_tokens=thought)
