"""One decision run: a `DecisionRequest` read stage by stage, gated, escalated and reported.

The stages, each taking the request: look up the engine (`info`), the decision cache, the
length check of every read a plan can send, then per dependency stage the plan, the reads
(`Reading`), the escalation of what the gate did not pass, and one report per question.

The outcome rules, one per cause (`OutcomePolicy`), in order: a canvas answer the gate
passes stands; a question the engine failed for (`engine_fault`), whose abstain label won
(`abstained`) or that stayed uncertain (`uncertain`) takes its cause's action: escalate
while the budget grants it (engine faults first), else `over_budget` decides; `answer`,
`fallback`, `raise` or `review`. An engine fault never becomes a cheap answer: it
escalates, takes a declared fallback, or raises; when its escalation fails too, the error
names both and keeps the engine's attempts. Every budget grant that does not become an
escalation is refunded, except a hedge's that the re-reads beat (`Escalation.hedge`: a
target call beside a borderline question's re-reads, `canvasroute.router._hedge`). Every
absorbed fault is logged (WARNING, logger `canvasroute.router`), marked on the `decide` span
and counted (`canvasroute.faults`).
An escalation-rate controller (`canvasroute.router._control`) sets the thresholds at the start
of a run and observes its outcomes at the end; live certification (`canvasroute.router._audit`)
sets its certified thresholds before it, and at the end takes the sampled answers' rows (free
labels now, audits in the background).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from langchain_core.decisions import ChoiceAnswer, NoulAnswer, ScoreAnswer

from canvasroute.engine import (
    SPECIAL_CANDIDATES,
    BreakerOpen,
    BudgetExhausted,
    CanvasRouteError,
    DecisionError,
    EngineInfo,
    EscalationError,
    UnsureAnswer,
    defuse,
)

from . import _audit as live
from . import telemetry as tm
from ._breaker import watched
from ._control import observe, steer
from ._escalation import Asked, Calls, Escalated, Restated, escalate, target_name
from ._hedge import Hedging, cancel, joined
from ._plan import Plan, Planner, Prompt
from ._policy import Breaker
from ._questions import QuestionSpec
from ._read import QuestionRead, Reading, SlotStats, system_one_confidence
from ._request import DecisionRequest
from ._state import check_images
from ._types import CanvasResponse, Cause, Diagnostics, ReadReport, ThoughtReport

__all__ = ["Decision"]

logger = logging.getLogger("canvasroute.router")


@dataclass(slots=True)
class Decision:
    """One request run against one engine (what `CanvasDecisionModel.arun` does)."""

    request: DecisionRequest
    engine: Any
    planner: Planner
    cache: Any
    """The model's `DecisionCache` (None: every call reads)."""
    name: str
    """The model's name, for spans when the engine cannot say its own."""
    notices: set[str] = field(default_factory=set)
    """The model's warnings given so far (each is given once per model)."""
    ticket: Any = None
    """A sampled decision's audit slot (live certification), until its end hands it on or back."""
    live_fault: Exception | None = None
    """The fault that kept live certification's shared state from refreshing at the start (None: none)."""

    def absorbs(self, exc: CanvasRouteError) -> bool:
        """Whether an engine fault goes to escalation or a fallback instead of raising.

        Misuse (`DecisionError`) always raises; so does a fault with nowhere expensive to go.
        """
        request = self.request
        if isinstance(exc, DecisionError) or request.mode == "canvas_only":
            return False
        action = request.outcomes.engine_fault
        return action == "fallback" or (action == "escalate" and request.escalation is not None)

    async def run(self) -> CanvasResponse:
        escalation = self.request.escalation
        if escalation is not None and escalation.audit is not None and self.request.mode != "canvas_only":
            return await self._audited()
        return await self._run()

    async def _audited(self) -> CanvasResponse:
        """`_run` under live certification: its certified thresholds set first (the controller steers
        on top), the audit coin drawn, and its slot given back however the run ends."""
        self.request, ticket, self.live_fault = await live.steer(self.request)
        self.ticket = ticket
        try:
            return await self._run()
        finally:
            if self.ticket is not None:
                self.ticket.release()

    async def _run(self) -> CanvasResponse:
        start = time.perf_counter()
        refresh_fault = None
        if self.request.escalation is not None and self.request.escalation.controller is not None:
            # the controller's thresholds, once: every stage and the cache key see them
            self.request, refresh_fault = await steer(self.request)
        request, specs = self.request, self.request.questions.specs
        fault: CanvasRouteError | None = None
        info: EngineInfo | None = None
        try:
            info = await self.engine.info()
        except CanvasRouteError as exc:  # engine down before anything could be read
            if not self.absorbs(exc):
                raise
            fault = exc
        if info is not None and request.state.images:
            check_images(info, request.state.images)  # before any read: an engine that cannot see them refuses
        model = info.model if info is not None else self.name
        attrs = {tm.DECISION_SET: ",".join(specs), tm.QUESTIONS: len(specs), **request.identity.attributes}
        if tm.record_content():
            attrs[tm.STATE_CONTENT] = request.state.text
        cache_key = None
        if self.cache is not None and info is not None:
            cache_key = f"{request.key}:{info.model}:{request.constrained}"
            if (hit := self.cache.get(cache_key)) is not None:
                return _replay(hit, f"decide {model}", attrs, time.perf_counter() - start, refresh_fault)
            attrs[tm.CACHE_HIT] = False
        observed = request.controlled is not None or refresh_fault is not None
        with tm.span(f"decide {model}", attrs) as span:
            run = _Run(self, info, fault)
            try:
                await run.stages()
                latency = time.perf_counter() - start
                reports = run.finish(latency)
            except CanvasRouteError as exc:  # the gate's outcomes so far are observed, unless a retry decides again
                if observed:
                    await observe(request, {} if exc.retryable else run.gated, span, refresh_fault)
                raise
            span.set_attribute(tm.CANVAS_READS, run.canvas_reads)
            _note_faults(span, reports, request)
            tm.record_reports(span, reports, latency, model, request.gates, attrs)
            if observed:
                await observe(request, run.gated, span, refresh_fault)  # once per decision (a cache hit returned)
            if request.live:
                ticket, self.ticket = self.ticket, None
                await live.observe(request, reports, span, ticket, self.live_fault)  # once per decision
        response = CanvasResponse.model_validate({
            "model": model,
            "answers": {r.question_id: answer_of(specs[r.question_id], r) for r in reports if r.path != "skipped"},
            "reads": {r.question_id: r for r in reports},
            "usage": run.usage,
            "canvas_reads": run.canvas_reads,
            "latency_s": latency,
            "diagnostics": run.log.build(),
        })
        if cache_key is not None and replayable(response):  # a fault or budget refusal is decided again
            self.cache.put(cache_key, response.model_copy(deep=True))  # its own copy: callers may edit theirs
        return response


