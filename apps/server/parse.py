"""A `/v1/systemone` body to a validated request: malformed body and fields (422), sizes (413).

The body follows vLLM's gateway (`systemone-openapi.yaml` in vllm-project/vllm): `state` is
any JSON value but null (text as is, anything else as JSON), a question's `instructions`
and criteria may hold any JSON value, and keys neither the gateway nor canvasroute knows
are ignored (and listed in the reply's `diagnostics.ignored`). Its status codes too: a field,
a question, a feature or an answer template that cannot be used is 422. This server's own
bounds (`Limits`) are 422, or 413 for the state's size. Every check here runs on the body
alone, before admission and before any engine work.

A body that is not JSON (or not a JSON object, or JSON a decision cannot take: NaN, lone
surrogates, nesting past `Limits.max_depth`) is 422 with FastAPI's `detail` list, like every
other validation failure (FastAPI's own answer to a body it cannot parse, which Jev clients
read); vLLM's gateway answers it 400, and `/v1/decisions` makes it a 400, OpenAI's request error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.decisions import Choice, Noul, Score
from pydantic import ValidationError

from canvasroute.engine import DecisionError
from canvasroute.router import parse_questions

from .assets import place_assets
from .extensions import GATEWAY_KEYS, QUESTION_KEYS, VLLM_KEYS, Extensions, read_extensions, text_of
from .limits import Limits
from .wire import Refusal, from_exception, malformed

__all__ = ["Parsed", "load_json", "parse_request"]

_QUESTION_TYPES: dict[str, type[Noul | Choice | Score]] = {"noul": Noul, "choice": Choice, "score": Score}
_QUESTION_KEYS = {"type", "instructions", "criteria", *QUESTION_KEYS}
_REQUEST_KEYS = {"model", "state", "questions", "assets", "seed", "thread_id", *GATEWAY_KEYS}
_MEDIA_FIELDS = ("audio", "videos")
_SURROGATE = re.compile("[\ud800-\udfff]")
"""After `json.loads`, a valid escaped pair is one code point: any surrogate left is a lone one."""
_MAX_IGNORED = 20


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated `/v1/systemone` request."""

    model: str | None
    state: Any
    questions: dict[str, Any]
    """The questions to answer (all, or those `ask` lists), as langchain-core models."""
    seed: int | None
    thread_id: str | None
    extensions: Extensions = field(default_factory=Extensions)
    ignored: tuple[str, ...] = ()
    """Keys this server does not read (dotted paths, at most 20)."""
    gateway: bool = False
    """Whether the request uses a key of vLLM's gateway (`GATEWAY_KEYS`, `QUESTION_KEYS`, `VLLM_KEYS`):
    its reply then also carries the fields vLLM's `/v1/systemone` adds to System One's."""


class _NonFinite:
    """Stands in for NaN / Infinity / -Infinity while parsing, so the walk can say where."""


_NON_FINITE = _NonFinite()


