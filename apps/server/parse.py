"""A `/v1/systemone` body to a validated request: shape (422), bounds (400/413), what cannot be asked (400).

Every check here runs on the body alone, before admission and before any engine work.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import Choice, Noul, Score
from pydantic import ValidationError

from canvasroute.engine import DecisionError
from canvasroute.router import parse_questions

from .limits import Limits
from .wire import Refusal, from_exception, malformed

__all__ = ["Parsed", "parse_request"]

_QUESTION_TYPES = {"noul": Noul, "choice": Choice, "score": Score}
_QUESTION_KEYS = {"type", "instructions", "criteria"}
_MEDIA_FIELDS = ("assets", "images", "audio", "videos")
_SURROGATE = re.compile("[\ud800-\udfff]")
"""After `json.loads`, a valid escaped pair is one code point: any surrogate left is a lone one."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated `/v1/systemone` request."""

    model: str | None
    state: Any
    questions: dict[str, Any]
    seed: int | None
    thread_id: str | None


class _NonFinite:
    """Stands in for NaN / Infinity / -Infinity while parsing, so the walk can say where."""


_NON_FINITE = _NonFinite()


def parse_request(body: bytes, limits: Limits) -> Parsed:
    """Shape checks (422) first, then bounds (400/413), then what cannot be asked (400)."""
    data = _load(body, limits)
    if not isinstance(data, dict):
        raise Refusal(422, "invalid_request", "the body must be a JSON object", loc=())
    for name in ("state", "questions"):
        if name not in data:
            raise malformed((name,), "field required", "missing")
    state = data["state"]
    if not isinstance(state, (str, dict, list)):
        raise malformed(("state",), "must be text, a JSON object or a JSON array", "invalid_state")
    model = _optional_name(data, "model", limits)
    thread_id = _optional_name(data, "thread_id", limits)
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise malformed(("seed",), "must be a non-negative 64-bit integer")
    raw = data["questions"]
    if not isinstance(raw, dict) or not raw:
        raise malformed(("questions",), "must be a non-empty object of question id to question")
    if len(raw) > limits.max_questions:
        raise Refusal(400, "too_many_questions", f"{len(raw)} questions; at most {limits.max_questions} "
                      "per request", loc=("questions",))
    shaped = {qid: _shape_question(qid, q) for qid, q in raw.items()}
    for name in _MEDIA_FIELDS:
        if data.get(name):
            raise Refusal(400, "unsupported_media", f"{name}: this server reads text and JSON state only", loc=(name,))
    if data.get("instructions"):
        raise Refusal(400, "unsupported_field", "instructions: put request-wide context in the state",
                      loc=("instructions",))
    _check_sizes(state, shaped, limits)
    questions = {qid: _question(qid, q) for qid, q in shaped.items()}
    try:
        parse_questions(questions)  # labels and option names, before any slot is taken
    except DecisionError as exc:
        raise from_exception(exc) from exc
    return Parsed(model, state, questions, seed, thread_id)


def _load(body: bytes, limits: Limits) -> Any:
    try:
        data = json.loads(body, parse_constant=lambda _: _NON_FINITE)
    except RecursionError:
        raise Refusal(422, "invalid_json", f"the body is nested deeper than {limits.max_depth} levels",
                      loc=()) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refusal(422, "invalid_json", f"the body is not JSON: {str(exc)[:200]}", loc=()) from None
    _walk(data, limits.max_depth)
    return data


