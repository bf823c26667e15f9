"""Escalation: ask a larger model the questions the canvas was unsure about, in one call.

Targets: a chat model (`BaseChatModel`), any `Runnable` that takes messages (e.g. a
structured-output chain), or another `BaseDecisionModel`. Chat models and runnables get
the question, the options, the state and the canvas probabilities (after a one-shot
example of the reply format), and must reply with a JSON object `{question id: option}`
restricted to the allowed options. A failed call or malformed output gets one retry,
then `EscalationError`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.decisions import BaseDecisionModel, ChoiceAnswer, NoulAnswer, ScoreAnswer
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from canvasroute.engine.errors import CanvasRouteError, EscalationError

from ._questions import QuestionSpec, option_text, parse_questions


@dataclass(slots=True)
class Escalated:
    """The escalation's answers: option and (if the target reported one) distribution."""

    model: str
    answers: dict[str, str]
    probabilities: dict[str, dict[str, float] | None]
    usage: dict[str, int] = field(default_factory=dict)


def target_name(target: Any) -> str:
    """A readable model name for reports and spans."""
    for attr in ("model_name", "model", "model_id"):
        value = getattr(target, attr, None)
        if isinstance(value, str) and value:
            return value
    if callable(getattr(target, "get_name", None)):  # a Runnable: its name (default: its class)
        return str(target.get_name())
    return type(target).__name__


async def escalate(target: Any, state_text: str, state: Any, specs: Sequence[QuestionSpec],
                   canvas: Mapping[str, Mapping[str, float] | None]) -> Escalated:
    """Answer `specs` with `target`, one call for all of them."""
    name = target_name(target)
    config = {"tags": ["nostream"]}
    if isinstance(target, BaseDecisionModel):
        request = {"state": state, "questions": {s.id: s.question for s in specs}}
        cause: Exception | None = None
        for _ in range(2):
            try:
                return _from_decision(name, await target.ainvoke(request, config=config), specs)
            except Exception as exc:  # the target's fault, typed or not: one retry
                _reraise_control_flow(exc)
                cause = exc
        raise EscalationError(f"escalation to {name} failed twice: {cause!r}",
                              hint="check the escalation model", retryable=_transient(cause)) from cause
    messages: list[BaseMessage] = [SystemMessage(_instructions(specs)), *_EXAMPLE,
                                   HumanMessage(_request(state_text, specs, canvas))]
    usage = {"input_tokens": 0, "output_tokens": 0}
    error, cause = "", None
    for _ in range(2):
        try:
            reply = await target.ainvoke(messages, config=config)
        except Exception as exc:
            _reraise_control_flow(exc)
            error, cause = f"escalation to {name} failed: {exc!r}", exc
            continue
        for key, value in _usage(reply).items():
            usage[key] += value
        try:
            result = _from_reply(name, reply, specs)
        except ValueError as exc:
            error, cause = f"escalation to {name} answered outside the allowed options: {exc}", exc
            messages = [*messages, reply if isinstance(reply, BaseMessage) else AIMessage(str(reply)),
                        HumanMessage(f"That reply was invalid ({exc}). Reply with the JSON object only.")]
            continue
        result.usage = usage  # both attempts count
        return result
    raise EscalationError(error, hint="check the escalation model, or its output format",
                          retryable=_transient(cause)) from cause


def _transient(exc: BaseException | None) -> bool:
    """A target failure that may pass by itself: unreachable, timed out, or shedding load."""
    if isinstance(exc, CanvasRouteError):
        return exc.retryable
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in _TRANSIENT_NAMES


_TRANSIENT_NAMES = {"APIConnectionError", "APITimeoutError", "RateLimitError", "InternalServerError",
                    "ConnectError", "ReadTimeout", "ConnectTimeout", "RemoteProtocolError"}
"""Transient errors of the OpenAI and httpx clients, named so neither has to be imported."""


def _reraise_control_flow(exc: Exception) -> None:
    """Let a graph's control flow through (LangGraph's `GraphBubbleUp`: an `interrupt()`
    inside an escalation target, e.g. a human reviewer), without importing LangGraph."""
    if any(cls.__name__ == "GraphBubbleUp" for cls in type(exc).__mro__):
        raise exc


