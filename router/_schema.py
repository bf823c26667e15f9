"""Questions become canvases: labels, the system prompt, the answer template, slots.

A decision set is planned once per (engine, questions) and cached: each question gets
a label alphabet whose labels are each ONE token at ONE shared canvas position (the
slot), found by re-tokenizing the template with that question flipped to every label.
Questions that do not fit one canvas are split into chunks, each with its own prompt.
"""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import Choice, Noul, Score
from pydantic import TypeAdapter, ValidationError

from engine import (
    MAX_LABEL_IDS,
    SPECIAL_CANDIDATES,
    DecisionError,
    Engine,
    EngineInfo,
    InputTooLong,
    LabelError,
    UnsupportedQuestion,
    defuse,
)

_QUESTION = TypeAdapter(Noul | Choice | Score)
_UPPER = list(string.ascii_uppercase)
_LOWER = list(string.ascii_lowercase)


@dataclass(frozen=True, slots=True)
class QuestionSpec:
    """One question as the canvas sees it: option names and candidate label alphabets."""

    id: str
    question: Noul | Choice | Score
    options: tuple[str, ...]
    """Answer names in label order: `yes/no`, the Choice's keys, or Score levels `0..n-1`."""
    alphabets: tuple[tuple[str, ...], ...]
    """Label alphabets to try, best first; each has one label per option."""

    @property
    def kind(self) -> str:
        return self.question.type


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one question is read: canvas position and the token id of each label."""

    question_id: str
    position: int
    labels: tuple[str, ...]
    label_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Questions that share one canvas (and one system prompt)."""

    system: str
    template: tuple[int, ...]
    """Template ids with every question at its first label (no padding)."""
    width: int
    slots: tuple[Slot, ...]

    @property
    def label_ids(self) -> tuple[int, ...]:
        return tuple(sorted({i for s in self.slots for i in s.label_ids}))


@dataclass(frozen=True, slots=True)
class Plan:
    """Every chunk of one decision set (one chunk: one canvas read)."""

    specs: Mapping[str, QuestionSpec]
    chunks: tuple[Chunk, ...]


def parse_questions(questions: Mapping[str, Any]) -> dict[str, QuestionSpec]:
    """Validate questions (models or plain dicts) and give each its label alphabets."""
    if not isinstance(questions, Mapping) or not questions:
        raise DecisionError("questions must be a non-empty mapping of id to question")
    specs: dict[str, QuestionSpec] = {}
    for qid, raw in questions.items():
        if not isinstance(qid, str) or not qid.strip():
            raise UnsupportedQuestion(f"question ids must be non-empty strings, got {qid!r}")
        if getattr(raw, "type", None) == "box" or (isinstance(raw, Mapping) and raw.get("type") == "box"):
            raise UnsupportedQuestion(f"question {qid!r}: Box questions have no canvas form",
                                      hint="ask Noul, Choice or Score questions")
        try:
            q = raw if isinstance(raw, (Noul, Choice, Score)) else _QUESTION.validate_python(raw)
        except ValidationError as exc:
            raise UnsupportedQuestion(f"question {qid!r} is not a Noul, Choice or Score: {exc}") from exc
        specs[qid] = _spec(qid, q)
    return specs


def _spec(qid: str, q: Noul | Choice | Score) -> QuestionSpec:
    if isinstance(q, Noul):
        return QuestionSpec(qid, q, ("yes", "no"), (("yes", "no"), ("Yes", "No"), ("Y", "N"), ("A", "B")))
    if isinstance(q, Choice):
        names = list(q.criteria)
        seen: dict[str, str] = {}
        for name in names:
            if not name.strip():
                raise LabelError(f"question {qid!r} has an empty option name")
            key = name.strip().casefold()
            if key in seen:
                raise LabelError(f"question {qid!r} has duplicate options {seen[key]!r} and {name!r}")
            seen[key] = name
        return QuestionSpec(qid, q, tuple(names), _alphabets(len(names), letters_first=True))
    levels = len(q.criteria)
    return QuestionSpec(qid, q, tuple(str(i) for i in range(levels)), _alphabets(levels, letters_first=False))


def _alphabets(k: int, *, letters_first: bool) -> tuple[tuple[str, ...], ...]:
    """Label alphabets for k options: letters (A.., a..) and digits (1.., 0..)."""
    if k > MAX_LABEL_IDS:
        raise LabelError(f"{k} options; one read carries at most {MAX_LABEL_IDS} labels")
    letters = [_UPPER[:k], _LOWER[:k]] if k <= 26 else [(_UPPER + _LOWER)[:k]] if k <= 52 else []
    digits = [[str(i) for i in range(1, k + 1)]] if k <= 9 else []
    digits += [[str(i) for i in range(k)]] if k <= 10 else []
    if k > 52:  # bracket: two-letter labels, kept only where each is one token
        letters = [[a + b for a in _UPPER for b in _UPPER][:k]]
    ordered = letters + digits if letters_first else digits + letters
    return tuple(tuple(a) for a in ordered)


# -- prompts --------------------------------------------------------------------------


