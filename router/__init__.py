"""Decisions: questions about a state become canvas reads, gated and escalated.

`router` knows questions and policies, not LangGraph (that is `harness`), and reaches
the model only through the `engine` protocol. A decision is one frozen `DecisionRequest`,
built once where it enters and read by every stage; the modules follow it:

```
_model       CanvasDecisionModel: builds requests (`request`) and runs them (`arun`)
_request     DecisionRequest: state as read, questions, read options, gate, outcomes, escalation, identity
_questions   the one validator (model, client, server), canvas views of questions, dependencies
_state       how a state is rendered as text, and its images
_policy      GatePolicy, OutcomePolicy, Escalation, EscalationBudget, Controller, Hedge, Breaker, Audit; gate
             overrides; policy files
_plan        chunks that fit a canvas, one-token labels, prompts, two-read routes, length checks
_read        samples, per-chunk re-reads, in-group reads, thoughts -> per-question distributions
_decision    one run: stages, escalation under the budget (_budget), the outcome rules, reports
_control     the escalation-rate controller: thresholds set at a run's start, outcomes observed at its end
_audit       live certification: thresholds certified on the live traffic's labelled rows, at every moment
_hedge       hedged escalation: a borderline question's target call raced against its re-reads
_breaker     the escalation guards' state: the target's circuit breaker, the cap on what engine faults escalate
_escalation  the target call: prompt, structured output, reading the reply
_types       ReadReport, CanvasResponse, Diagnostics, Tally, Totals: the outcome vocabulary (path, cause, replay)
_schema      questions from a pydantic model or TypedDict, answers back into it (with_structured_output)
systemone    SystemOneDecisionModel, SystemOneResponse: the same answers from any /v1/systemone server
```

Public modules beside this surface: `canvasroute.router.telemetry` (span and attribute names,
`JsonlSpanExporter`, `add_otlp_exporter`) and `canvasroute.router.calibration` (the math).
"""

from typing import Any

from ._audit import InMemoryLiveState, Labeller
from ._breaker import BreakerState
from ._budget import BudgetMeter, InMemoryBudgetMeter
from ._cache import DecisionCache
from ._control import ControllerState, InMemoryControllerState
from ._escalation import ESCALATION_PROMPT, Asked, Escalated, escalate, target_name
from ._model import CanvasDecisionModel
from ._policy import (
    ACTIONS,
    MAX_SAMPLES,
    Audit,
    Breaker,
    Certificate,
    Controller,
    ControlSetting,
    Escalation,
    EscalationBudget,
    GatePolicy,
    Hedge,
    LiveFigures,
    OutcomePolicy,
    load_policy,
    resolve_gate,
    save_policy,
)
from ._questions import ABSTAIN, MAX_OPTIONS, QuestionSpec, parse_questions, validate_questions
from ._read import SlotStats, aggregate, slot_stats, system_one_confidence
from ._request import (
    MAX_STEPS,
    MAX_THINK,
    DecisionRequest,
    Identity,
    QuestionSet,
    ReadOptions,
    StateView,
    question_set_key,
    read_options,
)
from ._schema import StructuredDecision, answers_to_schema, questions_from_schema
from ._state import image_digests, read_state, render_state, state_images
from ._types import (
    CAUSES,
    PATHS,
    REPLAYS,
    CanvasResponse,
    Diagnostics,
    ReadReport,
    Replay,
    Tally,
    ThoughtReport,
    Totals,
)
from .calibration import (
    Calibration,
    Labelled,
    QuestionCalibration,
    calibrate,
    expected_calibration_error,
    fit_temperature,
)
from .systemone import SystemOneDecisionModel, SystemOneResponse
from .telemetry import add_otlp_exporter

__all__ = [
    "ABSTAIN",
    "ACTIONS",
    "CAUSES",
    "ESCALATION_PROMPT",
    "MAX_OPTIONS",
    "MAX_SAMPLES",
    "MAX_STEPS",
    "MAX_THINK",
    "PATHS",
    "REPLAYS",
    "Asked",
    "Audit",
    "Breaker",
    "BreakerState",
    "BudgetMeter",
    "Calibration",
    "CanvasDecisionModel",
    "CanvasResponse",
    "Certificate",
    "ControlSetting",
    "Controller",
    "ControllerState",
    "DecisionCache",
    "DecisionRequest",
    "Diagnostics",
    "Escalated",
    "Escalation",
    "EscalationBudget",
    "GatePolicy",
    "Hedge",
    "Identity",
    "InMemoryBudgetMeter",
    "InMemoryControllerState",
    "InMemoryLiveState",
    "JsonlSpanExporter",
    "Labelled",
    "Labeller",
    "LiveFigures",
    "OutcomePolicy",
    "QuestionCalibration",
    "QuestionSet",
    "QuestionSpec",
    "ReadOptions",
    "ReadReport",
    "Replay",
    "SlotStats",
    "StateView",
    "StructuredDecision",
    "SystemOneDecisionModel",
    "SystemOneResponse",
    "Tally",
    "ThoughtReport",
    "Totals",
    "add_otlp_exporter",
    "aggregate",
    "answers_to_schema",
    "calibrate",
    "escalate",
    "expected_calibration_error",
    "fit_temperature",
    "image_digests",
    "load_policy",
    "parse_questions",
    "question_set_key",
    "questions_from_schema",
    "read_options",
    "read_state",
    "render_state",
    "resolve_gate",
    "save_policy",
    "slot_stats",
    "state_images",
    "system_one_confidence",
    "target_name",
    "validate_questions",
]


def __getattr__(name: str) -> Any:
    if name == "JsonlSpanExporter":  # loads the OTel SDK: only when asked for
        from .telemetry import JsonlSpanExporter

        return JsonlSpanExporter
    raise AttributeError(f"module 'canvasroute.router' has no attribute {name!r}")
