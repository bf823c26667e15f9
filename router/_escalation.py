"""Escalation: ask a larger model the questions the canvas was unsure about, in one call.

Targets: a chat model (`BaseChatModel`), any `Runnable` that takes messages (e.g. a
structured-output chain), or another `BaseDecisionModel`. Chat models and runnables get
the question, the options, the state and the canvas probabilities, and must reply with a
JSON object `{question id: option}` restricted to the allowed options. Malformed output
gets one retry, then `EscalationError`.
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

from engine import CanvasRouteError

from ._schema import QuestionSpec, _text

_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


class EscalationError(CanvasRouteError):
    """The escalation target failed, timed out, or answered outside the allowed options."""

    retryable = True


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
    return type(target).__name__


async def escalate(target: Any, state_text: str, state: Any, specs: Sequence[QuestionSpec],
                   canvas: Mapping[str, Mapping[str, float] | None]) -> Escalated:
    """Answer `specs` with `target`, one call for all of them."""
    name = target_name(target)
    if isinstance(target, BaseDecisionModel):
        try:
            resp = await target.ainvoke({"state": state, "questions": {s.id: s.question for s in specs}},
                                        config={"tags": ["nostream"]})
        except CanvasRouteError:
            raise
        except Exception as exc:
            raise EscalationError(f"escalation to {name} failed: {exc!r}") from exc
        return _from_decision(name, resp, specs)
    messages: list[BaseMessage] = [SystemMessage(_instructions(specs)),
                                   HumanMessage(_request(state_text, specs, canvas))]
    error = ""
    for attempt in range(2):
        try:
            reply = await target.ainvoke(messages, config={"tags": ["nostream"]})
        except Exception as exc:
            error = f"escalation to {name} failed: {exc!r}"
            continue
        try:
            return _from_reply(name, reply, specs)
        except ValueError as exc:
            error = f"escalation to {name} answered outside the allowed options: {exc}"
            messages = [*messages, reply if isinstance(reply, BaseMessage) else AIMessage(str(reply)),
                        HumanMessage(f"That reply was invalid ({exc}). Reply with the JSON object only.")]
    raise EscalationError(error, hint="check the escalation model, or its output format")


def _instructions(specs: Sequence[QuestionSpec]) -> str:
    ids = ", ".join(f'"{s.id}"' for s in specs)
    return ("You answer classification questions about the input. For each question choose exactly one "
            "of its allowed options. A fast model's probabilities are given as a hint; they may be wrong. "
            f"Reply with only a JSON object with the keys {ids}, each mapped to one allowed option.")


def _request(state_text: str, specs: Sequence[QuestionSpec],
             canvas: Mapping[str, Mapping[str, float] | None]) -> str:
    parts = [f"Input:\n{state_text}"]
    for spec in specs:
        lines = [f'Question "{spec.id}": {_text(spec.question.instructions)}', "Allowed options:"]
        descs = _descriptions(spec)
        lines += [f'- "{opt}"' + (f": {d}" if d else "") for opt, d in zip(spec.options, descs, strict=True)]
        hint = canvas.get(spec.id)
        if hint:
            lines.append("Fast model's probabilities: " + json.dumps({k: round(v, 3) for k, v in hint.items()}))
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _descriptions(spec: QuestionSpec) -> list[str]:
    q = spec.question
    if q.type == "noul":
        crit = q.criteria
        return [_text(crit.true) if crit and crit.true is not None else "",
                _text(crit.false) if crit and crit.false is not None else ""]
    if q.type == "choice":
        return [_text(d) if d not in (None, "") else "" for d in q.criteria.values()]
    return [_text(d) for d in q.criteria]


def _from_reply(name: str, reply: Any, specs: Sequence[QuestionSpec]) -> Escalated:
    """Validate a chat/runnable reply and read a distribution from logprobs if present."""
    usage: dict[str, int] = {}
    logprobs = None
    if isinstance(reply, BaseMessage):
        text = reply.text if isinstance(reply.text, str) else reply.text()
        if isinstance(reply, AIMessage) and reply.usage_metadata:
            usage = {"input_tokens": reply.usage_metadata.get("input_tokens", 0),
                     "output_tokens": reply.usage_metadata.get("output_tokens", 0)}
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
    for spec in specs:
        value = data.get(spec.id) if isinstance(data, Mapping) else None
        option = _match(spec, value)
        if option is None:
            raise ValueError(f"{spec.id!r}: {value!r} is not one of {list(spec.options)}")
        answers[spec.id] = option
    probs = {s.id: _logprob_distribution(logprobs, text, s) if logprobs else None for s in specs}
    return Escalated(name, answers, probs, usage)


def _parse_json(text: str) -> Any:
    m = _JSON_OBJECT.search(text or "")
    if m is None:
        raise ValueError(f"no JSON object in {text[:120]!r}")
    try:
        return json.loads(m.group(0))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg})") from exc


def _match(spec: QuestionSpec, value: Any) -> str | None:
    if isinstance(value, bool) and spec.kind == "noul":
        return "yes" if value else "no"
    if isinstance(value, int) and spec.kind == "score":
        value = str(value)
    if not isinstance(value, str):
        return None
    folded = {o.casefold(): o for o in spec.options}
    return folded.get(value.strip().casefold())


def _logprob_distribution(logprobs: Any, text: str, spec: QuestionSpec) -> dict[str, float] | None:
    """Distribution over options from OpenAI-shaped logprobs at the answer's first token.

    Approximate: each option takes the best alternative whose text is a prefix of it;
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
            for option in spec.options:
                hits = [lp for tok, lp in alts.items() if tok and option.casefold().startswith(tok.casefold())]
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


def is_target(target: Any) -> bool:
    """Whether `target` can be escalated to."""
    return isinstance(target, (BaseChatModel, BaseDecisionModel)) or hasattr(target, "ainvoke")
