"""The request keys vLLM's gateway adds to the Jev wire, as the parts of one `DecisionRequest`.

Per request: `instructions` (context for every question), `samples` (1, N fixed reads, or
`"auto"` with `auto_max` reads at most and `auto_threshold` nats of entropy that call for
more), `steps`, `think`, `ask` (answer only these questions), `images` (data URLs, or
`{content_type, base64}` objects; multipart file parts arrive here too), `seed`. Per
question: `depends_on` (ids answered first, restated), `ask_if` (`{id: [answers]}`: asked
only when every named answer matches) and `alone` (a canvas of its own). They become
`CanvasDecisionModel.request`'s `read` (`ReadOptions` fields), `depends_on` and `gate` (the
`GatePolicy` fields the samples keys set, applied over the server's gate for every question,
per-question fits included). `auto_threshold` asks for more reads only (`reread_above`): a
client cannot make the server escalate an answer its gate passes. Every error is a 422 about
one place in the body; nothing here reaches the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from canvasroute.router import MAX_SAMPLES, MAX_STEPS, MAX_THINK

from .limits import Limits
from .wire import Refusal, malformed

__all__ = ["GATEWAY_KEYS", "QUESTION_KEYS", "VLLM_KEYS", "Extensions", "read_extensions"]

GATEWAY_KEYS = ("instructions", "samples", "auto_max", "auto_threshold", "steps", "think", "ask", "images",
                "chunk_rows", "chunk_prompt", "sequential")
"""Request keys of vLLM's gateway this server reads (with `model`, `state`, `questions`, `seed`, `thread_id`)."""
QUESTION_KEYS = ("depends_on", "ask_if", "alone")
"""Question keys of vLLM's gateway this server reads (with `type`, `instructions`, `criteria`)."""
VLLM_KEYS = ("request_id", "cache_salt", "priority", "chat_template_kwargs")
"""Request keys of vLLM's own `/v1/systemone` (its structured decisions API) that this server does not
read: like the gateway keys above, they make a request a gateway client's (`Parsed.gateway`)."""
AUTO_MAX = 4
"""Reads at most under `samples: "auto"` without `auto_max` (vLLM's gateway's default)."""


@dataclass(frozen=True, slots=True)
class Extensions:
    """What the gateway keys of one request ask for, ready for the model."""

    read: dict[str, Any] = field(default_factory=dict)
    """`ReadOptions` fields this request sets: instructions, alone, steps, think, images."""
    depends_on: dict[str, dict[str, Any]] | None = None
    """`{child: {parent: answers or None}}` from `depends_on` and `ask_if` (None: no dependencies)."""
    gate: dict[str, Any] = field(default_factory=dict)
    """`GatePolicy` fields this request sets: samples, rereads, reread_above."""
    samples: dict[str, Any] | None = None
    """The read policy as the request put it (for the diagnostics), None: the server's."""
    ask: tuple[str, ...] | None = None
    """The question ids to answer (None: all)."""


