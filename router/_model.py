"""`CanvasDecisionModel`: a decision set becomes one canvas read, gated and escalated.

The class wires the parts: questions are parsed (`_questions`) and planned (`_plan`)
once per question set, `_reading.Reading` reads and gates, `_outcome.Outcomes` applies
the escalation, budget, fallback and fault rules.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from langchain_core.decisions import BaseDecisionModel, ClassifierRequest
from langchain_core.runnables import RunnableConfig
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from canvasroute.engine import CanvasRouteError, Engine, EngineInfo, run_sync

from . import telemetry as tm
from ._budget import BudgetMeter, InMemoryBudgetMeter
from ._cache import DecisionCache, decision_key, replay, replayable
from ._depends import parse_depends_on
from ._diagnostics import DiagnosticsLog
from ._escalation import EscalationOutput, is_target
from ._escalation_prompt import check_prompt
from ._images import ImageEngine, check_images, image_digests
from ._length import check_length
from ._options import REQUEST_OPTIONS, ReadOptions, read_options, request_options
from ._outcome import Outcomes, skipped_report
from ._plans import Planner, shaped
from ._policy import EscalationBudget, GatePolicy, check_fallbacks
from ._questions import QuestionSpec, parse_questions, question_set_key
from ._reading import QuestionRead, Reading
from ._schema import StructuredOutput
from ._state import default_seed, read_state
from ._types import CanvasResponse, ReadReport, answer_of


class CanvasDecisionModel(StructuredOutput, BaseDecisionModel):
    """Answers Noul, Choice and Score questions with one DiffusionGemma canvas read.

    The questions about one state go into one canvas (split into chunks only when they
    do not fit), one denoising pass returns a distribution per answer slot, and the gate
    decides per question: answer, re-read with fresh noise, or escalate to `escalate_to`.
    Engine faults fail expensive: escalate (default), raise, or a declared fallback label.
    A question with more options than one read can label is read in two steps (its group,
    then the option in it); its probability is the product of both reads.

    Request keys beyond `state` and `questions`: `seed` (int, the noise seed; default a
    hash of state and questions, so identical requests read identically), `thread_id`
    (for per-thread escalation budgets), `policy` (a `GatePolicy` for this request),
    `attributes` (extra span attributes, e.g. the graph node), and the keywords of `adecide`
    (`depends_on`, `instructions`, `alone`, `steps`, `think`, `images`).

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
    """The name callback tracers see (`ls_model_name`) when set; by default the engine's served
    model, once the engine has said it. Each response reports the served model."""
    policy: GatePolicy = Field(default_factory=GatePolicy)
    """Thresholds and re-reads."""
    escalate_to: Any = None
    """`BaseChatModel`, `Runnable` or `BaseDecisionModel` for uncertain questions."""
    budget: EscalationBudget | None = None
    """Cap on escalations (None: unbounded)."""
    budget_meter: Any = None
    """A `BudgetMeter` that counts against `budget` (e.g. store-backed, shared by replicas);
    default an `InMemoryBudgetMeter`."""
    on_engine_error: Literal["escalate", "raise", "fallback"] = "escalate"
    """What an engine fault does: escalate every question, raise, or use `fallback`."""
    fallback: dict[str, str] = Field(default_factory=dict)
    """Fallback option per question id (for `on_engine_error="fallback"` and budgets)."""
    constrained: bool | None = None
    """Reads normalized over the request's label ids only (vLLM's `diffusion_constrained`):
    the same label distribution, in well under half the time on the vLLM CPU server, but no
    label mass and no `argmax_is_label` (reported as None). None (default): constrained
    unless the policy gates on `min_label_mass`; True: always; False: never."""
    escalation_timeout: float = 60.0
    """Seconds one escalation call may take."""
    escalation_prompt: Any = None
    """A `ChatPromptTemplate` for escalations over `{state}`, `{questions}` and `{keys}`
    (None: `ESCALATION_PROMPT`, instructions and a one-shot example)."""
    escalation_output: EscalationOutput = "auto"
    """How a chat-model target answers: `auto` (its structured output, `with_structured_output`;
    a JSON reply in text when it has none), a `with_structured_output` method, or `text`."""
    cache: Any = None
    """A `DecisionCache`: an identical decision set about an identical state (same policy
    and seed) is answered from it without a read (None: every call reads)."""

    _kept: _Memo = PrivateAttr()

    @field_validator("escalation_prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return check_prompt(value)

    @field_validator("escalate_to")
    @classmethod
    def _check_target(cls, value: Any) -> Any:
        if value is not None and not is_target(value):
            raise ValueError(f"escalate_to must be a chat model, Runnable or decision model, not {type(value)!r}")
        return value

    def model_post_init(self, context: Any) -> None:
        if not isinstance(self.engine, Engine):
            raise TypeError(f"engine must implement engine.Engine, got {type(self.engine).__name__}")
        if self.on_engine_error == "fallback" and not self.fallback:
            raise ValueError("on_engine_error='fallback' needs fallback={question id: option}")
        if self.budget_meter is not None and not isinstance(self.budget_meter, BudgetMeter):
            raise TypeError(f"budget_meter must implement router.BudgetMeter, got {type(self.budget_meter).__name__}")
        if self.cache is not None and not isinstance(self.cache, DecisionCache):
            raise TypeError(f"cache must be a router.DecisionCache, got {type(self.cache).__name__}")
        if self.budget is None and self.budget_meter is not None:
            raise ValueError("budget_meter needs budget= (its when_spent decides what a refusal does)")
        meter = self.budget_meter or (InMemoryBudgetMeter(self.budget) if self.budget else None)
        self._kept = _Memo(Outcomes(escalate_to=self.escalate_to, budget=self.budget, meter=meter,
                                    on_engine_error=self.on_engine_error, fallback=dict(self.fallback),
                                    escalation_timeout=self.escalation_timeout,
                                    escalation_prompt=self.escalation_prompt,
                                    escalation_output=self.escalation_output), Planner(self.engine))

    @property
    def _memo(self) -> _Memo:
        # a plain slot read: pydantic's lookup of a private attribute costs ~2 us, on every decision
        return self.__pydantic_private__["_kept"]  # type: ignore[index]

    @property
    def _provider(self) -> str:
        return "canvasroute"

    @property
    def budget_counters(self) -> dict[str, int]:
        """Escalations granted and refused by the budget (empty without a budget)."""
        meter = self._memo.outcomes.meter
        return meter.snapshot() if meter else {}

    # -- BaseDecisionModel --------------------------------------------------------------
    # Request keys beyond state and questions travel in a context variable, so langchain-core's
    # own request hooks (and their LangSmith usage recording) run unchanged.

    def _classify(self, state: Any, questions: dict[str, Any]) -> CanvasResponse:
        return run_sync(self.adecide(state, questions, **REQUEST_OPTIONS.get()))

    async def _aclassify(self, state: Any, questions: dict[str, Any]) -> CanvasResponse:
        return await self.adecide(state, questions, **REQUEST_OPTIONS.get())

    def _classify_and_record(self, request: ClassifierRequest) -> CanvasResponse:
        token = REQUEST_OPTIONS.set(request_options(request))
        try:
            return super()._classify_and_record(request)  # type: ignore[return-value]
        finally:
            REQUEST_OPTIONS.reset(token)

    async def _aclassify_and_record(self, request: ClassifierRequest) -> CanvasResponse:
        token = REQUEST_OPTIONS.set(request_options(request))
        try:
            return await super()._aclassify_and_record(request)  # type: ignore[return-value]
        finally:
            REQUEST_OPTIONS.reset(token)

    # Callback tracers (LangSmith, Langfuse) name the run by `ls_model_name`: the served model,
    # once the engine has said it (the `model` field when set explicitly).

    def invoke(self, input: ClassifierRequest, config: RunnableConfig | None = None,
               **kwargs: Any) -> CanvasResponse:
        if self._memo.served is None:
            run_sync(self._learn_served())
        return super().invoke(input, config, **kwargs)  # type: ignore[return-value]

    async def ainvoke(self, input: ClassifierRequest, config: RunnableConfig | None = None,
                      **kwargs: Any) -> CanvasResponse:
        if self._memo.served is None:
            await self._learn_served()
        return await super().ainvoke(input, config, **kwargs)  # type: ignore[return-value]

    async def _learn_served(self) -> None:
        try:
            self._memo.served = (await self.engine.info()).model
        except CanvasRouteError:  # the decision itself handles an engine that is down
            pass

    def _traced_config(self, config: RunnableConfig | None) -> RunnableConfig:
        config = super()._traced_config(config)
        if self._memo.served and "model" not in self.model_fields_set:
            config["metadata"]["ls_model_name"] = self._memo.served
        return config

    # -- the decision ------------------------------------------------------------------

    def decide(self, state: Any, questions: Mapping[str, Any], **options: Any) -> CanvasResponse:
        """Sync `adecide` (same keywords)."""
        return run_sync(self.adecide(state, questions, **options))

    async def adecide(self, state: Any, questions: Mapping[str, Any], *, seed: int | None = None,
                      thread_id: str | None = None, policy: GatePolicy | None = None,
                      attributes: Mapping[str, Any] | None = None,
                      depends_on: Mapping[str, Any] | None = None,
                      budget_meter: BudgetMeter | None = None, instructions: Any = None,
                      alone: Collection[str] = (), steps: int = 1, think: int = 0,
                      images: Sequence[str] = ()) -> CanvasResponse:
        """Answer every question about `state`: read, gate, re-read, escalate.

        `depends_on`: questions asked after others, and only when their answers match
        (`canvasroute.router._depends`: a child not asked has path `skipped` and no answer).
        `budget_meter` counts this decision's escalations against the model's `budget` instead
        of its own meter (e.g. a `StoreBudgetMeter` shared by every worker of a graph).
        `instructions`, `alone`, `steps`, `think`, `images`: how the canvases are read
        (`canvasroute.router._options`).
        """
        start = time.perf_counter()
        policy = policy or self.policy
        key, specs = self._specs(questions)
        outcomes = self._memo.outcomes
        if not outcomes.canvas_only:  # every fallback is an option; every abstaining or unsure question has a way out
            check_fallbacks(specs, policy, self.escalate_to is not None, self.fallback)
        deps = parse_depends_on(depends_on, specs)
        if budget_meter is not None:
            if self.budget is None:
                raise ValueError("budget_meter needs the model's budget= (its when_spent decides what a refusal does)")
            outcomes = replace(outcomes, meter=budget_meter)
        fault: CanvasRouteError | None = None
        try:
            info: EngineInfo | None = await self.engine.info()
        except CanvasRouteError as exc:  # engine down before anything could be read
            if not outcomes.absorbs(exc):
                raise
            info, fault = None, exc
        specials = info.special_tokens if info is not None else None
        opts = read_options(specs, policy, self.constrained, instructions=instructions, alone=alone, steps=steps,
                            think=think, images=images, special_tokens=specials)
        state_text, state_imgs = read_state(state, specials)
        images = (*state_imgs, *opts.images)
        if info is not None:
            check_images(info, images)  # before any read: an engine that cannot see them refuses
        model_name = info.model if info is not None else self.model
        attrs = {tm.DECISION_SET: ",".join(specs), tm.QUESTIONS: len(specs), **(attributes or {})}
        if tm.record_content():
            attrs[tm.STATE_CONTENT] = state_text
        cache_key = None
        if self.cache is not None and info is not None:
            cache_key = decision_key(questions=key + deps.key() + opts.key(), state_text=state_text, policy=policy,
                                     seed=seed, model=info.model, constrained=opts.constrained,
                                     images=image_digests(images))
            if (hit := self.cache.get(cache_key)) is not None:
                return replay(hit, f"decide {model_name}", attrs, time.perf_counter() - start)
            attrs[tm.CACHE_HIT] = False
        with tm.span(f"decide {model_name}", attrs) as span:
            usage = {"input_tokens": 0, "output_tokens": 0}
            canvas_reads = 0
            answers: dict[str, str | None] = {}
            done: dict[str, ReadReport] = {}
            log = DiagnosticsLog(opts)
            last: list[tuple[QuestionRead, Any, dict[str, Any] | None]] = []  # reported once the latency is known
            if info is not None and fault is None:
                try:  # before any read: every read a plan of any layer can send is length-checked
                    await self._memo.planner.check(info, state_text, key, specs, deps.layers, policy, opts)
                except CanvasRouteError as exc:
                    if not outcomes.absorbs(exc):
                        raise
                    fault = exc
            for i, layer in enumerate(deps.layers):
                asked = [qid for qid in layer if deps.applies(qid, answers)]
                for qid in layer:
                    if qid not in asked:
                        done[qid] = skipped_report(specs[qid], deps.asked_if(qid, answers))
                        answers[qid] = None
                if not asked:
                    continue
                text = state_text + deps.restated(asked, answers, specs, specials)
                # a later layer's prompt restates its parents' answers: checked again as read
                reads, reading = await self._read_layer(key, specs, asked, info, fault, text, seed, policy, usage,
                                                        opts, images, checked=i == 0 and len(asked) == len(layer))
                log.add(asked, reading)
                canvas_reads += reading.canvas_reads if reading is not None else 0
                escalated = await outcomes.escalate(state, text, reads, usage, thread_id)
                for r in reads.values():
                    asked_if = deps.asked_if(r.spec.id, answers)
                    if i == len(deps.layers) - 1:
                        last.append((r, escalated, asked_if))
                        continue
                    report = outcomes.report(r, escalated, asked_if=asked_if)  # its answer decides the next layer
                    done[r.spec.id], answers[r.spec.id] = report, report.answer
            latency = time.perf_counter() - start
            done = {qid: report.model_copy(update={"latency_s": latency}) for qid, report in done.items()}
            for r, escalated, asked_if in last:
                done[r.spec.id] = outcomes.report(r, escalated, latency, asked_if)
            reports = [done[qid] for qid in specs]
            span.set_attribute(tm.CANVAS_READS, canvas_reads)
            tm.record_reports(span, reports, latency, model_name, policy, attrs)
        response = CanvasResponse.model_validate({
            "model": model_name,
            "answers": {r.question_id: answer_of(specs[r.question_id], r) for r in reports if r.path != "skipped"},
            "reads": {r.question_id: r for r in reports},
            "usage": usage,
            "canvas_reads": canvas_reads,
            "latency_s": latency,
            "diagnostics": log.build(),
        })
        if cache_key is not None and replayable(response):  # a fault or budget refusal is decided again
            self.cache.put(cache_key, response.model_copy(deep=True))  # its own copy: callers may edit theirs
        return response

    async def _read_layer(self, key: str, specs: Mapping[str, QuestionSpec], asked: Sequence[str],
                          info: EngineInfo | None, fault: CanvasRouteError | None, state_text: str,
                          seed: int | None, policy: GatePolicy, usage: dict[str, int],
                          opts: ReadOptions, images: Sequence[str] = (),
                          checked: bool = False) -> tuple[dict[str, QuestionRead], Reading | None]:
        # checked: `Planner.check` has length-checked this plan for this prompt
        """One layer's asked questions read and gated, and its `Reading` (None on a fault)."""
        absorbs, planner = self._memo.outcomes.absorbs, self._memo.planner
        if info is not None and fault is None:
            try:
                the_plan = await planner.layer(key, specs, asked, policy, opts)
                if not checked:
                    await check_length(self.engine, info, the_plan, state_text, planner.member, opts)
            except CanvasRouteError as exc:
                if not absorbs(exc):
                    raise
                fault = exc
        if fault is not None:  # every question goes down the escalation/fallback path, none is answered from nothing
            reads = {qid: QuestionRead(spec, -1, ()) for qid, spec in shaped(specs, asked, policy).items()}
            for r in reads.values():
                r.fail(fault)
            return reads, None
        assert info is not None
        reading = Reading(engine=ImageEngine(self.engine, images) if images else self.engine, info=info,
                          plan=the_plan, state_text=state_text,
                          seed=default_seed(state_text, the_plan) if seed is None else seed,
                          policy=policy, options=opts, absorbs=absorbs,
                          member_plan=planner.member, usage=usage)
        return await reading.run(), reading

    def canvas_only(self) -> CanvasDecisionModel:
        """This model measuring the canvas alone, as shadow mode and `canvasroute eval` do.

        No escalation target, budget or cache: every question gets the canvas's best real option,
        `confident=False` where the model would not have answered it so; an engine fault raises.
        """
        memo = self._memo
        if memo.canvas_only is None:
            copy = self.model_copy(update={"escalate_to": None, "budget": None, "budget_meter": None, "cache": None})
            copy.model_post_init(None)
            copy._memo.outcomes = replace(copy._memo.outcomes, canvas_only=True)
            copy._memo.parsed, copy._memo.planner = memo.parsed, memo.planner  # same engine, same plans
            memo.canvas_only = copy
        return memo.canvas_only

    def _specs(self, questions: Mapping[str, Any]) -> tuple[str, dict[str, QuestionSpec]]:
        """Parsed questions and their cache key; a question set seen before is not re-parsed."""
        key, parsed = question_set_key(questions), self._memo.parsed
        if key is None or key not in parsed:
            specs = parse_questions(questions)
            key = key or json.dumps({qid: s.question.model_dump(mode="json") for qid, s in specs.items()})
            _remember(parsed, key, specs)
        parsed.move_to_end(key)
        return key, parsed[key]


# -- helpers ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Memo:
    """What a model keeps between decisions: its outcome rules, parsed question sets and plans."""

    outcomes: Outcomes
    planner: Planner
    served: str | None = None
    """The engine's served model name, once known (for callback tracers)."""
    parsed: OrderedDict[str, dict[str, QuestionSpec]] = field(default_factory=OrderedDict)
    canvas_only: CanvasDecisionModel | None = None
    """The model's `canvas_only()` copy, once made."""

    @property
    def plans(self) -> OrderedDict[Any, Any]:
        """The plans made so far, by key."""
        return self.planner.plans


def _remember(cache: OrderedDict[str, Any], key: str, value: Any, size: int = 256) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
