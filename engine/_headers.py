"""`forward_headers`: headers every engine request made inside a block carries (e.g. a caller's request id)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

__all__ = ["forward_headers", "forwarded"]

_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_FORWARDED: ContextVar[Mapping[str, str]] = ContextVar("canvasroute_forwarded_headers", default=MappingProxyType({}))


@contextmanager
def forward_headers(headers: Mapping[str, str]) -> Iterator[None]:
    """Send `headers` with every HTTP request an engine or client makes inside the block,
    in this task and the tasks it starts (a context variable). Nested blocks add to the outer.

    `canvasroute serve` uses it to pass the caller's `X-Request-ID` to vLLM on every read.

    Example:
        ```python
        with forward_headers({"x-request-id": "req-42"}):
            await model.adecide(state, questions)
        ```
    """
    for name, value in headers.items():
        if not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
            raise ValueError(f"invalid header to forward {name[:100]!r}: a name must be a token and a value may "
                             "hold no control character")
    token = _FORWARDED.set({**_FORWARDED.get(), **{k.lower(): v for k, v in headers.items()}})
    try:
        yield
    finally:
        _FORWARDED.reset(token)


def forwarded() -> Mapping[str, str]:
    """The headers `forward_headers` set for the current context (empty outside any block)."""
    return _FORWARDED.get()
