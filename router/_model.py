"""`CanvasDecisionModel`: a decision set becomes one canvas read, gated and escalated.

The model is the way in: `request()` builds the one frozen `DecisionRequest` a decision is
(`canvasroute.router._request`), and `arun()` runs it (`canvasroute.router._decision`).
`decide`/`adecide` do both; `invoke`/`ainvoke` are langchain-core's Runnable path to the same.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Coroutine, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Self

from langchain_core.decisions import BaseDecisionModel, ClassifierRequest
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig

from canvasroute.engine import CanvasRouteError, DecisionError, Engine, run_sync

from ._audit import InMemoryLiveState, live_gated
from ._breaker import BreakerState
from ._budget import BudgetMeter, InMemoryBudgetMeter
from ._cache import DecisionCache
from ._compat import DECIDE, gate_layer, legacy_request, model_keywords
from ._control import ControllerState, InMemoryControllerState
from ._decision import Decision
from ._escalation import check_prompt, is_target, target_name
from ._plan import Planner
from ._policy import Escalation, GatePolicy, OutcomePolicy
from ._questions import QuestionSpec
from ._request import (
    REQUEST,
    DecisionRequest,
    Defaults,
    ReadOptions,
    build_request,
    read_options,
)
from ._schema import StructuredDecision
from ._types import CanvasResponse

REQUEST_KEYS = ("read", "depends_on", "gate", "seed", "thread_id", "attributes")
"""The keys a request to `invoke` may carry beyond `state` and `questions` (`CanvasDecisionModel.request`'s)."""
_OPTIONS = frozenset((*REQUEST_KEYS, "site"))
"""The keywords of `request` beyond state and questions (`decide` takes them too)."""
_KEYS = frozenset(REQUEST_KEYS)


class CanvasDecisionModel(BaseDecisionModel):
    """Answers Noul, Choice and Score questions with one DiffusionGemma canvas read.

    The questions about one state go into one canvas (split into chunks only when they
    do not fit), one denoising pass returns a distribution per answer slot, and the gate
    decides per question: answer, re-read with fresh noise, or what `outcomes` says for a
    question it does not pass (by default: escalate to `escalate_to`). Engine faults fail
    expensive: escalate, raise, or a declared fallback option. A question with more options
    than one read can label is read in two steps (its group, then the option in it).

    `invoke` takes `{"state": ..., "questions": {...}}` and the keywords of `request` as
    further keys (`read`, `depends_on`, `gate`, `seed`, `thread_id`, `attributes`).

    Example:
        ```python
        model = CanvasDecisionModel(engine=VLLMServerEngine("http://127.0.0.1:8000"),
                                    policy=GatePolicy(max_normalized_entropy=0.5))
        resp = model.invoke({"state": "Refund me now!", "questions": {
            "team": Choice(instructions="Which team?", criteria={"billing": None, "tech": None})}})
        resp.answers["team"].choice, resp.reads["team"].path
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    engine: Any
    """The engine that reads canvases (`VLLMServerEngine`, `TransformersEngine`, ...)."""
    model: str = "canvas"
    """The name callback tracers see (`ls_model_name`) when set; by default the engine's served
    model, once the engine has said it. Each response reports the served model."""
    policy: GatePolicy = Field(default_factory=GatePolicy)
    """The gate: thresholds, reads, per-question overrides."""
    escalate_to: Any = None
    """Where questions the gate does not pass go: a target (`BaseChatModel`, `Runnable`,
    `BaseDecisionModel`) or an `Escalation` (target, output, prompt, timeout, budget, meter,
    breaker). None: nowhere; with `OutcomePolicy(uncertain='escalate')` (the default) such
    questions answer from the canvas (path `unsure`), and the model warns once that they do."""
    outcomes: OutcomePolicy = Field(default_factory=OutcomePolicy)
    """What happens when the gate is not passed, by cause (uncertain, abstained, engine fault,
    over budget), and the fallback options."""
    read: ReadOptions = Field(default_factory=ReadOptions)
    """How every decision's canvases are read unless a call says otherwise (`ReadOptions`, or a
    dict of its fields): e.g. `read={"constrained": False}` measures label mass on every read,
    `read={"isolate": "all"}` reads each question without the others in view."""
    cache: Any = None
    """A `DecisionCache`: an identical request (same questions, state, options, gate, seed) is
    answered from it without a read (None: every call reads)."""

    _kept: _Memo = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return model_keywords(data)  # 0.1's fields (on_engine_error=, budget=, ...), until 0.3.0

    @field_validator("read", mode="before")
    @classmethod
    def _check_read(cls, value: Any) -> ReadOptions:
        return read_options(value)

    @field_validator("escalate_to")
    @classmethod
    def _check_target(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, Escalation):
            value = Escalation(value)
        if not is_target(value.target):
            raise ValueError(f"escalate_to must be a chat model, Runnable or decision model, not "
                             f"{type(value.target)!r}")
        check_prompt(value.prompt)
        if value.meter is not None and not isinstance(value.meter, BudgetMeter):
            raise ValueError(f"Escalation.meter must implement router.BudgetMeter, not {type(value.meter).__name__}")
        if value.controller_state is not None and not isinstance(value.controller_state, ControllerState):
            raise ValueError("Escalation.controller_state must implement router.ControllerState, not "
                             f"{type(value.controller_state).__name__}")
        if value.breaker_state is not None and not isinstance(value.breaker_state, BreakerState):
            raise ValueError(f"Escalation.breaker_state must be a router.BreakerState, not "
                             f"{type(value.breaker_state).__name__}")
        if value.audit_state is not None and not isinstance(value.audit_state, InMemoryLiveState):
            raise ValueError("Escalation.audit_state must be a router.InMemoryLiveState (or a harness "
                             f"StoreLiveState), not {type(value.audit_state).__name__}")
        return value

    def model_post_init(self, context: Any) -> None:
        if not isinstance(self.engine, Engine):
            raise TypeError(f"engine must implement engine.Engine, got {type(self.engine).__name__}")
        if not isinstance(self.outcomes, OutcomePolicy):
            raise TypeError(f"outcomes must be an OutcomePolicy, got {type(self.outcomes).__name__}")
        if self.cache is not None and not isinstance(self.cache, DecisionCache):
            raise TypeError(f"cache must be a router.DecisionCache, got {type(self.cache).__name__}")
        escalation: Escalation | None = self.escalate_to
        own_meter = escalation is not None and escalation.meter is not None
        own_state = escalation is not None and escalation.controller_state is not None
        if escalation is not None and escalation.budget is not None and escalation.meter is None:
            escalation = replace(escalation, meter=InMemoryBudgetMeter(escalation.budget))
        if escalation is not None and escalation.controller is not None and escalation.controller_state is None:
            escalation = replace(escalation, controller_state=InMemoryControllerState(escalation.controller))
        if escalation is not None and escalation.breaker is not None and escalation.breaker_state is None:
            escalation = replace(escalation, breaker_state=BreakerState(escalation.breaker,
                                                                        target_name(escalation.target)))
        own_audit = escalation is not None and escalation.audit_state is not None
        if escalation is not None and escalation.audit is not None:
            _check_audited(self.policy)
            if escalation.audit_state is None:
                escalation = replace(escalation, audit_state=InMemoryLiveState(escalation.audit))
        defaults = Defaults(read=self.read, policy=self.policy, outcomes=self.outcomes, escalation=escalation)
        self._kept = _Memo(Planner(self.engine), defaults, own_meter, own_state, own_audit)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy of this model with `update`'s fields changed: the model its fields build.

        pydantic's own copy takes `update` unchecked and keeps what the original derived from its
        fields at construction; here the fields are validated as the constructor validates them (a
        bare target becomes an `Escalation`, a `read` dict a `ReadOptions`, a bad value raises) and
        everything derived is derived again, for the copy: its escalation as decisions use it, with
        an in-process budget meter and controller state of its own where the model made them (a copy
        counts its own budget and holds its own rate, as a second model built with the same fields
        would). A meter or controller state given in `Escalation(meter=..., controller_state=...)`
        is the caller's and stays shared; to share the original's in-process ones, pass them:
        `model.model_copy(update={"escalate_to": model.escalation})`. Plans are kept when the engine is.

        Raises:
            ValueError: a field value the constructor refuses (pydantic's `ValidationError`).
        """
        values = {name: getattr(self, name) for name in type(self).model_fields if name not in (update or {})}
        if deep:
            values = copy.deepcopy(values)
        copied = type(self)(**values, **(update or {}))
        object.__setattr__(copied, "__pydantic_fields_set__", self.model_fields_set | set(update or ()))
        if copied.engine is self.engine:
            copied._memo.planner, copied._memo.served = self._memo.planner, self._memo.served
        return copied

    @property
    def _memo(self) -> _Memo:
        # a plain slot read: pydantic's lookup of a private attribute costs ~2 us, on every decision
        return self.__pydantic_private__["_kept"]  # type: ignore[no-any-return,index]

    @property
    def _provider(self) -> str:
        return "canvasroute"

    @property
    def escalation(self) -> Escalation | None:
        """The escalation as decisions use it (its budget counted by `meter`), or None."""
        return self._memo.defaults.escalation

    @property
    def budget_counters(self) -> dict[str, int]:
        """Escalations granted and refused by the budget (empty without a budget)."""
        escalation = self._memo.defaults.escalation
        meter = escalation.meter if escalation is not None else None
        return meter.snapshot() if meter is not None else {}

    @property
    def breaker_counters(self) -> dict[str, Any]:
        """The escalation breaker's state (`closed`, `open`, `half_open`), its changes of state, short
        circuits and failed calls, and the engine-fault cap's counts (`BreakerState.snapshot`; empty
        without a breaker)."""
        escalation = self._memo.defaults.escalation
        state = escalation.breaker_state if escalation is not None else None
        return state.snapshot() if state is not None else {}

    @property
    def budget_scope(self) -> str | None:
        """What names this model's budget in a shared store (`Escalation.name`, else its model
        name, target and budget), or None without a budget or with a meter of its own."""
        escalation = self._memo.defaults.escalation
        if escalation is None or escalation.budget is None or self._memo.own_meter:
            return None
        return self._scope(escalation, "budget", escalation.budget)

    @property
    def controller_counters(self) -> dict[str, Any]:
        """The escalation-rate controller's target and, per question, its offset, realised
        (decayed) rate and decisions (`ControllerState.snapshot`; empty without a controller)."""
        escalation = self._memo.defaults.escalation
        state = escalation.controller_state if escalation is not None else None
        return state.snapshot() if state is not None else {}

    @property
    def controller_scope(self) -> str | None:
        """What names this model's controller state in a shared store (`Escalation.name`, else its
        model name, target and controller), or None without a controller or with a state of its own."""
        escalation = self._memo.defaults.escalation
        if escalation is None or escalation.controller is None or self._memo.own_state:
            return None
        return self._scope(escalation, "controller", escalation.controller)

    @property
    def live_counters(self) -> dict[str, Any]:
        """Live certification's claim, counts and, per question, its certified threshold, bound,
        rows, audits and epoch (`InMemoryLiveState.snapshot`; empty without an audit)."""
        escalation = self._memo.defaults.escalation
        state = escalation.audit_state if escalation is not None else None
        return state.snapshot() if state is not None else {}

    @property
    def live_scope(self) -> str | None:
        """What names this model's live certification rows in a shared store (`Escalation.name`, else
        its model name, target and audit), or None without an audit or with a state of its own."""
        escalation = self._memo.defaults.escalation
        if escalation is None or escalation.audit is None or self._memo.own_audit:
            return None
        return self._scope(escalation, "audit", escalation.audit)

    def _scope(self, escalation: Escalation, kind: str, value: Any) -> str:
        """`escalation.name`, else a hash of the model name, the target and `value` (the budget or
        controller: `kind`), worked out once per model name and target name (a graph store looks it
        up on every decision)."""
        if escalation.name:
            return escalation.name
        target = escalation.target
        key = (kind, self.model, target_name(target))
        scope = self._memo.scopes.get(key)
        if scope is None:
            blob = json.dumps([self.model, type(target).__qualname__, key[2], repr(value)])
            scope = self._memo.scopes[key] = f"{self.model}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
        return scope

    # -- the request ----------------------------------------------------------------------

    def request(self, state: Any, questions: Mapping[str, Any] | type, *,
                read: ReadOptions | Mapping[str, Any] | None = None, depends_on: Mapping[str, Any] | None = None,
                gate: GatePolicy | Mapping[str, Any] | None = None, seed: int | None = None,
                thread_id: str | None = None, attributes: Mapping[str, Any] | None = None,
                site: tuple[str, str] | None = None) -> DecisionRequest:
        """The decision about `state` as one frozen request: every option checked and resolved once.

        Args:
            state: What to decide on: text, messages, or JSON-like values (images as content blocks).
            questions: `{question_id: Noul | Choice | Score}` (models or their dicts), or a schema
                (a pydantic model or TypedDict class, as `with_structured_output` takes): its fields
                are the questions (`questions_from_schema`), its docstring the decision's
                instructions unless `read` gives its own.
            read: How the canvases are read: a `ReadOptions` (taken whole), or a dict of its fields
                over the model's own `read`.
            depends_on: `{child: (parent, answers)}` or `{child: {parent: answers or None}}`:
                children asked after their parents, and only when their answers match.
            gate: This decision's gate: a `GatePolicy`, or a dict of fields applied over the
                model's policy for every question (`resolve_gate`).
            seed: The noise seed (default: a hash of what is decided, so identical requests
                read identically).
            thread_id: The LangGraph thread (per-thread budgets, span attributes).
            attributes: Extra span attributes (e.g. the graph node).
            site: Where the decision runs, for its default seed: a graph node's checkpoint
                namespace and its node or edge (`decision_node` and `route_on` set it).

        Raises:
            DecisionError: a question, dependency, read option or fallback that cannot be used.
        """
        defaults = self._memo.defaults
        if gate is not None and (type(gate) is not GatePolicy  # a dict, or a gate holding 0.1 keywords
                                 or any(type(p) is not GatePolicy for p in gate.per_question.values())):
            defaults, gate = gate_layer(defaults, gate)
        return build_request(defaults, questions, state, depends_on=depends_on, read=read, gate=gate,
                             seed=seed, thread_id=thread_id, attributes=attributes, site=site)

    # -- the decision ------------------------------------------------------------------

    def arun(self, request: DecisionRequest) -> Coroutine[Any, Any, CanvasResponse]:
        """Answer a request built by `request()`: read, gate, re-read, escalate, report (await it).

        It returns the decision's coroutine itself, so no frame of this model sits between the
        caller and the run."""
        if not isinstance(request, DecisionRequest):
            raise TypeError(f"arun takes a DecisionRequest (from model.request(...)), not {type(request).__name__}")
        memo = self._memo
        return Decision(request, self.engine, memo.planner, self.cache, self.model, memo.notices).run()

    def run(self, request: DecisionRequest) -> CanvasResponse:
        """Sync `arun`."""
        return run_sync(self.arun(request))

    async def adecide(self, state: Any, questions: Mapping[str, Any] | type, **options: Any) -> CanvasResponse:
        """Answer every question about `state`: `arun(request(state, questions, **options))`."""
        if options.keys() <= _OPTIONS:
            return await self.arun(self.request(state, questions, **options))
        return await self.arun(legacy_request(self, state, questions, options, "CanvasDecisionModel.adecide"))

    def decide(self, state: Any, questions: Mapping[str, Any] | type, **options: Any) -> CanvasResponse:
        """Sync `adecide` (the same keywords as `request`)."""
        if options.keys() <= _OPTIONS:
            return run_sync(self.arun(self.request(state, questions, **options)))
        return run_sync(self.arun(legacy_request(self, state, questions, options)))

    def with_structured_output(self, schema: type, *, include_raw: bool = False,
                               **kwargs: Any) -> StructuredDecision:
        """A Runnable that answers `schema` (a pydantic model or TypedDict of bool, `Literal` or
        Enum fields) with one decision per call, as a chat model's structured output would
        (`canvasroute.router._schema`): `llm.with_structured_output(Grade)` ports in one line.

        `method` and `strict` (a chat model's structured-output options) are accepted and
        ignored, as langchain-core's default does: a canvas can only answer the options.

        Raises:
            UnsupportedQuestion: a field with no question form (named), or not a schema.
            ValueError: another keyword.
        """
        if unknown := sorted(set(kwargs) - {"method", "strict"}):
            raise ValueError(f"with_structured_output takes schema, include_raw, method and strict, not {unknown}")
        return StructuredDecision(self, schema, include_raw=include_raw)

    @classmethod
    def reader(cls, engine: Engine, **fields: Any) -> CanvasDecisionModel:
        """A model that answers every question from one read of `engine` and trusts it: no gate, no
        re-read, no escalation; an engine fault raises. As an escalation target (`Escalation(...)`,
        a decision model) its read distribution becomes the escalated answer's, e.g. a larger
        causal model read for its exact label distribution: one forward pass per slot, no JSON to
        generate or parse. `fields` go to the model (`read=`, `model=`, ...).

        Example:
            ```python
            big = CanvasDecisionModel.reader(CausalServerEngine("http://big-host:8000/v1"))
            model = CanvasDecisionModel(engine=VLLMServerEngine(url), escalate_to=Escalation(big))
            ```
        """
        return cls(engine=engine, policy=GatePolicy(max_normalized_entropy=None, rereads=0),
                   outcomes=OutcomePolicy(engine_fault="raise"), **fields)

    def canvas_only(self) -> CanvasDecisionModel:
        """This model measuring the canvas alone, as `canvasroute eval` does (shadow mode uses
        `DecisionRequest.canvas_only()`): no escalation or cache; every question gets the
        canvas's best real option, `confident=False` where the gate did not pass it; an engine
        fault raises."""
        memo = self._memo
        if memo.only is None:
            only = self.model_copy(update={"escalate_to": None, "cache": None})  # same engine: same plans
            only._memo.defaults = replace(only._memo.defaults, canvas_only=True)
            memo.only = only
        return memo.only

    # -- BaseDecisionModel --------------------------------------------------------------
    # Request keys beyond state and questions travel in a context variable (as the built request),
    # so langchain-core's own request hooks (and their LangSmith usage recording) run unchanged.

    def _classify(self, state: Any, questions: dict[str, Any]) -> CanvasResponse:
        return run_sync(self._aclassify(state, questions))

    async def _aclassify(self, state: Any, questions: dict[str, Any]) -> CanvasResponse:
        request = REQUEST.get()
        return await self.arun(request if request is not None else self.request(state, questions))

    def _classify_and_record(self, request: ClassifierRequest) -> CanvasResponse:
        built = self._from_input(request)
        token = REQUEST.set(built)
        if not isinstance(request["questions"], Mapping):  # a schema: langchain-core reads the questions as a dict
            request = {**request, "questions": built.questions.asked}
        try:
            return super()._classify_and_record(request)  # type: ignore[return-value]
        finally:
            REQUEST.reset(token)

    async def _aclassify_and_record(self, request: ClassifierRequest) -> CanvasResponse:
        built = self._from_input(request)
        token = REQUEST.set(built)
        if not isinstance(request["questions"], Mapping):  # a schema: langchain-core reads the questions as a dict
            request = {**request, "questions": built.questions.asked}
        try:
            return await super()._aclassify_and_record(request)  # type: ignore[return-value]
        finally:
            REQUEST.reset(token)

    def _from_input(self, value: Any) -> DecisionRequest:
        """The request an `invoke` input is: a prebuilt one (`{"request": ...}`, the harness's
        way), or one built from its keys."""
        if not isinstance(value, Mapping) or "state" not in value or "questions" not in value:
            raise DecisionError("a decision request is {'state': ..., 'questions': {...}}")
        prebuilt = value.get("request")
        if isinstance(prebuilt, DecisionRequest):
            return prebuilt
        options = {k: v for k, v in value.items() if k not in ("state", "questions") and v is not None}
        if options.keys() <= _KEYS:
            return self.request(value["state"], value["questions"], **options)
        if unknown := sorted(options.keys() - _KEYS - DECIDE.keys()):
            raise DecisionError(f"a decision request has no key(s) {unknown}; it takes state, questions and "
                                f"{', '.join(REQUEST_KEYS)}")
        return legacy_request(self, value["state"], value["questions"], options, "CanvasDecisionModel.invoke")

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
        with suppress(CanvasRouteError):  # the decision itself handles an engine that is down
            self._memo.served = (await self.engine.info()).model

    def _traced_config(self, config: RunnableConfig | None) -> RunnableConfig:
        config = super()._traced_config(config)
        if self._memo.served and "model" not in self.model_fields_set:
            config["metadata"]["ls_model_name"] = self._memo.served
        return config


