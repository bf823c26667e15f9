"""`CanvasDecisionModel`: a decision set becomes one canvas read, gated and escalated."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.decisions import (
    BaseDecisionModel,
    Choice,
    ChoiceAnswer,
    ClassifierRequest,
    Noul,
    NoulAnswer,
    Score,
    ScoreAnswer,
)
from langchain_core.decisions.base import _record_usage
from langchain_core.messages import BaseMessage
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from engine import (
    SPECIAL_CANDIDATES,
    BudgetExhausted,
    CanvasRead,
    CanvasRouteError,
    DecisionError,
    Engine,
    EngineInfo,
    EngineResponseError,
    EscalationError,
    InputTooLong,
    defuse,
    run_sync,
)

from . import telemetry as tm
from ._distribution import SlotStats, aggregate, slot_stats
from ._escalation import Escalated, escalate, is_target, target_name
from ._budget import BudgetMeter
from ._policy import EscalationBudget, GatePolicy
from ._schema import Chunk, Plan, QuestionSpec, parse_questions, plan
from ._types import CanvasResponse, ReadReport

REREAD_STRIDE = 7919
"""Read k of a canvas uses noise seed `seed + 7919 k` (vLLM's gateway convention)."""


@dataclass(slots=True)
class _Read:
    """Per-question canvas state while a decision set is answered."""

    spec: QuestionSpec
    chunk: int
    labels: tuple[str, ...]
    runs: list[SlotStats]
    stats: SlotStats | None = None
    crossed: tuple[str, ...] = ()
    error: str | None = None
    fault: CanvasRouteError | None = None
    """The engine fault behind `error`, re-raised when no escalation or fallback covers it."""


class CanvasDecisionModel(BaseDecisionModel):
    """Answers Noul, Choice and Score questions with one DiffusionGemma canvas read.

    The questions about one state go into one canvas (split into chunks only when they
    do not fit), one denoising pass returns a distribution per answer slot, and the gate
    decides per question: answer, re-read with fresh noise, or escalate to `escalate_to`.
    Engine faults fail expensive: escalate (default), raise, or a declared fallback label.

    Request keys beyond `state` and `questions`: `seed` (int, the noise seed; default a
    hash of state and questions, so identical requests read identically), `thread_id`
    (for per-thread escalation budgets), `policy` (a `GatePolicy` for this request) and
    `attributes` (extra span attributes, e.g. the graph node).

    Example:
        ```python
        model = CanvasDecisionModel(engine=VLLMServerEngine("http://127.0.0.1:8000"),
                                    policy=GatePolicy(max_normalized_entropy=0.5))
        resp = model.invoke({"state": "Refund me now!", "questions": {
            "team": Choice(instructions="Which team?", criteria={"billing": None, "tech": None})}})
        resp.answers["team"].choice, resp.reads["team"].path
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any
    """The engine that reads canvases (`VLLMServerEngine`, `TransformersEngine`, ...)."""
    model: str = "canvas"
    """Reported model name; replaced by the engine's served model on first use."""
    policy: GatePolicy = Field(default_factory=GatePolicy)
    """Thresholds and re-reads."""
    escalate_to: Any = None
    """`BaseChatModel`, `Runnable` or `BaseDecisionModel` for uncertain questions."""
    budget: EscalationBudget | None = None
    """Cap on escalations (None: unbounded)."""
    on_engine_error: Literal["escalate", "raise", "fallback"] = "escalate"
    """What an engine fault does: escalate every question, raise, or use `fallback`."""
    fallback: dict[str, str] = Field(default_factory=dict)
    """Fallback option per question id (for `on_engine_error="fallback"` and budgets)."""
    constrained: bool = False
    """Ask the engine to normalize each row over the request's label ids (the union over all
    slots of a canvas): label mass is then 1 for a lone question, a share for several."""
    escalation_timeout: float = 60.0
    """Seconds one escalation call may take."""

    _plans: OrderedDict[str, Plan] = PrivateAttr(default_factory=OrderedDict)
    _parsed: OrderedDict[str, dict[str, QuestionSpec]] = PrivateAttr(default_factory=OrderedDict)
    _meter: BudgetMeter | None = PrivateAttr(default=None)

    @field_validator("escalate_to")
    @classmethod
    def _check_target(cls, value: Any) -> Any:
        if value is not None and not is_target(value):
            raise ValueError(f"escalate_to must be a chat model, Runnable or decision model, not {type(value)!r}")
        return value

    def model_post_init(self, context: Any) -> None:
        if not isinstance(self.engine, Engine):
            raise TypeError(f"engine must implement engine.Engine, got {type(self.engine).__name__}")
        if self.budget is not None:
            self._meter = BudgetMeter(self.budget)
        if self.on_engine_error == "fallback" and not self.fallback:
            raise ValueError("on_engine_error='fallback' needs fallback={question id: option}")

    @property
    def _provider(self) -> str:
        return "canvasroute"

    @property
    def budget_counters(self) -> dict[str, int]:
        """Escalations granted and refused by the budget (empty without a budget)."""
        return self._meter.snapshot() if self._meter else {}

    # -- BaseDecisionModel --------------------------------------------------------------

    def _classify(self, state: Any, questions: dict[str, Any]) -> CanvasResponse:
        return run_sync(self.decide(state, questions))

    async def _aclassify(self, state: Any, questions: dict[str, Any]) -> CanvasResponse:
        return await self.decide(state, questions)

    # The request-level hooks are overridden (not `_classify`) so request keys beyond state and
    # questions (seed, thread_id, policy, attributes) reach `decide`; usage still goes to LangSmith.
    def _classify_and_record(self, request: ClassifierRequest) -> CanvasResponse:
        return _record_usage(run_sync(self._adecide_request(request)))

    async def _aclassify_and_record(self, request: ClassifierRequest) -> CanvasResponse:
        return _record_usage(await self._adecide_request(request))

    async def _adecide_request(self, request: Mapping[str, Any]) -> CanvasResponse:
        if not isinstance(request, Mapping) or "state" not in request or "questions" not in request:
            raise DecisionError("a decision request is {'state': ..., 'questions': {...}}")
        return await self.decide(request["state"], request["questions"], seed=request.get("seed"),
                                 thread_id=request.get("thread_id"), policy=request.get("policy"),
                                 attributes=request.get("attributes"))

    # -- the decision ------------------------------------------------------------------

    async def decide(self, state: Any, questions: Mapping[str, Any], *, seed: int | None = None,
                     thread_id: str | None = None, policy: GatePolicy | None = None,
                     attributes: Mapping[str, Any] | None = None) -> CanvasResponse:
        """Answer every question about `state`: read, gate, re-read, escalate."""
        start = time.perf_counter()
        policy = policy or self.policy
        key, specs = self._specs(questions)
        for qid, option in self.fallback.items():
            if qid in specs and option not in specs[qid].options:
                raise DecisionError(f"fallback {option!r} is not an option of {qid!r}")
        fault: CanvasRouteError | None = None
        try:
            info: EngineInfo | None = await self.engine.info()
        except CanvasRouteError as exc:  # engine down before anything could be read
            if not self._absorbs(exc):
                raise
            info, fault = None, exc
        if info is not None:
            self.model = info.model
        model_name = self.model
        state_text = render_state(state, info.special_tokens if info is not None else None)
        attrs = {tm.DECISION_SET: ",".join(specs), tm.QUESTIONS: len(specs), **(attributes or {})}
        if tm.record_content():
            attrs[tm.STATE_CONTENT] = state_text
        with tm.span(f"decide {model_name}", attrs) as span:
            usage = {"input_tokens": 0, "output_tokens": 0}
            if info is not None:
                try:
                    the_plan = await self._plan(key, specs)
                    messages = [_messages(c, state_text) for c in the_plan.chunks]
                    await _check_length(self.engine, info, the_plan.chunks, messages)
                except CanvasRouteError as exc:
                    if not self._absorbs(exc):
                        raise
                    fault = exc
            if fault is None:
                assert info is not None
                if seed is None:
                    seed = _default_seed(state_text, the_plan)
                reads = {s.question_id: _Read(specs[s.question_id], c, s.labels, [])
                         for c, chunk in enumerate(the_plan.chunks) for s in chunk.slots}
                canvas_reads = await self._first_reads(info, the_plan, messages, seed, reads, usage, policy)
                canvas_reads += await self._rereads(info, the_plan, messages, seed, reads, usage, policy)
            else:  # every question goes down the escalation/fallback path, none is answered from nothing
                reads = {qid: _Read(spec, -1, (), [], error=f"{type(fault).__name__}: {fault}", fault=fault)
                         for qid, spec in specs.items()}
                canvas_reads = 0
            escalated = await self._escalate(state, state_text, reads, usage, thread_id)
            reports = [self._report(r, escalated) for r in reads.values()]
            latency = time.perf_counter() - start
            reports = [r.model_copy(update={"latency_s": latency}) for r in reports]
            span.set_attribute(tm.CANVAS_READS, canvas_reads)
            tm.record_reports(span, reports, latency, model_name, policy, attrs)
        return CanvasResponse(
            model=model_name,
            answers={r.question_id: _answer(specs[r.question_id], r) for r in reports},
            reads={r.question_id: r for r in reports},
            usage=usage,
            canvas_reads=canvas_reads,
            latency_s=latency,
        )

    def _specs(self, questions: Mapping[str, Any]) -> tuple[str, dict[str, QuestionSpec]]:
        """Parsed questions and their cache key; a question set seen before is not re-parsed."""
        key = _questions_key(questions)
        if key is None or key not in self._parsed:
            specs = parse_questions(questions)
            key = key or json.dumps({qid: s.question.model_dump(mode="json") for qid, s in specs.items()})
            _remember(self._parsed, key, specs)
        self._parsed.move_to_end(key)
        return key, self._parsed[key]

    async def _plan(self, key: str, specs: Mapping[str, QuestionSpec]) -> Plan:
        if key not in self._plans:
            _remember(self._plans, key, await plan(self.engine, specs))
        self._plans.move_to_end(key)
        return self._plans[key]

    async def _read(self, info: EngineInfo, the_plan: Plan, jobs: Sequence[tuple[int, int]],
                    messages: Sequence[tuple[Mapping[str, str], ...]], seed: int, kind: str,
                    usage: dict[str, int], policy: GatePolicy) -> list[list[SlotStats]]:
        """One engine call reading (chunk, k) pairs; returns stats per job, in slot order."""
        batch = [_canvas(the_plan.chunks[c], messages[c], info, seed + REREAD_STRIDE * k, self.constrained)
                 for c, k in jobs]
        with tm.engine_call(info, batch, kind) as call:
            results = await self.engine.read(batch)
            if len(results) != len(batch):
                raise EngineResponseError(f"the engine returned {len(results)} results for {len(batch)} canvases")
            tokens_in = sum(r.prompt_tokens for r in results)
            tokens_out = sum(r.completion_tokens for r in results)
            call.usage(tokens_in, tokens_out, results)
        usage["input_tokens"] += tokens_in
        usage["output_tokens"] += tokens_out
        out = []
        for (c, _), result in zip(jobs, results, strict=True):
            slots = the_plan.chunks[c].slots
            if len(result.rows) != len(slots):
                raise EngineResponseError(f"the engine returned {len(result.rows)} slot rows for {len(slots)} slots")
            out.append([slot_stats(row, s.label_ids, policy.for_question(s.question_id).temperature)
                        for row, s in zip(result.rows, slots, strict=True)])
        return out

    async def _first_reads(self, info: EngineInfo, the_plan: Plan, messages: Any, seed: int,
                           reads: dict[str, _Read], usage: dict[str, int], policy: GatePolicy) -> int:
        jobs = [(c, 0) for c in range(len(the_plan.chunks))]
        try:
            stats = await self._read(info, the_plan, jobs, messages, seed, "first", usage, policy)
        except CanvasRouteError as exc:
            if not self._absorbs(exc):
                raise
            for r in reads.values():
                r.error, r.fault = f"{type(exc).__name__}: {exc}", exc
            return len(jobs)
        self._collect(the_plan, jobs, stats, reads, policy)
        return len(jobs)

    async def _rereads(self, info: EngineInfo, the_plan: Plan, messages: Any, seed: int,
                       reads: dict[str, _Read], usage: dict[str, int], policy: GatePolicy) -> int:
        """Re-read the chunks holding an uncertain question: k times each, k the largest
        `rereads` among their uncertain questions. Each uncertain question keeps its own
        first `rereads` re-reads; questions the gate passed keep their first read."""
        uncertain = {r.spec.id: policy.for_question(r.spec.id).rereads for r in reads.values()
                     if r.error is None and r.crossed and policy.for_question(r.spec.id).rereads}
        if not uncertain:
            return 0
        chunks = sorted({reads[qid].chunk for qid in uncertain})
        jobs = [(c, n) for c in chunks for n in range(1, max(uncertain.values()) + 1)]
        try:
            stats = await self._read(info, the_plan, jobs, messages, seed, "reread", usage, policy)
        except CanvasRouteError as exc:
            if not self._absorbs(exc):
                raise
            for qid in uncertain:
                reads[qid].error, reads[qid].fault = f"{type(exc).__name__}: {exc}", exc
            return len(jobs)
        self._collect(the_plan, jobs, stats, reads, policy, uncertain)
        return len(jobs)

    def _collect(self, the_plan: Plan, jobs: Sequence[tuple[int, int]], stats: Sequence[Sequence[SlotStats]],
                 reads: dict[str, _Read], policy: GatePolicy, only: Mapping[str, int] | None = None) -> None:
        """Add each job's slot stats to its question and gate again on the aggregate.

        `only` (re-reads): question id -> re-reads it asked for; other questions are left alone.
        """
        for (c, n), chunk_stats in zip(jobs, stats, strict=True):
            for slot, st in zip(the_plan.chunks[c].slots, chunk_stats, strict=True):
                if only is None or n <= only.get(slot.question_id, 0):
                    reads[slot.question_id].runs.append(st)
        for r in reads.values():
            if r.runs and r.error is None and (only is None or r.spec.id in only):
                r.stats = aggregate(r.runs)
                r.crossed = tuple(policy.for_question(r.spec.id).crossed(r.stats))

    def _absorbs(self, exc: CanvasRouteError) -> bool:
        """Whether an engine fault goes to escalation or the fallback label instead of raising.

        Misuse (`DecisionError`) always raises; so does a fault with nowhere expensive to go.
        """
        if isinstance(exc, DecisionError) or self.on_engine_error == "raise":
            return False
        return self.escalate_to is not None or self.on_engine_error == "fallback"

    async def _escalate(self, state: Any, state_text: str, reads: dict[str, _Read],
                        usage: dict[str, int], thread_id: str | None) -> Escalated | None:
        # engine faults first: under a partial budget they are the ones that cannot keep a canvas answer
        wanted = sorted((r for r in reads.values() if r.error is not None or r.crossed), key=lambda r: r.error is None)
        if self.on_engine_error == "fallback":
            wanted = [r for r in wanted if r.error is None]  # faults take the fallback label
        if not wanted or self.escalate_to is None:
            return None
        granted = self._meter.take(len(wanted), thread_id) if self._meter else len(wanted)
        if granted < len(wanted):
            spent = wanted[granted:]
            if self.budget and self.budget.when_spent == "raise":
                raise BudgetExhausted(f"escalation budget spent; {len(spent)} question(s) could not escalate",
                                      hint="raise the budget, or set when_spent='keep' or 'fallback'")
            for r in spent:
                if r.error is not None and (self.budget is None or self.budget.when_spent == "keep"):
                    raise BudgetExhausted(f"engine failed ({r.error}) and the escalation budget is spent",
                                          hint="an engine fault never becomes a cheap answer")
            wanted = wanted[:granted]
            for r in spent:
                r.crossed = (*r.crossed, "over_budget")
        if not wanted:
            return None
        canvas = {r.spec.id: _named(r.spec, r.stats) if r.stats else None for r in wanted}
        name = target_name(self.escalate_to)
        with tm.escalation_call(self.escalate_to, name, list(canvas)) as call:
            try:
                result = await asyncio.wait_for(
                    escalate(self.escalate_to, state_text, state, [r.spec for r in wanted], canvas),
                    self.escalation_timeout)
            except TimeoutError as exc:
                raise EscalationError(f"escalation to {name} timed out after {self.escalation_timeout}s",
                                      retryable=True) from exc
            call.usage(result.usage.get("input_tokens", 0), result.usage.get("output_tokens", 0))
        for key in ("input_tokens", "output_tokens"):
            usage[key] += result.usage.get(key, 0)
        return result

    def _report(self, r: _Read, escalated: Escalated | None) -> ReadReport:
        spec, st = r.spec, r.stats
        canvas = _named(spec, st) if st else None
        base: dict[str, Any] = dict(
            question_id=spec.id, kind=spec.kind, labels=list(r.labels), canvas_probabilities=canvas,
            reads=len(r.runs), error=r.error, crossed=[c for c in r.crossed if c != "over_budget"],
            over_budget="over_budget" in r.crossed,
        )
        if st is not None:
            base.update(entropy=st.entropy, normalized_entropy=st.normalized_entropy, margin=st.margin,
                        label_mass=st.label_mass, confidence=st.confidence, agreement=st.agreement,
                        stderr=st.stderr)
        if escalated is not None and spec.id in escalated.answers:
            answer = escalated.answers[spec.id]
            probs = escalated.probabilities.get(spec.id) or {o: float(o == answer) for o in spec.options}
            return ReadReport(answer=answer, probabilities=probs, path="escalated", confident=False,
                              escalation_model=escalated.model, **base)
        over_budget = base["over_budget"] and self.budget is not None and self.budget.when_spent == "fallback"
        if st is None or over_budget or (r.fault is not None and self.on_engine_error == "fallback"):
            if spec.id not in self.fallback:
                if over_budget:
                    raise BudgetExhausted(f"question {spec.id!r} could not escalate (budget spent) and has no "
                                          "fallback option", hint="add it to fallback=") from r.fault
                assert r.fault is not None
                raise r.fault  # an engine fault never becomes a cheap answer
            answer = self.fallback[spec.id]
            return ReadReport(answer=answer, probabilities={o: float(o == answer) for o in spec.options},
                              path="fallback", confident=False, **base)
        path = "reread" if len(r.runs) > 1 else "canvas"
        return ReadReport(answer=spec.options[st.top], probabilities=canvas, path=path,
                          confident=not r.crossed, **base)


# -- helpers ---------------------------------------------------------------------------


def render_state(state: Any, special_tokens: Sequence[str] | None = None) -> str:
    """The user message: a string as is, messages as a transcript, anything else as JSON.

    Every special-token text of the engine's tokenizer (`EngineInfo.special_tokens`;
    default: the texts `engine` probes servers for) is defused with a zero-width space, so
    a state cannot close the turn or forge template tokens.
    """
    if isinstance(state, str):
        text = state
    elif isinstance(state, BaseMessage):
        text = f"{state.type}: {state.text}"
    elif isinstance(state, Sequence) and state and all(isinstance(m, BaseMessage) for m in state):
        text = "\n".join(f"{m.type}: {m.text}" for m in state)
    else:
        text = json.dumps(state, ensure_ascii=False, default=_jsonable, sort_keys=False)
    return defuse(text, special_tokens or SPECIAL_CANDIDATES)


def _questions_key(questions: Any) -> str | None:
    """A cheap exact key for a question set (pydantic's JSON of each question), or None
    when the input is not a mapping of question models (it is parsed first, then keyed)."""
    if not isinstance(questions, Mapping) or not questions:
        return None
    parts = []
    for qid, q in questions.items():
        if not isinstance(q, (Noul, Choice, Score)) or not isinstance(qid, str):
            return None
        parts.append(f"{json.dumps(qid)}:{q.model_dump_json()}")
    return "{" + ",".join(parts) + "}"


def _remember(cache: OrderedDict[str, Any], key: str, value: Any, size: int = 256) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseMessage):
        return {"role": value.type, "content": value.text}
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    raise TypeError(f"state holds a {type(value).__name__}, which is not JSON")


