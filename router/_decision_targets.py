"""Escalating to a decision model: ask a decision API the questions the canvas was unsure about.

Targets: langchain-openai's `OpenAIDecisions` (the OpenAI Decisions wire, `/v1/decisions`) and
any langchain-core `BaseDecisionModel` (canvasroute's `SystemOneDecisionModel` on `/v1/systemone`
among them). One call asks every question; each comes back as the target answered it: the
option, the target's own distribution over the options (kept, never re-derived from the
option), its confidence, or a refusal, which is not an answer.

What the target is asked (`DecisionAsk`): the questions in the target's own types (`Noul` ->
`Predicate`, `Choice` -> `Choice`, `Score` -> `Score` for `OpenAIDecisions`; langchain-core's
questions as they are for a `BaseDecisionModel`), each question's instructions headed by the
decision's instructions and followed by its parents' answers ("Earlier answers about this
input"), as the canvas read them. The state: a `BaseDecisionModel` gets the state value (it
renders and reads it itself, images included); `OpenAIDecisions` gets the text the canvas read,
with the images beside it in one user message (its client would send any other conversation as
JSON text).

`OpenAIDecisions` is a Runnable over `{"input", "questions"}` with its own question types, not a
`BaseDecisionModel`: the chat path (`_escalation.escalate`) invokes it with a list of chat messages,
and its `_payload` reads `request["input"]` from that list, raising `TypeError('list indices must
be integers or slices, not str')` before any request is sent, which `failure` then reports as
"the target answered with an error". Here it gets the request it takes.

Failures are `EscalationError`s (`_escalation.failure` classifies the exception: `network` or
`target`), except an answer outside the wire, which is `format`: a response the target's client
could not read (`APIResponseValidationError`, `EngineResponseError`), a missing answer, an
answer of another type, an option that was not offered.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.decisions import BaseDecisionModel, Choice, Noul, NoulAnswer, Score
from langchain_core.exceptions import ModelRefusalError
from langchain_core.messages import HumanMessage

from canvasroute.engine.errors import EngineResponseError, EscalationError

from ._escalation import _reraise_control_flow, failure, target_name
from ._questions import option_text

__all__ = ["DecisionAsk", "Restated", "TargetAnswer", "TargetReply", "ask_decision_target", "is_decision_target"]

_FORMAT_HINT = ("the decision target answered outside the wire: check that it answers every question with its "
                "own type and one of the options it was given")
_OPENAI_RETRIES = 2
"""The `openai` SDK's own retries when `OpenAIDecisions(max_retries=None)` (`openai.DEFAULT_MAX_RETRIES`)."""