def _check_audited(policy: GatePolicy) -> None:
    """An audit needs some question it can certify live: an entropy threshold and one read (no re-reads).

    Raises:
        ValueError: no question of `policy` (its default or an override) reads once.
    """
    if not any(live_gated(g) for g in (policy, *policy.per_question.values())):
        raise ValueError("Escalation(audit=...) certifies questions that are read once: give the gate rereads=0 "
                         "(and an entropy threshold); with re-reads, which reads a decision gets depends on the "
                         "threshold, so the rows of one threshold do not describe another")


@dataclass(slots=True)
class _Memo:
    """What a model keeps between decisions: its plans, parsed question sets, resolved escalation."""

    planner: Planner
    defaults: Defaults
    """What every request of the model starts from (its escalation with an in-process meter when it
    has a budget and none of its own)."""
    own_meter: bool = False
    """The caller gave the escalation its meter (a graph store does not replace it)."""
    own_state: bool = False
    """The caller gave the escalation its controller state (a graph store does not replace it)."""
    own_audit: bool = False
    """The caller gave the escalation its live certification state (a graph store does not replace it)."""
    served: str | None = None
    """The engine's served model name, once known (for callback tracers)."""
    only: CanvasDecisionModel | None = None
    """The model's `canvas_only()` copy, once made."""
    scopes: dict[tuple[str, str, str], str] = field(default_factory=dict)
    """`budget_scope`, `controller_scope` and `live_scope` by kind, model name and target name, once worked out."""
    notices: set[str] = field(default_factory=set)
    """The warnings the model's decisions have given (each once per model)."""


__all__ = ["REQUEST_KEYS", "CanvasDecisionModel", "QuestionSpec"]
