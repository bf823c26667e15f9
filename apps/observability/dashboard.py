"""`canvasroute dashboard TRACES -o report.html`: exported decision spans as one HTML page.

The page is self-contained (inline CSS and SVG, no scripts). It draws the graph (from
`--graph module:attr`, a `graph` span in the traces, or the routes seen) with per-edge
traffic, per-node entropy, escalation share, shadow agreement and cache hits; clicking a
node filters the tables to it. It shows, per graph node
(`canvasroute.graph.node`, else the decision set): normalized-entropy histograms by path,
path shares over time, escalation rate (questions with path `escalated`, whatever the
cause) and why the gate did not pass each question (its cause: uncertain, abstained,
engine fault, over budget, target fault), what the escalation guards did (the target's
circuit breaker opening, probing and closing, the decisions it kept from the target, the
engine faults the cap did not escalate), canvas-vs-escalation agreement (escalated questions
whose canvas argmax equals the escalation's answer), latency percentiles, and the most
uncertain decisions; per run (trace file), what its decisions cost beside sending every decision set
to the escalation target ("saved by routing"). It names the model that produced the data
and warns that tiny and embedded models are near chance.

Example:
    ```bash
    canvasroute dashboard spans.jsonl -o report.html
    ```
"""


from __future__ import annotations

import argparse
import sys
from pathlib import Path

from canvasroute.engine import TraceFileError

from .graph import load_graph
from .page import plural, render
from .report import Decision, NodeStats, Report, build_report, near_chance
from .stats import percentile
from .traces import read_spans

__all__ = ["Decision", "NodeStats", "Report", "build_report", "configure", "near_chance", "percentile",
           "render", "run"]


# -- CLI ---------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACES",
                        help="span JSONL files (JsonlSpanExporter) or OTLP JSON files, or folders of them")
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    parser.add_argument("--title", default="canvasroute decisions", help="page title")
    parser.add_argument("--top", type=int, default=20, help="rows in the most-uncertain table (default 20)")
    parser.add_argument("--graph", metavar="MODULE:ATTR",
                        help="the LangGraph graph to draw (a compiled graph, or a function returning one); "
                             "default: the graph recorded in the traces, else the routes seen")
    parser.add_argument("--buckets", type=int, default=24, help="time buckets for path shares (default 24)")


def run(args: argparse.Namespace) -> int:
    try:
        spans = read_spans(*args.traces)
        report = build_report(spans, [Path(p).name for p in args.traces])
        if args.graph:
            report.graph = load_graph(args.graph)
    except (TraceFileError, ValueError, ImportError, AttributeError) as exc:
        print(f"canvasroute dashboard: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.write_text(render(report, title=args.title, top=args.top, buckets=args.buckets), encoding="utf-8")
    ds = report.decisions
    sets, replayed = len(report.set_latencies), report.replayed
    print(f"wrote {out} ({plural(len(ds), 'question')} in {plural(sets, 'decision set')}"
          f"{f' (+ {replayed} replayed)' if replayed else ''}, "
          f"{plural(len(report.nodes), 'node')}, model {', '.join(report.models) or 'unknown'})")
    return 0
