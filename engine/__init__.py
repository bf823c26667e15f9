"""The single-step engine: canvases in, slot log-probabilities out.

`engine` knows tokens and logprobs, not questions (that is `router`). Backends share
one small protocol, `Engine`:

- `VLLMServerEngine`: vLLM's OpenAI-compatible server over HTTP (the production path).
- `VLLMEngine`: vLLM in-process (extra `[vllm]`).
- `TransformersEngine`: in-process torch, DiffusionGemma or a causal LM (extra `[local]`).
- `FunctionEngine`: a test double driven by a function.

Every error the library raises lives in `canvasroute.engine.errors`, re-exported here. Shared parts:
`Connection` (HTTP with replicas, retries and typed errors), `forward_headers` (headers every
request inside a block carries, e.g. a caller's request id), `MAX_LABEL_IDS` (vLLM's cap
per read), `check_rows` (every requested label id at every slot), `defuse` (special-token
text made harmless). Test doubles and the vLLM-wire fake live in `canvasroute.engine.testing`.
"""

from typing import TYPE_CHECKING, Any

from ._function import FunctionEngine
from ._headers import forward_headers
from ._http import Connection
from ._server import VLLMServerEngine
from ._sync import run_sync
from ._text import SPECIAL_CANDIDATES, THOUGHT_SCAFFOLD, defuse
from ._types import CanvasRead, Engine, EngineInfo, Message, ReadResult, Thought, check_rows
from ._wire import MAX_LABEL_IDS
from .errors import (
    BudgetExhausted,
    CalibrationError,
    CanvasRouteError,
    DecisionError,
    EmbeddedModelMissing,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    EscalationError,
    GraphSetupError,
    ImagesUnsupported,
    InputTooLong,
    LabelError,
    TraceFileError,
    UnsupportedQuestion,
    UnsureAnswer,
)

if TYPE_CHECKING:
    from ._embedded import embedded_cache_dir, embedded_engine
    from ._transformers import TransformersEngine
    from ._vllm import VLLMEngine

__all__ = [
    "MAX_LABEL_IDS",
    "SPECIAL_CANDIDATES",
    "THOUGHT_SCAFFOLD",
    "BudgetExhausted",
    "CalibrationError",
    "CanvasRead",
    "CanvasRouteError",
    "Connection",
    "DecisionError",
    "EmbeddedModelMissing",
    "Engine",
    "EngineInfo",
    "EngineOverloaded",
    "EngineRequestError",
    "EngineResponseError",
    "EngineTimeout",
    "EngineUnavailable",
    "EscalationError",
    "GraphSetupError",
    "FunctionEngine",
    "ImagesUnsupported",
    "InputTooLong",
    "LabelError",
    "Message",
    "ReadResult",
    "Thought",
    "TraceFileError",
    "TransformersEngine",
    "UnsupportedQuestion",
    "UnsureAnswer",
    "VLLMEngine",
    "VLLMServerEngine",
    "check_rows",
    "defuse",
    "embedded_cache_dir",
    "embedded_engine",
    "forward_headers",
    "run_sync",
]

_LAZY = {
    "TransformersEngine": "._transformers",
    "VLLMEngine": "._vllm",
    "embedded_cache_dir": "._embedded",
    "embedded_engine": "._embedded",
}


def __getattr__(name: str) -> Any:
    """Import the heavy backends (torch, vllm) only when asked for."""
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canvasroute.engine' has no attribute {name!r}")
