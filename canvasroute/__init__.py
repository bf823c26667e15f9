"""canvasroute: LangGraph branch decisions as one DiffusionGemma canvas read.

The one import surface. The library is one package whose layers follow the data flow,
applications → `canvasroute.harness` → `canvasroute.router` → `canvasroute.engine`; the
public API of the three layers is re-exported here, so users need not know which holds what:

```python
from canvasroute import CanvasDecisionModel, GatePolicy, VLLMServerEngine, decision_node, retry_on
```

Names are imported on first use: `import canvasroute` loads neither LangGraph nor torch.
The applications (CLI, `serve`, `bench`, `eval`, `calibrate`, `dashboard`, `demo`) live in
`canvasroute.apps` and use the library as a user would.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from canvasroute.engine import (
        Batching,
        BreakerOpen,
        BudgetExhausted,
        CalibrationError,
        CanvasRead,
        CanvasRouteError,
        CausalServerEngine,
        Connection,
        DecisionError,
        EmbeddedModelMissing,
        Engine,
        EngineInfo,
        EngineOverloaded,
        EngineRequestError,
        EngineResponseError,
        EngineTimeout,
        EngineUnavailable,
        EscalationError,
        ExtraMissing,
        FunctionEngine,
        GraphSetupError,
        ImagesUnsupported,
        InputTooLong,
        LabelError,
        Limits,
        ReadResult,
        Retries,
        Timeout,
        TraceFileError,
        TransformersEngine,
        UnsupportedQuestion,
        UnsureAnswer,
        VLLMEngine,
        VLLMServerEngine,
        embedded_engine,
    )
    from canvasroute.harness import (
        AuditInbox,
        DecisionEdge,
        DecisionNode,
        NodeCache,
        ReviewPolicy,
        StoreBudgetMeter,
        StoreControllerState,
        StoreLiveState,
        decision_node,
        merge_decisions,
        retry_on,
        route_on,
        run_totals,
    )
    from canvasroute.router import (
        Audit,
        Breaker,
        CanvasDecisionModel,
        CanvasResponse,
        Certificate,
        Controller,
        DecisionCache,
        DecisionRequest,
        Escalation,
        EscalationBudget,
        GatePolicy,
        Hedge,
        JsonlSpanExporter,
        OutcomePolicy,
        ReadOptions,
        ReadReport,
        SystemOneDecisionModel,
        Tally,
        Totals,
        add_otlp_exporter,
        answers_to_schema,
        load_policy,
        questions_from_schema,
        save_policy,
    )

_LAYERS = {
    "engine": [
        "Batching", "BreakerOpen", "BudgetExhausted", "CalibrationError", "CanvasRead", "CanvasRouteError",
        "CausalServerEngine", "Connection", "DecisionError", "EmbeddedModelMissing", "Engine", "EngineInfo",
        "EngineOverloaded", "EngineRequestError", "EngineResponseError", "EngineTimeout", "EngineUnavailable",
        "EscalationError", "ExtraMissing", "FunctionEngine", "GraphSetupError", "ImagesUnsupported", "InputTooLong",
        "LabelError", "Limits", "ReadResult", "Retries", "Timeout", "TraceFileError", "TransformersEngine",
        "UnsupportedQuestion", "UnsureAnswer", "VLLMEngine", "VLLMServerEngine", "embedded_engine",
    ],
    "router": [
        "Audit", "Breaker", "CanvasDecisionModel", "CanvasResponse", "Certificate", "Controller", "DecisionCache",
        "DecisionRequest", "Escalation", "EscalationBudget", "GatePolicy", "Hedge", "JsonlSpanExporter",
        "OutcomePolicy", "ReadOptions", "ReadReport", "SystemOneDecisionModel", "Tally", "Totals", "add_otlp_exporter",
        "answers_to_schema", "load_policy", "questions_from_schema", "save_policy",
    ],
    "harness": [
        "AuditInbox", "DecisionEdge", "DecisionNode", "NodeCache", "ReviewPolicy", "StoreBudgetMeter",
        "StoreControllerState", "StoreLiveState", "decision_node", "merge_decisions", "retry_on", "route_on",
        "run_totals",
    ],
}
_HOME = {name: layer for layer, names in _LAYERS.items() for name in names}

__all__ = [
    "Audit",
    "AuditInbox",
    "Batching",
    "Breaker",
    "BreakerOpen",
    "BudgetExhausted",
    "CalibrationError",
    "CanvasDecisionModel",
    "CanvasRead",
    "CanvasResponse",
    "CanvasRouteError",
    "CausalServerEngine",
    "Certificate",
    "Connection",
    "Controller",
    "DecisionCache",
    "DecisionEdge",
    "DecisionError",
    "DecisionNode",
    "DecisionRequest",
    "EmbeddedModelMissing",
    "Engine",
    "EngineInfo",
    "EngineOverloaded",
    "EngineRequestError",
    "EngineResponseError",
    "EngineTimeout",
    "EngineUnavailable",
    "Escalation",
    "EscalationBudget",
    "EscalationError",
    "ExtraMissing",
    "FunctionEngine",
    "GatePolicy",
    "GraphSetupError",
    "Hedge",
    "ImagesUnsupported",
    "InputTooLong",
    "JsonlSpanExporter",
    "LabelError",
    "Limits",
    "NodeCache",
    "OutcomePolicy",
    "ReadOptions",
    "ReadReport",
    "ReadResult",
    "Retries",
    "ReviewPolicy",
    "StoreBudgetMeter",
    "StoreControllerState",
    "StoreLiveState",
    "SystemOneDecisionModel",
    "Tally",
    "Timeout",
    "Totals",
    "TraceFileError",
    "TransformersEngine",
    "UnsupportedQuestion",
    "UnsureAnswer",
    "VLLMEngine",
    "VLLMServerEngine",
    "__version__",
    "add_otlp_exporter",
    "answers_to_schema",
    "decision_node",
    "embedded_engine",
    "load_policy",
    "merge_decisions",
    "questions_from_schema",
    "retry_on",
    "route_on",
    "run_totals",
    "save_policy",
]
"""Literal, so type checkers see the re-exports; `_LAYERS` says where each name lives."""


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(import_module(f"canvasroute.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canvasroute' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, once each (not this module's own imports)."""
    return sorted(set(__all__))