class _Run:
    """The mutable part of one decision run: per-stage reads, answers so far, usage."""

    __slots__ = ("answers", "canvas_reads", "checked", "decision", "done", "fault", "gated", "info", "last", "log",
                 "prompt", "refused", "target_failed", "usage")

    def __init__(self, decision: Decision, info: EngineInfo | None, fault: CanvasRouteError | None) -> None:
        self.decision, self.info, self.fault = decision, info, fault
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.canvas_reads = 0
        self.answers: dict[str, str | None] = {}
        self.done: dict[str, ReadReport] = {}
        self.last: list[tuple[QuestionRead, Escalated | None, dict[str, Any] | None]] = []
        self.refused: set[str] = set()
        """Questions the budget (or the breaker's cap on engine faults) turned away."""
        self.gated: dict[str, bool] = {}
        """Each question gated so far (an engine fault or a skip is not), by whether the gate did not
        pass it: what an escalation-rate controller observes (kept only when one steers the decision)."""
        self.target_failed: dict[str, EscalationError] = {}
        """Questions whose escalation failed, or was not made because the target's breaker is open."""
        self.checked: list[Plan] = []
        """Each stage's plan, all of it asked, as the length check made it (none: not checked)."""
        self.log = DiagnosticsLog(decision.request)
        specials = info.special_tokens if info is not None else None
        read = decision.request.read
        self.prompt = Prompt(defuse(decision.request.state.text, specials or SPECIAL_CANDIDATES),
                             defuse(read.instructions, specials or SPECIAL_CANDIDATES) if read.instructions else "")

    async def stages(self) -> None:
        decision, request = self.decision, self.decision.request
        deps, specs = request.questions.depends, request.questions.specs
        if self.info is not None and self.fault is None:
            try:  # before any read: every read a plan of any stage can send is length-checked
                self.checked = await decision.planner.check(request, self.info, self.prompt)
            except CanvasRouteError as exc:
                if not decision.absorbs(exc):
                    raise
                self.fault = exc
        for i, layer in enumerate(deps.layers):
            conditioned = bool(deps.parents)  # (no dependencies, the common case: no condition to look at)
            asked = [qid for qid in layer if deps.applies(qid, self.answers)] if conditioned else list(layer)
            for qid in layer:
                if qid not in asked:
                    self.done[qid] = _skipped(specs[qid], deps.asked_if(qid, self.answers))
                    self.answers[qid] = None
            if not asked:
                continue
            restated, prompt = "", self.prompt
            if conditioned:  # a later stage's prompt restates its parents' answers
                specials = self.info.special_tokens if self.info is not None else None
                restated = deps.restatement(asked, self.answers, specs)
                prompt = replace(prompt, state_text=prompt.state_text + deps.restated(asked, self.answers, specs,
                                                                                    specials))
            async with self._hedging(restated) as hedge:  # (a hedge's call races the re-reads of `_read`)
                reads = await self._read(asked, prompt, stage=i, hedge=hedge)
                if request.controlled is not None:  # the gate's outcomes, before any action on them can raise
                    self.gated.update((q, _cause(r) is not None) for q, r in reads.items() if r.error is None)
                escalated = await self._escalate(reads, restated, hedge)
            for r in reads.values():
                asked_if = deps.asked_if(r.spec.id, self.answers) if conditioned else None
                if i == len(deps.layers) - 1:
                    self.last.append((r, escalated, asked_if))
                    continue
                report = self.report(r, escalated, asked_if=asked_if)  # its answer decides the next stage
                self.done[r.spec.id], self.answers[r.spec.id] = report, report.answer

    def finish(self, latency: float) -> list[ReadReport]:
        """Every question's report, in the caller's order, with the decision's latency."""
        done = {qid: report.model_copy(update={"latency_s": latency}) for qid, report in self.done.items()}
        for r, escalated, asked_if in self.last:
            done[r.spec.id] = self.report(r, escalated, latency, asked_if)
        return [done[qid] for qid in self.decision.request.questions.specs]

    async def _read(self, asked: Sequence[str], prompt: Prompt, *, stage: int,
                    hedge: Hedging | None = None) -> dict[str, QuestionRead]:
        """One stage's asked questions read and gated (every one failed, on a fault)."""
        decision, request = self.decision, self.decision.request
        fault, info = self.fault, self.info
        whole = len(asked) == len(request.questions.depends.layers[stage])
        if info is not None and fault is None:
            try:
                the_plan = (self.checked[stage] if whole and self.checked
                            else await decision.planner.layer(request, asked, info))
            except CanvasRouteError as exc:
                if not decision.absorbs(exc):
                    raise
                fault = exc
        if fault is not None or info is None:  # every question goes down its fault's path: none answered from nothing
            assert fault is not None
            specs = request.questions.specs
            reads = {qid: QuestionRead(specs[qid], -1, ()) for qid in asked}
            for r in reads.values():
                r.fail(fault)
            self.log.add(asked, None)
            return reads
        if not (stage == 0 and whole):
            # a later stage's prompt restates its parents' answers: checked again as read
            await decision.planner.check_plan(the_plan, request, info, prompt)
        reading = Reading(request=request, engine=decision.engine, info=info, plan=the_plan, prompt=prompt,
                          absorbs=decision.absorbs, planner=decision.planner, usage=self.usage,
                          race=hedge.race if hedge is not None else None)
        reads = await reading.run()
        self.log.add(asked, reading)
        self.canvas_reads += reading.canvas_reads
        return reads

    def _hedging(self, restated: str) -> AbstractAsyncContextManager[Hedging | None]:
        """This stage's hedge (`Escalation.hedge`; `canvasroute.router._hedge`), or none."""
        request = self.decision.request
        escalation = request.escalation
        if escalation is None or escalation.hedge is None or request.mode == "canvas_only":
            return contextlib.nullcontext()
        return Hedging(hedge=escalation.hedge, escalation=escalation, thread=request.identity.thread_id,
                       gates=request.gates, ask=lambda wanted, calls: self._call(wanted, restated, calls),
                       escalates=lambda r: _cause(r) is not None and _action(request, r) == "escalate",
                       usage=self.usage, ended=self.log.hedges)

    async def _escalate(self, reads: Mapping[str, QuestionRead], restated: str,
                        hedge: Hedging | None = None) -> Escalated | None:
        """Escalate what the gate did not pass, as the outcome policy says, under the budget, in one
        call; beside a hedge's call in flight, which answers the questions it asked."""
        request = self.decision.request
        if request.escalation is None or request.mode == "canvas_only":
            return None
        if hedge is None or hedge.task is None:
            return await self._escalate_rest(reads, restated, ())
        answers = asyncio.create_task(hedge.answers(reads))  # while the stage's other questions are asked
        try:
            rest = await self._escalate_rest(reads, restated, hedge.asked)
        except BaseException:
            await cancel(answers)  # (the hedge's call itself ends with the hedge)
            raise
        try:
            hedged = await answers
        except EscalationError as exc:  # (its budget grants are refunded as the hedge ends)
            self._target_failed([reads[q] for q in hedge.asked if hedge.escalates(reads[q])], exc)
            hedged = None
        return joined(hedged, rest)

    async def _escalate_rest(self, reads: Mapping[str, QuestionRead], restated: str,
                             hedged: Sequence[str]) -> Escalated | None:
        """The stage's own call, for the questions that escalate and no hedge asked."""
        request = self.decision.request
        escalation = request.escalation
        assert escalation is not None
        # engine faults first: under a partial budget they are the ones that cannot keep a canvas answer
        wanted = sorted((r for r in reads.values() if r.spec.id not in hedged and _cause(r) is not None
                         and _action(request, r) == "escalate"), key=lambda r: r.error is None)
        if not wanted:
            return None
        breaker = escalation.breaker_state
        try:
            probe = breaker.admit([r.spec.id for r in wanted]) if breaker is not None else False
        except BreakerOpen as exc:  # the target is not called: nothing is taken from a budget
            self._target_failed(wanted, exc)
            return None
        meter, thread = escalation.meter, request.identity.thread_id
        faults = sum(r.error is not None for r in wanted)  # (sorted first)
        capped = granted = 0  # grants of the engine-fault cap and of the budget, given back if nothing escalates
        called = False
        try:
            if faults and breaker is not None:
                capped = breaker.take_faults([r.spec.id for r in wanted[:faults]])
                if capped < faults:
                    refused, wanted = wanted[capped:faults], wanted[:capped] + wanted[faults:]
                    self._refuse(refused, cap=escalation.breaker)
            granted = await meter.take(len(wanted), thread) if meter is not None else len(wanted)
            if granted < len(wanted):
                if breaker is not None and capped > granted:  # engine faults the budget refused: their cap grants back
                    breaker.refund_faults(capped - granted)
                    capped = granted
                self._refuse(wanted[granted:])
            wanted = wanted[:granted]
            if not wanted:
                if breaker is not None:
                    breaker.abandoned(probe)
                return None
            called = True
            result = await self._call(wanted, restated, probe=probe)
        except EscalationError as exc:  # the target failed: nothing was escalated
            await _give_back(meter, granted, breaker, capped, thread)
            self._target_failed(wanted, exc)
            return None
        except BaseException:
            await _give_back(meter, granted, breaker, capped, thread)
            if breaker is not None and not called:
                breaker.abandoned(probe)
            raise
        for key in ("input_tokens", "output_tokens"):
            self.usage[key] += result.usage.get(key, 0)
        return result

    def _refuse(self, spent: Sequence[QuestionRead], cap: Breaker | None = None) -> None:
        """Mark the questions the budget turned away (`cap`: the breaker's cap on what engine faults
        escalate), or raise as `over_budget` says."""
        action = self.decision.request.outcomes.over_budget
        if cap is None:
            if action == "raise":
                raise BudgetExhausted(f"escalation budget spent; {len(spent)} question(s) could not escalate",
                                      hint="raise the budget, or set OutcomePolicy(over_budget='answer' | 'fallback')")
            for r in spent:
                if r.error is not None and action == "answer":
                    raise BudgetExhausted(f"engine failed ({r.error}) and the escalation budget is spent",
                                          hint="an engine fault never becomes a cheap answer: give it "
                                               "OutcomePolicy(over_budget='fallback') and a fallback option")
        elif action != "fallback":  # every question the cap refused is an engine fault
            r = spent[0]
            raise BudgetExhausted(
                f"the canvas engine failed ({r.error}) and engine faults' escalations are capped at "
                f"{cap.fault_escalations} per {cap.window_s:g} s in this process (Breaker.fault_escalations): "
                f"{len(spent)} question(s) were not escalated",
                hint="an engine fault never becomes a cheap answer: bring the canvas engine back; give the questions "
                     "a fallback (OutcomePolicy(over_budget='fallback', fallback={...})); or raise the cap "
                     "(Escalation(breaker=Breaker(fault_escalations=...)))") from r.fault
        self.refused.update(r.spec.id for r in spent)

    def _target_failed(self, wanted: Sequence[QuestionRead], exc: EscalationError) -> None:
        """The target did not answer `wanted` (it failed, or its open breaker kept the call from being
        made): each takes `OutcomePolicy.target_fault`, or this raises as it says (an engine fault
        never answers from nothing: its fallback, or the error naming both faults)."""
        outcomes = self.decision.request.outcomes
        action = outcomes.target_fault
        falls_back = action == "fallback"
        if action == "raise" or any(r.error is not None and not (falls_back and r.spec.id in outcomes.fallback)
                                    for r in wanted):
            _with_fault(exc, wanted)
        self.target_failed.update(dict.fromkeys((r.spec.id for r in wanted), exc))

    async def _call(self, wanted: Sequence[QuestionRead], restated: str, hedge: Calls | None = None, *,
                    probe: bool | None = None) -> Escalated:
        """One call to the target for `wanted`, asked what the canvas had: the state and its images,
        the instructions, the parents' answers (`restated`, and per question for decision targets);
        `hedge`: a hedge's, beside the re-reads (its span says how it ended), counted there. The
        target calls it made (a malformed reply's retry among them) count as they go out. The target's
        breaker learns how it ended (`probe`: what its `admit` said; None: not asked yet, so asked here).

        Raises:
            BreakerOpen: the breaker is open: no call was made.
            EscalationError: the call failed.
        """
        request = self.decision.request
        escalation = request.escalation
        assert escalation is not None
        canvas = {r.spec.id: answer_probs(r.spec, r.stats) if r.stats else None for r in wanted}
        deps, specs = request.questions.depends, request.questions.specs
        parents = {r.spec.id: tuple(Restated(q, a) for q, a in deps.parents_of(r.spec.id, self.answers, specs))
                   for r in wanted}
        asked = Asked(specs=tuple(plain(r.spec) for r in wanted), state=request.state.value, text=request.state.text,
                      restated=restated, parents={q: p for q, p in parents.items() if p},
                      instructions=request.read.instructions, images=request.state.images, canvas=canvas)
        name = target_name(escalation.target)
        breaker = escalation.breaker_state
        if probe is None:
            probe = breaker.admit(list(canvas)) if breaker is not None else False
        calls = hedge if hedge is not None else Calls()
        try:
            with watched(breaker, probe), tm.escalation_call(escalation.target, name, list(canvas),
                                                             hedge=hedge is not None, calls=calls) as call:
                try:
                    result = await asyncio.wait_for(escalate(escalation, asked, calls), escalation.timeout)
                except TimeoutError as exc:
                    raise EscalationError(f"escalation to {name} timed out after {escalation.timeout}s (network)",
                                          failure="network", retryable=True) from exc
                call.usage(result.usage.get("input_tokens", 0), result.usage.get("output_tokens", 0))
                call.output({**result.answers, **dict.fromkeys(result.refused)}, result.response_model)
        finally:
            self.log.target_calls += calls.sent
            self.log.ran_on += calls.ran_on
        return result

    def report(self, r: QuestionRead, escalated: Escalated | None, latency_s: float = 0.0,
               asked_if: dict[str, Any] | None = None) -> ReadReport:
        """The report for one question: who answered, and why the gate did not pass it."""
        request = self.decision.request
        outcomes, spec, st = request.outcomes, r.spec, r.stats
        canvas = named(spec, st) if st else None
        cause = _cause(r)
        base: dict[str, Any] = dict(
            question_id=spec.id, kind=spec.kind, labels=list(r.labels), canvas_probabilities=canvas,
            reads=len(r.runs) + r.in_group_reads, error=r.error, latency_s=latency_s, asked_if=asked_if,
            crossed=list(r.crossed), gate=r.gate, slot=r.slot, read_entropies=[run.entropy for run in r.runs],
            rereadable=r.rereadable, cause=cause, hedged=r.hedged,
        )
        if st is not None:
            base.update(entropy=st.entropy, normalized_entropy=st.normalized_entropy, margin=st.margin,
                        confidence=st.confidence, agreement=st.agreement, stderr=st.stderr)
            if not r.constrained:  # a constrained row is normalized over the labels: nothing to measure
                base.update(label_mass=st.label_mass, argmax_is_label=st.argmax_is_label)
        options = spec.answer_options
        if escalated is not None and spec.id in escalated.answers:
            answer = escalated.answers[spec.id]
            probs = escalated.probabilities.get(spec.id) or {o: float(o == answer) for o in options}
            return _report(base, answer, probs, "escalated", escalation_model=escalated.model,
                           escalation_confidence=escalated.confidence.get(spec.id))
        refused = escalated is not None and spec.id in escalated.refused
        if refused:  # not an answer: the question goes on as if nothing could answer it
            assert escalated is not None
            base.update(refusal=escalated.refused[spec.id], escalation_model=escalated.model)
        if cause is None:
            assert st is not None
            return _report(base, spec.options[st.top], answer_probs(spec, st),
                           "reread" if len(r.runs) > r.samples else "canvas", confident=True)
        canvas_only = request.mode == "canvas_only"
        action: str
        if spec.id in self.refused:
            base["cause"] = "over_budget"
            action = outcomes.over_budget
        elif (failed := self.target_failed.get(spec.id)) is not None:
            base.update(cause="target_fault", escalation_error=f"{type(failed).__name__}: {failed}")
            action = outcomes.target_fault
        elif canvas_only:
            action = "answer"
        else:
            action = _action(request, r)
            if action == "escalate":  # nothing to escalate to, or the target refused it
                action = "answer"
                if request.escalation is None:
                    self._warn_no_target()
        if cause == "engine_fault" and action != "fallback":
            if action == "answer" and spec.id in self.refused:
                raise BudgetExhausted(f"question {spec.id!r}: the engine failed and the escalation budget is spent",
                                      hint="an engine fault never becomes a cheap answer") from r.fault
            assert r.fault is not None
            raise r.fault  # an engine fault never becomes a cheap answer
        if action == "fallback":
            if spec.id not in outcomes.fallback:
                if spec.id in self.refused:
                    raise BudgetExhausted(f"question {spec.id!r} could not escalate (budget spent) and has no "
                                          "fallback option",
                                          hint="add it to OutcomePolicy(fallback={...})") from r.fault
                assert r.fault is not None  # (uncertain and abstained fallbacks are checked before any read)
                raise r.fault  # an engine fault never becomes a cheap answer
            answer = outcomes.fallback[spec.id]
            return _report(base, answer, {o: float(o == answer) for o in options}, "fallback")
        assert st is not None
        if action == "raise":
            raise UnsureAnswer(
                f"question {spec.id!r} stayed unsure after {len(r.runs)} read(s) (crossed "
                f"{', '.join(r.crossed) or cause}; normalized entropy {st.normalized_entropy:.3f})",
                hint="set escalate_to=, or OutcomePolicy(uncertain='answer' | 'fallback' | 'review')")
        probs = answer_probs(spec, st)
        return _report(base, max(probs, key=probs.__getitem__), probs, "unsure")  # answer and review


    def _warn_no_target(self) -> None:
        """Once per model: questions the gate does not pass answer from the canvas, for want of a target."""
        decision = self.decision
        if "no_target" in decision.notices:
            return
        decision.notices.add("no_target")
        model = self.info.model if self.info is not None else decision.name
        warnings.warn(f"model {model!r} has no escalation target and OutcomePolicy(uncertain='escalate'): the "
                      "questions its gate does not pass answer from the canvas (path 'unsure', confident=False). Give "
                      "it escalate_to=..., or say what you mean: OutcomePolicy(uncertain='answer') answers from the "
                      "canvas on purpose ('fallback', 'review' and 'raise' are the others). This warning is given once "
                      "per model.", UserWarning, stacklevel=2)


