"""Trace files: finished spans as JSONL, and a reader for them and for OTLP JSON.

One line per finished span:

```json
{"name": "decide tiny-dgemma", "trace_id": "4bf9...", "span_id": "00f0...", "parent_id": null,
 "kind": "INTERNAL", "start_time_ns": 1700000000000000000, "end_time_ns": 1700000000250000000,
 "attributes": {"canvasroute.decision_set": "team"}, "status": {"code": "OK", "message": null},
 "resource": {"service.name": "support-bot"}}
```

`read_spans` reads these files and also OTLP JSON (`{"resourceSpans": [...]}`, one
object per line as the OpenTelemetry Collector's file exporter writes it, or one
document per file).

Example:
    ```python
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter("spans.jsonl")))
    trace.set_tracer_provider(provider)
    ...                                   # run decisions
    spans = read_spans("spans.jsonl")     # or: canvasroute dashboard spans.jsonl
    ```
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from canvasroute.engine.errors import TraceFileError
from canvasroute.router import telemetry as tm

try:  # the SDK is an optional extra; reading trace files does not need it
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
except ImportError:  # pragma: no cover - exercised only without the SDK
    ReadableSpan = Any  # type: ignore[assignment,misc]
    SpanExporter = object  # type: ignore[assignment,misc]
    SpanExportResult = None  # type: ignore[assignment,misc]

__all__ = ["JsonlSpanExporter", "SpanRecord", "decision_figures", "read_spans", "span_record"]

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanRecord:
    """One finished span as the dashboard and `calibrate --from-traces` see it."""

    name: str
    trace_id: str
    """32 hex digits."""
    span_id: str
    """16 hex digits."""
    parent_id: str | None
    start_time_ns: int
    end_time_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    status: str = "UNSET"
    """`UNSET`, `OK` or `ERROR`."""
    status_message: str | None = None
    kind: str = "INTERNAL"
    resource: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return max(0, self.end_time_ns - self.start_time_ns) / 1e9

    def to_json(self) -> dict[str, Any]:
        """The JSONL line of this span, as a dict."""
        return {"name": self.name, "trace_id": self.trace_id, "span_id": self.span_id, "parent_id": self.parent_id,
                "kind": self.kind, "start_time_ns": self.start_time_ns, "end_time_ns": self.end_time_ns,
                "attributes": dict(self.attributes), "status": {"code": self.status, "message": self.status_message},
                "resource": dict(self.resource)}


def span_record(span: ReadableSpan) -> SpanRecord:
    """A `SpanRecord` from an SDK span."""
    ctx = span.get_span_context()
    parent = span.parent
    return SpanRecord(
        name=span.name,
        trace_id=format(ctx.trace_id, "032x"),
        span_id=format(ctx.span_id, "016x"),
        parent_id=format(parent.span_id, "016x") if parent is not None else None,
        start_time_ns=int(span.start_time or 0),
        end_time_ns=int(span.end_time or span.start_time or 0),
        attributes={k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        status=span.status.status_code.name,
        status_message=span.status.description,
        kind=span.kind.name,
        resource=dict(span.resource.attributes) if span.resource is not None else {},
    )


class JsonlSpanExporter(SpanExporter):  # type: ignore[misc,valid-type]
    """Appends finished spans to a JSONL file, one span per line (thread-safe).

    Use it with the SDK's `BatchSpanProcessor` (or `SimpleSpanProcessor` in tests).
    """

    def __init__(self, path: str | Path) -> None:
        if SpanExportResult is None:
            raise ImportError("JsonlSpanExporter needs opentelemetry-sdk (pip install 'canvasroute[otel]')")
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
                    self._file.write(json.dumps(span_record(s).to_json(), ensure_ascii=False, default=str) + "\n")
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


# -- reading -------------------------------------------------------------------------


def decision_figures(attributes: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A decide span's `canvasroute.decision.<qid>.<figure>` attributes, per question id.

    Question ids may hold dots: the figure is the part after the last one.
    """
    prefix = tm.DECISION_PREFIX + "."
    out: dict[str, dict[str, Any]] = {}
    for key, value in attributes.items():
        if key.startswith(prefix):
            qid, _, figure = key[len(prefix):].rpartition(".")
            if qid and figure in tm.FIGURES:
                out.setdefault(qid, {})[figure] = value
    return out