@dataclass(frozen=True, slots=True)
class Restated:
    """A parent's final answer, restated to a question that depends on it."""

    question: str
    """The parent question, as text (its instructions)."""
    answer: str
    """Its answer, as text (yes/no, the option's name, the level's description)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionAsk:
    """What a decision target is asked: the state as the canvas saw it, and the unsure questions."""

    state: Any
    """The state, as the caller gave it (text, messages, JSON-like values)."""
    text: str
    """The state as the canvas read it (rendered)."""
    questions: Mapping[str, Noul | Choice | Score]
    """The questions to ask, by id, in order."""
    images: tuple[str, ...] = ()
    """The state's image URLs (data URLs for inline images), in order."""
    instructions: str = ""
    """The decision's instructions (context for every question), as the canvas read them."""
    parents: Mapping[str, tuple[Restated, ...]] = field(default_factory=dict)
    """Per dependent question: its parents' answers, restated after its instructions."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetAnswer:
    """One question as the target answered it."""

    answer: str | None
    """The option (`yes`/`no`, a Choice's key, a Score level `0`..`n-1`); None when refused."""
    probabilities: Mapping[str, float] | None = None
    """The target's distribution over the question's options, as it reported it."""
    confidence: float | None = None
    """The target's confidence (a predicate's: the larger of p and 1 - p)."""
    refusal: str | None = None
    """Why the target did not answer (a refusal is not an answer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetReply:
    """A decision target's reply to one `DecisionAsk`."""

    model: str
    """The model that answered, as the target names it."""
    answers: Mapping[str, TargetAnswer]
    """Per question id, in the order asked."""
    usage: Mapping[str, int] = field(default_factory=dict)
    """`input_tokens`, `output_tokens` (0 when not reported)."""
    request_id: str | None = None
    """The target's request id, when it reports one."""


def is_decision_target(target: Any) -> bool:
    """Whether `target` is asked as a decision model (`OpenAIDecisions` or a `BaseDecisionModel`)."""
    return isinstance(target, BaseDecisionModel) or _is_openai_decisions(target)


async def ask_decision_target(target: Any, ask: DecisionAsk) -> TargetReply:
    """Ask `target` every question of `ask` in one call.

    Raises:
        EscalationError: `failure` `network` (unreachable, timed out), `target` (it answered
            with an error, or cannot take the request) or `format` (an answer outside the wire).

    Example:
        ```python
        reply = await ask_decision_target(OpenAIDecisions(model="gpt-6-luna"), DecisionAsk(
            state=ticket, text=ticket, questions={"urgent": Noul(instructions="Urgent?")}))
        reply.answers["urgent"].probabilities  # {"yes": 0.91, "no": 0.09}
        ```
    """
    name = target_name(target)
    options = {qid: _options(q) for qid, q in ask.questions.items()}
    if _is_openai_decisions(target):
        request = _openai_request(ask, name)
    elif isinstance(target, BaseDecisionModel):
        request = {"state": ask.state, "questions": {qid: _restated(qid, q, ask) for qid, q in ask.questions.items()}}
    else:
        raise TypeError(f"{name} is not a decision model (OpenAIDecisions or a BaseDecisionModel)")
    try:
        response = await target.ainvoke(request, config={"tags": ["nostream"]})
    except ModelRefusalError as exc:  # a BaseDecisionModel's refusal: every question refused, none answered
        return TargetReply(model=name, answers={qid: TargetAnswer(answer=None, refusal=str(exc) or "refused")
                                                for qid in ask.questions})
    except Exception as exc:
        _reraise_control_flow(exc)
        raise _classified(name, target, exc) from exc
    try:
        answers = {qid: _read(qid, q, getattr(response, "answers", {}).get(qid), options[qid])
                   for qid, q in ask.questions.items()}
    except ValueError as exc:
        raise EscalationError(f"escalation to {name} answered outside the wire (format): {exc}", failure="format",
                              hint=_FORMAT_HINT) from exc
    usage = getattr(response, "usage", None)
    counts = {k: int(_usage_value(usage, k) or 0) for k in ("input_tokens", "output_tokens")}
    model = getattr(response, "model", None)
    return TargetReply(model=model if isinstance(model, str) and model else name, answers=answers, usage=counts,
                       request_id=getattr(response, "request_id", None))


# -- asking ------------------------------------------------------------------------------------


def _options(q: Noul | Choice | Score) -> tuple[str, ...]:
    if isinstance(q, Noul):
        return ("yes", "no")
    if isinstance(q, Choice):
        return tuple(q.criteria)
    return tuple(str(n) for n in range(len(q.criteria)))


def _text(q: Noul | Choice | Score, ask: DecisionAsk, qid: str, *, criteria: bool) -> str:
    """A question's instructions as the target reads them: the decision's instructions first, a
    Noul's outcome descriptions (when the target's type has no place for them), the parents' answers."""
    parts = [ask.instructions] if ask.instructions else []
    parts.append(option_text(q.instructions))
    if criteria and isinstance(q, Noul) and q.criteria is not None:
        outcomes = [f"{word} means: {option_text(text)}" for word, text in
                    (("Yes", q.criteria.true), ("No", q.criteria.false)) if text not in (None, "")]
        parts += outcomes
    if restated := ask.parents.get(qid):
        parts.append("Earlier answers about this input:\n" + "\n".join(f"- {r.question}: {r.answer}"
                                                                       for r in restated))
    return "\n\n".join(parts)


def _restated(qid: str, q: Noul | Choice | Score, ask: DecisionAsk) -> Noul | Choice | Score:
    """A langchain-core question with the decision's instructions and its parents' answers in it."""
    if not ask.instructions and not ask.parents.get(qid):
        return q
    return q.model_copy(update={"instructions": _text(q, ask, qid, criteria=False)})


def _openai_request(ask: DecisionAsk, name: str) -> dict[str, Any]:
    """`OpenAIDecisions`'s input: the canvas's text (and images), the questions in its own types."""
    from langchain_openai.decisions import Choice as OpenAIChoice
    from langchain_openai.decisions import Level, Predicate
    from langchain_openai.decisions import Score as OpenAIScore

    hosted = [url for url in ask.images if not url.startswith("data:")]
    if hosted:
        raise EscalationError(f"escalation to {name}: OpenAIDecisions sends images only as base64 data URLs, and "
                              f"the state holds {len(hosted)} hosted image URL(s)", failure="target",
                              hint="inline the images (data URLs), or escalate to a target that takes image URLs")
    state: Any = ask.text
    if ask.images:
        state = [HumanMessage(content=[{"type": "text", "text": ask.text},
                                       *({"type": "image_url", "image_url": {"url": url}} for url in ask.images)])]
    questions: dict[str, Any] = {}
    for qid, q in ask.questions.items():
        text = _text(q, ask, qid, criteria=True)
        if isinstance(q, Noul):
            questions[qid] = Predicate(instructions=text)
        elif isinstance(q, Choice):
            questions[qid] = OpenAIChoice(instructions=text, choices={
                option: None if d in (None, "") else option_text(d) for option, d in q.criteria.items()})
        else:
            questions[qid] = OpenAIScore(instructions=text, levels=[
                Level(label=option_text(d) or str(n)) for n, d in enumerate(q.criteria)])
    return {"input": state, "questions": questions}


def _is_openai_decisions(target: Any) -> bool:
    """langchain-openai's `OpenAIDecisions` (optional: `canvasroute[openai]`), by its class."""
    return any(c.__name__ == "OpenAIDecisions" and c.__module__.startswith("langchain_openai.decisions")
               for c in type(target).__mro__)


def _classified(name: str, target: Any, exc: Exception) -> EscalationError:
    """`failure`'s classification, with an unreadable response as `format` and the SDK's own retries counted."""
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, EngineResponseError) or "APIResponseValidationError" in names:
        return EscalationError(f"escalation to {name} answered something its client cannot read (format): "
                               f"{exc!r}", failure="format", hint=_FORMAT_HINT)
    error = failure(name, target, exc)
    status = getattr(exc, "status_code", None)
    retried = "APIConnectionError" in names or (isinstance(status, int) and (status in (408, 409, 429) or status >= 500))
    if _is_openai_decisions(target) and getattr(target, "max_retries", None) is None and retried:
        error.attempts = _OPENAI_RETRIES + 1  # the SDK retried these by itself
    return error


