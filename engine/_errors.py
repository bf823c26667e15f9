"""The error tree.

```
CanvasRouteError                 every error this library raises
├── EngineUnavailable            ConnectionError: transient, retry later
│   ├── EngineTimeout            a read or connection timed out
│   └── EngineOverloaded         the engine said 429/503/529
├── EngineRequestError           ValueError: the engine refused the request (HTTP 4xx)
├── EngineResponseError          the engine answered something unreadable
└── DecisionError                ValueError: the questions cannot be asked as given
    ├── UnsupportedQuestion      a question type with no canvas form (e.g. Box)
    ├── LabelError               a label set that cannot be one token at one slot
    └── InputTooLong             state or questions do not fit the model
EscalationError                  (router) the escalation target failed or answered garbage
BudgetExhausted                  (router) the escalation budget is spent and policy says raise
```

Transient faults subclass `ConnectionError` and misuse subclasses `ValueError`, so
LangGraph's default `RetryPolicy` retries the first and not the second. Every error
carries `retryable` and a `hint`.
"""

from __future__ import annotations


class CanvasRouteError(Exception):
    """Base class of every canvasroute error."""

    retryable: bool = False

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

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
    """The engine answered, but not with what a read must return."""


class DecisionError(CanvasRouteError, ValueError):
    """The questions cannot be asked as given (found before any request is sent)."""


class UnsupportedQuestion(DecisionError):
    """A question type that has no canvas form."""


class LabelError(DecisionError):
    """Labels that cannot each be one token at one shared slot, or too many of them."""


class InputTooLong(DecisionError):
    """The state or the question set does not fit the model's context or canvas."""
