"""Error answers on the wire: a stable `type` code and a short message, never a fault's details.

Every error body is `{"error": {"type", "message", "code", "param"?}}`; 415 and 422 also
carry FastAPI's validation list, `{"detail": [{"loc", "msg", "type"}]}`, which Jev clients
read. What went wrong inside (an engine URL, the engine's reply, a traceback) goes to the
log and the request's span under its `x-request-id`, never into a reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from starlette.responses import JSONResponse

from canvasroute.engine import (
    BreakerOpen,
    BudgetExhausted,
    DecisionError,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    EscalationError,
    ImagesUnsupported,
    InputTooLong,
    LabelError,
    UnsupportedQuestion,
)

__all__ = ["Refusal", "from_exception", "malformed", "public_name"]

_RETRY = {"retry-after": "1"}


class Refusal(Exception):  # a wire answer, not a library error (those live in engine/errors.py)
    """An error answer: status, stable `type` code, short message, where in the body, headers."""

    def __init__(self, status: int, kind: str, message: str, *, loc: Sequence[str | int] | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.loc = tuple(loc) if loc is not None else None
        self.headers = dict(headers or {})

    @property
    def param(self) -> str | None:
        """The dotted body path the error is about (`questions.q.type`), when there is one."""
        return ".".join(map(str, self.loc)) if self.loc else None

    def response(self, request_id: str | None = None) -> JSONResponse:
        error: dict[str, Any] = {"type": self.kind, "message": self.message, "code": self.status}
        if self.param is not None:
            error["param"] = self.param
        body: dict[str, Any] = {"error": error}
        if self.status in (415, 422):
            where = ["header", "content-type"] if self.status == 415 else ["body", *(self.loc or ())]
            body["detail"] = [{"loc": where, "msg": self.message, "type": self.kind}]
        headers = {**self.headers, **({"x-request-id": request_id} if request_id else {})}
        return JSONResponse(body, status_code=self.status, headers=headers)


def malformed(loc: Sequence[str | int], message: str, kind: str = "invalid_request") -> Refusal:
    """A 422 about one place in the body."""
    where = ".".join(map(str, loc))
    return Refusal(422, kind, f"{where}: {message}" if where else message, loc=loc)


def from_exception(exc: BaseException) -> Refusal:
    """The answer for an exception raised while deciding: a fixed message for every fault."""
    if isinstance(exc, ImagesUnsupported):  # its message names the engine and its model: not for the wire
        return Refusal(422, "images_unsupported", "this server's engine cannot read images; send text or JSON "
                       "state only")
    if isinstance(exc, DecisionError):  # about the client's own questions: its message helps and leaks nothing
        kind = ("unsupported_question" if isinstance(exc, UnsupportedQuestion) else "label_error"
                if isinstance(exc, LabelError) else "input_too_long" if isinstance(exc, InputTooLong)
                else "invalid_question")
        return Refusal(422, kind, str(exc))  # vLLM's gateway: an unusable schema or template is 422
    if isinstance(exc, BudgetExhausted):
        return Refusal(429, "escalation_budget_exhausted", "the escalation budget is spent; retry later",
                       headers=_RETRY)
    if isinstance(exc, EngineOverloaded):
        return Refusal(529, "engine_overloaded", "the engine is overloaded; retry later", headers=_RETRY)
    if isinstance(exc, EngineTimeout):
        return Refusal(504, "engine_timeout", "the engine did not answer in time; retry later", headers=_RETRY)
    if isinstance(exc, EngineUnavailable):
        return Refusal(503, "engine_unavailable", "the engine is unavailable; retry later", headers=_RETRY)
    if isinstance(exc, BreakerOpen):
        return Refusal(503, "escalation_unavailable", "the escalation model is failing and is not being called; "
                       "retry later", headers=_RETRY)
    if isinstance(exc, EscalationError):
        return Refusal(502, "escalation_failed", "the escalation model failed to answer")
    if isinstance(exc, (EngineRequestError, EngineResponseError)):
        return Refusal(502, "engine_error", "the engine refused the request or answered something unreadable")
    return Refusal(500, "internal_error", "the server could not answer; its log has the details under the "
                   "x-request-id")


def public_name(name: str) -> str:
    """A served model's name as clients see it: a filesystem path becomes its last part."""
    if name.startswith(("/", "~", ".", "\\")) or (len(name) > 2 and name[1] == ":" and name[2] in "/\\"):
        return PurePath(name.replace("\\", "/")).name or "model"
    return name
