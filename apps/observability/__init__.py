"""Observability: decision spans on disk and the page that renders them.

- `traces`: `JsonlSpanExporter` writes spans as JSONL; `read_spans` reads that or OTLP JSON.
- `report`, `charts`, `page`: decide spans folded into a `Report` (paths and causes counted with
  `Tally`, per-run totals), its SVG charts, its HTML page.
- `dashboard`: the `canvasroute dashboard` command.
"""

from .report import Report, build_report, near_chance
from .traces import JsonlSpanExporter, SpanRecord, read_spans, span_record

__all__ = ["JsonlSpanExporter", "Report", "SpanRecord", "build_report", "near_chance", "read_spans", "span_record"]
