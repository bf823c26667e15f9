"""Questions: one validator for every entry point, the canvas view of each question, and dependencies.

`validate_questions` is the single check that the model, the `/v1/systemone` client and
the HTTP server run on caller input; `parse_questions` adds what the canvas needs (option
names in label order and candidate label alphabets).

Dependent questions (`parse_depends_on`) are asked after others, with their answers
restated, and only when they match: `depends_on={"refund_reason": ("team", {"billing"})}`
asks `refund_reason` only when the final answer of `team` (canvas, re-read, escalated or
fallback) is `billing`; `depends_on={"reason": {"team": {"billing"}, "summary_first": None}}`
names several parents, each with the answers that ask the child or None (any answer: read
after it). Questions without parents are read first; each further stage (children of the
stages before) is read only for the children whose conditions all hold, all inside one
decision, with the parents' final answers restated after the state. A child whose condition
fails, or whose conditioning parent was itself skipped, is reported as `skipped`.
"""

from __future__ import annotations

import json
import string
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from langchain_core.decisions import Box, Choice, Noul, Question, Score
from pydantic import BaseModel, TypeAdapter, ValidationError
from typing_extensions import is_typeddict

from canvasroute.engine import SPECIAL_CANDIDATES, DecisionError, LabelError, UnsupportedQuestion, defuse


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
    kind: str = field(init=False, compare=False)
    """`noul`, `choice` or `score` (the question's type)."""
    answer_options: tuple[str, ...] = field(init=False, compare=False)
    """The options an answer may name (without `ABSTAIN`)."""

    def __post_init__(self) -> None:  # plain fields, not properties: every read of a decision reads them
        object.__setattr__(self, "kind", self.question.type)
        object.__setattr__(self, "answer_options", self.options[:-1] if self.abstain else self.options)

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


# -- dependencies ------------------------------------------------------------------------

Parents = Mapping[str, frozenset[str] | None]
"""parent question id -> the parent's answers that ask the child (None: any answer)."""


@dataclass(frozen=True, slots=True)
class Dependencies:
    """Validated parents and the read order they imply."""

    parents: Mapping[str, Parents]
    """child -> its parents and their conditions."""
    layers: tuple[tuple[str, ...], ...]
    """Question ids per read stage: stage 0 has no parent, stage n+1 depends on earlier ones."""

    def key(self) -> str:
        """The dependencies as one stable string (for the decision cache)."""
        return json.dumps(sorted((c, sorted((p, sorted(a) if a is not None else None) for p, a in ps.items()))
                                 for c, ps in self.parents.items()))

    @property
    def parent_ids(self) -> frozenset[str]:
        """Every question some other question depends on."""
        return frozenset(p for ps in self.parents.values() for p in ps)

    def asked_if(self, qid: str, answers: Mapping[str, str | None]) -> dict[str, Any] | None:
        """The condition that decides `qid` as a JSON-able record (the first that fails, else
        the first), with the parent's final answer; None when it has no condition."""
        if qid not in self.parents:
            return None
        conditions = [(p, a) for p, a in self.parents[qid].items() if a is not None]
        if not conditions:
            return None
        parent, wanted = next(((p, a) for p, a in conditions if answers.get(p) not in a), conditions[0])
        return {"question": parent, "answers": sorted(wanted), "parent_answer": answers.get(parent)}

    def applies(self, qid: str, answers: Mapping[str, str | None]) -> bool:
        """Whether `qid` is asked, given the final answers so far (None: skipped parent)."""
        return qid not in self.parents or all(answers.get(p) in a for p, a in self.parents.get(qid, {}).items()
                                              if a is not None)

    def restatement(self, asked: Sequence[str], answers: Mapping[str, str | None],
                    specs: Mapping[str, QuestionSpec]) -> str:
        """What a stage reads after the state: its questions' parents' final answers ("" for none)."""
        if not self.parents:
            return ""
        parents = {p for q in asked for p in self.parents.get(q, {})}
        lines = [f"- {option_text(specs[p].question.instructions)}: {_shown(specs[p], answers[p])}"
                 for p in specs if p in parents and answers.get(p) is not None]
        return "\n\nEarlier answers about this input:\n" + "\n".join(lines) if lines else ""

    def restated(self, asked: Sequence[str], answers: Mapping[str, str | None], specs: Mapping[str, QuestionSpec],
                 special_tokens: Sequence[str] | None = None) -> str:
        """`restatement`, defused for the engine's tokenizer (what the canvas reads)."""
        text = self.restatement(asked, answers, specs)
        return defuse(text, special_tokens or SPECIAL_CANDIDATES) if text else ""

    def parents_of(self, qid: str, answers: Mapping[str, str | None],
                   specs: Mapping[str, QuestionSpec]) -> tuple[tuple[str, str], ...]:
        """One question's parents as (question text, its final answer as text), in question order."""
        mine = self.parents.get(qid, {})
        return tuple((option_text(specs[p].question.instructions), _shown(specs[p], answers[p]))
                     for p in specs if p in mine and answers.get(p) is not None)