def _instructions(specs: Sequence[QuestionSpec]) -> str:
    return ("You answer classification questions about an input. For each question choose exactly one "
            "of its allowed options. A fast model's probabilities are given as a hint; they may be wrong. "
            "Reply with only a JSON object that maps each question id to one allowed option.")


def _request(state_text: str, specs: Sequence[QuestionSpec],
             canvas: Mapping[str, Mapping[str, float] | None]) -> str:
    """The user turn: the input, then one line per question (options, canvas hint).

    One compact line per question keeps small models on track across several questions.
    """
    lines = []
    for spec in specs:
        options = ", ".join(f'"{o}"' + (f" ({d})" if d else "")
                            for o, d in zip(spec.options, spec.descriptions, strict=True))
        line = f'Question "{spec.id}": {option_text(spec.question.instructions)} Options: {options}.'
        if hint := canvas.get(spec.id):
            line += " Fast model's probabilities: " + json.dumps({k: round(v, 3) for k, v in hint.items()})
        lines.append(line)
    keys = ", ".join(f'"{s.id}"' for s in specs)
    return f"Input:\n{state_text}\n\n" + "\n".join(lines) + f"\n\nJSON with the keys {keys}:"


def _example() -> tuple[HumanMessage, AIMessage]:
    """A one-shot example of the reply format (small models need it; large ones don't mind)."""
    specs = parse_questions({"weather": {"type": "choice", "instructions": "What is the weather like?",
                                         "criteria": {"sunny": None, "rainy": None}},
                             "cold": {"type": "noul", "instructions": "Is it cold?"}})
    hint = {"weather": {"sunny": 0.6, "rainy": 0.4}, "cold": {"yes": 0.3, "no": 0.7}}
    return (HumanMessage(_request("It is a bright, sunny day in July.", list(specs.values()), hint)),
            AIMessage('{"weather": "sunny", "cold": "no"}'))


def _usage(reply: Any) -> dict[str, int]:
    """Token usage a chat reply reports (empty when it reports none)."""
    if isinstance(reply, AIMessage) and reply.usage_metadata:
        return {"input_tokens": int(reply.usage_metadata.get("input_tokens", 0)),
                "output_tokens": int(reply.usage_metadata.get("output_tokens", 0))}
    return {}


def _from_reply(name: str, reply: Any, specs: Sequence[QuestionSpec]) -> Escalated:
    """Validate a chat/runnable reply and read a distribution from logprobs if present."""
    usage = _usage(reply)
    logprobs = None
    if isinstance(reply, BaseMessage):
        text = reply.text if isinstance(reply.text, str) else reply.text()
        logprobs = (reply.response_metadata or {}).get("logprobs")
        data: Any = _parse_json(text)
    elif isinstance(reply, Mapping):
        data, text = dict(reply), ""
    elif hasattr(reply, "model_dump"):
        data, text = reply.model_dump(), ""
    else:
        text = str(reply)
        data = _parse_json(text)
    answers: dict[str, str] = {}
    by_description: dict[str, bool] = {}  # answered by an option's description, not its name
    for spec in specs:
        value = data.get(spec.id) if isinstance(data, Mapping) else None
        option = _match(spec, value)
        if option is None:
            raise ValueError(f"{spec.id!r}: {value!r} is not one of {list(spec.options)}")
        answers[spec.id] = option
        by_description[spec.id] = isinstance(value, str) and value.strip().casefold() != option.casefold()
    probs = {s.id: _logprob_distribution(logprobs, text, s, by_description[s.id]) if logprobs else None
             for s in specs}
    for qid, dist in probs.items():  # a distribution that disagrees with the answer was mis-mapped
        if dist and max(dist, key=dist.__getitem__) != answers[qid]:
            probs[qid] = None
    return Escalated(name, answers, probs, usage)


def _parse_json(text: str) -> Any:
    """The first JSON object in `text` (prose or code fences around it are ignored)."""
    decoder = json.JSONDecoder()
    start, error = (text or "").find("{"), "no JSON object"
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            error = f"invalid JSON ({exc.msg})"
        else:
            if isinstance(value, dict):
                return value
        start = text.find("{", start + 1)
    raise ValueError(f"{error} in {(text or '')[:120]!r}")