async def _give_back(meter: Any, granted: int, breaker: Any, capped: int, thread: str | None) -> None:
    """Refund an escalation that did not happen: the budget's grants and the engine-fault cap's."""
    if breaker is not None and capped:
        breaker.refund_faults(capped)
    if meter is not None and granted:
        await meter.refund(granted, thread)


def _with_fault(exc: EscalationError, wanted: Sequence[QuestionRead]) -> NoReturn:
    """Raise an escalation's failure; after an engine fault of one of its questions, naming both."""
    fault = next((r.fault for r in wanted if r.fault is not None), None)
    if fault is None:
        raise exc
    raise type(exc)(
        f"{exc.message}, after the canvas engine failed: {type(fault).__name__}: {fault.message}",
        failure=exc.failure, attempts=max(exc.attempts, fault.attempts), retryable=exc.retryable or fault.retryable,
        hint=f"the canvas engine: {fault.hint or 'check it'}; the escalation: {exc.hint or 'check it'}",
    ) from fault


def _cause(r: QuestionRead) -> Cause | None:
    """Why the gate did not pass a question's read (None: it passed)."""
    if r.error is not None:
        return "engine_fault"
    if r.abstained:
        return "abstained"
    return "uncertain" if r.crossed else None


def _action(request: DecisionRequest, r: QuestionRead) -> str:
    """The outcome policy's action for a question's cause (`over_budget` aside)."""
    cause = _cause(r)
    outcomes = request.outcomes
    return (outcomes.engine_fault if cause == "engine_fault" else outcomes.abstained if cause == "abstained"
            else outcomes.uncertain)


