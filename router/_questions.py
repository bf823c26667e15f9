"""Questions: one validator for every entry point, and the canvas view of each question.

`validate_questions` is the single check that the model, the `/v1/systemone` client and
the HTTP server run on caller input; `parse_questions` adds what the canvas needs (option
names in label order and candidate label alphabets).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from langchain_core.decisions import Box, Choice, Noul, Question, Score
from pydantic import BaseModel, TypeAdapter, ValidationError
from typing_extensions import is_typeddict

from canvasroute.engine import DecisionError, LabelError, UnsupportedQuestion


def option_text(content: Any) -> str:
    """A criterion or instruction as prompt text (JSON when it is not text)."""
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


ABSTAIN_TEXT = "none of these / can't tell"
"""How an abstain label is described in the prompt."""

MAX_OPTIONS = 255
"""Options one Choice or Score may have (the Jev limit); past one read's labels, two reads."""

_QUESTION = TypeAdapter(Question)
_UPPER = list(string.ascii_uppercase)
_LOWER = list(string.ascii_lowercase)


def validate_questions(questions: Any, *, allow_box: bool = False) -> dict[str, Noul | Choice | Score | Box]:
    """Check a decision set (question models or plain dicts) and return it as models.

    Args:
        questions: A non-empty mapping of question id to question.
        allow_box: Accept `Box` questions (servers that can locate; a canvas cannot).

    Raises:
        DecisionError: `questions` is not a non-empty mapping.
        UnsupportedQuestion: an id is not a non-empty string, a question is not a
            Noul/Choice/Score (or Box, when allowed), or a Box is asked of a canvas.

    Example:
        ```python
        validate_questions({"urgent": {"type": "noul", "instructions": "Urgent?"}})
        ```
    """
    if not isinstance(questions, Mapping) or not questions:
        raise DecisionError("questions must be a non-empty mapping of id to question", hint=_schema_hint(questions))
    out: dict[str, Noul | Choice | Score | Box] = {}
    for qid, raw in questions.items():
        if not isinstance(qid, str) or not qid.strip():
            raise UnsupportedQuestion(f"question ids must be non-empty strings, got {qid!r}")
        is_box = isinstance(raw, Box) or (isinstance(raw, Mapping) and raw.get("type") == "box")
        if is_box and not allow_box:
            raise UnsupportedQuestion(f"question {qid!r}: Box questions have no canvas form",
                                      hint="ask Noul, Choice or Score questions")
        try:
            out[qid] = raw if isinstance(raw, (Noul, Choice, Score, Box)) else _QUESTION.validate_python(raw)
        except ValidationError as exc:
            kinds = "Noul, Choice, Score or Box" if allow_box else "Noul, Choice or Score"
            raise UnsupportedQuestion(f"question {qid!r} is not a {kinds}: {exc}", hint=_schema_hint(raw)) from exc
    return out


def _schema_hint(value: Any) -> str | None:
    """For a pydantic model or TypedDict given as questions: how a schema is asked."""
    if isinstance(value, type) and (issubclass(value, BaseModel) or is_typeddict(value)):
        return ("a schema is asked with questions_from_schema(schema), or as a chat model's structured output: "
                "model.with_structured_output(schema)")
    return None


_QUESTION_TYPES = frozenset((Noul, Choice, Score))


def question_set_key(questions: Any) -> str | None:
    """A cheap exact key for a mapping of question models: each id with pydantic's JSON of
    its question (`model_dump_json`), in order. None when `questions` is anything else
    (plain dicts, subclasses): such a set is parsed first, then keyed by its parse.

    Questions are mutable models, so the key is computed on every call, never cached by identity.
    """
    if not isinstance(questions, Mapping) or not questions:
        return None
    parts = []
    for qid, q in questions.items():
        if type(q) not in _QUESTION_TYPES or type(qid) is not str:
            return None
        parts.append(f"{qid!r}:{q.__pydantic_serializer__.to_json(q).decode()}")
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class QuestionSpec:
    """One question as the canvas sees it: option names and candidate label alphabets."""

    id: str
    question: Noul | Choice | Score
    options: tuple[str, ...]
    """Answer names in label order: `yes/no`, the Choice's keys, or Score levels `0..n-1`."""
    alphabets: tuple[tuple[str, ...], ...]
    """Label alphabets to try, best first; each has one label per option. Empty when no
    fixed alphabet fits: the planner then scans the tokenizer for one-token labels."""
    abstain: bool = False
    """The last option is `ABSTAIN` ("none of these / can't tell"), an extra label in the
    same slot (`with_abstain`)."""
    shift: int = 0
    """An order-bias view (`rotated`): the options listed again, rotated left by `shift`
    places, as one more slot of the same canvas. 0 for the question itself."""

    @property
    def kind(self) -> str:
        return self.question.type

    @property
    def descriptions(self) -> tuple[str, ...]:
        """Each option's description as text, in option order ("" where there is none)."""
        q = self.question
        extra = (ABSTAIN_TEXT,) if self.abstain else ()
        if isinstance(q, Noul):
            crit = q.criteria
            return (option_text(crit.true) if crit and crit.true is not None else "",
                    option_text(crit.false) if crit and crit.false is not None else "", *extra)
        if isinstance(q, Choice):
            return (*(option_text(d) if d not in (None, "") else "" for d in q.criteria.values()), *extra)
        return (*(option_text(d) for d in q.criteria), *extra)

    @property
    def answer_options(self) -> tuple[str, ...]:
        """The options an answer may name (without `ABSTAIN`)."""
        return self.options[:-1] if self.abstain else self.options


