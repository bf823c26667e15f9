"""Decisions: questions about a state become canvas reads, gated and escalated.

`router` knows questions and policies, not LangGraph (that is `harness`), and reaches
the model only through the `engine` protocol. The modules follow one decision:

```
_questions   validate_questions / parse_questions: the one validator (model, client, server)
_labels      one-token labels at a slot, checked against the engine's tokenizer
_prompts     the system prompt (questions, defused) and the answer-canvas text
_options     how a decision is read: instructions, alone, steps, think, images
_plan        chunks that fit a canvas (lines or compact answers), slots, two-read routes
_reading     samples, per-chunk re-reads, second reads -> per-question distributions (_think)
_depends     dependency stages, conditions, restated answers
_distribution  entropy, margin, label mass; re-read aggregation
_outcome     gate, budget (_budget), fallback, fault -> escalation (_escalation) -> reports
_diagnostics how the decision was read (stages, chunks, formats, thoughts)
_model       CanvasDecisionModel: the BaseDecisionModel that connects them
_schema      questions from a pydantic model or TypedDict, answers back into it (with_structured_output)
systemone    SystemOneDecisionModel: the same answers from any /v1/systemone server
```

Public modules beside this surface: `canvasroute.router.telemetry` (span and attribute names,
`JsonlSpanExporter`, `add_otlp_exporter`), `canvasroute.router.calibration` (the math) and
`canvasroute.router.testing` (`ScriptedTarget`, an escalation target for tests).
"""

from typing import Any

from ._budget import BudgetMeter, InMemoryBudgetMeter
from ._cache import DecisionCache
from ._diagnostics import Diagnostics, ThoughtReport
from ._distribution import SlotStats, aggregate, slot_stats
from ._escalation import Escalated, escalate, target_name
from ._images import image_digests
from ._model import CanvasDecisionModel
from ._options import MAX_STEPS, MAX_THINK, READ_KEYS, fixed_read_options
from ._policy import MAX_SAMPLES, EscalationBudget, GatePolicy
from ._policy_file import load_policy, save_policy
from ._questions import ABSTAIN, MAX_OPTIONS, QuestionSpec, parse_questions, question_set_key, validate_questions
from ._schema import StructuredDecision, answers_to_schema, questions_from_schema
from ._state import read_state, render_state, state_images
from ._tally import Tally
from ._types import CanvasResponse, ReadReport
from .calibration import (
    Calibration,
    Labelled,
    QuestionCalibration,
    calibrate,
    expected_calibration_error,
    fit_temperature,
)
from .systemone import SystemOneDecisionModel
from .telemetry import add_otlp_exporter

__all__ = [
    "ABSTAIN",
    "MAX_OPTIONS",
    "MAX_SAMPLES",
    "MAX_STEPS",
    "MAX_THINK",
    "READ_KEYS",
    "BudgetMeter",
    "Calibration",
    "CanvasDecisionModel",
    "CanvasResponse",
    "DecisionCache",
    "Diagnostics",
    "Escalated",
    "EscalationBudget",
    "GatePolicy",
    "InMemoryBudgetMeter",
    "JsonlSpanExporter",
    "Labelled",
    "QuestionCalibration",
    "QuestionSpec",
    "ReadReport",
    "SlotStats",
    "StructuredDecision",
    "SystemOneDecisionModel",
    "Tally",
    "ThoughtReport",
    "add_otlp_exporter",
    "aggregate",
    "answers_to_schema",
    "calibrate",
    "escalate",
    "expected_calibration_error",
    "fit_temperature",
    "fixed_read_options",
    "image_digests",
    "load_policy",
    "parse_questions",
    "question_set_key",
    "questions_from_schema",
    "read_state",
    "render_state",
    "save_policy",
    "slot_stats",
    "state_images",
    "target_name",
    "validate_questions",
]


def __getattr__(name: str) -> Any:
    if name == "JsonlSpanExporter":  # loads the OTel SDK: only when asked for
        from .telemetry import JsonlSpanExporter

        return JsonlSpanExporter
    raise AttributeError(f"module 'canvasroute.router' has no attribute {name!r}")