# -- reading -----------------------------------------------------------------------------------


def _read(qid: str, q: Noul | Choice | Score, answer: Any, options: Sequence[str]) -> TargetAnswer:
    """One answer (OpenAI Decisions' or langchain-core's) as a `TargetAnswer` (ValueError: outside the wire)."""
    kind = getattr(answer, "type", None)
    if answer is None:
        raise ValueError(f"no answer for {qid!r}")
    if kind == "refusal":
        extra = getattr(answer, "model_extra", None) or {}
        reason = next((str(v) for k, v in extra.items() if k in ("reason", "refusal", "message") and v), None)
        return TargetAnswer(answer=None, refusal=reason or "the target refused to answer")
    wanted = ("predicate", "noul") if isinstance(q, Noul) else ("choice",) if isinstance(q, Choice) else ("score",)
    if kind not in wanted:
        raise ValueError(f"{qid!r} is a {q.type}, the target answered a {kind}")
    if isinstance(answer, NoulAnswer) or kind == "predicate":
        p = _probability(answer.noul if isinstance(answer, NoulAnswer) else answer.probability, qid)
        return TargetAnswer(answer="yes" if p >= 0.5 else "no", probabilities={"yes": p, "no": 1.0 - p},
                            confidence=max(p, 1.0 - p))
    if kind == "choice":
        choice = answer.choice
        if not isinstance(choice, str) or choice not in options:
            raise ValueError(f"{qid!r}: {json.dumps(choice)} is not one of {list(options)}")
        probs = _distribution(qid, dict(answer.probabilities), options, _choice_key)
        return TargetAnswer(answer=choice, probabilities=probs, confidence=float(answer.confidence))
    probs = _distribution(qid, dict(answer.probabilities), options, _level_key)
    if probs:
        level = max(probs, key=probs.__getitem__)
    else:
        level = str(min(max(round(float(answer.score)), 0), len(options) - 1))
    return TargetAnswer(answer=level, probabilities=probs or None, confidence=float(answer.confidence))


def _choice_key(key: Any) -> str | None:
    return key if isinstance(key, str) else None  # a boolean is another value than any string option


def _level_key(key: Any) -> str | None:
    return str(key) if isinstance(key, int) and not isinstance(key, bool) else None


def _distribution(qid: str, given: Mapping[Any, Any], options: Sequence[str],
                  key: Callable[[Any], str | None]) -> dict[str, float]:
    """The target's probabilities over the options (an option it gave none: 0); ValueError for mass on
    anything that is not an option."""
    out = dict.fromkeys(options, 0.0)
    for raw, p in given.items():
        option = key(raw)
        if option not in out:
            raise ValueError(f"{qid!r}: a probability for {json.dumps(raw)}, which is not one of {list(options)}")
        out[option] = _probability(p, qid)
    return out if given else {}


def _probability(value: Any, qid: str) -> float:
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{qid!r}: probability {value!r} is not in [0, 1]")
    return p


def _usage_value(usage: Any, key: str) -> Any:
    if isinstance(usage, Mapping):
        return usage.get(key)
    return getattr(usage, key, None)

