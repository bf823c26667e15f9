"""`questions`: each as a langchain-core question beside what the wire said (name, typed values, labels)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from langchain_core.decisions import Choice, Noul, Score
from pydantic import JsonValue

from ..limits import Limits
from ._fields import Path, array, fail, mapping, one_of, param_of, required, string, type_name
from ._input import image, json_text

__all__ = ["MAX_CHOICES", "MAX_LEVELS", "MAX_QUESTIONS", "MIN_CHOICES", "MIN_LEVELS", "ChoiceValue", "Kind",
           "WireQuestion", "read_questions"]

ChoiceValue = str | bool
"""A choice's value: typed, so `true` and `"true"` are two values."""
Kind = Literal["predicate", "choice", "score"]

MAX_QUESTIONS = 400
"""Questions per request (the SDK: "Ask 1-400 questions")."""
MIN_CHOICES, MAX_CHOICES = 2, 255
"""Choices per choice question (the SDK: "between 2 and 255 choices. Each choice must be unique")."""
MIN_LEVELS, MAX_LEVELS = 2, 255
"""Levels per score question: two at least (langchain's `Score`); at most canvasroute's 255 options
(the SDK states no bound)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WireQuestion:
    """One question as asked: its langchain-core form for the router, and what the wire said."""

    index: int
    """Its place in `questions` (answers come back in this order)."""
    id: str
    """Its id for the router: the name, or `questions[i]` when unnamed (made unique)."""
    name: str | None
    """The name the caller gave (null when unnamed; the answer repeats it)."""
    kind: Kind
    """`predicate`, `choice` or `score`."""
    question: Noul | Choice | Score
    """The langchain-core question: `Noul` for a predicate, `Choice` keyed by `options`, `Score` over the levels."""
    instructions: str
    """The instructions as text (text parts as they are, JSON parts as compact JSON, one per line)."""
    images: tuple[str, ...] = ()
    """Image URLs of the instructions' image parts (data URLs or http(s) URLs), in order."""
    options: tuple[str, ...]
    """The option names an answer names: `yes`/`no`, the Choice's keys, the levels `0`..`n-1`."""
    values: tuple[ChoiceValue, ...] = ()
    """A choice's typed values, one per option (a boolean is named `true`/`false`, or `true (boolean)`
    beside a string `"true"`)."""
    labels: tuple[str, ...] = ()
    """A score's level labels, one per level."""




def read_questions(value: Any, limits: Limits | None, ignored: list[str]) -> tuple[WireQuestion, ...]:
    raw = array(value, ("questions",))
    most = min(MAX_QUESTIONS, limits.max_questions) if limits else MAX_QUESTIONS
    if not raw:
        fail(("questions",), "expected at least 1 question.", "empty_array")
    if len(raw) > most:
        fail(("questions",), f"{len(raw)} questions; at most {most}.", "array_above_max_length")
    names: set[str] = set()
    out = []
    for i, item in enumerate(raw):
        q = mapping(item, ("questions", i))
        name = q.get("name")
        if name is not None:
            string(name, ("questions", i, "name"), empty=False, limit=limits.max_name_chars if limits else None)
            if name in names:
                fail(("questions", i, "name"), f"{name!r} names an earlier question too.", "duplicate_value")
            names.add(name)
        out.append((i, name, q))
    taken = set(names)
    questions = []
    for i, name, q in out:
        qid = name if name is not None else _free(f"questions[{i}]", taken)
        questions.append(_question(i, qid, name, q, limits, ignored))
    return tuple(questions)


def _free(qid: str, taken: set[str]) -> str:
    while qid in taken:
        qid += "'"
    taken.add(qid)
    return qid


def _question(i: int, qid: str, name: str | None, q: Mapping[str, Any], limits: Limits | None,
              ignored: list[str]) -> WireQuestion:
    path: Path = ("questions", i)
    kind = cast(Kind, one_of(required(q, "type", path), ("predicate", "choice", "score"), (*path, "type")))
    text_limit = limits.max_text_chars if limits else None
    instructions, images = _instructions(required(q, "instructions", path), (*path, "instructions"), text_limit)
    keys = {"predicate": ("type", "name", "instructions"), "choice": ("type", "name", "instructions", "choices"),
            "score": ("type", "name", "instructions", "levels")}[kind]
    ignored += [param_of((*path, k)) for k in q if k not in keys]
    question: Noul | Choice | Score
    options: tuple[str, ...]
    values: tuple[ChoiceValue, ...] = ()
    labels: tuple[str, ...] = ()
    if kind == "predicate":
        question, options = Noul(instructions=instructions), ("yes", "no")
    elif kind == "choice":
        most = min(MAX_CHOICES, limits.max_options) if limits else MAX_CHOICES
        values, descriptions = _choices(required(q, "choices", path), (*path, "choices"), most, text_limit)
        options = _option_names(values)
        criteria: dict[str, JsonValue] = dict(zip(options, descriptions, strict=True))
        question = Choice(instructions=instructions, criteria=criteria)
    else:
        most = min(MAX_LEVELS, limits.max_levels) if limits else MAX_LEVELS
        labels, texts = _levels(required(q, "levels", path), (*path, "levels"), most, text_limit)
        question = Score(instructions=instructions, criteria=list(texts))
        options = tuple(str(n) for n in range(len(labels)))
    return WireQuestion(index=i, id=qid, name=name, kind=kind, question=question, instructions=instructions,
                        images=images, options=options, values=values, labels=labels)