def _messages(chunk: Chunk, state_text: str) -> tuple[Mapping[str, str], ...]:
    return ({"role": "system", "content": chunk.system}, {"role": "user", "content": state_text})


def _default_seed(state_text: str, the_plan: Plan) -> int:
    blob = state_text + "\x00" + "\x00".join(c.system for c in the_plan.chunks)
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "big")


def _canvas(chunk: Chunk, messages: tuple[Mapping[str, str], ...], info: EngineInfo, seed: int,
            constrained: bool) -> CanvasRead:
    """Template + pad to the chunk width, with a random non-label id at every slot."""
    rng = random.Random(seed)
    canvas = list(chunk.template) + [info.pad_id] * (chunk.width - len(chunk.template))
    for slot in chunk.slots:
        avoid = set(slot.label_ids) | {info.pad_id}
        noise = rng.randrange(info.vocab_size)
        while noise in avoid:
            noise = rng.randrange(info.vocab_size)
        canvas[slot.position] = noise
    return CanvasRead(messages=messages, canvas=tuple(canvas), slots=tuple(s.position for s in chunk.slots),
                      label_ids=chunk.label_ids, constrained=constrained)


async def _check_length(engine: Engine, info: EngineInfo, chunks: Sequence[Chunk],
                        messages: Sequence[tuple[Mapping[str, str], ...]]) -> None:
    """Refuse before any read when prompt + canvas exceed the model's context.

    A token covers at least one UTF-8 byte, so a byte count bounds the prompt cheaply;
    only prompts near the limit are tokenized exactly.
    """
    for chunk, msgs in zip(chunks, messages, strict=True):
        budget = info.max_model_len - chunk.width
        if info.chat_overhead + sum(len(m["content"].encode()) for m in msgs) <= budget:
            continue
        n = await engine.count_prompt(msgs)
        if n > budget:
            raise InputTooLong(f"prompt of {n} tokens + canvas of {chunk.width} exceed the model's "
                               f"{info.max_model_len}-token context",
                               hint="shorten the state or ask fewer questions per node")


def _named(spec: QuestionSpec, st: SlotStats) -> dict[str, float]:
    return dict(zip(spec.options, st.probs, strict=True))


def _answer(spec: QuestionSpec, report: ReadReport) -> NoulAnswer | ChoiceAnswer | ScoreAnswer:
    """The langchain-core answer for one report."""
    probs = report.probabilities
    if spec.kind == "noul":
        return NoulAnswer(type="noul", noul=min(1.0, max(0.0, probs.get("yes", 0.0))))
    confidence = min(1.0, max(0.0, probs.get(report.answer, 0.0)))
    if spec.kind == "choice":
        return ChoiceAnswer(type="choice", choice=report.answer, probabilities=dict(probs), confidence=confidence)
    by_level = {int(k): v for k, v in probs.items()}
    return ScoreAnswer(type="score", score=sum(i * p for i, p in by_level.items()),
                       legend=dict(enumerate(spec.question.criteria)), probabilities=by_level,
                       confidence=confidence)
