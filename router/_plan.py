"""Planning: a decision set becomes canvases (chunks of slots, each label one token).

A decision set is planned once per (engine, questions) and cached by the model: each
question gets a label alphabet whose labels are each ONE token at ONE shared canvas
position (the slot), found by re-tokenizing the template with that question flipped to
every label. Questions that do not fit one canvas are split into chunks, each with its
own prompt (a question asked `alone` gets a chunk of its own); a set of more than
`COMPACT_ABOVE` questions answers in the compact format (`q1A q2B`) when that needs fewer
chunks. A question with more options than one read can label (the tokenizer's one-token
labels, or `MAX_LABEL_IDS` per request) is routed in two reads: `Route`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from langchain_core.decisions import Choice

from canvasroute.engine import MAX_LABEL_IDS, Engine, EngineInfo, InputTooLong, LabelError

from ._labels import one_token_labels
from ._prompts import system_prompt, template_text
from ._questions import QuestionSpec, rotated, view_shifts

COMPACT_ABOVE = 10
"""Sets of more questions than this may answer in the compact format (vLLM's gateway's
threshold: up to ten, it found lines and the compact format agreeing on every set tried)."""
GROUP_LISTING_CHARS = 300
"""Longest member listing in a group question's prompt; longer groups name their ends."""
_LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one question is read: canvas position and the token id of each label."""

    question_id: str
    position: int
    labels: tuple[str, ...]
    label_ids: tuple[int, ...]
    shift: int = 0
    """Order-bias view: the question's options rotated by `shift` (0: the question itself)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """Questions that share one canvas (and one system prompt)."""

    system: str
    template: tuple[int, ...]
    """Template ids with every question at its first label (no padding)."""
    width: int
    slots: tuple[Slot, ...]
    compact: bool = False
    """Answers as `q1A q2B` on one line instead of `q1: A` lines."""
    label_ids: tuple[int, ...] = field(init=False, compare=False, repr=False)
    """Every slot's label ids, sorted (what one read asks the engine for)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_ids", tuple(sorted({i for s in self.slots for i in s.label_ids})))


@dataclass(frozen=True, slots=True)
class Route:
    """Two reads for one question: first which group holds the answer, then the option in it.

    The reported probability of an option in the read group is p(group) * p(option | group);
    options of unread groups share their group's probability evenly.
    """

    groups: tuple[tuple[str, ...], ...]
    """Option names per group, in option order."""
    labels: tuple[str, ...]
    """One-token labels for the in-group read (at least as many as the largest group)."""

    def member_spec(self, spec: QuestionSpec, group: int) -> QuestionSpec:
        """The in-group question: the original question restricted to one group's options."""
        names = self.groups[group]
        described = dict(zip(spec.options, spec.descriptions, strict=True))
        question = Choice(instructions=spec.question.instructions,
                          criteria={name: described[name] or None for name in names})
        return QuestionSpec(spec.id, question, names, (self.labels[:len(names)],))

    def group_spec(self, spec: QuestionSpec) -> QuestionSpec:
        """The group question: which group holds the answer.

        A group is described by its option names when they fit `GROUP_LISTING_CHARS`, else
        by its first and last option (the in-group read lists every option in full).
        """
        names = tuple(f"group {g + 1}" for g in range(len(self.groups)))
        question = Choice(instructions=f"{spec.question.instructions} (First: which group holds the answer?)",
                          criteria={n: _describe(members) for n, members in zip(names, self.groups)})
        alphabets = ((_LETTERS[:len(names)],) if len(names) <= len(_LETTERS) else ()) + (self.labels[:len(names)],)
        return QuestionSpec(spec.id, question, names, alphabets)


def _describe(members: Sequence[str]) -> str:
    listing = "one of: " + ", ".join(members)
    if len(listing) <= GROUP_LISTING_CHARS:
        return listing
    return f"one of {len(members)} options, from {members[0]} to {members[-1]}"


@dataclass(frozen=True, slots=True)
class Plan:
    """Every chunk of one decision set (one chunk: one canvas read)."""

    specs: Mapping[str, QuestionSpec]
    chunks: tuple[Chunk, ...]
    routes: Mapping[str, Route] = field(default_factory=dict)
    """Questions read in two steps; their slot in `chunks` is the group question."""


