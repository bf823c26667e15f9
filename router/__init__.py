"""Decisions: questions about a state become canvas reads, gated and escalated.

`router` knows questions and policies, not LangGraph (that is `harness`), and reaches
the model only through the `engine` protocol. Public modules beside this surface:
`router.telemetry` (span and attribute names) and `router.calibration` (the math).
"""

from .calibration import (
    Calibration,
    Labelled,
    QuestionCalibration,
    calibrate,
    expected_calibration_error,
    fit_temperature,
    load_policy,
    save_policy,
)
from ._distribution import SlotStats, aggregate, slot_stats
from ._budget import BudgetMeter, InMemoryBudgetMeter
from ._cache import DecisionCache
from ._model import CanvasDecisionModel, render_state
from ._policy import EscalationBudget, GatePolicy
from ._questions import MAX_OPTIONS, QuestionSpec, parse_questions, validate_questions
from ._types import CanvasResponse, ReadReport
from .systemone import SystemOneDecisionModel

__all__ = [
    "BudgetMeter",
    "Calibration",
    "CanvasDecisionModel",
    "CanvasResponse",
    "DecisionCache",
    "EscalationBudget",
    "GatePolicy",
    "InMemoryBudgetMeter",
    "Labelled",
    "MAX_OPTIONS",
    "QuestionCalibration",
    "QuestionSpec",
    "ReadReport",
    "SlotStats",
    "SystemOneDecisionModel",
    "aggregate",
    "calibrate",
    "expected_calibration_error",
    "fit_temperature",
    "load_policy",
    "parse_questions",
    "render_state",
    "save_policy",
    "slot_stats",
    "validate_questions",
]