def _shown(spec: QuestionSpec, answer: str | None) -> str:
    """An answer as text: yes/no, the option's name, or a Score level's description."""
    if spec.kind == "score" and answer is not None:
        return spec.descriptions[int(answer)] or answer
    return str(answer)


def parse_depends_on(depends_on: Any, specs: Mapping[str, QuestionSpec]) -> Dependencies:
    """Check `{child: (parent, answers) | {parent: answers or None}}` against the questions
    and order them in stages.

    `answers` is one option name or a collection of them (a Noul's `yes`/`no` or a bool,
    a Score's level as int or string).

    Raises:
        DecisionError: not a mapping of pairs or of parents, an unknown child or parent, an
            answer that is not an option of the parent, or a cycle.
    """
    if depends_on is None:
        return Dependencies({}, (tuple(specs),))
    if not isinstance(depends_on, Mapping):
        raise DecisionError("depends_on must be a mapping {question id: (parent id, answers)}")
    parents: dict[str, Parents] = {}
    for child, given in depends_on.items():
        if child not in specs:
            raise DecisionError(f"depends_on names {child!r}, which is not one of the questions")
        cond: Mapping[Any, Any]
        if isinstance(given, (tuple, list)) and len(given) == 2 and isinstance(given[0], str):
            cond = {given[0]: given[1]}
        elif isinstance(given, Mapping) and given:
            cond = given
        else:
            raise DecisionError(f"depends_on[{child!r}] must be a pair (parent id, answers) or a mapping "
                                f"{{parent id: answers or None}}, got {given!r}")
        mine: dict[str, frozenset[str] | None] = {}
        for parent, raw in cond.items():
            if parent not in specs:
                raise DecisionError(f"depends_on[{child!r}] names parent {parent!r}, which is not one of the "
                                    "questions")
            mine[parent] = None if raw is None else _answers(child, specs[parent], raw)
        parents[child] = mine
    depth: dict[str, int] = {}
    for qid in specs:
        _depth(qid, parents, depth, ())
    layers = [tuple(q for q in specs if depth[q] == d) for d in range(max(depth.values()) + 1)]
    return Dependencies(parents, tuple(q for q in layers if q))


def _answers(child: str, parent: QuestionSpec, raw: Any) -> frozenset[str]:
    values = [raw] if isinstance(raw, (str, bool, int)) else raw
    if not isinstance(values, Collection) or not values:
        raise DecisionError(f"depends_on[{child!r}]: answers must be an option or a non-empty collection of options")
    out = set()
    for given in values:
        value = ("yes" if given else "no") if isinstance(given, bool) else given
        name = str(value)
        if name not in parent.answer_options:
            raise DecisionError(f"depends_on[{child!r}]: {value!r} is not an answer of {parent.id!r} "
                                f"(one of {list(parent.answer_options)})")
        out.add(name)
    return frozenset(out)


def _depth(qid: str, parents: Mapping[str, Parents], depth: dict[str, int], path: tuple[str, ...]) -> int:
    if qid in depth:
        return depth[qid]
    if qid in path:
        cycle = " -> ".join((*path[path.index(qid):], qid))
        raise DecisionError(f"depends_on has a cycle: {cycle}")
    d = max((_depth(p, parents, depth, (*path, qid)) + 1 for p in parents.get(qid, {})), default=0)
    depth[qid] = d
    return d
