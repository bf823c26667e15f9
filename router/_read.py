"""Reading: a planned decision becomes canvas reads, gated per question.

`Reading` holds one decision stage's request, engine, plan and prompt. It sends the first
reads of every chunk in one engine call (`GatePolicy.samples` each), re-reads each chunk
holding an uncertain question (as many times as that chunk's uncertain questions ask), and
gives routed questions their in-group read. With `think`, each canvas prompt's reads
continue a thought the model wrote for that prompt first, seeded like the reads (in-group
reads included). Engine faults are recorded on the questions they hit when the decision can
absorb them (escalation or fallback), else raised.

Distribution math for one answer slot (`slot_stats`), for K labels and a row of
log-probabilities `lp`:

- every label id must be in the row: a missing one is a malformed row
  (`EngineResponseError`, which fails expensive like any engine fault), never filled in;
- `p = softmax(lp[labels])`, the distribution over labels only, then at temperature `T`
  `tempered(p, T) = softmax(ln p / T)` (T = 1: `p` itself);
- `label_mass = sum(exp(lp[labels]))`, how much of the model's mass fell on labels;
- `entropy = -sum(p ln p)` in nats; `normalized_entropy = entropy / ln K` (0 when K = 1);
- `margin = p(top) - p(second)`; `confidence = p(top)` (for several reads: the mean's), the
  gate's figure; an answer reports System One's (`system_one_confidence`).

`tempered`, `entropy` and `normalized_entropy` are the only implementations: calibration
(`canvasroute.router.calibration`) computes a row's figures with them from the T = 1
distribution the read reported, so a threshold certified at one row's entropy is the very float
the gate computes for that read, and a tie passes live as it passed in the calibration.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from canvasroute.engine import (
    CanvasRead,
    CanvasRouteError,
    DecisionError,
    EngineInfo,
    EngineResponseError,
    Thought,
)

from . import telemetry as tm
from ._plan import Chunk, Messages, Plan, Planner, Prompt, Route, Slot, messages
from ._questions import QuestionSpec, unrotate

if TYPE_CHECKING:
    from ._policy import GatePolicy
    from ._request import DecisionRequest

REREAD_STRIDE = 7919
"""Read k of a canvas uses noise seed `seed + 7919 k` (vLLM's gateway convention)."""
Race = Callable[[dict[str, "QuestionRead"], list[str], list[str], Callable[[], Coroutine[Any, Any, None]]],
                Awaitable[None]]
"""What a stage's re-reads run beside (`Hedging.race`): `race(reads, ids re-read, ids it may hedge,
the re-reads)`, done when the re-reads are (or were cancelled)."""


@dataclass(slots=True)
class QuestionRead:
    """Per-question canvas state while a decision is answered."""

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
    rereadable: bool = True
    """False when another read could not have changed this question's read (a causal readout's
    slot that sees no noisy position), so none was made: not for its samples, not as a re-read."""
    hedged: bool = False
    """The target was asked beside this question's re-reads (`Escalation.hedge`)."""

    def fail(self, exc: CanvasRouteError) -> None:
        self.error, self.fault = f"{type(exc).__name__}: {exc}", exc

    def gated(self, gate: GatePolicy) -> None:
        """Hold the read as it stands (`stats`) to its gate: the thresholds it crosses, and whether
        the abstain label won."""
        assert self.stats is not None
        self.crossed = tuple(gate.crossed(self.stats))
        self.abstained = self.spec.abstain and self.stats.top == len(self.spec.options) - 1


def build_canvas(chunk: Chunk, msgs: Messages, info: EngineInfo, seed: int, request: DecisionRequest,
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
                      label_ids=chunk.label_ids, constrained=request.constrained, steps=request.read.steps,
                      thought=thought.ids if thought is not None else None, images=request.state.images)


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
    """The canvas reads of one decision stage: first reads, per-chunk re-reads, in-group reads."""

    request: DecisionRequest
    engine: Any
    info: EngineInfo
    plan: Plan
    prompt: Prompt
    absorbs: Callable[[CanvasRouteError], bool]
    """Whether an engine fault is recorded on the questions (True) or raised (False)."""
    planner: Planner
    usage: dict[str, int]
    race: Race | None = None
    """The hedged escalation the re-reads race (`Escalation.hedge`; None: re-reads alone)."""
    canvas_reads: int = 0
    sent: list[int] = field(default_factory=list)
    """Reads sent per chunk so far (the next read's index k)."""
    thoughts: list[Thought] = field(default_factory=list)
    """The thought each chunk's reads continue (`ReadOptions.think`), in chunk order."""
    prompt_tokens: int = 0
    """Prompt tokens of the first read (0 when the engine reports none)."""

    @property
    def seed(self) -> int:
        return self.request.identity.seed

    async def run(self) -> dict[str, QuestionRead]:
        """Read, gate and re-read every question; returns each question's state."""
        gates = self.request.gates
        reads = {s.question_id: QuestionRead(self.plan.specs[s.question_id], c, s.labels, s.position,
                                             self.request.constrained)
                 for c, chunk in enumerate(self.plan.chunks) for s in chunk.slots if not s.shift}
        for qid, route in self.plan.routes.items():  # "group/option" labels, in option order
            reads[qid].labels = tuple(f"{g}/{route.labels[j]}" for g, members in zip(reads[qid].labels, route.groups)
                                      for j in range(len(members)))
        msgs = [messages(c, self.prompt.state_text, self.prompt.instructions) for c in self.plan.chunks]
        self.sent = [0] * len(self.plan.chunks)
        if self.request.read.think:
            thoughts = await self._think(msgs, reads, list(reads))
            if thoughts is None:
                return reads
            self.thoughts = thoughts
        fixed = self._fixed()
        samples = {qid: 1 if qid in fixed else gates[qid].samples for qid in reads}
        await self._jobs(self._jobs_for(reads, samples), msgs, reads, list(reads), "first", samples)
        for qid, r in reads.items():
            r.samples = len(r.runs)
            r.rereadable = qid not in fixed
        uncertain = {qid: gates[qid].rereads for qid, r in reads.items()
                     if r.error is None and self._wants_more(qid, r) and gates[qid].rereads}
        for qid in fixed.intersection(uncertain):
            del uncertain[qid]
        if uncertain:
            rereads = partial(self._jobs, self._jobs_for(reads, uncertain), msgs, reads, list(uncertain), "reread",
                              uncertain)
            if self.race is None:
                await rereads()
            else:  # a two-read question's first read is not its distribution: never hedged
                await self.race(reads, list(uncertain), [q for q in uncertain if q not in self.plan.routes], rereads)
        await self._in_group(reads)
        for qid in self.plan.routes:
            if reads[qid].error is not None:  # a group distribution is no distribution over the options
                reads[qid].stats = None
        texts: dict[int, str] = {}  # each policy's text made once (most questions share the model's policy)
        for qid, r in reads.items():
            policy = gates[qid]
            if r.runs:
                r.gate = texts.get(id(policy)) or texts.setdefault(id(policy), policy.gate_text)
        return reads

    def _wants_more(self, qid: str, r: QuestionRead) -> bool:
        """Re-read: the gate did not pass it, or its first read is above `reread_above` nats."""
        above = self.request.gates[qid].reread_above
        return bool(r.crossed) or (above is not None and bool(r.runs) and r.runs[0].entropy > above)

    def _fixed(self) -> set[str]:
        """Questions another read cannot change. Noise sits at the slots, so under a causal readout
        (`EngineInfo.causal_readout`) a slot sees fresh noise only from the slots before it in its
        canvas: a question none of whose slots has one would read the same distribution again."""
        if not self.info.causal_readout:
            return set()
        varies: set[str] = set()
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
        batch = [build_canvas(self.plan.chunks[c], msgs[c], self.info, self.seed + REREAD_STRIDE * k, self.request,
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
        gates = self.request.gates
        for qid in hit:
            r = reads[qid]
            if r.runs and r.error is None:
                r.stats = aggregate(r.runs)
                r.gated(gates[qid])

    async def _think(self, msgs: Sequence[Messages], reads: dict[str, QuestionRead],
                     hit: Sequence[str]) -> list[Thought] | None:
        """A thought per prompt, seeded by the decision (None when an engine fault was recorded on `hit`)."""
        try:
            thoughts = await write_thoughts(self.engine, msgs, self.request.read.think, self.seed)
        except CanvasRouteError as exc:
            if not self.absorbs(exc):
                raise
            for qid in hit:
                reads[qid].fail(exc)
            return None
        for t in thoughts:
            self.usage["input_tokens"] += t.prompt_tokens
            self.usage["output_tokens"] += len(t.ids)
        return thoughts

    async def _in_group(self, reads: dict[str, QuestionRead]) -> None:
        """The second read of each routed question: the option within its most likely group
        (continuing a thought of its own prompt, with `think`)."""
        routed = [(qid, route) for qid, route in self.plan.routes.items()
                  if reads[qid].error is None and reads[qid].stats is not None]
        if not routed:
            return
        think = bool(self.request.read.think)
        member_plans = [await self.planner.member(self.plan, qid, reads[qid].stats.top, think)  # type: ignore[union-attr]
                        for qid, _ in routed]
        chunks = [p.chunks[0] for p in member_plans]
        msgs = [messages(c, self.prompt.state_text, self.prompt.instructions) for c in chunks]
        thoughts: list[Thought] | None = None
        if think:
            thoughts = await self._think(msgs, reads, [qid for qid, _ in routed])
            if thoughts is None:
                return
            self.thoughts += thoughts
        batch = [build_canvas(c, m, self.info, self.seed, self.request, thoughts[i] if thoughts else None)
                 for i, (c, m) in enumerate(zip(chunks, msgs, strict=True))]
        try:
            stats = await self._read(batch, chunks, "in_group")
        except CanvasRouteError as exc:
            if not self.absorbs(exc):
                raise
            for qid, _ in routed:
                reads[qid].fail(exc)
            return
        gates = self.request.gates
        for (qid, route), (within,) in zip(routed, stats, strict=True):
            r = reads[qid]
            assert r.stats is not None
            r.stats = combine(r.stats, route, r.stats.top, within)
            r.in_group_reads = 1
            r.gated(gates[qid])

    async def _read(self, batch: Sequence[CanvasRead], chunks: Sequence[Chunk], kind: str) -> list[list[SlotStats]]:
        """One engine call; returns stats per canvas, in slot order."""
        self.canvas_reads += len(batch)  # sent, whether or not the engine answers
        gates = self.request.gates
        with tm.engine_call(self.info, batch, kind, self.seed) as call:
            results = await self.engine.read(batch)
            if len(results) != len(batch):
                raise EngineResponseError(f"the engine returned {len(results)} results for {len(batch)} canvases")
            tokens_in = sum(r.prompt_tokens for r in results)
            tokens_out = sum(r.completion_tokens for r in results)
            call.read(tokens_in, tokens_out, chunks, results, self.plan.specs)
        self.usage["input_tokens"] += tokens_in
        self.usage["output_tokens"] += tokens_out
        self.prompt_tokens = self.prompt_tokens or results[0].prompt_tokens
        out = []
        for chunk, result in zip(chunks, results, strict=True):
            if len(result.rows) != len(chunk.slots):
                raise EngineResponseError(f"the engine returned {len(result.rows)} slot rows for "
                                          f"{len(chunk.slots)} slots")
            out.append([slot_stats(row, s.label_ids, gates[s.question_id].temperature)
                        for row, s in zip(result.rows, chunk.slots, strict=True)])
        return out


# -- distributions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotStats:
    """Probabilities over one slot's labels and the figures the gate reads (computed once)."""

    probs: tuple[float, ...]
    label_mass: float
    reads: int = 1
    agreement: float | None = None
    """Share of reads whose argmax equals the final answer (re-reads only)."""
    stderr: float | None = None
    """Standard error of the chosen label's probability across reads (re-reads only)."""
    argmax_is_label: bool | None = None
    """Whether the row's most likely token was one of the labels (of the first read)."""
    top: int = field(init=False, compare=False, repr=False)
    """Index of the most likely label (the first, on a tie)."""
    confidence: float = field(init=False, compare=False, repr=False)
    """The probability of the chosen label (for several reads: the mean's)."""
    entropy: float = field(init=False, compare=False, repr=False)
    normalized_entropy: float = field(init=False, compare=False, repr=False)
    margin: float = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        probs, put = self.probs, object.__setattr__
        h = entropy(probs)
        best = max(probs)
        top = probs.index(best)  # the first, on a tie
        k = len(probs)
        put(self, "top", top)
        put(self, "confidence", best)
        put(self, "entropy", h)
        put(self, "normalized_entropy", _over_ln_k(h, k))
        put(self, "margin", best - max(probs[:top] + probs[top + 1:]) if k > 1 else 1.0)


def entropy(probs: Sequence[float]) -> float:
    """`-sum(p ln p)` in nats (the one implementation: the gate's and calibration's)."""
    log = math.log
    return -sum([p * log(p) for p in probs if p > 0.0])


def _over_ln_k(h: float, k: int) -> float:
    return h / math.log(k) if k > 1 else 0.0


def normalized_entropy(probs: Sequence[float]) -> float:
    """Entropy over ln K (0 = certain, 1 = uniform; 0 when K = 1): `SlotStats.normalized_entropy`."""
    return _over_ln_k(entropy(probs), len(probs))


def tempered(probs: Sequence[float], temperature: float) -> tuple[float, ...]:
    """`softmax(ln p / T)`: the distribution at temperature T (T = 1: `probs` as they are; a zero
    stays zero). The one implementation: the gate tempers a read with it, calibration its rows."""
    if temperature == 1.0:
        return tuple(probs)
    log, exp, inf = math.log, math.exp, math.inf
    logs = [log(p) if p > 0.0 else -inf for p in probs]
    top = max(logs)
    weights = [exp((x - top) / temperature) for x in logs]
    total = sum(weights)
    return tuple([w / total for w in weights])



def system_one_confidence(p: float, k: int) -> float:
    """System One's confidence in an answer of probability `p` among `k` options: how far the
    answer stands above an even guess, `clip((p - 1/k) / (1 - 1/k), 0, 1)`.

    TypeSafe documents a Choice's and a Score's confidence as derived from the distribution, lower
    the flatter it is; this is the formula its answers follow (read back from them by its
    clients: docs/wire-format.md §6). canvasroute reports it on the library's answers and on
    `/v1/systemone`, for a Choice and a Score, and for a yes/no answer where one is reported
    (`|2p - 1|`). It is 0 at an even distribution and 1 when the answer has all the mass. Not the
    gate's `SlotStats.confidence` (`ReadReport.confidence`), which is the canvas's top probability.

    Example:
        ```python
        system_one_confidence(0.7, 4)   # 0.6
        system_one_confidence(0.5, 2)   # 0.0
        ```
    """
    if k < 2:
        return 1.0
    return min(1.0, max(0.0, (p - 1.0 / k) / (1.0 - 1.0 / k)))


def slot_stats(row: Mapping[int, float], label_ids: Sequence[int], temperature: float = 1.0) -> SlotStats:
    """Label-normalized probabilities from one row of log-probabilities, at `temperature`
    (`tempered` of the T = 1 distribution)."""
    if not temperature > 0.0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    try:
        lps = [row[i] for i in label_ids]
    except KeyError as exc:
        raise EngineResponseError(f"a slot row lacks label id {exc.args[0]} (a row must hold every requested "
                                  "label id)") from None
    exp = math.exp
    mass = sum([exp(lp) for lp in lps])  # before the all--inf case below: that mass is 0
    top = max(lps)
    if top == -math.inf:
        lps, top = [0.0] * len(lps), 0.0
    weights = [exp(lp - top) for lp in lps]
    total = sum(weights)
    probs = tuple([w / total for w in weights])  # at T = 1: what a read reports, and calibration's rows hold
    return SlotStats(probs if temperature == 1.0 else tempered(probs, temperature), min(1.0, mass),
                     argmax_is_label=max(row, key=row.__getitem__) in label_ids)


def aggregate(reads: Sequence[SlotStats]) -> SlotStats:
    """Mean distribution over several reads of one slot, with agreement and stderr."""
    if len(reads) == 1:
        return reads[0]
    n, k = len(reads), len(reads[0].probs)
    mean = tuple(sum(r.probs[j] for r in reads) / n for j in range(k))
    top = max(range(k), key=mean.__getitem__)
    agreement = sum(r.top == top for r in reads) / n
    tops = [r.probs[top] for r in reads]
    mu = sum(tops) / n
    stderr = math.sqrt(sum((x - mu) ** 2 for x in tops) / (n - 1) / n)
    mass = sum(r.label_mass for r in reads) / n
    return SlotStats(mean, mass, reads=n, agreement=agreement, stderr=stderr,
                     argmax_is_label=reads[0].argmax_is_label)


# -- thoughts ------------------------------------------------------------------------------


async def write_thoughts(engine: Any, prompts: Sequence[Sequence[Mapping[str, str]]], budget: int,
                         seed: int) -> list[Thought]:
    """One thought of up to `budget` tokens per prompt, written concurrently, seeded (`seed`) so
    the same decision writes the same thought (the engine's `think`: `VLLMServerEngine.think`)."""
    think = getattr(engine, "think", None)
    if think is None:
        raise DecisionError(f"think needs an engine that can write a thought; {type(engine).__name__} cannot",
                            hint="use VLLMServerEngine")
    return list(await asyncio.gather(*(think(msgs, budget, seed=seed) for msgs in prompts)))
