"""Every error canvasroute raises, in one tree.

```
CanvasRouteError                  every error this library raises; `retryable`, `hint`
├── EngineUnavailable             ConnectionError: transient, retry later          retryable
│   ├── EngineTimeout             a read or connection timed out (also TimeoutError) retryable
│   └── EngineOverloaded          the engine shed load (429/503/529)                retryable
├── EngineRequestError            ValueError: the engine refused the request (4xx)
├── EngineResponseError           the engine answered something a read cannot be
├── EscalationError               the escalation target failed or answered garbage  retryable if it timed out or was unreachable
├── BudgetExhausted               escalation was needed, the budget is spent, policy says raise
├── UnsureAnswer                  the gate stayed unsure, nothing to escalate to, on_unsure says raise
├── DecisionError                 ValueError: the questions cannot be asked as given
│   ├── UnsupportedQuestion       a question type with no canvas form (e.g. Box)
│   ├── LabelError                labels that cannot be one token at one slot
│   ├── InputTooLong              state or questions do not fit the model
│   └── ImagesUnsupported         the state holds images this engine or server cannot take
├── CalibrationError              ValueError: calibration input that cannot be used
├── TraceFileError                ValueError: a trace file that cannot be read
└── EmbeddedModelMissing          ValueError: the embedded model's wheel is not installed
```

`retryable` is decided per class, on purpose: only a fault that may pass by itself is
retryable (a server that is down, slow or shedding load; an escalation target that
timed out or could not be reached). A malformed engine answer, a refused request, a spent
budget and misuse are not: retrying them costs reads and escalations and cannot help.
`canvasroute.harness.retry_on` gives LangGraph exactly this rule.

(`canvasroute serve` turns these into HTTP answers; its `Refusal` is such an answer and its
`ClientGone` is control flow inside the server: neither reaches a caller as an exception.)
"""

from __future__ import annotations

__all__ = [
    "BudgetExhausted",
    "CalibrationError",
    "CanvasRouteError",
    "DecisionError",
    "EmbeddedModelMissing",
    "EngineOverloaded",
    "EngineRequestError",
    "EngineResponseError",
    "EngineTimeout",
    "EngineUnavailable",
    "EscalationError",
    "ImagesUnsupported",
    "InputTooLong",
    "LabelError",
    "TraceFileError",
    "UnsupportedQuestion",
    "UnsureAnswer",
]


class CanvasRouteError(Exception):
    """Base class of every canvasroute error."""

    retryable: bool = False
    """Whether retrying the same call later may succeed (a transient fault)."""

    def __init__(self, message: str, *, hint: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message


class EngineUnavailable(CanvasRouteError, ConnectionError):
    """The engine could not be reached or is failing; retrying later may work."""

    retryable = True


class EngineTimeout(EngineUnavailable, TimeoutError):
    """A connection or read did not finish within its timeout."""


class EngineOverloaded(EngineUnavailable):
    """The engine shed load (HTTP 429, 503 or 529)."""


class EngineRequestError(CanvasRouteError, ValueError):
    """The engine refused the request; `status` and the engine's message are kept."""

    def __init__(self, message: str, *, status: int | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.status = status


class EngineResponseError(CanvasRouteError):
    """The engine answered, but not with what a read must return (e.g. a slot row
    without every requested label id)."""


class EscalationError(CanvasRouteError):
    """The escalation target failed, timed out, or answered outside the allowed options.

    Retryable only when the target timed out or could not be reached."""


class BudgetExhausted(CanvasRouteError):
    """Escalation was needed, the budget is spent, and the budget says raise."""


class UnsureAnswer(CanvasRouteError):
    """A question stayed over the gate after its re-reads, nothing could answer it instead
    (no escalation target), and `GatePolicy(on_unsure="raise")` says raise."""


class DecisionError(CanvasRouteError, ValueError):
    """The questions cannot be asked as given (found before any request is sent)."""


class UnsupportedQuestion(DecisionError):
    """A question type that has no canvas form."""


class LabelError(DecisionError):
    """Labels that cannot each be one token at one shared slot, or too many of them."""


class InputTooLong(DecisionError):
    """The state or the question set does not fit the model's context or canvas."""


class CalibrationError(CanvasRouteError, ValueError):
    """Calibration input that cannot be used (no rows, a gold label that is no option, ...)."""


class TraceFileError(CanvasRouteError, ValueError):
    """A trace file that cannot be read (missing, or neither span JSONL nor OTLP JSON)."""


class EmbeddedModelMissing(CanvasRouteError, ValueError):
    """The embedded model's wheel is not installed."""


class ImagesUnsupported(DecisionError):
    """The state holds images and this engine (or its server) cannot take them.

    Raised before any read: by the router when `EngineInfo.accepts_images` is False
    (completions endpoint, in-process causal LMs, FunctionEngine), and by
    `VLLMServerEngine` when the server refuses image parts (e.g. started with
    `--limit-mm-per-prompt '{"image": 0}'`, or a text-only model)."""
