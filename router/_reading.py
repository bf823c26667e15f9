"""Reading: a planned decision set becomes canvas reads, gated per question.

`Reading` holds one decision's engine, plan and seed. It sends the first reads of every
chunk in one engine call (`GatePolicy.samples` each), re-reads each chunk holding an
uncertain question (as many times as that chunk's uncertain questions ask), and gives
routed questions their in-group read. With `think`, each chunk's reads continue a thought the model wrote for
that chunk's prompt first (`_think`). Engine faults are recorded on the questions they
hit when the model can absorb them (escalation or fallback), else raised.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from canvasroute.engine import (
    CanvasRead,
    CanvasRouteError,
    EngineInfo,
    EngineResponseError,
    Thought,
)

from . import telemetry as tm
from ._distribution import SlotStats, aggregate, slot_stats
from ._options import ReadOptions
from ._plan import Chunk, Plan, Route, Slot
from ._policy import GatePolicy
from ._questions import QuestionSpec, unrotate
from ._think import write_thoughts

REREAD_STRIDE = 7919
"""Read k of a canvas uses noise seed `seed + 7919 k` (vLLM's gateway convention)."""

Messages = tuple[Mapping[str, str], ...]


@dataclass(slots=True)
class QuestionRead:
    """Per-question canvas state while a decision set is answered."""

    spec: QuestionSpec
    chunk: int
    labels: tuple[str, ...]
    slot: int | None = None
    """Canvas position of the question's slot (the group slot, for a routed question)."""
    constrained: bool = False
    """Read constrained: its label mass and argmax are not measured."""
    runs: list[SlotStats] = field(default_factory=list)
    """One entry per read of the question's slot (the group slot, for a routed question)."""
    stats: SlotStats | None = None
    crossed: tuple[str, ...] = ()
    gate: str | None = None
    """The gate it was held to (`GatePolicy.gate_text`)."""
    error: str | None = None
    fault: CanvasRouteError | None = None
    """The engine fault behind `error`, re-raised when no escalation or fallback covers it."""
    samples: int = 0
    """Reads before the gate (`GatePolicy.samples`); `runs` beyond them are re-reads."""
    in_group_reads: int = 0
    """Reads of the option within the chosen group (routed questions)."""
    abstained: bool = False
    """The abstain label won the final canvas distribution."""
    on_abstain: str = "escalate"
    """Where an abstained question goes: `escalate` or `fallback` (its policy's)."""
    on_unsure: str = "answer"
    """What an unsure question answers when nothing can answer it instead (its policy's)."""
    rereadable: bool = True
    """False when a re-read could not have changed this question's read (a causal readout's
    slot that sees no noisy position), so none was made for it."""

    def fail(self, exc: CanvasRouteError) -> None:
        self.error, self.fault = f"{type(exc).__name__}: {exc}", exc


def messages(chunk: Chunk, state_text: str, instructions: str = "") -> Messages:
    """The chat messages one chunk is read with (the decision's `instructions` head its system prompt)."""
    system = f"{instructions}\n\n{chunk.system}" if instructions else chunk.system
    return ({"role": "system", "content": system}, {"role": "user", "content": state_text})


def build_canvas(chunk: Chunk, msgs: Messages, info: EngineInfo, seed: int, options: ReadOptions,
                 thought: Thought | None = None) -> CanvasRead:
    """Template + pad to the chunk width, with a random non-label id at every slot."""
    draw, pad = random.Random(seed).randrange, info.pad_id
    canvas = [*chunk.template, *[pad] * (chunk.width - len(chunk.template))]
    for slot in chunk.slots:
        noise = draw(info.vocab_size)
        while noise == pad or noise in slot.label_ids:
            noise = draw(info.vocab_size)
        canvas[slot.position] = noise
    return CanvasRead(messages=msgs, canvas=tuple(canvas), slots=tuple(s.position for s in chunk.slots),
                      label_ids=chunk.label_ids, constrained=options.constrained, steps=options.steps,
                      thought=thought.ids if thought is not None else None)


def combine(groups: SlotStats, route: Route, group: int, within: SlotStats) -> SlotStats:
    """The distribution over every option of a routed question, from its two reads.

    An option of the read group gets p(group) * p(option | group); each option of an
    unread group gets p(that group) / its size (the reads cannot tell them apart).
    Agreement and stderr are the group read's; label mass is the product of both.
    """
    probs: list[float] = []
    for g, members in enumerate(route.groups):
        if g == group:
            probs += [groups.probs[g] * p for p in within.probs]
        else:
            probs += [groups.probs[g] / len(members)] * len(members)
    return SlotStats(tuple(probs), groups.label_mass * within.label_mass, reads=groups.reads,
                     agreement=groups.agreement, stderr=groups.stderr, argmax_is_label=groups.argmax_is_label)


def fold_views(slots: Sequence[Slot], stats: Sequence[SlotStats]) -> dict[str, SlotStats]:
    """One read's stats per question: a question read with order-bias views gets the mean
    of its slot's distribution and each view's, turned back to option order (`unrotate`)."""
    seen: dict[str, list[tuple[int, SlotStats]]] = {}
    for slot, st in zip(slots, stats, strict=True):
        seen.setdefault(slot.question_id, []).append((slot.shift, st))
    out = {}
    for qid, views in seen.items():
        if len(views) == 1:
            out[qid] = views[0][1]
            continue
        aligned = [unrotate(st.probs, shift) for shift, st in views]
        k, n = len(aligned[0]), len(aligned)
        out[qid] = SlotStats(tuple(sum(a[j] for a in aligned) / n for j in range(k)),
                             sum(st.label_mass for _, st in views) / n, argmax_is_label=views[0][1].argmax_is_label)
    return out


@dataclass(slots=True)
class Reading:
    """The canvas reads of one decision: first reads, per-chunk re-reads, in-group reads."""

    engine: object
    info: EngineInfo
    plan: Plan
    state_text: str
    seed: int
    policy: GatePolicy
    options: ReadOptions
    absorbs: Callable[[CanvasRouteError], bool]
    """Whether an engine fault is recorded on the questions (True) or raised (False)."""
    member_plan: Callable[[Plan, str, int], Awaitable[Plan]]
    """The (cached) plan of a routed question's in-group read: (plan, question id, group)."""
    usage: dict[str, int]
    canvas_reads: int = 0
    sent: list[int] = field(default_factory=list)
    """Reads sent per chunk so far (the next read's index k)."""
    thoughts: list[Thought] = field(default_factory=list)
    """The thought each chunk's reads continue (`options.think`), in chunk order."""
    prompt_tokens: int = 0
    """Prompt tokens of the first read (0 when the engine reports none)."""

    async def run(self) -> dict[str, QuestionRead]:
        """Read, gate and re-read every question; returns each question's state."""
        reads = {s.question_id: QuestionRead(self.plan.specs[s.question_id], c, s.labels, s.position,
                                             self.options.constrained)
                 for c, chunk in enumerate(self.plan.chunks) for s in chunk.slots if not s.shift}
        for qid, route in self.plan.routes.items():  # "group/option" labels, in option order
            reads[qid].labels = tuple(f"{g}/{route.labels[j]}" for g, members in zip(reads[qid].labels, route.groups)
                                      for j in range(len(members)))
        msgs = [messages(c, self.state_text, self.options.instructions) for c in self.plan.chunks]
        self.sent = [0] * len(self.plan.chunks)
        if self.options.think and not await self._think(msgs, reads):
            return reads
        samples = {qid: self.policy.for_question(qid).samples for qid in reads}
        await self._jobs(self._jobs_for(reads, samples), msgs, reads, list(reads), "first", samples)
        for r in reads.values():
            r.samples = len(r.runs)
        uncertain = {qid: self.policy.for_question(qid).rereads for qid, r in reads.items()
                     if r.error is None and r.crossed and self.policy.for_question(qid).rereads}
        for qid in self._fixed().intersection(uncertain):
            reads[qid].rereadable = False
            del uncertain[qid]
        if uncertain:
            await self._jobs(self._jobs_for(reads, uncertain), msgs, reads, list(uncertain), "reread", uncertain)
        await self._in_group(reads)
        for qid in self.plan.routes:
            if reads[qid].error is not None:  # a group distribution is no distribution over the options
                reads[qid].stats = None
        gates: dict[int, str] = {}  # each policy's text made once (most questions share the model's policy)
        for qid, r in reads.items():
            policy = self.policy.for_question(qid)
            r.on_unsure = policy.on_unsure
            if r.runs:
                r.gate = gates.get(id(policy)) or gates.setdefault(id(policy), policy.gate_text)
            if r.spec.abstain and r.error is None and r.stats is not None:
                r.abstained = r.stats.top == len(r.spec.options) - 1
                r.on_abstain = policy.on_abstain
        return reads

    def _fixed(self) -> set[str]:
        """Questions a re-read cannot change. Noise sits at the slots, so under a causal readout
        (`EngineInfo.causal_readout`) a slot sees fresh noise only from the slots before it in its
        canvas: a question none of whose slots has one would read the same distribution again."""
        if not self.info.causal_readout:
            return set()
        varies = set()
        for chunk in self.plan.chunks:
            first = min(s.position for s in chunk.slots)
            varies.update(s.question_id for s in chunk.slots if s.position > first)
        return {s.question_id for c in self.plan.chunks for s in c.slots} - varies

    def _jobs_for(self, reads: Mapping[str, QuestionRead], wanted: Mapping[str, int]) -> list[tuple[int, int]]:
        """(chunk, k) reads: each chunk holding a question in `wanted` is read n more times,
        n the largest count ITS questions want, continuing the chunk's read index k (read k
        of a chunk always uses noise seed `seed + 7919 k`, first reads and re-reads alike)."""
        per_chunk: dict[int, int] = {}
        for qid, n in wanted.items():
            per_chunk[reads[qid].chunk] = max(per_chunk.get(reads[qid].chunk, 0), n)
        jobs = [(c, k) for c, n in sorted(per_chunk.items()) for k in range(self.sent[c], self.sent[c] + n)]
        for c, n in per_chunk.items():
            self.sent[c] += n
        return jobs

    async def _jobs(self, jobs: Sequence[tuple[int, int]], msgs: Sequence[Messages],
                    reads: dict[str, QuestionRead], hit: Sequence[str], kind: str,
                    wanted: Mapping[str, int]) -> None:
        """Read (chunk, k) pairs in one call, add each slot's stats to its question, gate again.

        `wanted`: question id -> reads it asked for in this call; a question keeps only
        that many of its chunk's reads (the others read it for a neighbour). A fault is
        recorded on the questions in `hit`.
        """
        batch = [build_canvas(self.plan.chunks[c], msgs[c], self.info, self.seed + REREAD_STRIDE * k, self.options,
                              self.thoughts[c] if self.thoughts else None) for c, k in jobs]
        try:
            stats = await self._read(batch, [self.plan.chunks[c] for c, _ in jobs], kind)
        except CanvasRouteError as exc:
            if not self.absorbs(exc):
                raise
            for qid in hit:
                reads[qid].fail(exc)
            return
        taken: dict[str, int] = {}
        for (c, _), chunk_stats in zip(jobs, stats, strict=True):
            for qid, st in fold_views(self.plan.chunks[c].slots, chunk_stats).items():
                if taken.get(qid, 0) < wanted.get(qid, 0):
                    taken[qid] = taken.get(qid, 0) + 1
                    reads[qid].runs.append(st)
        for qid in hit:
            r = reads[qid]
            if r.runs and r.error is None:
                r.stats = aggregate(r.runs)
                r.crossed = tuple(self.policy.for_question(qid).crossed(r.stats))

    async def _think(self, msgs: Sequence[Messages], reads: dict[str, QuestionRead]) -> bool:
        """Each chunk's thought (False when an engine fault was recorded on every question instead)."""
        try:
            self.thoughts = await write_thoughts(self.engine, msgs, self.options.think, self.seed)
        except CanvasRouteError as exc:
            if not self.absorbs(exc):
                raise
            for r in reads.values():
                r.fail(exc)
            return False
        for t in self.thoughts:
            self.usage["input_tokens"] += t.prompt_tokens
            self.usage["output_tokens"] += len(t.ids)
        return True

    async def _in_group(self, reads: dict[str, QuestionRead]) -> None:
        """The second read of each routed question: the option within its most likely group."""
        routed = [(qid, route) for qid, route in self.plan.routes.items()
                  if reads[qid].error is None and reads[qid].stats is not None]
        if not routed:
            return
        member_plans = [await self.member_plan(self.plan, qid, reads[qid].stats.top) for qid, _ in routed]
        chunks = [p.chunks[0] for p in member_plans]
        batch = [build_canvas(c, messages(c, self.state_text, self.options.instructions), self.info, self.seed,
                              self.options) for c in chunks]
        try:
            stats = await self._read(batch, chunks, "in_group")
        except CanvasRouteError as exc:
            if not self.absorbs(exc):
                raise
            for qid, _ in routed:
                reads[qid].fail(exc)
            return
        for (qid, route), (within,) in zip(routed, stats, strict=True):
            r = reads[qid]
            assert r.stats is not None
            r.stats = combine(r.stats, route, r.stats.top, within)
            r.in_group_reads = 1
            r.crossed = tuple(self.policy.for_question(qid).crossed(r.stats))

    async def _read(self, batch: Sequence[CanvasRead], chunks: Sequence[Chunk], kind: str) -> list[list[SlotStats]]:
        """One engine call; returns stats per canvas, in slot order."""
        self.canvas_reads += len(batch)  # sent, whether or not the engine answers
        with tm.engine_call(self.info, batch, kind, self.seed) as call:
            results = await self.engine.read(batch)  # type: ignore[attr-defined]
            if len(results) != len(batch):
                raise EngineResponseError(f"the engine returned {len(results)} results for {len(batch)} canvases")
            tokens_in = sum(r.prompt_tokens for r in results)
            tokens_out = sum(r.completion_tokens for r in results)
            call.usage(tokens_in, tokens_out, results)
            call.read_output(chunks, results, self.plan.specs)
            call.response_model(self.info.model)
        self.usage["input_tokens"] += tokens_in
        self.usage["output_tokens"] += tokens_out
        self.prompt_tokens = self.prompt_tokens or results[0].prompt_tokens
        out = []
        for chunk, result in zip(chunks, results, strict=True):
            if len(result.rows) != len(chunk.slots):
                raise EngineResponseError(f"the engine returned {len(result.rows)} slot rows for "
                                          f"{len(chunk.slots)} slots")
            out.append([slot_stats(row, s.label_ids, self.policy.for_question(s.question_id).temperature)
                        for row, s in zip(result.rows, chunk.slots, strict=True)])
        return out
