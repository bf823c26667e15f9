"""`JsonlSpanExporter`: finished spans as JSON lines, the file `canvasroute dashboard` reads.

One line per finished span:

```json
{"name": "decide tiny-dgemma", "trace_id": "4bf9...", "span_id": "00f0...", "parent_id": null,
 "kind": "INTERNAL", "start_time_ns": 1700000000000000000, "end_time_ns": 1700000000250000000,
 "attributes": {"canvasroute.decision_set": "team"}, "status": {"code": "OK", "message": null},
 "events": [{"name": "canvasroute.question", "time_ns": 1700000000249000000,
             "attributes": {"canvasroute.question.id": "team", "canvasroute.decision.path": "canvas"}}],
 "resource": {"service.name": "support-bot"}}
```

Needs `opentelemetry-sdk` (extra `[otel]`).

Example:
    ```python
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter("spans.jsonl")))
    add_otlp_exporter(provider)           # and to any OTLP viewer, when OTEL_EXPORTER_OTLP_ENDPOINT is set
    trace.set_tracer_provider(provider)
    ```
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from canvasroute.engine._extras import require_extra

try:  # the SDK is an optional extra
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
except ImportError:  # pragma: no cover - exercised only without the SDK
    ReadableSpan = Any  # type: ignore[assignment,misc]
    SpanExporter = object  # type: ignore[assignment,misc]
    SpanExportResult = None  # type: ignore[assignment,misc]

__all__ = ["JsonlSpanExporter", "span_json"]


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """The JSONL line of one finished SDK span, as a dict."""
    ctx = span.get_span_context()
    assert ctx is not None  # a finished SDK span has its context
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_time_ns": int(span.start_time or 0),
        "end_time_ns": int(span.end_time or span.start_time or 0),
        "attributes": _plain(span.attributes),
        "status": {"code": span.status.status_code.name, "message": span.status.description},
        "events": [{"name": e.name, "time_ns": int(e.timestamp or 0), "attributes": _plain(e.attributes)}
                   for e in span.events],
        "resource": dict(span.resource.attributes) if span.resource is not None else {},
    }


def _plain(attributes: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to a JSONL file, one span per line (thread-safe).

    Use it with the SDK's `BatchSpanProcessor` (or `SimpleSpanProcessor` in tests).
    """

    def __init__(self, path: str | Path) -> None:
        if SpanExportResult is None:
            require_extra("otel", "JsonlSpanExporter", ("opentelemetry.sdk",))
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"JsonlSpanExporter({str(self.path)!r})"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            try:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("a", encoding="utf-8")
                for s in spans:
                    self._file.write(json.dumps(span_json(s), ensure_ascii=False, default=str) + "\n")
                self._file.flush()
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if self._file is not None:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None