def canvas_width(template_len: int, served: int) -> int:
    """Template + 1, rounded up to a multiple of 16, at most the served canvas."""
    return min(served, -(-(template_len + 1) // 16) * 16)


async def plan(engine: Engine, specs: Mapping[str, QuestionSpec], views: Mapping[str, int] | None = None, *,
               alone: Collection[str] = (), canvas_prefix: str | None = None) -> Plan:
    """Route questions too big for one read, chunk the rest to fit the canvas, resolve every slot.

    `views`: question id -> extra order-bias listings of that Choice (`rotated`), each one
    more slot in the question's own chunk (routed questions get none). `alone`: questions
    read in a chunk of their own. `canvas_prefix` replaces the engine's (`""` for reads
    whose prompt already closes the thought channel).
    """
    info = await engine.info()
    if canvas_prefix is not None:
        info = replace(info, canvas_prefix=canvas_prefix)
    routes: dict[str, Route] = {}
    units: list[list[QuestionSpec]] = []  # a question and its views share a chunk
    for spec in specs.values():
        if not spec.alphabets:  # past the fixed alphabets: scan the tokenizer
            spec, route = await _scanned(engine, info, spec)
            if route is not None:
                routes[spec.id] = route
                spec = route.group_spec(spec)
        spec = await _settled(engine, info, spec)
        n = (views or {}).get(spec.id, 0)
        extra = ([rotated(spec, s) for s in view_shifts(len(spec.options), n)]
                 if n and spec.id not in routes and isinstance(spec.question, Choice) and not spec.abstain else [])
        units.append([spec, *extra])
    chunks = await _pack(engine, info, units, alone, compact=False)
    if len(specs) > COMPACT_ABOVE and len(chunks) > 1:
        tight = await _pack(engine, info, units, alone, compact=True)
        if len(tight) < len(chunks):
            try:
                resolved = await asyncio.gather(*(_resolve(engine, info, c, compact=True) for c in tight))
                return Plan(specs=dict(specs), chunks=tuple(resolved), routes=routes)
            except LabelError:  # a label that is one token in lines but not in words: keep the lines
                pass
    resolved = await asyncio.gather(*(_resolve(engine, info, c) for c in chunks))
    return Plan(specs=dict(specs), chunks=tuple(resolved), routes=routes)


async def _pack(engine: Engine, info: EngineInfo, units: Sequence[Sequence[QuestionSpec]], alone: Collection[str],
                *, compact: bool) -> list[list[QuestionSpec]]:
    """Units in order, in the fewest chunks that fit the canvas; an `alone` unit gets its own."""
    chunks: list[list[QuestionSpec]] = []
    takes_more = False
    for unit in units:
        lone = unit[0].id in alone
        if takes_more and not lone and await _fits(engine, info, [*chunks[-1], *unit], compact):
            chunks[-1].extend(unit)
        elif await _fits(engine, info, unit, compact):
            chunks.append(list(unit))
            takes_more = not lone
        else:
            raise InputTooLong(f"question {unit[0].id!r} alone does not fit a {info.canvas_width}-token canvas"
                               + (" with its order-bias views" if len(unit) > 1 else ""))
    return chunks


async def _settled(engine: Engine, info: EngineInfo, spec: QuestionSpec) -> QuestionSpec:
    """The question with the first alphabet that is one token at its slot on its own moved
    to the front, so chunks are packed with the labels they will be read with."""
    for a, alphabet in enumerate(spec.alphabets if len(spec.alphabets) > 1 else ()):
        if isinstance(await _slot(engine, info, [spec], [a], 0), Slot):
            return spec if a == 0 else replace(spec, alphabets=(alphabet, *spec.alphabets[:a],
                                                                 *spec.alphabets[a + 1:]))
    return spec


async def _scanned(engine: Engine, info: EngineInfo, spec: QuestionSpec) -> tuple[QuestionSpec, Route | None]:
    """The question with scanned one-token labels, or its two-read route when too few exist."""
    k = len(spec.options)
    labels = await one_token_labels(engine.tokenize, lambda label: template_text(info, [label]),
                                    min(k, MAX_LABEL_IDS))
    if len(labels) >= k:
        return replace(spec, alphabets=(labels,)), None
    groups = math.ceil(k / max(1, len(labels)))
    if len(labels) < 2 or groups > len(labels):
        raise LabelError(f"question {spec.id!r}: {k} options, but this tokenizer offers only {len(labels)} "
                         "one-token labels at the slot, too few even for two reads",
                         hint="fewer options, or a model whose tokenizer keeps more labels whole")
    size = math.ceil(k / groups)
    members = tuple(spec.options[g * size:(g + 1) * size] for g in range(groups))
    return spec, Route(groups=tuple(m for m in members if m), labels=labels)


async def _fits(engine: Engine, info: EngineInfo, specs: Sequence[QuestionSpec], compact: bool = False) -> bool:
    if sum(len(s.options) for s in specs) > MAX_LABEL_IDS:
        return False
    ids = await engine.tokenize(template_text(info, [s.alphabets[0][0] for s in specs], compact=compact))
    return len(ids) + 1 <= info.canvas_width


async def _resolve(engine: Engine, info: EngineInfo, specs: Sequence[QuestionSpec], *,
                   compact: bool = False) -> Chunk:
    choice = [0] * len(specs)
    slots: list[Slot] = []
    for i, spec in enumerate(specs):
        failures = []
        for a, alphabet in enumerate(spec.alphabets):
            choice[i] = a
            found = await _slot(engine, info, specs, choice, i, compact)
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
    template = tuple(await engine.tokenize(template_text(info, labels, compact=compact)))
    for slot in slots:  # later alphabet choices never move earlier slots; check anyway
        if template[slot.position] != slot.label_ids[0]:
            raise LabelError(f"question {slot.question_id!r}: slot moved while resolving later questions")
    alphabets = [s.alphabets[c] for s, c in zip(specs, choice, strict=True)]
    return Chunk(system=system_prompt(specs, alphabets, info.special_tokens, compact=compact), template=template,
                 width=canvas_width(len(template), info.canvas_width), slots=tuple(slots), compact=compact)


async def _slot(engine: Engine, info: EngineInfo, specs: Sequence[QuestionSpec],
                choice: Sequence[int], i: int, compact: bool = False) -> Slot | str:
    """The slot of question i under the current alphabets, or why there is none."""
    alphabet = specs[i].alphabets[choice[i]]
    base = [s.alphabets[c][0] for s, c in zip(specs, choice, strict=True)]

    def flipped(label: str) -> str:
        return template_text(info, [*base[:i], label, *base[i + 1:]], compact=compact)

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
    if compact:  # the label right after its id must stay its own token, not merge with the id
        alone = await asyncio.gather(*(engine.tokenize(label) for label in alphabet))
        if any(list(a) != [t] for a, t in zip(alone, ids, strict=True)):
            return f"{alphabet[0]!r} merges with the question id in the compact format"
    return Slot(specs[i].id, position, tuple(alphabet), tuple(ids), specs[i].shift)