def _walk(data: Any, max_depth: int) -> None:
    """Refuse what JSON may carry but a decision cannot: deep nesting, lone surrogates, non-finite numbers."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, loc = stack.pop()
        if len(loc) > max_depth:
            raise Refusal(422, "invalid_json", f"the body is nested deeper than {max_depth} levels", loc=())
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise malformed(loc, "text with a lone surrogate (\\ud800-\\udfff) is not Unicode", "invalid_text")
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise malformed(loc, "a key with a lone surrogate (\\ud800-\\udfff) is not Unicode",
                                    "invalid_text")
                stack.append((item, (*loc, key)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in enumerate(value))
        elif value is _NON_FINITE or (isinstance(value, float) and not math.isfinite(value)):
            raise malformed(loc, "NaN and Infinity are not JSON numbers", "invalid_number")


def _optional_name(data: dict[str, Any], field: str, limits: Limits) -> str | None:
    value = data.get(field)
    if value is not None and not isinstance(value, str):
        raise malformed((field,), "must be a string")
    if value is not None and len(value) > limits.max_name_chars:
        raise Refusal(400, "name_too_long", f"{field}: over {limits.max_name_chars} characters", loc=(field,))
    return value


def _is_content(value: Any) -> bool:
    return value is None or isinstance(value, (str, dict, list))


def _shape_question(qid: str, q: Any) -> dict[str, Any]:
    where = ("questions", qid)
    if not qid:
        raise malformed(("questions",), "question ids must be non-empty")
    if not isinstance(q, dict):
        raise malformed(where, "must be an object with 'type', 'instructions' and 'criteria'")
    kind = q.get("type")
    if kind not in ("noul", "choice", "score", "box"):
        shown = kind[:40] if isinstance(kind, str) else type(kind).__name__
        raise malformed((*where, "type"), f"must be 'noul', 'choice', 'score' or 'box', not {shown!r}")
    if unknown := sorted(set(q) - _QUESTION_KEYS):
        raise malformed(where, f"unknown field(s) {[u[:40] for u in unknown[:5]]}")
    if not _is_content(q.get("instructions")):
        raise malformed((*where, "instructions"), "must be text, a JSON object or a JSON array")
    criteria = q.get("criteria")
    if kind == "noul" and criteria is not None and (not isinstance(criteria, dict)
                                                    or not set(criteria) <= {"true", "false"}):
        raise malformed((*where, "criteria"), "a noul's criteria is an object with 'true' and/or 'false'")
    if kind == "choice" and not isinstance(criteria, dict):
        raise malformed((*where, "criteria"), "a choice's criteria is an object of option name to description")
    if kind == "score" and not isinstance(criteria, list):
        raise malformed((*where, "criteria"), "a score's criteria is an ordered list of level descriptions")
    shaped = {"type": kind, "instructions": q.get("instructions") or ""}
    if criteria is not None and kind != "box":
        shaped["criteria"] = criteria
    return shaped


def _chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, separators=(",", ":")))


def _check_sizes(state: Any, shaped: dict[str, dict[str, Any]], limits: Limits) -> None:
    if _chars(state) > limits.max_state_chars:
        raise Refusal(413, "state_too_large", f"state: over {limits.max_state_chars} characters", loc=("state",))
    for qid, q in shaped.items():
        where = ("questions", qid)
        if len(qid) > limits.max_name_chars:
            raise Refusal(400, "name_too_long", f"a question id is over {limits.max_name_chars} characters",
                          loc=("questions",))
        if _chars(q["instructions"]) > limits.max_text_chars:
            raise Refusal(400, "text_too_long", f"question {qid!r}: instructions over {limits.max_text_chars} "
                          "characters", loc=(*where, "instructions"))
        criteria = q.get("criteria")
        if q["type"] == "choice" and len(criteria) > limits.max_options:
            raise Refusal(400, "too_many_options", f"question {qid!r}: {len(criteria)} options; at most "
                          f"{limits.max_options}", loc=(*where, "criteria"))
        if q["type"] == "score" and len(criteria) > limits.max_levels:
            raise Refusal(400, "too_many_levels", f"question {qid!r}: {len(criteria)} levels; at most "
                          f"{limits.max_levels}", loc=(*where, "criteria"))
        names = criteria if isinstance(criteria, dict) else {}
        if any(len(name) > limits.max_name_chars for name in names):
            raise Refusal(400, "name_too_long", f"question {qid!r}: an option name is over "
                          f"{limits.max_name_chars} characters", loc=(*where, "criteria"))
        texts = criteria.values() if isinstance(criteria, dict) else criteria or ()
        if any(_chars(text) > limits.max_text_chars for text in texts):
            raise Refusal(400, "text_too_long", f"question {qid!r}: a criterion over {limits.max_text_chars} "
                          "characters", loc=(*where, "criteria"))


def _question(qid: str, q: dict[str, Any]) -> Any:
    if q["type"] == "box":
        raise Refusal(400, "unsupported_question", f"question {qid!r}: Box questions have no canvas form; "
                      "ask Noul, Choice or Score questions", loc=("questions", qid))
    try:
        return _QUESTION_TYPES[q["type"]].model_validate(q)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise Refusal(400, "invalid_question", f"question {qid!r} cannot be asked: {problems}",
                      loc=("questions", qid)) from exc
