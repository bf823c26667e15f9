"""`canvasroute demo`: the support-triage agent end to end, traced.

Runs the triage graph (`harness.demo.triage`) on the embedded SmolLM2 engine (offline)
or on a DiffusionGemma server (`--engine-url`), prints every decision, a summary, and writes the spans to a
JSONL trace file that `canvasroute dashboard` renders.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

STAND_IN = ("note: the embedded engine is SmolLM2-135M, a small stand-in read at each slot; its answers are "
            "near chance. For real decisions point it at DiffusionGemma on vLLM: "
            "canvasroute demo --engine-url http://HOST:8000")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", default=os.environ.get("CANVASROUTE_ENGINE_URL"),
                        help="vLLM DiffusionGemma server (default: the embedded CPU model); env CANVASROUTE_ENGINE_URL")
    parser.add_argument("--trace", default="canvasroute-demo.jsonl", help="trace file to write (JSONL spans)")
    parser.add_argument("--ticket", action="append", help="a ticket to triage (repeatable; default: samples)")


def run(args: argparse.Namespace) -> int:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from .._console import print_table, progress
    from ..observability.traces import JsonlSpanExporter
    from . import triage
    from .model import make_model
    from router.telemetry import add_otlp_exporter

    trace_path = Path(args.trace)
    trace_path.unlink(missing_ok=True)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(str(trace_path))))
    if add_otlp_exporter(provider):  # OTEL_EXPORTER_OTLP_ENDPOINT set: also to Phoenix, Langfuse, a collector...
        print(f"exporting spans over OTLP to {os.environ.get('OTEL_EXPORTER_OTLP_TRACES_ENDPOINT') or os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']}")
    trace.set_tracer_provider(provider)

    where = args.engine_url or "the embedded engine (SmolLM2-135M-Instruct, CPU)"
    print(f"canvasroute demo: support-ticket triage on {where}")
    if not args.engine_url:
        print(STAND_IN)
    start = time.perf_counter()
    model = make_model(args.engine_url)
    loaded = time.perf_counter() - start
    tickets = args.ticket or triage.SAMPLE_TICKETS
    with progress(len(tickets), "triage", unit="tickets") as advance:
        results = triage.run_samples(model, tickets, progress=advance)
    elapsed = time.perf_counter() - start - loaded
    provider.shutdown()

    paths: Counter[str] = Counter()
    columns = ["question", "answer", "path", "H/lnK", "probabilities"]
    for n, result in enumerate(results, 1):
        rows, lines = [], [f"\n[{n}] {result['ticket']}"]
        for qid, d in result["decisions"].items():
            paths[d["path"]] += 1
            probs = "  ".join(f"{k}={v:.2f}" for k, v in d["probabilities"].items())
            rows.append([qid, d["answer"], d["path"], _fmt(d["normalized_entropy"]), probs])
            lines.append(f"    {qid:<9} {d['answer']:<10} path={d['path']:<9} "
                         f"H/lnK={_fmt(d['normalized_entropy'])}  {probs}")
        lines.append(f"    -> routed to {result['handled_by']}")
        print_table(f"[{n}] {result['ticket']}", columns, rows, notes=[f"-> routed to {result['handled_by']}"],
                    plain="\n".join(lines))
    decisions = sum(paths.values())
    print(f"\nsummary: {len(results)} tickets, {decisions} decisions in {len(results)} decision sets; "
          f"paths {dict(paths)}; model load {loaded:.1f}s, decisions {elapsed:.2f}s "
          f"({1000 * elapsed / max(1, len(results)):.0f} ms per ticket)")
    print(f"trace: {trace_path} (render it: canvasroute dashboard {trace_path} -o report.html)")
    return 0


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"