def _text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def system_prompt(specs: Sequence[QuestionSpec], labels: Sequence[Sequence[str]],
                  special_tokens: Sequence[str] | None = None) -> str:
    """The question list for one chunk. Caller ids are hidden behind q1, q2, ...

    Instructions, option names and criteria are defused like the state (`engine.defuse`
    with the engine's special tokens): a question built from state cannot forge tokens.
    """
    specials = special_tokens or SPECIAL_CANDIDATES

    def text(content: Any) -> str:
        return defuse(_text(content), specials)

    parts = ["Read the input and answer every question below."]
    for n, (spec, alphabet) in enumerate(zip(specs, labels, strict=True), 1):
        q = spec.question
        lines = [f"Question q{n}: {text(q.instructions)}"]
        if isinstance(q, Noul):
            crit = q.criteria
            yes = text(crit.true) if crit and crit.true is not None else "yes"
            no = text(crit.false) if crit and crit.false is not None else "no"
            lines += [f"{alphabet[0]}: {yes}", f"{alphabet[1]}: {no}"]
        elif isinstance(q, Choice):
            for label, (name, desc) in zip(alphabet, q.criteria.items(), strict=True):
                lines.append(f"{label}: {text(name)}" + (f" ({text(desc)})" if desc not in (None, "") else ""))
        else:
            lines += [f"{label}: {text(desc)}" for label, desc in zip(alphabet, q.criteria, strict=True)]
        parts.append("\n".join(lines))
    parts.append('Reply with one line per question, in this order, formatted as "id: label".')
    return "\n\n".join(parts)


def template_text(info: EngineInfo, labels: Sequence[str]) -> str:
    """The answer canvas text: the thought block where the prompt lacks it
    (`info.canvas_prefix`), one `qN: label` line per question, and the end of turn right
    after the last line (as vLLM's reference gateway builds it)."""
    body = "\n".join(f"q{n}: {label}" for n, label in enumerate(labels, 1))
    return f"{info.canvas_prefix}{body}{info.end_of_turn}"


def canvas_width(template_len: int, served: int) -> int:
    """Template + 1, rounded up to a multiple of 16, at most the served canvas."""
    return min(served, -(-(template_len + 1) // 16) * 16)


# -- planning -------------------------------------------------------------------------


async def plan(engine: Engine, specs: Mapping[str, QuestionSpec]) -> Plan:
    """Chunk the questions to fit the canvas and resolve every slot."""
    info = await engine.info()
    chunks: list[list[QuestionSpec]] = []
    for spec in specs.values():
        if chunks and await _fits(engine, info, [*chunks[-1], spec]):
            chunks[-1].append(spec)
        elif await _fits(engine, info, [spec]):
            chunks.append([spec])
        else:
            raise InputTooLong(f"question {spec.id!r} alone does not fit a {info.canvas_width}-token canvas")
    resolved = await asyncio.gather(*(_resolve(engine, info, c) for c in chunks))
    return Plan(specs=dict(specs), chunks=tuple(resolved))


async def _fits(engine: Engine, info: EngineInfo, specs: Sequence[QuestionSpec]) -> bool:
    if sum(len(s.options) for s in specs) > MAX_LABEL_IDS:
        return False
    ids = await engine.tokenize(template_text(info, [s.alphabets[0][0] for s in specs]))
    return len(ids) + 1 <= info.canvas_width


async def _resolve(engine: Engine, info: EngineInfo, specs: Sequence[QuestionSpec]) -> Chunk:
    choice = [0] * len(specs)
    slots: list[Slot] = []
    for i, spec in enumerate(specs):
        failures = []
        for a, alphabet in enumerate(spec.alphabets):
            choice[i] = a
            found = await _slot(engine, info, specs, choice, i)
            if isinstance(found, Slot):
                slots.append(found)
                break
            failures.append(found)
        else:
            raise LabelError(
                f"question {spec.id!r}: no label alphabet is one token at one slot with this tokenizer ("
                + "; ".join(failures) + ")",
                hint="fewer options, or a model whose tokenizer keeps these labels whole",
            )
    labels = [s.alphabets[c][0] for s, c in zip(specs, choice, strict=True)]
    template = tuple(await engine.tokenize(template_text(info, labels)))
    for slot in slots:  # later alphabet choices never move earlier slots; check anyway
        if template[slot.position] != slot.label_ids[0]:
            raise LabelError(f"question {slot.question_id!r}: slot moved while resolving later questions")
    alphabets = [s.alphabets[c] for s, c in zip(specs, choice, strict=True)]
    return Chunk(system=system_prompt(specs, alphabets, info.special_tokens), template=template,
                 width=canvas_width(len(template), info.canvas_width), slots=tuple(slots))


async def _slot(engine: Engine, info: EngineInfo, specs: Sequence[QuestionSpec],
                choice: Sequence[int], i: int) -> Slot | str:
    """The slot of question i under the current alphabets, or why there is none."""
    alphabet = specs[i].alphabets[choice[i]]
    base = [s.alphabets[c][0] for s, c in zip(specs, choice, strict=True)]

    def flipped(label: str) -> str:
        return template_text(info, [*base[:i], label, *base[i + 1:]])

    variants = await asyncio.gather(*(engine.tokenize(flipped(label)) for label in alphabet))
    reference = variants[0]
    position: int | None = None
    ids = [0] * len(alphabet)
    for j, toks in enumerate(variants):
        if j == 0:
            continue
        if len(toks) != len(reference):
            return f"{alphabet[j]!r} changes the template length"
        diff = [p for p, (x, y) in enumerate(zip(reference, toks)) if x != y]
        if len(diff) != 1 or (position is not None and diff[0] != position):
            return f"{alphabet[j]!r} is not one token at the slot of {alphabet[0]!r}"
        position = diff[0]
        ids[j] = toks[position]
    if position is None:  # a single option: find its line by flipping to another letter
        probe = await engine.tokenize(flipped("Z" if alphabet[0] != "Z" else "Y"))
        diff = [p for p, (x, y) in enumerate(zip(reference, probe)) if x != y]
        if len(probe) != len(reference) or len(diff) != 1:
            return f"{alphabet[0]!r} is not one token"
        position = diff[0]
    ids[0] = reference[position]
    if len(set(ids)) != len(ids):
        return "two labels map to the same token"
    return Slot(specs[i].id, position, tuple(alphabet), tuple(ids))
