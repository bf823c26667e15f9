"""The single-step engine: canvases in, slot log-probabilities out.

`engine` knows tokens and logprobs, not questions (that is `router`). Backends share
one small protocol, `Engine`:

- `VLLMServerEngine`: vLLM's OpenAI-compatible server over HTTP (the production path).
- `CausalServerEngine`: a causal LM on an OpenAI-compatible server, read at each slot for its
  exact label logprobs (`server_kind` tells which of the two a server needs).
- `VLLMEngine`: vLLM in-process (extra `[vllm]`).
- `TransformersEngine`: in-process torch, DiffusionGemma or a causal LM (extra `[local]`).
- `FunctionEngine`: a test double driven by a function.

Every error the library raises lives in `canvasroute.engine.errors`, re-exported here. Shared parts:
`Connection` (HTTP with replicas, retries and typed errors, told by `Timeout`, `Limits` and
`Retries`; also what escalation clients use, through `Connection.openai_options()`),
`forward_headers` (headers every request inside a block carries, e.g. a caller's request id),
`MAX_LABEL_IDS` (vLLM's cap per read), `check_rows` (every requested label id at every slot),
`defuse` (special-token text made harmless). Test doubles and the vLLM-wire fake live in
`canvasroute.engine.testing`.

Rooms, by job: `transport/` (the connection), `vllm/` (both vLLM engines and their wire), `causal/`
(the causal-LM server engine), `local/` (torch engines and the embedded default), and beside them
the values and protocol
(`_types.py`), prompts (`_prompts.py`), the sync path (`_sync.py`), `FunctionEngine`, the errors.
"""

from typing import TYPE_CHECKING, Any

from ._function import FunctionEngine
from ._prompts import SPECIAL_CANDIDATES, defuse
from ._sync import run_sync
from ._types import THOUGHT_SCAFFOLD, Batching, CanvasRead, Engine, EngineInfo, Message, ReadResult, Thought, check_rows
from .causal import CausalServerEngine, server_kind
from .errors import (
    BreakerOpen,
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
    ExtraMissing,
    GraphSetupError,
    ImagesUnsupported,
    InputTooLong,
    LabelError,
    TraceFileError,
    UnsupportedQuestion,
    UnsureAnswer,
)
from .transport import Connection, Limits, Retries, Timeout, forward_headers
from .vllm import MAX_LABEL_IDS, VLLMEngine, VLLMServerEngine

if TYPE_CHECKING:
    from .local import TransformersEngine, embedded_cache_dir, embedded_engine

__all__ = [
    "MAX_LABEL_IDS",
    "SPECIAL_CANDIDATES",
    "THOUGHT_SCAFFOLD",
    "Batching",
    "BreakerOpen",
    "BudgetExhausted",
    "CalibrationError",
    "CanvasRead",
    "CanvasRouteError",
    "CausalServerEngine",
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
    "ExtraMissing",
    "FunctionEngine",
    "GraphSetupError",
    "ImagesUnsupported",
    "InputTooLong",
    "LabelError",
    "Limits",
    "Message",
    "ReadResult",
    "Retries",
    "Thought",
    "Timeout",
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
    "server_kind",
]

_LOCAL = ("TransformersEngine", "embedded_cache_dir", "embedded_engine")


def __getattr__(name: str) -> Any:
    """Import the torch backends only when asked for."""
    if name in _LOCAL:
        from . import local

        value = getattr(local, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canvasroute.engine' has no attribute {name!r}")