def _report(base: dict[str, Any], answer: str, probabilities: Mapping[str, float], path: str, *,
            confident: bool = False, **more: Any) -> ReadReport:
    """`base` completed and validated as one mapping (`model_validate`: the constructor's
    checks without its keyword-argument call)."""
    base.update(answer=answer, probabilities=probabilities, path=path, confident=confident, **more)
    return ReadReport.model_validate(base)


def named(spec: QuestionSpec, st: SlotStats) -> dict[str, float]:
    """A distribution keyed by option name."""
    return dict(zip(spec.options, st.probs, strict=True))


def answer_probs(spec: QuestionSpec, st: SlotStats) -> dict[str, float]:
    """The distribution over the options an answer may name: without the abstain label's
    share, renormalized (the canvas distribution itself when the question cannot abstain)."""
    if not spec.abstain:
        return named(spec, st)
    real = st.probs[:-1]
    total = sum(real) or 1.0
    return {o: p / total for o, p in zip(spec.answer_options, real, strict=True)}


def plain(spec: QuestionSpec) -> QuestionSpec:
    """The question as asked by the caller (no abstain label), for the escalation."""
    return replace(spec, options=spec.answer_options, abstain=False) if spec.abstain else spec


def _skipped(spec: QuestionSpec, asked_if: dict[str, Any] | None) -> ReadReport:
    """The report of a dependent question whose condition did not hold: no answer, no read."""
    return ReadReport(question_id=spec.id, kind=spec.kind, answer=None, labels=[], probabilities={},  # type: ignore[arg-type]
                      path="skipped", confident=False, asked_if=asked_if)


