"""canvasroute: LangGraph branch decisions as one DiffusionGemma canvas read.

The one import surface. Names live in three layers (`harness` → `router` → `engine`,
the data flow) and are re-exported here, so users need not know which layer holds what:

```python
from canvasroute import CanvasDecisionModel, GatePolicy, VLLMServerEngine, decision_node, retry_on
```

Names are imported on first use: `import canvasroute` loads neither LangGraph nor torch.
Import from here: the layer packages' generic top-level names (`engine`, `router`,
`harness`) would clash with another distribution installing the same names.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import (
        BudgetExhausted,
        CalibrationError,
        CanvasRead,
        CanvasRouteError,
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
        FunctionEngine,
        ImagesUnsupported,
        InputTooLong,
        LabelError,
        ReadResult,
        TraceFileError,
        TransformersEngine,
        UnsupportedQuestion,
        VLLMEngine,
        VLLMServerEngine,
        embedded_engine,
    )
    from harness import (
        DecisionEdge,
        DecisionNode,
        ReviewPolicy,
        StoreBudgetMeter,
        decision_node,
        merge_decisions,
        retry_on,
        route_on,
    )
    from router import (
        CanvasDecisionModel,
        CanvasResponse,
        DecisionCache,
        EscalationBudget,
        GatePolicy,
        ReadReport,
        SystemOneDecisionModel,
        load_policy,
        save_policy,
    )

_LAYERS = {
    "engine": [
        "BudgetExhausted", "CalibrationError", "CanvasRead", "CanvasRouteError", "DecisionError",
        "EmbeddedModelMissing", "Engine", "EngineInfo", "EngineOverloaded", "EngineRequestError",
        "EngineResponseError", "EngineTimeout", "EngineUnavailable", "EscalationError", "FunctionEngine",
        "ImagesUnsupported", "InputTooLong", "LabelError", "ReadResult", "TraceFileError", "TransformersEngine",
        "UnsupportedQuestion", "VLLMEngine", "VLLMServerEngine", "embedded_engine",
    ],
    "router": [
        "CanvasDecisionModel", "CanvasResponse", "DecisionCache", "EscalationBudget", "GatePolicy", "ReadReport",
        "SystemOneDecisionModel", "load_policy", "save_policy",
    ],
    "harness": [
        "DecisionEdge", "DecisionNode", "ReviewPolicy", "StoreBudgetMeter", "decision_node", "merge_decisions",
        "retry_on", "route_on",
    ],
}
_HOME = {name: layer for layer, names in _LAYERS.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canvasroute' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
