"""Request and reply bodies: JSON both ways (orjson when installed), a refusal's message, `Retry-After`."""

from __future__ import annotations

import json
import time
from email.utils import parsedate_to_datetime
from typing import Any

from ._protocol import Answer

try:  # optional: decodes the large read responses ~3x faster than the json module
    from orjson import OPT_NON_STR_KEYS
    from orjson import dumps as _fast_dumps
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_dumps = _fast_loads = None

MAX_RETRY_AFTER = 30.0
"""Longest `Retry-After` honoured, in seconds."""


def dumps(body: Any) -> bytes:
    """Compact UTF-8 JSON of a request body (orjson when installed)."""
    if _fast_dumps is not None:
        return _fast_dumps(body, option=OPT_NON_STR_KEYS)  # int keys become strings, as with json
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def loads(content: bytes) -> Any:
    """JSON from bytes: orjson when installed, the json module otherwise (and for the
    NaN/Infinity literals orjson refuses, so both decode exactly the same documents)."""
    if _fast_loads is not None:
        try:
            return _fast_loads(content)
        except ValueError:
            pass
    return json.loads(content)


def text(resp: Answer) -> str:
    """The body as text (UTF-8, undecodable bytes replaced)."""
    return resp.content.decode("utf-8", "replace")


def error_message(resp: Answer) -> str:
    """The server's error message: OpenAI's `{"error": {"message"}}`, `message`, `detail`, or the text."""
    try:
        body = loads(resp.content)
    except ValueError:
        return text(resp)[:500] or f"HTTP {resp.status}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for value in (err, body.get("message"), body.get("detail")):
            if isinstance(value, str):
                return value
    return json.dumps(body)[:500]


def retry_after(resp: Answer) -> float:
    """Seconds the server asked us to wait, as a number or an HTTP date (capped at
    `MAX_RETRY_AFTER`); 0 when it did not say or said something unreadable."""
    raw = (resp.headers.get("retry-after") or "").strip()
    if not raw:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return 0.0
    return min(MAX_RETRY_AFTER, max(0.0, seconds)) if seconds == seconds else 0.0
