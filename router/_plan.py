"""Planning: a decision set becomes canvases (chunks of slots, each label one token).

A decision set is planned once per (engine, questions) and cached by the model: each
question gets a label alphabet whose labels are each ONE token at ONE shared canvas
position (the slot), found by re-tokenizing the template with that question flipped to
every label. Questions that do not fit one canvas are split into chunks, each with its
own prompt (a question asked `alone` gets a chunk of its own); a set of more than
`COMPACT_ABOVE` questions answers in the compact format (`q1A q2B`) when that needs fewer
chunks. A question none of whose fixed alphabets is one token at its slot with this tokenizer
gets labels scanned from the tokenizer (`one_token_labels`); one with more options than
one read can label (the tokenizer's one-token labels, or `MAX_LABEL_IDS` per request) is
routed in two reads: `Route`.
"""

from __future__ import annotations

import asyncio
import math
import string
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from langchain_core.decisions import Choice, Noul

from canvasroute.engine import MAX_LABEL_IDS, SPECIAL_CANDIDATES, Engine, EngineInfo, InputTooLong, LabelError, defuse

from ._questions import ABSTAIN_TEXT, QuestionSpec, option_text, rotated, view_shifts, with_abstain

if TYPE_CHECKING:
    from ._request import DecisionRequest

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
    isolated: bool = False
    """An isolated read on a causal engine (`ReadOptions.isolate`, `isolated`): the state first, its
    question after it, so a decision's reads share the prompt's prefix up to the end of the state."""
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
    for given in specs.values():
        settled = await _settled(engine, info, given) if given.alphabets else None
        if settled is None:  # past the fixed alphabets, or none is one token here: scan the tokenizer
            spec, route = await _scanned(engine, info, given)
            if route is not None:
                routes[spec.id] = route
                grouped = route.group_spec(spec)
                spec = await _settled(engine, info, grouped) or grouped
        else:
            spec = settled
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


async def _settled(engine: Engine, info: EngineInfo, spec: QuestionSpec) -> QuestionSpec | None:
    """The question with the first alphabet that is one token at its slot on its own moved
    to the front, so chunks are packed with the labels they will be read with; None when no
    alphabet is (the planner then scans the tokenizer for labels, or reads in two steps)."""
    for a, alphabet in enumerate(spec.alphabets):
        if isinstance(await _slot(engine, info, [spec], [a], 0), Slot):
            return spec if a == 0 else replace(spec, alphabets=(alphabet, *spec.alphabets[:a],
                                                                 *spec.alphabets[a + 1:]))
    return None


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
        for a in range(len(spec.alphabets)):
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


# -- prompts ---------------------------------------------------------------------------

LINES_FORMAT = 'Reply with one line per question, in this order, formatted as "id: label".'
COMPACT_FORMAT = ("Reply on one line: each question's id directly followed by its label, in this order, "
                  "separated by single spaces (for example q1A q2B).")


def system_prompt(specs: Sequence[QuestionSpec], labels: Sequence[Sequence[str]],
                  special_tokens: Sequence[str] | None = None, *, compact: bool = False) -> str:
    """The question list for one chunk. Caller ids are hidden behind q1, q2, ...

    Instructions, option names and criteria are defused like the state (`canvasroute.engine.defuse`
    with the engine's special tokens): a question built from state cannot forge tokens.
    """
    specials = special_tokens or SPECIAL_CANDIDATES

    def text(content: Any) -> str:
        return defuse(option_text(content), specials)

    parts = ["Read the input and answer every question below."]
    for n, (spec, spec_labels) in enumerate(zip(specs, labels, strict=True), 1):
        q = spec.question
        again = " (the same question again, options in another order)" if spec.shift else ""
        lines = [f"Question q{n}: {text(q.instructions)}{again}"]
        # with abstain, the last label is "none of these / can't tell"
        alphabet = spec_labels[:-1] if spec.abstain else spec_labels
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
        if spec.abstain:
            lines.append(f"{spec_labels[-1]}: {ABSTAIN_TEXT}")
        parts.append("\n".join(lines))
    parts.append(COMPACT_FORMAT if compact else LINES_FORMAT)
    return "\n\n".join(parts)


