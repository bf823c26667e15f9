"""The server's logs: plain text or JSON lines, every record of a request carrying its `request_id`.

`request_scope(request_id)` marks the records logged while a request is answered (a context
variable read by `RequestIdFilter`); `log_config(fmt, level)` is the `logging.config`
dictionary `canvasroute serve` gives uvicorn, for its loggers and canvasroute's alike.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["JsonFormatter", "RequestIdFilter", "caller_request_id", "log_config", "request_scope"]

_REQUEST_ID: ContextVar[str | None] = ContextVar("canvasroute_request_id", default=None)
_CALLER_ID = re.compile(r"[!-~]{1,128}")
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id"}


def caller_request_id(value: str | None) -> str | None:
    """The caller's `X-Request-ID` when it is 1-128 visible ASCII characters (safe to log and
    forward), else None (the server makes one)."""
    return value if value is not None and _CALLER_ID.fullmatch(value) else None


@contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Records logged inside the block carry `request_id`."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` (None outside a request) unless the record already has one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, any `extra=` fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if (request_id := getattr(record, "request_id", None)) is not None:
            out["request_id"] = request_id
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def log_config(fmt: str, level: str) -> dict[str, Any]:
    """`logging.config.dictConfig` for `canvasroute serve`: `fmt` is `text` or `json`."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")
    formatter = ({"()": JsonFormatter} if fmt == "json"
                 else {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"})
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "main",
               "filters": ["request_id"]}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"main": formatter},
        "handlers": {"main": handler},
        "root": {"handlers": ["main"], "level": level.upper()},
        "loggers": {name: {"handlers": [], "level": level.upper(), "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
