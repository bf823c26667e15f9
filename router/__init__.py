"""Decisions: questions about a state become canvas reads, gated and escalated.

`router` knows questions and policies, not LangGraph (that is `harness`), and reaches
the model only through the `engine` protocol.
"""

from ._calibration import (
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
from ._model import CanvasDecisionModel, render_state
from ._policy import EscalationBudget, GatePolicy
from ._types import CanvasResponse, ReadReport
from .systemone import SystemOneDecisionModel

__all__ = [
    "Calibration",
    "CanvasDecisionModel",
    "CanvasResponse",
    "EscalationBudget",
    "GatePolicy",
    "Labelled",
    "QuestionCalibration",
    "ReadReport",
    "SlotStats",
    "SystemOneDecisionModel",
    "aggregate",
    "calibrate",
    "expected_calibration_error",
    "fit_temperature",
    "load_policy",
    "render_state",
    "save_policy",
    "slot_stats",
]