ABSTAIN = "(abstain)"
"""The option name of the abstain label in canvas distributions (`canvas_probabilities`)."""


def with_abstain(spec: QuestionSpec) -> QuestionSpec:
    """The question with one more label in its slot: "none of these / can't tell".

    A Noul becomes three labels (letters or digits); past the fixed alphabets the planner
    scans the tokenizer for one more label, as for any large question.
    """
    if spec.abstain:
        return spec
    k = len(spec.options) + 1
    alphabets = _alphabets(spec.id, k, letters_first=spec.kind != "score") if spec.alphabets else ()
    return replace(spec, options=(*spec.options, ABSTAIN), alphabets=alphabets, abstain=True)


def rotated(spec: QuestionSpec, shift: int) -> QuestionSpec:
    """An order-bias view of a Choice: its options listed rotated left by `shift` places.

    Label j of the view names option (j + shift) mod K of the question, so the view's
    distribution, turned back (`unrotate`), is a second estimate of the same answer with
    each option under another label.
    """
    if not isinstance(spec.question, Choice) or spec.abstain or spec.shift:
        raise DecisionError(f"question {spec.id!r}: only a plain Choice has order-bias views")
    k = len(spec.options)
    names = spec.options[shift % k:] + spec.options[:shift % k]
    criteria = {name: spec.question.criteria[name] for name in names}
    question = Choice(instructions=spec.question.instructions, criteria=criteria)
    return replace(spec, question=question, options=names, shift=shift % k)


def unrotate(probs: tuple[float, ...], shift: int) -> tuple[float, ...]:
    """A view's distribution in the question's option order (see `rotated`)."""
    k = len(probs)
    return tuple(probs[(j - shift) % k] for j in range(k))


def view_shifts(k: int, views: int) -> tuple[int, ...]:
    """Shifts of `views` extra listings of k options, spread evenly round the cycle
    (k = 4, 2 views: 1, 2; k = 2: only 1 view fits)."""
    n = min(views, k - 1)
    return tuple(dict.fromkeys(max(1, (v * k) // (n + 1)) for v in range(1, n + 1)))


def parse_questions(questions: Mapping[str, Any]) -> dict[str, QuestionSpec]:
    """Validate questions (models or plain dicts) and give each its label alphabets."""
    return {qid: _spec(qid, q) for qid, q in validate_questions(questions).items()}  # type: ignore[arg-type]


def _spec(qid: str, q: Noul | Choice | Score) -> QuestionSpec:
    if isinstance(q, Noul):
        return QuestionSpec(qid, q, ("yes", "no"), (("yes", "no"), ("Yes", "No"), ("Y", "N"), ("A", "B")))
    if isinstance(q, Choice):
        names = list(q.criteria)  # any distinct keys: an empty name or names differing only in case are options too
        return QuestionSpec(qid, q, tuple(names), _alphabets(qid, len(names), letters_first=True))
    levels = len(q.criteria)
    return QuestionSpec(qid, q, tuple(str(i) for i in range(levels)), _alphabets(qid, levels, letters_first=False))


def _alphabets(qid: str, k: int, *, letters_first: bool) -> tuple[tuple[str, ...], ...]:
    """Fixed label alphabets for k options: letters (A.., a..) and digits (1.., 0..).

    Past 52 options there is no fixed alphabet: the planner finds one-token labels in
    the served tokenizer (`canvasroute.router._labels`).
    """
    if k > MAX_OPTIONS:
        raise LabelError(f"question {qid!r} has {k} options; a question has at most {MAX_OPTIONS}")
    letters = [_UPPER[:k], _LOWER[:k]] if k <= 26 else [(_UPPER + _LOWER)[:k]] if k <= 52 else []
    digits = [[str(i) for i in range(1, k + 1)]] if k <= 9 else []
    digits += [[str(i) for i in range(k)]] if k <= 10 else []
    ordered = letters + digits if letters_first else digits + letters
    return tuple(tuple(a) for a in ordered)