def parse_request(body: bytes, limits: Limits, parts: Sequence[tuple[str, str]] = ()) -> Parsed:
    """Malformed body (422) first, then fields (422), then bounds (413/422), then what cannot be asked (422).

    `parts`: a multipart body's image file parts, (name, data URL): those System One's `assets`
    name are placed where their placeholders are (`assets`), the others are read with every question.
    """
    data = load_json(body, limits)
    if not isinstance(data, dict):
        raise Refusal(422, "invalid_body", "the body must be a JSON object", loc=())
    for name in ("state", "questions"):
        if name not in data:
            raise malformed((name,), "field required", "missing")
    state = data["state"]
    if state is None:
        raise malformed(("state",), "must be text or any JSON value but null", "invalid_state")
    model = _optional_name(data, "model", limits)
    thread_id = _optional_name(data, "thread_id", limits)
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise malformed(("seed",), "must be a non-negative 64-bit integer")
    raw = data["questions"]
    if not isinstance(raw, dict) or not raw:
        raise malformed(("questions",), "must be a non-empty object of question id to question")
    gateway = any(k in data for k in (*GATEWAY_KEYS, *VLLM_KEYS)) or any(
        isinstance(q, dict) and any(k in q for k in QUESTION_KEYS) for q in raw.values())
    if len(raw) > limits.max_questions:
        raise Refusal(422, "too_many_questions", f"{len(raw)} questions; at most {limits.max_questions} "
                      "per request", loc=("questions",))
    images = [url for _, url in parts]
    if data.get("assets") is not None:  # System One's images, named by placeholders in the text
        placed = place_assets(data["assets"], state, raw, parts)
        state, raw = placed.state, placed.questions
        images = [*placed.images, *(url for name, url in parts if name not in placed.parts)]
    shaped = {qid: _shape_question(qid, q) for qid, q in raw.items()}
    for name in _MEDIA_FIELDS:
        if data.get(name):
            raise Refusal(422, "unsupported_media", f"{name}: this server reads text, JSON and images",
                          loc=(name,))
    _check_sizes(state, shaped, limits)
    extensions = read_extensions(data, raw, {qid: _answer_names(q) for qid, q in shaped.items()}, images, limits)
    questions = {qid: _question(qid, shaped[qid]) for qid in (extensions.ask or shaped)}
    try:
        parse_questions(questions)  # labels and option names, before any slot is taken
    except DecisionError as exc:
        raise from_exception(exc) from exc
    ignored = [k for k in data if k not in _REQUEST_KEYS and k not in _MEDIA_FIELDS]
    ignored += [f"questions.{qid}.{k}" for qid, q in raw.items() for k in q if k not in _QUESTION_KEYS]
    return Parsed(model, state, questions, seed, thread_id, extensions, tuple(i[:200] for i in ignored[:_MAX_IGNORED]),
                  gateway)


def load_json(body: bytes, limits: Limits) -> Any:
    """The decoded body: 422 `invalid_json` for bad JSON or nesting deeper than `limits.max_depth`,
    `invalid_text` for lone surrogates, `invalid_number` for NaN and Infinity, on either wire
    (`/v1/decisions` answers each as a 400)."""
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
                raise _not_json(loc, "text with a lone surrogate (\\ud800-\\udfff) is not Unicode", "invalid_text")
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise _not_json(loc, "a key with a lone surrogate (\\ud800-\\udfff) is not Unicode",
                                    "invalid_text")
                stack.append((item, (*loc, key)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in enumerate(value))
        elif value is _NON_FINITE or (isinstance(value, float) and not math.isfinite(value)):
            raise _not_json(loc, "NaN and Infinity are not JSON numbers", "invalid_number")


def _not_json(loc: Sequence[str | int], message: str, kind: str) -> Refusal:
    """A 422 about one place in a body that is not valid JSON text."""
    where = ".".join(map(str, loc))
    return Refusal(422, kind, f"{where}: {message}" if where else message, loc=loc)


def _optional_name(data: dict[str, Any], field: str, limits: Limits) -> str | None:
    value = data.get(field)
    if value is not None and not isinstance(value, str):
        raise malformed((field,), "must be a string")
    if value is not None and len(value) > limits.max_name_chars:
        raise Refusal(422, "name_too_long", f"{field}: over {limits.max_name_chars} characters", loc=(field,))
    return value


def _shape_question(qid: str, q: Any) -> dict[str, Any]:
    where = ("questions", qid)
    if not qid.strip():
        raise malformed(("questions",), "question ids must be non-empty", "invalid_question_id")
    if not isinstance(q, dict):
        raise malformed(where, "must be an object with 'type', 'instructions' and 'criteria'")
    kind = q.get("type")
    if kind not in ("noul", "choice", "score", "box"):
        shown = kind[:40] if isinstance(kind, str) else type(kind).__name__
        raise malformed((*where, "type"), f"must be 'noul', 'choice' or 'score', not {shown!r}")
    instructions = q.get("instructions")
    shaped: dict[str, Any] = {"type": kind, "instructions": instructions if isinstance(instructions, (str, dict, list))
                              else text_of(instructions)}
    criteria = q.get("criteria")
    if kind == "noul" and criteria is not None:
        if not isinstance(criteria, dict):
            raise malformed((*where, "criteria"), "a noul's criteria is an object with 'true' and/or 'false'")
        criteria = {k: v for k, v in criteria.items() if k in ("true", "false")}
    if kind == "choice" and not isinstance(criteria, dict):
        raise malformed((*where, "criteria"), "a choice's criteria is an object of option name to description")
    if kind == "score":
        if not isinstance(criteria, list):
            raise malformed((*where, "criteria"), "a score's criteria is an ordered list of level descriptions")
        criteria = [text_of(level) for level in criteria]
    if criteria is not None and kind != "box":
        shaped["criteria"] = criteria
    return shaped


def _answer_names(q: dict[str, Any]) -> dict[str, str]:
    """Each answer as the gateway's `ask_if` names it -> the library's answer."""
    if q["type"] == "noul":
        return {"yes": "yes", "no": "no"}
    if q["type"] == "choice":
        return {name: name for name in q["criteria"]}
    out: dict[str, str] = {}
    for i, level in enumerate(q.get("criteria") or ()):
        out.setdefault(level, str(i))
    return out


def _chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, separators=(",", ":")))