def replayable(response: CanvasResponse) -> bool:
    """Whether a response may be stored: no engine fault, no budget refusal and no failed escalation
    (`target_fault`: a degraded answer, not the target's) touched it; each is decided again next
    time, never replayed."""
    return not any(r.error or r.cause in ("over_budget", "target_fault") for r in response.reads.values())


def _replay(response: CanvasResponse, span_name: str, attrs: dict[str, Any], latency_s: float,
            refresh_fault: Exception | None) -> CanvasResponse:
    """A cached response as this call's answer (`CanvasResponse.replay`): a decide span marked
    as a hit, no reads, no escalation, no token usage, and a copy of its own (the stored one is
    never handed out). A controller refresh that failed before the hit is marked and counted
    there (`observe`, which a hit never reaches, would have)."""
    with tm.span(span_name, {**attrs, tm.CACHE_HIT: True}) as span:
        span.set_attribute(tm.CANVAS_READS, 0)
        if refresh_fault is not None:
            tm.record_controller_fault(span, refresh_fault)
    return response.replay("decision_cache", latency_s)


def _note_faults(span: Any, reports: Sequence[ReadReport], request: DecisionRequest) -> None:
    """No silent fault: each engine fault and each target fault a decision absorbed is logged
    (WARNING), marked on its `decide` span and counted, with what answered instead. (A question the
    target's open breaker kept from it is marked and counted, not logged: the breaker logged its
    opening once.)"""
    faults: dict[str, list[ReadReport]] = {}
    failed: dict[str, list[ReadReport]] = {}
    for r in reports:
        if r.error is not None:
            faults.setdefault(r.error, []).append(r)
        if r.escalation_error is not None:
            failed.setdefault(r.escalation_error, []).append(r)
    target = target_name(request.escalation.target) if request.escalation is not None else None
    for error, hit in faults.items():
        paths = sorted({r.path for r in hit})
        instead = ", ".join("escalated to " + str(target) if p == "escalated" else p for p in paths)
        logger.warning("engine fault absorbed for question(s) %s (%s): %s",
                       ", ".join(r.question_id for r in hit), instead, error)
        tm.record_fault(span, error, [r.question_id for r in hit], paths)
    for error, hit in failed.items():
        paths = sorted({r.path for r in hit})
        if not error.startswith(BreakerOpen.__name__ + ":"):
            logger.warning("escalation to %s failed for question(s) %s (answered %s instead): %s", target,
                           ", ".join(r.question_id for r in hit), ", ".join(paths), error)
        tm.record_fault(span, error, [r.question_id for r in hit], paths)