def template_text(info: EngineInfo, labels: Sequence[str], *, compact: bool = False) -> str:
    """The answer canvas text: the thought block where the prompt lacks it
    (`info.canvas_prefix`), the answers, and the end of turn right after the last one (as
    vLLM's reference gateway builds it). Answers are `qN: label` lines, or `qNlabel` words
    separated by spaces when `compact` (a token or more less per question)."""
    if compact:
        body = " ".join(f"q{n}{label}" for n, label in enumerate(labels, 1))
    else:
        body = "\n".join(f"q{n}: {label}" for n, label in enumerate(labels, 1))
    return f"{info.canvas_prefix}{body}{info.end_of_turn}"


# -- one-token labels --------------------------------------------------------------------

Tokenize = Callable[[str], Awaitable[list[int]]]

LABEL_POOL: tuple[str, ...] = tuple(
    list(string.ascii_uppercase) + list(string.ascii_lowercase) + list(string.digits)
    + [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
    + [a + b for a in string.ascii_uppercase for b in string.ascii_lowercase]
    + [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    + [str(i) for i in range(10, 100)]
)
"""Candidate labels, best first: letters, digits, then two-character labels."""

_BATCH = 64


async def one_token_labels(tokenize: Tokenize, render: Callable[[str], str], want: int,
                           pool: Sequence[str] = LABEL_POOL) -> tuple[str, ...]:
    """Up to `want` labels from `pool` that are each one distinct token at one slot.

    `render(label)` is the canvas text with the question's slot holding `label`. The
    slot is where the first two one-token pool entries differ; returns () when the
    pool offers no such pair.
    """
    found: list[str] = []
    ids: set[int] = set()
    reference: list[int] | None = None
    position: int | None = None
    for start in range(0, len(pool), _BATCH):
        batch = pool[start:start + _BATCH]
        variants = await asyncio.gather(*(tokenize(render(label)) for label in batch))
        for label, toks in zip(batch, variants, strict=True):
            if reference is None:
                reference, reference_label = toks, label
                continue
            if len(toks) != len(reference):
                continue
            diff = [p for p, (x, y) in enumerate(zip(reference, toks)) if x != y]
            if len(diff) != 1 or (position is not None and diff[0] != position):
                continue
            if position is None:  # the first label that differs in one token fixes the slot
                position = diff[0]
                found.append(reference_label)
                ids.add(reference[position])
            if toks[position] not in ids:
                found.append(label)
                ids.add(toks[position])
            if len(found) >= want:
                return tuple(found[:want])
    return tuple(found)


# -- the plans a model keeps -------------------------------------------------------------

KEEP = 256
"""Plans kept (least recently used dropped first)."""

Messages = tuple[Mapping[str, str], ...]


ISOLATED_SYSTEM = "Read the input, then answer the question that follows it."
"""The system prompt of an isolated read (its question follows the state in the user message)."""


def messages(chunk: Chunk, state_text: str, instructions: str = "") -> Messages:
    """The chat messages one chunk is read with (the decision's `instructions` head its system
    prompt). An isolated chunk puts the state first and its question after it, so the isolated
    reads of one decision share every token up to the end of the state (a prefix cache's hit)."""
    if chunk.isolated:
        system = f"{instructions}\n\n{ISOLATED_SYSTEM}" if instructions else ISOLATED_SYSTEM
        return ({"role": "system", "content": system}, {"role": "user", "content": f"{state_text}\n\n{chunk.system}"})
    system = f"{instructions}\n\n{chunk.system}" if instructions else chunk.system
    return ({"role": "system", "content": system}, {"role": "user", "content": state_text})


AUTO_ISOLATE = range(2, 5)
"""Sizes of yes/no sets `isolate="auto"` reads one question at a time on a bidirectional engine:
where a loss is reported (two yes/no questions read together scored 0.60, alone 0.88; none at five)."""


def isolated(isolate: str, info: EngineInfo, specs: Mapping[str, QuestionSpec]) -> bool:
    """Whether a stage's questions are each read without the others in view: `all`; `auto` on a
    causal engine (a slot sees the questions before it: a lone question too, for its layout), and
    on others for sets of 2-4 yes/no questions.

    An isolated read on a bidirectional engine is the question's lone read, prompt for prompt;
    on a causal engine it puts the state first (`Chunk.isolated`), so a decision's reads share the
    prompt up to the end of the state (the engine's prefix cache), whatever its neighbours."""
    if isolate == "none":
        return False
    if info.causal_readout:
        return True
    return (isolate == "all" and len(specs) > 1) or (
        len(specs) in AUTO_ISOLATE and all(s.kind == "noul" for s in specs.values()))


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a decision stage's canvases are read about, defused for the engine's tokenizer."""

    state_text: str
    """The state (and, past the first stage, its parents' answers restated)."""
    instructions: str
    """`ReadOptions.instructions`, defused."""


@dataclass(slots=True)
class Planner:
    """One engine's plans, by key (an LRU of `KEEP`)."""

    engine: Engine
    plans: OrderedDict[Any, Plan] = field(default_factory=OrderedDict)

    async def layer(self, request: DecisionRequest, asked: Sequence[str], info: EngineInfo) -> Plan:
        """The plan of the asked questions of a decision, as read (abstain labels, order views,
        questions read alone, a thought first) on the engine `info` describes."""
        specs, gates, read = request.questions.specs, request.gates, request.read
        shaped = {qid: with_abstain(specs[qid]) if gates[qid].abstain else specs[qid] for qid in asked}
        views = {qid: gates[qid].order_views for qid in asked if gates[qid].order_views}
        apart = isolated(read.isolate, info, shaped)
        alone = sorted(asked) if apart and len(asked) > 1 else sorted(read.alone.intersection(asked))
        state_first = apart and info.causal_readout
        plan_key: Any = request.questions.key
        if (len(asked) != len(specs) or views or alone or read.think
                or any(s.abstain for s in shaped.values())):
            plan_key = (plan_key, tuple(asked), tuple(q for q, s in shaped.items() if s.abstain),
                        tuple(views.items()), tuple(alone), bool(read.think), state_first)
        return await self._get(plan_key, shaped, views, alone, "" if read.think else None, state_first)

    async def member(self, the_plan: Plan, qid: str, group: int, think: bool = False) -> Plan:
        """The in-group plan of a question read in two steps (`think`: its read continues a thought)."""
        spec = the_plan.routes[qid].member_spec(the_plan.specs[qid], group)
        return await self._get(("member", qid, spec.question.model_dump_json(), think), {qid: spec},
                               canvas_prefix="" if think else None)

    async def check(self, request: DecisionRequest, info: EngineInfo, prompt: Prompt) -> list[Plan]:
        """`InputTooLong` unless every read of every stage (all of it asked) fits the model; returns
        each stage's plan, all of it asked."""
        plans = []
        for layer in request.questions.depends.layers:
            plans.append(the_plan := await self.layer(request, layer, info))
            await self.check_plan(the_plan, request, info, prompt)
        return plans

    async def check_plan(self, the_plan: Plan, request: DecisionRequest, info: EngineInfo, prompt: Prompt) -> None:
        """`InputTooLong` unless every read `the_plan` can send fits the model: each chunk's first
        read (its re-reads share its prompt), and for a question read in two steps the in-group
        read of every group (which one is read is known only after the first read)."""
        think = request.read.think
        for chunk in the_plan.chunks:
            await _check(self.engine, info, chunk, prompt, think, None)
        for qid, route in the_plan.routes.items():
            for group in range(len(route.groups)):
                for chunk in (await self.member(the_plan, qid, group, bool(think))).chunks:
                    await _check(self.engine, info, chunk, prompt, think, qid)

    async def _get(self, key: Any, specs: Mapping[str, QuestionSpec], views: Mapping[str, int] | None = None,
                   alone: Sequence[str] = (), canvas_prefix: str | None = None, state_first: bool = False) -> Plan:
        plans = self.plans
        if key not in plans:
            made = await plan(self.engine, specs, views, alone=alone, canvas_prefix=canvas_prefix)
            if state_first:
                made = replace(made, chunks=tuple(replace(c, isolated=True) for c in made.chunks))
            plans[key] = made
            while len(plans) > KEEP:
                plans.popitem(last=False)
        plans.move_to_end(key)
        return plans[key]


async def _check(engine: Engine, info: EngineInfo, chunk: Chunk, prompt: Prompt, think: int,
                 routed: str | None) -> None:
    """A byte count bounds a prompt cheaply (a token covers at least one UTF-8 byte); only a
    prompt near the limit is tokenized exactly."""
    budget = info.max_model_len - chunk.width - think
    msgs = messages(chunk, prompt.state_text, prompt.instructions)
    if info.chat_overhead + sum(len(m["content"].encode()) for m in msgs) <= budget:
        return
    n = await engine.count_prompt(msgs)
    if n > budget:
        step = f" (the in-group read of {routed!r}, which lists every option of a group)" if routed else ""
        thought = f" + thought of {think}" if think else ""
        raise InputTooLong(f"prompt of {n} tokens + canvas of {chunk.width}{thought} exceed the model's "
                           f"{info.max_model_len}-token context{step}",
                           hint="shorten the state or ask fewer questions (or options) per node")