def _instructions(value: Any, path: Path, limit: int | None) -> tuple[str, tuple[str, ...]]:
    """Instructions as text (text and JSON parts, one per line) and their images."""
    if isinstance(value, str):
        return string(value, path, empty=False, limit=limit), ()
    parts = array(value, path)
    texts: list[str] = []
    images: list[str] = []
    for i, raw in enumerate(parts):
        where = (*path, i)
        part = mapping(raw, where)
        kind = one_of(required(part, "type", where), ("input_text", "input_image", "input_json"), (*where, "type"))
        if kind == "input_text":
            texts.append(string(required(part, "text", where), (*where, "text")))
        elif kind == "input_json":
            texts.append(json_text(required(part, "data", where), (*where, "data")))
        else:
            images.append(image(part, where))
    text = "\n".join(texts)
    if not text.strip():
        fail(path, "expected some text.", "empty_string")
    if limit is not None and len(text) > limit:
        fail(path, f"over {limit} characters.", "string_above_max_length")
    return text, tuple(images)


def _choices(value: Any, path: Path, most: int, limit: int | None
             ) -> tuple[tuple[ChoiceValue, ...], tuple[str | None, ...]]:
    raw = array(value, path)
    if not MIN_CHOICES <= len(raw) <= most:
        code = "array_below_min_length" if len(raw) < MIN_CHOICES else "array_above_max_length"
        fail(path, f"{len(raw)} choices; between {MIN_CHOICES} and {most}.", code)
    values: list[ChoiceValue] = []
    descriptions: list[str | None] = []
    seen: set[tuple[type, ChoiceValue]] = set()
    for j, item in enumerate(raw):
        where = (*path, j)
        choice = mapping(item, where)
        v = required(choice, "value", where)
        if not isinstance(v, (str, bool)):
            fail((*where, "value"), f"expected a string or a boolean, got {type_name(v)}.", "invalid_type")
        if (type(v), v) in seen:
            fail((*where, "value"), f"{json.dumps(v)} is an earlier choice too; each choice must be unique.",
                  "duplicate_value")
        seen.add((type(v), v))
        if isinstance(v, str) and limit is not None and len(v) > limit:
            fail((*where, "value"), f"over {limit} characters.", "string_above_max_length")
        d = choice.get("description")
        descriptions.append(None if d is None else string(d, (*where, "description"), limit=limit))
        values.append(v)
    return tuple(values), tuple(descriptions)


def _option_names(values: Sequence[ChoiceValue]) -> tuple[str, ...]:
    """Option names for typed values: a string as it is, a boolean as `true`/`false` (`true (boolean)`
    when a string `"true"` is a choice too)."""
    taken = {v for v in values if isinstance(v, str)}
    names = []
    for v in values:
        if isinstance(v, str):
            names.append(v)
            continue
        name = "true" if v else "false"
        if name in taken:
            name += " (boolean)"
            while name in taken:
                name += "'"
        taken.add(name)
        names.append(name)
    return tuple(names)


def _levels(value: Any, path: Path, most: int, limit: int | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Level labels, and each level as the Score's criterion text (`label: description`)."""
    raw = array(value, path)
    if not MIN_LEVELS <= len(raw) <= most:
        code = "array_below_min_length" if len(raw) < MIN_LEVELS else "array_above_max_length"
        fail(path, f"{len(raw)} levels; between {MIN_LEVELS} and {most}.", code)
    labels: list[str] = []
    texts: list[str] = []
    for j, item in enumerate(raw):
        where = (*path, j)
        level = mapping(item, where)
        label = string(required(level, "label", where), (*where, "label"), empty=False, limit=limit)
        d = level.get("description")
        description = None if d is None else string(d, (*where, "description"), limit=limit)
        labels.append(label)
        texts.append(f"{label}: {description}" if description else label)
    return tuple(labels), tuple(texts)