def _match(spec: QuestionSpec, value: Any) -> str | None:
    """The option a reply value names: its name (exactly, else stripped, else case-folded if
    that names one option), or (if unambiguous) its description."""
    if isinstance(value, bool) and spec.kind == "noul":
        return "yes" if value else "no"
    if isinstance(value, int) and not isinstance(value, bool) and spec.kind == "score":
        value = str(value)
    if not isinstance(value, str):
        return None
    if value in spec.options:
        return value
    stripped = {o.strip(): o for o in spec.options}
    if value.strip() in stripped:
        return stripped[value.strip()]
    key = value.strip().casefold()
    folded = [o for o in spec.options if o.strip().casefold() == key]
    if len(folded) == 1:
        return folded[0]
    described = [o for o, d in zip(spec.options, spec.descriptions, strict=True) if d and d.casefold() == key]
    return described[0] if len(described) == 1 else None


def _logprob_distribution(logprobs: Any, text: str, spec: QuestionSpec,
                          by_description: bool = False) -> dict[str, float] | None:
    """Distribution over options from OpenAI-shaped logprobs at the answer's first token.

    Approximate: each option takes the best alternative whose text is a prefix of its
    name (of its description, when the reply named the answer by its description);
    options sharing a first token share that mass. None when the token is not found.
    """
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else logprobs
    if not content:
        return None
    m = re.search(r'"%s"\s*:\s*"?' % re.escape(spec.id), text)
    if m is None:
        return None
    offset = 0
    for entry in content:
        token = entry.get("token", "")
        if offset + len(token) > m.end() or (offset >= m.end()):
            alts = {a["token"].strip().strip('"'): a["logprob"] for a in entry.get("top_logprobs") or []}
            alts.setdefault(token.strip().strip('"'), entry.get("logprob", 0.0))
            scores = {}
            for option, desc in zip(spec.options, spec.descriptions, strict=True):
                name = (desc if by_description else option).casefold()
                hits = [lp for tok, lp in alts.items() if tok and name and name.startswith(tok.casefold())]
                scores[option] = max(hits) if hits else None
            known = [v for v in scores.values() if v is not None]
            if not known:
                return None
            floor = min(known) - 5.0
            weights = {o: math.exp(v if v is not None else floor) for o, v in scores.items()}
            total = sum(weights.values())
            return {o: w / total for o, w in weights.items()}
        offset += len(token)
    return None


def _from_decision(name: str, resp: Any, specs: Sequence[QuestionSpec]) -> Escalated:
    name = getattr(resp, "model", None) or name  # the model that answered, as it reports itself
    answers: dict[str, str] = {}
    probs: dict[str, dict[str, float] | None] = {}
    for spec in specs:
        ans = resp.answers.get(spec.id) if resp is not None else None
        if isinstance(ans, NoulAnswer):
            answers[spec.id] = "yes" if ans.noul >= 0.5 else "no"
            probs[spec.id] = {"yes": ans.noul, "no": 1.0 - ans.noul}
        elif isinstance(ans, ChoiceAnswer) and ans.choice in spec.options:
            answers[spec.id] = ans.choice
            probs[spec.id] = {o: float(ans.probabilities.get(o, 0.0)) for o in spec.options}
        elif isinstance(ans, ScoreAnswer):
            dist = {str(k): float(v) for k, v in ans.probabilities.items()}
            answers[spec.id] = max(dist, key=dist.__getitem__) if dist else str(round(ans.score))
            probs[spec.id] = {o: dist.get(o, 0.0) for o in spec.options}
        else:
            raise EscalationError(f"escalation to {name} returned no usable answer for {spec.id!r}: {ans!r}")
    usage = dict(resp.usage) if getattr(resp, "usage", None) else {}
    return Escalated(name, answers, probs, {k: int(usage.get(k, 0)) for k in ("input_tokens", "output_tokens")})


_EXAMPLE = _example()


def is_target(target: Any) -> bool:
    """Whether `target` can be escalated to."""
    return isinstance(target, (BaseChatModel, BaseDecisionModel)) or hasattr(target, "ainvoke")
