"""The server's bounds: what one request may carry (`Limits`, decided from the body alone, before a slot is
taken or the engine is asked) and what a connection is granted (`ConnectionLimits`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConnectionLimits", "Limits"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What one `/v1/systemone` request may carry. Over a size bound: 413; over a count or length: 422
    (vLLM's gateway's code for a schema it will not take; these bounds are stricter than its own)."""

    max_body_bytes: int = 1 << 20
    """Largest body, raw and decoded (413 `payload_too_large`)."""
    body_timeout: float = 10.0
    """Seconds to receive the whole body; a slower upload gets 408 `body_timeout` and never holds a slot."""
    max_depth: int = 32
    """Deepest JSON nesting anywhere in the body (400 `invalid_json`)."""
    max_questions: int = 64
    """Questions per request (422 `too_many_questions`)."""
    max_options: int = 64
    """Options of one Choice (422 `too_many_options`)."""
    max_levels: int = 32
    """Levels of one Score (422 `too_many_levels`)."""
    max_state_chars: int = 65_536
    """Characters of the state, as compact JSON when it is an object or array (413 `state_too_large`)."""
    max_text_chars: int = 8_192
    """Characters of one question's instructions or of one criterion, as compact JSON (422 `text_too_long`)."""
    max_name_chars: int = 256
    """Characters of a question id, an option name, `model` or `thread_id` (422 `name_too_long`)."""

    def __post_init__(self) -> None:
        _check_positive(self)

    def describe(self) -> str:
        """One line per bound (for `--help` and docs)."""
        return "; ".join(f"{name}={getattr(self, name):g}" for name in self.__slots__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ConnectionLimits:
    """What the server grants a connection, and how long shutdown may take."""

    max_connections: int = 1024
    """Open client connections at once; past it a new one is answered 503 and closed."""
    head_timeout: float = 10.0
    """Seconds for a request head (request line and headers) to arrive in full; past it, 408 and closed."""
    keep_alive: float = 5.0
    """Seconds an idle kept-alive connection stays open (uvicorn's `timeout_keep_alive`)."""
    shutdown_timeout: float = 10.0
    """Seconds requests in flight may take to finish once shutdown begins; then they are answered 503."""

    def __post_init__(self) -> None:
        _check_positive(self)


def _check_positive(bounds: object) -> None:
    for name in bounds.__slots__:  # type: ignore[attr-defined]
        if getattr(bounds, name) <= 0:
            raise ValueError(f"{type(bounds).__name__}.{name} must be positive")