# -- the response --------------------------------------------------------------------------


@dataclass(slots=True)
class DiagnosticsLog:
    """Collects a decision's stages as they are read."""

    request: DecisionRequest
    stages: list[list[str]] = field(default_factory=list)
    chunks: list[list[str]] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    thoughts: list[ThoughtReport] = field(default_factory=list)
    prompt_tokens: int = 0
    target_calls: int = 0
    """Calls handed to the target, hedges' and a malformed reply's retry included (`Calls.sent`)."""
    ran_on: int = 0
    """Cancelled hedge calls whose sync target's thread ran on (`Calls.ran_on`)."""
    hedges: list[str] = field(default_factory=list)

    def add(self, asked: Sequence[str], reading: Reading | None) -> None:
        """One stage: its questions and, when it was read (`Reading`), its canvases."""
        self.stages.append(list(asked))
        if reading is None:
            return
        for chunk in reading.plan.chunks:
            self.chunks.append([s.question_id for s in chunk.slots if not s.shift])
            self.formats.append("compact" if chunk.compact else "lines")
        self.thoughts += [ThoughtReport(text=t.text, tokens=len(t.ids), closed=t.closed, latency_s=t.latency_s)
                          for t in reading.thoughts]
        self.prompt_tokens = self.prompt_tokens or reading.prompt_tokens

    def build(self) -> Diagnostics:
        return Diagnostics.model_validate({
            "stages": self.stages, "chunks": self.chunks, "formats": self.formats,
            "conditioning": "restated" if len(self.stages) > 1 else None, "constrained": self.request.constrained,
            "steps": self.request.read.steps, "thoughts": self.thoughts, "prompt_tokens": self.prompt_tokens,
            "target_calls": self.target_calls, "hedges": self.hedges, "hedges_ran_on": self.ran_on})


def answer_of(spec: QuestionSpec, report: ReadReport) -> NoulAnswer | ChoiceAnswer | ScoreAnswer:
    """The langchain-core answer for one report (validated as one mapping, like the reports);
    a Choice's and a Score's `confidence` is System One's (`system_one_confidence`)."""
    probs = report.probabilities
    if spec.kind == "noul":
        return NoulAnswer.model_validate({"type": "noul", "noul": min(1.0, max(0.0, probs.get("yes", 0.0)))})
    confidence = system_one_confidence(probs.get(report.answer or "", 0.0), len(spec.answer_options))
    if spec.kind == "choice":
        return ChoiceAnswer.model_validate({"type": "choice", "choice": report.answer, "probabilities": probs,
                                            "confidence": confidence})
    by_level = {int(k): v for k, v in probs.items()}
    return ScoreAnswer.model_validate({"type": "score", "score": sum(i * p for i, p in by_level.items()),
                                       "legend": dict(enumerate(spec.question.criteria or ())),
                                       "probabilities": by_level, "confidence": confidence})

