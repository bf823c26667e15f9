"""Sending spans on: the standard OTLP/HTTP exporter, set up from the standard variables."""

from __future__ import annotations

import os
from typing import Any

from canvasroute.engine._extras import require_extra

__all__ = ["add_otlp_exporter"]


def add_otlp_exporter(provider: Any) -> bool:
    """Add a batching OTLP/HTTP span exporter to an SDK `TracerProvider` when the standard
    `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the
    exporter reads `OTEL_EXPORTER_OTLP_HEADERS` etc. itself. Returns whether it did.

    Needs `opentelemetry-sdk` and `opentelemetry-exporter-otlp-proto-http` (extra `[otel]`): without
    them, and an endpoint set, it raises `ExtraMissing`.
    """
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return False
    require_extra("otel", "add_otlp_exporter (OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return True