def text_of(value: Any) -> str:
    """A free-form field as prompt text: text as is, null as nothing, anything else as JSON."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def read_extensions(data: Mapping[str, Any], questions: Mapping[str, Mapping[str, Any]],
                    answers: Mapping[str, Mapping[str, str]], images: list[str], limits: Limits) -> Extensions:
    """The request's gateway keys (`data`) and question keys (`questions`, raw) as request parts.

    `answers`: per question, each answer as the gateway's `ask_if` names it (yes/no, an
    option name, a level's text) -> the library's answer (a Score level's index);
    `images`: image data URLs from multipart parts.
    """
    options: dict[str, Any] = {}
    if (instructions := text_of(data.get("instructions"))).strip():
        if len(instructions) > limits.max_text_chars:
            raise Refusal(422, "text_too_long", f"instructions: over {limits.max_text_chars} characters",
                          loc=("instructions",))
        options["instructions"] = instructions
    for name, top in (("steps", MAX_STEPS), ("think", MAX_THINK)):
        if name in data:
            options[name] = _count(data, name, 0 if name == "think" else 1, top)
    if options.get("steps") == 1:
        del options["steps"]
    if not options.get("think", 1):
        del options["think"]
    if data.get("chunk_rows") is not None:
        raise malformed(("chunk_rows",), "is not supported: chunks are packed to the served canvas",
                        "unsupported_field")
    if data.get("chunk_prompt", "own") != "own":
        raise malformed(("chunk_prompt",), "only 'own' is supported: each chunk lists its own questions",
                        "unsupported_field")
    if data.get("sequential"):
        raise malformed(("sequential",), "is not supported: chunks of one stage are read together; order "
                        "questions with depends_on", "unsupported_field")
    images = [*images, *_images(data.get("images"))]
    if images:
        options["images"] = images
    ask = _ask(data.get("ask"), questions)
    asked = ask or tuple(questions)
    depends: dict[str, dict[str, Any]] = {}
    alone = []
    for qid in asked:
        q = questions[qid]
        parents = _parents(qid, q, asked, answers)
        if parents:
            depends[qid] = parents
        lone = q.get("alone", False)
        if not isinstance(lone, bool):
            raise malformed(("questions", qid, "alone"), "must be true or false")
        if lone:
            alone.append(qid)
    if alone:
        options["alone"] = alone
    gate, samples = _samples(data)
    return Extensions(read=options, depends_on=depends or None, gate=gate, samples=samples, ask=ask)


def _count(data: Mapping[str, Any], name: str, low: int, top: int) -> int:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
        raise malformed((name,), f"must be an integer from {low} to {top}")
    return value


def _samples(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(GatePolicy fields, the policy as asked) for `samples`, `auto_max`, `auto_threshold`."""
    auto = {"auto_max", "auto_threshold"} & set(data)
    samples = data.get("samples", "auto" if auto else None)
    if samples is None:
        return {}, None
    if samples == "auto":
        top = _count(data, "auto_max", 1, MAX_SAMPLES) if "auto_max" in data else AUTO_MAX
        policy: dict[str, Any] = {"samples": 1, "rereads": top - 1}
        asked: dict[str, Any] = {"mode": "auto", "max": top}
        if "auto_threshold" in data:
            threshold = data["auto_threshold"]
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not \
                    (math.isfinite(threshold) and threshold >= 0):
                raise malformed(("auto_threshold",), "must be a number of nats, 0 or more")
            # more reads above it, never a stricter gate: the server's gate alone decides what escalates
            policy["reread_above"] = asked["threshold"] = float(threshold)
        return policy, asked
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= MAX_SAMPLES:
        raise malformed(("samples",), f"must be a count from 1 to {MAX_SAMPLES}, or \"auto\"")
    return {"samples": samples, "rereads": 0}, {"mode": "fixed", "n": samples}


def _ask(value: Any, questions: Mapping[str, Any]) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a in questions for a in value):
        raise malformed(("ask",), "must list question ids of this request")
    chosen = set(value)
    return tuple(q for q in questions if q in chosen)


def _parents(qid: str, q: Mapping[str, Any], asked: tuple[str, ...],
             answers: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """A question's `depends_on` and `ask_if` as the library's `{parent: answers or None}`."""
    where = ("questions", qid)
    after = q.get("depends_on") or []
    ask_if = q.get("ask_if") or {}
    if not isinstance(after, list) or not all(isinstance(d, str) for d in after):
        raise malformed((*where, "depends_on"), "must be a list of question ids")
    if not isinstance(ask_if, dict) or not all(isinstance(v, list) and v for v in ask_if.values()):
        raise malformed((*where, "ask_if"), "must map a question id to a non-empty list of its answers")
    parents: dict[str, Any] = dict.fromkeys(after)
    for parent, wanted in ask_if.items():
        known = answers.get(parent)
        if known is None:
            raise malformed((*where, "ask_if"), f"names {parent[:80]!r}, which is not a question of this request")
        if bad := [w for w in wanted if not isinstance(w, str) or w not in known]:
            raise malformed((*where, "ask_if", parent), f"{str(bad[0])[:80]!r} is not an answer of {parent[:80]!r} "
                            f"(one of {[k[:40] for k in list(known)[:8]]})")
        parents[parent] = {known[w] for w in wanted}
    for parent in parents:
        if parent not in answers or parent == qid:
            raise malformed((*where, "depends_on"), f"names {parent[:80]!r}, which is not another question of this "
                            "request")
        if parent not in asked:
            raise malformed(("ask",), f"asks {qid[:80]!r} but not {parent[:80]!r}, which it depends on")
    return parents


def _images(value: Any) -> list[str]:
    """Image data URLs from the body's `images`: `data:image/...` strings or `{content_type, base64}`."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise malformed(("images",), "must be a list of data:image/... URLs or {content_type, base64} objects")
    out = []
    for i, im in enumerate(value):
        if isinstance(im, str) and im.startswith("data:image/"):
            out.append(im)
        elif (isinstance(im, dict) and isinstance(im.get("content_type"), str)
              and im["content_type"].startswith("image/") and isinstance(im.get("base64"), str)):
            out.append(f"data:{im['content_type']};base64,{im['base64']}")
        else:
            raise malformed(("images", i), "must be a data:image/... URL or an object with content_type and base64")
    return out
