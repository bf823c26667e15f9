"""Field checks and the error shape of `/v1/decisions`: every request error is a 400 naming its field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ..wire import Refusal

__all__ = ["DecisionsWireError", "Path", "array", "error_body", "fail", "from_refusal", "mapping", "missing",
           "one_of", "optional", "param_of", "required", "string", "type_name"]


def error_body(message: str, *, status: int = 400, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body. `type` defaults by status: `invalid_request_error` below 500,
    `server_error` from 500 (the SDK picks its exception class by the status alone)."""
    kind = type or ("server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class DecisionsWireError(Exception):
    """An error answer of `/v1/decisions`: status, message, the field it is about, a stable code."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The error body (`error_body`)."""
        return error_body(self.message, status=self.status, param=self.param, code=self.code)


_REQUEST_ERRORS = (413, 415, 422)
"""What `/v1/systemone` answers 413, 415 or 422 is a request error: 400 here, as on OpenAI's API."""


def from_refusal(refusal: Refusal) -> DecisionsWireError:
    """The `/v1/systemone` server's error answer (status, stable kind, message, headers such
    as `retry-after`) in OpenAI's shape: its kind becomes the `code`. A request error it answers
    413, 415 or 422 is a 400 (the SDK's `BadRequestError`); a 401's code is `invalid_api_key`
    (OpenAI's); every other status is kept (401, 408, 429, 5xx: the SDK maps or retries each,
    waiting what `retry-after` says)."""
    status, code = refusal.status, refusal.kind
    if status in _REQUEST_ERRORS:
        status = 400
    elif status == 401:
        code = "invalid_api_key"
    return DecisionsWireError(refusal.message, status=status, code=code, headers=refusal.headers)


Path = tuple[str | int, ...]
"""Where a field is: `("questions", 3, "choices")` is `questions[3].choices`."""


def param_of(path: Path) -> str:
    """`("questions", 3, "choices")` -> `questions[3].choices`."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def fail(path: Path, message: str, code: str = "invalid_value") -> NoReturn:
    where = param_of(path)
    raise DecisionsWireError(f"Invalid '{where}': {message}" if where else message, param=where or None, code=code)


def missing(path: Path) -> NoReturn:
    where = param_of(path)
    raise DecisionsWireError(f"Missing required parameter: '{where}'.", param=where, code="missing_required_parameter")


def required(data: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in data:
        missing((*path, key))
    return data[key]


def string(value: Any, path: Path, *, empty: bool = True, limit: int | None = None) -> str:
    if not isinstance(value, str):
        fail(path, f"expected a string, got {type_name(value)}.", "invalid_type")
    if not empty and not value.strip():
        fail(path, "must not be empty.", "empty_string")
    if limit is not None and len(value) > limit:
        fail(path, f"over {limit} characters.", "string_above_max_length")
    return value


def mapping(value: Any, path: Path) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        fail(path, f"expected an object, got {type_name(value)}.", "invalid_type")
    return value


def array(value: Any, path: Path) -> Sequence[Any]:
    if not isinstance(value, list):
        fail(path, f"expected an array, got {type_name(value)}.", "invalid_type")
    return value


def one_of(value: Any, allowed: Sequence[str], path: Path) -> str:
    if not isinstance(value, str) or value not in allowed:
        shown = repr(value)[:60]
        fail(path, f"{shown} is not one of {', '.join(map(repr, allowed))}.")
    return value


def optional(data: Mapping[str, Any], key: str, allowed: Sequence[str], path: Path) -> str | None:
    value = data.get(key)
    return None if value is None else one_of(value, allowed, (*path, key))


def type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)

