"""What an escalation answered: a reply (text, a mapping, structured output) read into options.

Replies are read leniently but only into allowed options: an option by name (any case),
by its description when that is unambiguous, a bool for a Noul, an int for a Score level.
A distribution comes from OpenAI-shaped logprobs at the answer's first token, when the
reply carries them; a decision-model target reports its own.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.decisions import ChoiceAnswer, NoulAnswer, ScoreAnswer
from langchain_core.messages import AIMessage, BaseMessage

from ._questions import QuestionSpec

__all__ = ["Escalated", "from_decision", "from_reply", "usage_of"]


@dataclass(slots=True)
class Escalated:
    """The escalation's answers: option and (if the target reported one) distribution."""

    model: str
    answers: dict[str, str]
    probabilities: dict[str, dict[str, float] | None]
    usage: dict[str, int] = field(default_factory=dict)
    response_model: str | None = None
    """The model that answered, as the target's reply names it (None when it does not)."""


def usage_of(reply: Any) -> dict[str, int]:
    """Token usage a chat reply reports (empty when it reports none)."""
    if isinstance(reply, AIMessage) and reply.usage_metadata:
        return {"input_tokens": int(reply.usage_metadata.get("input_tokens", 0)),
                "output_tokens": int(reply.usage_metadata.get("output_tokens", 0))}
    return {}


def from_reply(name: str, reply: Any, specs: Sequence[QuestionSpec], parsed: Any = None) -> Escalated:
    """Validate a chat/runnable reply (or, with structured output, its `parsed` mapping beside
    the raw message) and read a distribution from logprobs if present."""
    usage = usage_of(reply)
    logprobs, served = None, None
    if isinstance(reply, BaseMessage):
        text = reply.text if isinstance(reply.text, str) else reply.text()
        metadata = reply.response_metadata or {}
        logprobs, served = metadata.get("logprobs"), metadata.get("model_name") or metadata.get("model")
        data: Any = parsed if parsed is not None else _parse_json(text)
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
    return Escalated(name, answers, probs, usage, served if isinstance(served, str) and served else None)


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
    """The option a reply value names: its name, or (if unambiguous) its description."""
    if isinstance(value, bool) and spec.kind == "noul":
        return "yes" if value else "no"
    if isinstance(value, int) and not isinstance(value, bool) and spec.kind == "score":
        value = str(value)
    if not isinstance(value, str):
        return None
    key = value.strip().casefold()
    folded = {o.casefold(): o for o in spec.options}
    if key in folded:
        return folded[key]
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


def from_decision(name: str, resp: Any, specs: Sequence[QuestionSpec]) -> Escalated:
    """A decision-model target's answers (ValueError: one it did not answer usably)."""
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
            raise ValueError(f"no usable answer for {spec.id!r}: {ans!r}")
    usage = dict(resp.usage) if getattr(resp, "usage", None) else {}
    return Escalated(name, answers, probs, {k: int(usage.get(k, 0)) for k in ("input_tokens", "output_tokens")},
                     name)
