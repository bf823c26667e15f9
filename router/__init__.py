"""Decisions: questions about a state become canvas reads, gated and escalated.

`router` knows questions and policies, not LangGraph (that is `harness`), and reaches
the model only through the `engine` protocol.
"""

from ._distribution import SlotStats, aggregate, slot_stats
from ._escalation import EscalationError
from ._model import BudgetExhausted, CanvasDecisionModel, render_state
from ._policy import EscalationBudget, GatePolicy
from ._types import CanvasResponse, ReadReport

__all__ = [
    "BudgetExhausted",
    "CanvasDecisionModel",
    "CanvasResponse",
    "EscalationBudget",
    "EscalationError",
    "GatePolicy",
    "ReadReport",
    "SlotStats",
    "aggregate",
    "render_state",
    "slot_stats",
]