def read_spans(*paths: str | Path) -> list[SpanRecord]:
    """Every span in the given files (or `*.jsonl` / `*.json` files in given folders), by start time."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".json") and f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise TraceFileError(f"no trace file at {p}")
    spans: list[SpanRecord] = []
    for f in files:
        spans += _read_file(f)
    return sorted(spans, key=lambda s: (s.start_time_ns, s.span_id))


def _read_file(path: Path) -> list[SpanRecord]:
    text = path.read_text(encoding="utf-8")
    try:
        docs = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        try:
            docs = [json.loads(text)]  # one pretty-printed document
        except json.JSONDecodeError as exc:
            raise TraceFileError(f"{path} is neither span JSONL nor OTLP JSON: {exc}") from exc
    out: list[SpanRecord] = []
    for n, doc in enumerate(docs, 1):
        try:
            out += _from_otlp(doc) if isinstance(doc, Mapping) and "resourceSpans" in doc else [_from_line(doc)]
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFileError(f"{path}, record {n}: not a span ({exc!r})") from exc
    return out


def _from_line(doc: Mapping[str, Any]) -> SpanRecord:
    status = doc.get("status") or {}
    return SpanRecord(
        name=str(doc["name"]), trace_id=str(doc["trace_id"]), span_id=str(doc["span_id"]),
        parent_id=doc.get("parent_id") or None, start_time_ns=int(doc["start_time_ns"]),
        end_time_ns=int(doc["end_time_ns"]), attributes=dict(doc.get("attributes") or {}),
        status=str(status.get("code") or "UNSET"), status_message=status.get("message"),
        kind=str(doc.get("kind") or "INTERNAL"), resource=dict(doc.get("resource") or {}),
    )


def _from_otlp(doc: Mapping[str, Any]) -> Iterator[SpanRecord]:
    for rs in doc.get("resourceSpans") or []:
        resource = _otlp_attributes((rs.get("resource") or {}).get("attributes") or [])
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            for sp in ss.get("spans") or []:
                status = sp.get("status") or {}
                yield SpanRecord(
                    name=str(sp["name"]), trace_id=_otlp_id(sp["traceId"], 32), span_id=_otlp_id(sp["spanId"], 16),
                    parent_id=_otlp_id(sp["parentSpanId"], 16) if sp.get("parentSpanId") else None,
                    start_time_ns=int(sp["startTimeUnixNano"]), end_time_ns=int(sp["endTimeUnixNano"]),
                    attributes=_otlp_attributes(sp.get("attributes") or []),
                    status=_enum(status.get("code"), _STATUS, "STATUS_CODE_", "UNSET"),
                    status_message=status.get("message"),
                    kind=_enum(sp.get("kind"), _KINDS, "SPAN_KIND_", "UNSPECIFIED"), resource=resource,
                )


def _otlp_id(value: str, hex_len: int) -> str:
    """OTLP/JSON ids are hex; accept base64 (protobuf-JSON mapping) too."""
    value = str(value)
    if len(value) == hex_len and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    raw = base64.b64decode(value)
    if len(raw) * 2 != hex_len:
        raise ValueError(f"bad id {value!r}")
    return raw.hex()


def _enum(value: Any, names: Mapping[int, str], prefix: str, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, int):
        return names.get(value, str(value))
    text = str(value)
    return text[len(prefix):] if text.startswith(prefix) else text


def _otlp_attributes(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return {item["key"]: _otlp_value(item.get("value") or {}) for item in items}


def _otlp_value(value: Mapping[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])  # int64 is a string in OTLP/JSON
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in (value["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in value:
        return _otlp_attributes((value["kvlistValue"] or {}).get("values") or [])
    if "bytesValue" in value:
        return value["bytesValue"]
    return None
