"""Outcome rules: after reading, which questions escalate under the budget, and what each answers.

The rules, in order: a confident canvas answer stands; an uncertain one (or one an
engine fault hit) escalates while the budget grants it; past the budget `when_spent`
decides (`keep` the canvas answer, `fallback` label, or `raise`); with nothing to
escalate to, `GatePolicy.on_unsure` decides (path `unsure`). A question whose abstain
label won goes where `on_abstain` says, however narrowly it won. An engine fault never
becomes a cheap answer: it escalates, takes a declared fallback label, or raises; when
its escalation fails too, the error names both. Every budget grant that does not become
an escalation is refunded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from canvasroute.engine import BudgetExhausted, CanvasRouteError, DecisionError, EscalationError, UnsureAnswer

from . import telemetry as tm
from ._budget import BudgetMeter
from ._distribution import SlotStats
from ._escalation import Escalated, EscalationOutput, escalate, target_name
from ._policy import EscalationBudget
from ._questions import QuestionSpec
from ._reading import QuestionRead
from ._types import ReadReport

OVER_BUDGET = "over_budget"


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcomes:
    """The model's escalation, budget, fallback and fault settings, applied to one decision."""

    escalate_to: Any
    budget: EscalationBudget | None
    meter: BudgetMeter | None
    on_engine_error: Literal["escalate", "raise", "fallback"]
    fallback: Mapping[str, str]
    escalation_timeout: float
    escalation_prompt: Any = None
    escalation_output: EscalationOutput = "auto"
    canvas_only: bool = False
    """Measure the canvas alone (shadow mode, `canvasroute eval`): nothing escalates, every
    question gets the canvas's best real option (not confident where it would have
    escalated, abstained or taken a fallback), and an engine fault raises."""

    def absorbs(self, exc: CanvasRouteError) -> bool:
        """Whether an engine fault goes to escalation or the fallback label instead of raising.

        Misuse (`DecisionError`) always raises; so does a fault with nowhere expensive to go.
        """
        if isinstance(exc, DecisionError) or self.on_engine_error == "raise" or self.canvas_only:
            return False
        return self.escalate_to is not None or self.on_engine_error == "fallback"

    async def escalate(self, state: Any, state_text: str, reads: Mapping[str, QuestionRead],
                       usage: dict[str, int], thread_id: str | None) -> Escalated | None:
        """Escalate the uncertain and faulted questions the budget grants, in one call."""
        # engine faults first: under a partial budget they are the ones that cannot keep a canvas answer;
        # an abstained question goes where on_abstain says, however narrowly the abstain label won
        wanted = sorted((r for r in reads.values() if r.error is not None
                         or (r.on_abstain == "escalate" if r.abstained else bool(r.crossed))),
                        key=lambda r: r.error is None)
        if self.on_engine_error == "fallback":
            wanted = [r for r in wanted if r.error is None]  # faults take the fallback label
        if not wanted or self.escalate_to is None:
            return None
        granted = await self.meter.take(len(wanted), thread_id) if self.meter else len(wanted)
        try:
            if granted < len(wanted):
                self._refuse(wanted[granted:])
            wanted = wanted[:granted]
            if not wanted:
                return None
            result = await self._call(state, state_text, wanted)
        except EscalationError as exc:
            if self.meter and granted:
                await self.meter.refund(granted, thread_id)  # nothing was escalated
            fault = next((r.fault for r in wanted if r.fault is not None), None)
            if fault is None:
                raise
            raise EscalationError(
                f"{exc.message}, after the canvas engine failed: {type(fault).__name__}: {fault.message}",
                failure=exc.failure, attempts=exc.attempts, retryable=exc.retryable or fault.retryable,
                hint=f"the canvas engine: {fault.hint or 'check it'}; the escalation: {exc.hint or 'check it'}",
            ) from fault
        except BaseException:
            if self.meter and granted:
                await self.meter.refund(granted, thread_id)  # nothing was escalated
            raise
        for key in ("input_tokens", "output_tokens"):
            usage[key] += result.usage.get(key, 0)
        return result

    def _refuse(self, spent: list[QuestionRead]) -> None:
        """Mark questions the budget turned away, or raise as `when_spent` declares."""
        if self.budget and self.budget.when_spent == "raise":
            raise BudgetExhausted(f"escalation budget spent; {len(spent)} question(s) could not escalate",
                                  hint="raise the budget, or set when_spent='keep' or 'fallback'")
        for r in spent:
            if r.error is not None and (self.budget is None or self.budget.when_spent == "keep"):
                raise BudgetExhausted(f"engine failed ({r.error}) and the escalation budget is spent",
                                      hint="an engine fault never becomes a cheap answer")
        for r in spent:
            r.crossed = (*r.crossed, OVER_BUDGET)

    async def _call(self, state: Any, state_text: str, wanted: list[QuestionRead]) -> Escalated:
        canvas = {r.spec.id: answer_probs(r.spec, r.stats) if r.stats else None for r in wanted}
        name = target_name(self.escalate_to)
        with tm.escalation_call(self.escalate_to, name, list(canvas)) as call:
            try:
                result = await asyncio.wait_for(
                    escalate(self.escalate_to, state_text, state, [plain(r.spec) for r in wanted], canvas,
                             prompt=self.escalation_prompt, output=self.escalation_output),
                    self.escalation_timeout)
            except TimeoutError as exc:
                raise EscalationError(f"escalation to {name} timed out after {self.escalation_timeout}s (network)",
                                      failure="network", retryable=True) from exc
            call.usage(result.usage.get("input_tokens", 0), result.usage.get("output_tokens", 0))
            call.output(result.answers, result.response_model)
        return result

    def report(self, r: QuestionRead, escalated: Escalated | None, latency_s: float = 0.0,
               asked_if: dict[str, Any] | None = None) -> ReadReport:
        """The report for one question: escalated, fallback, or the canvas answer."""
        spec, st = r.spec, r.stats
        canvas = named(spec, st) if st else None
        base: dict[str, Any] = dict(
            question_id=spec.id, kind=spec.kind, labels=list(r.labels), canvas_probabilities=canvas,
            reads=len(r.runs) + r.in_group_reads, error=r.error, latency_s=latency_s, asked_if=asked_if,
            crossed=[c for c in r.crossed if c != OVER_BUDGET], over_budget=OVER_BUDGET in r.crossed, gate=r.gate,
            slot=r.slot, read_entropies=[run.entropy for run in r.runs], rereadable=r.rereadable,
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
            return _report(base, answer, probs, "abstained" if r.abstained else "escalated",
                           escalation_model=escalated.model)
        over_budget = base["over_budget"] and self.budget is not None and self.budget.when_spent == "fallback"
        if r.abstained:  # not escalated: the fallback option, or past the budget ("keep") the best real option
            if (r.on_abstain == "fallback" or over_budget) and not self.canvas_only:
                if spec.id not in self.fallback:
                    raise BudgetExhausted(f"question {spec.id!r} abstained, could not escalate (budget spent) "
                                          "and has no fallback option", hint="add it to fallback=")
                answer = self.fallback[spec.id]
                return _report(base, answer, {o: float(o == answer) for o in options}, "abstained")
            assert st is not None
            probs = answer_probs(spec, st)
            return _report(base, max(probs, key=probs.__getitem__), probs, "abstained")
        if st is None or over_budget or (r.fault is not None and self.on_engine_error == "fallback"):
            if spec.id not in self.fallback:
                if over_budget:
                    raise BudgetExhausted(f"question {spec.id!r} could not escalate (budget spent) and has no "
                                          "fallback option", hint="add it to fallback=") from r.fault
                assert r.fault is not None
                raise r.fault  # an engine fault never becomes a cheap answer
            answer = self.fallback[spec.id]
            return _report(base, answer, {o: float(o == answer) for o in options}, "fallback")
        probs = answer_probs(spec, st) if spec.abstain else canvas  # (validation copies each dict)
        if not r.crossed:
            return _report(base, spec.options[st.top], probs, "reread" if len(r.runs) > r.samples else "canvas",
                           confident=True)
        # unsure: past the budget ("keep"), or nothing to escalate to (then on_unsure decides)
        if self.escalate_to is None and not self.canvas_only and not base["over_budget"]:
            if r.on_unsure == "raise":
                raise UnsureAnswer(
                    f"question {spec.id!r} stayed unsure after {len(r.runs)} read(s) (crossed "
                    f"{', '.join(base['crossed'])}; normalized entropy {st.normalized_entropy:.3f}) and there "
                    "is no escalation target", hint="set escalate_to=, or GatePolicy(on_unsure='answer' | "
                                                    "'fallback' | 'review')")
            if r.on_unsure == "fallback":
                answer = self.fallback[spec.id]
                return _report(base, answer, {o: float(o == answer) for o in options}, "unsure")
        return _report(base, spec.options[st.top], probs, "unsure")


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


def skipped_report(spec: QuestionSpec, asked_if: dict[str, Any] | None) -> ReadReport:
    """The report of a dependent question whose condition did not hold: no answer, no read."""
    return ReadReport(question_id=spec.id, kind=spec.kind, answer=None, labels=[], probabilities={},
                      path="skipped", confident=False, asked_if=asked_if)
