"""The request as a whole (`parse`) and the response (`render`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import BaseMessage

from ..limits import Limits
from ._fields import fail, mapping, optional, required, string
from ._input import read_input
from ._questions import WireQuestion, read_questions

__all__ = ["QuestionResult", "Usage", "WireRequest", "parse", "render"]

_REQUEST_KEYS = ("model", "input", "questions", "prompt_cache_key", "prompt_cache_options", "safety_identifier")


@dataclass(frozen=True, kw_only=True, slots=True)
class WireRequest:
    """A validated `/v1/decisions` request."""

    model: str
    """The model the caller named."""
    state: str | tuple[BaseMessage, ...]
    """What to decide on: the text, or the input items as langchain-core messages (a `HumanMessage`,
    `SystemMessage` (developer ones marked `__openai_role__`), `AIMessage` with `tool_calls`,
    `ToolMessage`), image parts as standard image blocks."""
    text: str
    """The state as one transcript (`role: text` lines, tool calls and outputs written out, `[image N]`
    where an image is); not yet defused: the router defuses what it reads."""
    images: tuple[str, ...]
    """The input's image URLs (data URLs or http(s) URLs), in order (`[image N]` is `images[N-1]`)."""
    questions: tuple[WireQuestion, ...]
    """The questions, in order."""
    prompt_cache_key: str | None = None
    """Kept as sent; a canvas read has no prompt cache to partition."""
    safety_identifier: str | None = None
    """Kept as sent (for the log)."""
    ignored: tuple[str, ...] = ()
    """Fields this server does not read (`param` paths, at most 20): a request keeps working."""

    def questions_by_id(self) -> dict[str, Noul | Choice | Score]:
        """The questions as the router takes them: id -> langchain-core question, in order."""
        return {q.id: q.question for q in self.questions}


def parse(body: Any, *, limits: Limits | None = None) -> WireRequest:
    """Check a decoded `/v1/decisions` body and return the request.

    Args:
        body: The decoded JSON body.
        limits: This server's bounds (questions, options, levels, text and name lengths, the
            state's size), on top of the wire's own; None: the wire's only.

    Raises:
        DecisionsWireError: (400) the first field that cannot be used, named in `param`.

    Example:
        ```python
        request = parse({"model": "m", "input": "Refund me!", "questions": [
            {"type": "predicate", "name": "refund", "instructions": "Is a refund asked for?"}]})
        request.questions_by_id()  # {"refund": Noul(instructions="Is a refund asked for?")}
        ```
    """
    data = mapping(body, ())
    ignored = [k for k in data if k not in _REQUEST_KEYS]
    model = string(required(data, "model", ()), ("model",), empty=False,
                    limit=limits.max_name_chars if limits else None)
    for key in ("prompt_cache_key", "safety_identifier"):
        if data.get(key) is not None:
            string(data[key], (key,))
    if (options := data.get("prompt_cache_options")) is not None:
        mapping(options, ("prompt_cache_options",))
        optional(options, "mode", ("implicit", "explicit"), ("prompt_cache_options",))
        optional(options, "ttl", ("30m",), ("prompt_cache_options",))
    state, text, images = read_input(required(data, "input", ()), ignored)
    if limits is not None and len(text) > limits.max_state_chars:
        fail(("input",), f"over {limits.max_state_chars} characters.", "string_above_max_length")
    questions = read_questions(required(data, "questions", ()), limits, ignored)
    return WireRequest(model=model, state=state, text=text, images=images, questions=questions,
                            prompt_cache_key=data.get("prompt_cache_key"),
                            safety_identifier=data.get("safety_identifier"),
                            ignored=tuple(i[:200] for i in ignored[:20]))



# -- the response ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class QuestionResult:
    """What was decided for one question."""

    answer: str | None = None
    """The option the answer names (`yes`/`no`, a choice's option name, a level `0`..`n-1`); None with a refusal."""
    probabilities: Mapping[str, float] | None = None
    """The distribution over the question's options (renormalized over them); None: all on `answer`."""
    confidence: float | None = None
    """The answer's confidence (a choice's and a score's); None: the top probability."""
    refusal: str | None = None
    """Why the question was not answered (for the log; the wire carries no reason): a refusal answer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    """Token usage for the request."""

    input_tokens: int = 0
    """Tokens read (state, questions, canvas)."""
    output_tokens: int = 0
    """Tokens written (a canvas read writes its answer slots)."""
    cached_tokens: int = 0
    """Input tokens served from a prompt cache."""
    cache_write_tokens: int = 0
    """Input tokens written to a prompt cache."""
    reasoning_tokens: int = 0
    """Output tokens spent thinking."""


def render(request: WireRequest, results: Mapping[str, QuestionResult], *, model: str | None = None,
           usage: Usage | None = None) -> dict[str, Any]:
    """The response body: one answer per question, in question order, each with its name.

    Args:
        request: The parsed request.
        results: Per question id (`WireQuestion.id`), what was decided.
        model: The model that answered (default: the one the request named).
        usage: Token usage (None: zeros).

    Raises:
        ValueError: a question without a result, an answer that is not an option, a
            distribution over names that are not options, or one that is not finite and positive.
    """
    usage = usage or Usage()
    answers = [_answer(q, results.get(q.id)) for q in request.questions]
    return {
        "answers": answers,
        "model": model or request.model,
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cache_write_tokens": usage.cache_write_tokens,
                                     "cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.input_tokens + usage.output_tokens,
        },
    }


def _answer(q: WireQuestion, result: QuestionResult | None) -> dict[str, Any]:
    if result is None:
        raise ValueError(f"no result for question {q.id!r}")
    if result.refusal is not None:
        return {"type": "refusal", "name": q.name}
    if result.answer not in q.options:
        raise ValueError(f"question {q.id!r}: {result.answer!r} is not one of {list(q.options)}")
    probs = _distribution(q, result)
    confidence = result.confidence if result.confidence is not None else max(probs)
    if q.kind == "predicate":
        return {"type": "predicate", "name": q.name, "probability": probs[0]}
    if q.kind == "choice":
        return {"type": "choice", "name": q.name, "choice": q.values[q.options.index(result.answer)],
                "confidence": confidence,
                "probabilities": [{"value": v, "probability": p} for v, p in zip(q.values, probs, strict=True)]}
    return {"type": "score", "name": q.name, "score": sum(n * p for n, p in enumerate(probs)),
            "confidence": confidence,
            "probabilities": [{"label": label, "value": n, "probability": p}
                              for n, (label, p) in enumerate(zip(q.labels, probs, strict=True))]}


def _distribution(q: WireQuestion, result: QuestionResult) -> list[float]:
    """The probabilities in option order, summing to 1 (all on the answer when none were given)."""
    given = result.probabilities
    if given is None:
        return [1.0 if o == result.answer else 0.0 for o in q.options]
    unknown = [k for k in given if k not in q.options]
    if unknown:
        raise ValueError(f"question {q.id!r}: probabilities for {unknown[:5]}, which are not options")
    probs = [float(given.get(o, 0.0)) for o in q.options]
    total = sum(probs)
    if not all(math.isfinite(p) and p >= 0.0 for p in probs) or not total > 0.0:
        raise ValueError(f"question {q.id!r}: probabilities must be finite, non-negative and not all 0")
    return [p / total for p in probs]