def _check_sizes(state: Any, shaped: dict[str, dict[str, Any]], limits: Limits) -> None:
    if _chars(state) > limits.max_state_chars:
        raise Refusal(413, "state_too_large", f"state: over {limits.max_state_chars} characters", loc=("state",))
    for qid, q in shaped.items():
        where = ("questions", qid)
        if len(qid) > limits.max_name_chars:
            raise Refusal(422, "name_too_long", f"a question id is over {limits.max_name_chars} characters",
                          loc=("questions",))
        if _chars(q["instructions"]) > limits.max_text_chars:
            raise Refusal(422, "text_too_long", f"question {qid!r}: instructions over {limits.max_text_chars} "
                          "characters", loc=(*where, "instructions"))
        criteria: Any = q.get("criteria")
        if q["type"] == "choice" and len(criteria) < 2:
            raise Refusal(422, "too_few_options", f"question {qid!r}: {len(criteria)} option(s); a choice has 2 to "
                          f"{limits.max_options}", loc=(*where, "criteria"))
        if q["type"] == "choice" and len(criteria) > limits.max_options:
            raise Refusal(422, "too_many_options", f"question {qid!r}: {len(criteria)} options; at most "
                          f"{limits.max_options}", loc=(*where, "criteria"))
        if q["type"] == "score" and len(criteria) < 2:
            raise Refusal(422, "too_few_levels", f"question {qid!r}: {len(criteria)} level(s); a score has 2 to "
                          f"{limits.max_levels}", loc=(*where, "criteria"))
        if q["type"] == "score" and len(criteria) > limits.max_levels:
            raise Refusal(422, "too_many_levels", f"question {qid!r}: {len(criteria)} levels; at most "
                          f"{limits.max_levels}", loc=(*where, "criteria"))
        names = criteria if isinstance(criteria, dict) and q["type"] == "choice" else {}
        if any(len(name) > limits.max_name_chars for name in names):
            raise Refusal(422, "name_too_long", f"question {qid!r}: an option name is over "
                          f"{limits.max_name_chars} characters", loc=(*where, "criteria"))
        texts = criteria.values() if isinstance(criteria, dict) else criteria or ()
        if any(_chars(text) > limits.max_text_chars for text in texts):
            raise Refusal(422, "text_too_long", f"question {qid!r}: a criterion over {limits.max_text_chars} "
                          "characters", loc=(*where, "criteria"))


def _question(qid: str, q: dict[str, Any]) -> Any:
    if q["type"] == "box":
        raise Refusal(422, "unsupported_question", f"question {qid!r}: Box questions have no canvas form; "
                      "ask Noul, Choice or Score questions", loc=("questions", qid))
    try:
        return _QUESTION_TYPES[q["type"]].model_validate(q)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise Refusal(422, "invalid_question", f"question {qid!r} cannot be asked: {problems}",
                      loc=("questions", qid)) from exc
