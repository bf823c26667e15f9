"""Trace files: read back the spans `JsonlSpanExporter` wrote, or OTLP JSON.

The exporter lives in the library (`canvasroute.JsonlSpanExporter`, from
`canvasroute.router.telemetry`); its line format is described there. `read_spans` reads
those files and also OTLP JSON (`{"resourceSpans": [...]}`, one object per line as the
OpenTelemetry Collector's file exporter writes it, or one document per file).

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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from canvasroute.engine.errors import TraceFileError
from canvasroute.router import telemetry as tm
from canvasroute.router.telemetry import JsonlSpanExporter, span_json

__all__ = ["JsonlSpanExporter", "SpanEvent", "SpanRecord", "decision_figures", "read_spans", "span_record"]

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanEvent:
    """One event of a finished span."""

    name: str
    time_ns: int = 0
    attributes: Mapping[str, Any] = field(default_factory=dict)


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
    events: tuple[SpanEvent, ...] = ()

    @property
    def duration_s(self) -> float:
        return max(0, self.end_time_ns - self.start_time_ns) / 1e9

    def to_json(self) -> dict[str, Any]:
        """The JSONL line of this span, as a dict."""
        return {"name": self.name, "trace_id": self.trace_id, "span_id": self.span_id, "parent_id": self.parent_id,
                "kind": self.kind, "start_time_ns": self.start_time_ns, "end_time_ns": self.end_time_ns,
                "attributes": dict(self.attributes), "status": {"code": self.status, "message": self.status_message},
                "events": [{"name": e.name, "time_ns": e.time_ns, "attributes": dict(e.attributes)}
                           for e in self.events],
                "resource": dict(self.resource)}


def span_record(span: Any) -> SpanRecord:
    """A `SpanRecord` from an SDK span (what `JsonlSpanExporter` writes, read back)."""
    return _from_line(span_json(span))


# -- reading -------------------------------------------------------------------------


def decision_figures(span: SpanRecord) -> dict[str, dict[str, Any]]:
    """A decide span's per-question figures, per question id: its `canvasroute.question`
    events (figure name -> value, `kind` included). Trace files written before 0.2 hold
    the figures as `canvasroute.decision.<question id>.<figure>` span attributes; those are
    read too (question ids may hold dots: the figure is the part after the last one)."""
    out: dict[str, dict[str, Any]] = {}
    keys = {key: figure for figure, key in tm.FIGURE_KEYS.items()}
    for event in span.events:
        qid = event.attributes.get(tm.QUESTION_ID)
        if event.name == tm.QUESTION_EVENT and isinstance(qid, str):
            figures = out.setdefault(qid, {})
            figures.update({keys[k]: v for k, v in event.attributes.items() if k in keys})
            if tm.QUESTION_KIND in event.attributes:
                figures["kind"] = event.attributes[tm.QUESTION_KIND]
    prefix = tm.DECISION_PREFIX + "."
    for key, value in span.attributes.items():
        if key.startswith(prefix):
            qid, _, figure = key[len(prefix):].rpartition(".")
            if qid and (figure in tm.FIGURES or figure == "kind"):
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
        events=tuple(SpanEvent(name=str(e["name"]), time_ns=int(e.get("time_ns") or 0),
                               attributes=dict(e.get("attributes") or {})) for e in doc.get("events") or ()),
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
                    events=tuple(SpanEvent(name=str(e["name"]), time_ns=int(e.get("timeUnixNano") or 0),
                                           attributes=_otlp_attributes(e.get("attributes") or []))
                                 for e in sp.get("events") or ()),
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
    return text.removeprefix(prefix)


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
