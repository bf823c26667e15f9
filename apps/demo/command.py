"""`canvasroute demo`: the support-triage agent end to end, traced.

Runs the triage graph (`canvasroute.apps.demo.triage`) on the embedded SmolLM2 engine (offline)
or on a server (`--engine-url`: DiffusionGemma, or a causal model read at each slot), prints every
decision, a summary, and writes the spans to a JSONL trace file that `canvasroute dashboard` renders.

The whole loop: decisions the gate is unsure about go to any OpenAI-compatible
autoregressive server (`--escalate-url URL --escalate-model M`, through langchain-openai's
`ChatOpenAI`). Without a target the output says, per decision, which ones would have
escalated at the threshold, and how to add one. The summary gives the share answered
from the canvas, after re-reads, and by the escalation model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from .._engine_options import ENGINE_KINDS, KIND_HELP

STAND_IN = ("note: the embedded engine is SmolLM2-135M, a small stand-in read at each slot; its answers are "
            "near chance. For real decisions point it at DiffusionGemma on vLLM: "
            "canvasroute demo --engine-url http://HOST:8000")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", default=os.environ.get("CANVASROUTE_ENGINE_URL"),
                        help="OpenAI-compatible server: vLLM serving DiffusionGemma, or a causal model (default: the "
                             "embedded CPU model); env CANVASROUTE_ENGINE_URL")
    parser.add_argument("--engine-kind", choices=ENGINE_KINDS,
                        default=os.environ.get("CANVASROUTE_ENGINE_KIND", "auto"),
                        help=KIND_HELP + "; env CANVASROUTE_ENGINE_KIND")
    parser.add_argument("--trace", default="canvasroute-demo.jsonl", help="trace file to write (JSONL spans)")
    parser.add_argument("--ticket", action="append", help="a ticket to triage (repeatable; default: samples)")
    parser.add_argument("--escalate-url", default=os.environ.get("CANVASROUTE_ESCALATE_URL"),
                        help="OpenAI-compatible server (vLLM, llama.cpp, OpenAI...) that answers the uncertain "
                             "decisions, e.g. http://HOST:8001/v1; env CANVASROUTE_ESCALATE_URL")
    parser.add_argument("--escalate-model", default=os.environ.get("CANVASROUTE_ESCALATE_MODEL"),
                        help="model name on that server; env CANVASROUTE_ESCALATE_MODEL")
    parser.add_argument("--threshold", type=float, default=None, metavar="H",
                        help="escalate when the canvas normalized entropy H/lnK exceeds H (default 0.5)")


def run(args: argparse.Namespace) -> int:
    from canvasroute.engine._extras import require_extra

    if bool(args.escalate_url) != bool(args.escalate_model):
        print("canvasroute demo: --escalate-url and --escalate-model go together", file=sys.stderr)
        return 2
    # every extra this run needs, before it prints or loads anything
    require_extra("otel", "tracing", ("opentelemetry.sdk",))
    if not args.engine_url:
        require_extra("local", "the embedded engine (SmolLM2-135M)", ("torch", "transformers"),
                      note="or point the demo at a vLLM server: --engine-url http://HOST:8000")
    if args.escalate_url:
        require_extra("openai", "escalation to --escalate-url")

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from canvasroute.engine import EscalationError
    from canvasroute.router import GatePolicy, Tally
    from canvasroute.router.telemetry import JsonlSpanExporter, add_otlp_exporter

    from .._console import print_table, progress, say
    from ..observability.graph import record_graph
    from ..observability.report import cause_shares
    from . import triage
    from .model import make_model

    trace_path = Path(args.trace)
    trace_path.unlink(missing_ok=True)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(str(trace_path))))
    if add_otlp_exporter(provider):  # OTEL_EXPORTER_OTLP_ENDPOINT set: also to Phoenix, Langfuse, a collector...
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        print(f"exporting spans over OTLP to {endpoint}")
    trace.set_tracer_provider(provider)

    where = args.engine_url or "the embedded engine (SmolLM2-135M-Instruct, CPU)"
    print(f"canvasroute demo: support-ticket triage on {where}")
    if not args.engine_url:
        print(STAND_IN)
    target = escalation_target(args.escalate_url, args.escalate_model) if args.escalate_url else None
    policy = GatePolicy() if args.threshold is None else GatePolicy(max_normalized_entropy=args.threshold)
    print(f"gate: answer from the canvas when {policy.gate_text}, else re-read up to "
          f"{policy.rereads} times, then " + (f"escalate to {args.escalate_model} at {args.escalate_url}"
                                              if target else "escalate (no target set: reported, not sent)"))
    start = time.perf_counter()
    if not args.engine_url:
        say("loading the embedded model...")
    model = make_model(args.engine_url, policy=policy, escalate_to=target, progress=say, engine_kind=args.engine_kind)
    record_graph(triage.build_graph(model), "triage")  # the dashboard draws it
    loaded = time.perf_counter() - start
    if not args.engine_url:
        say(f"embedded model ready ({loaded:.1f} s)")
    tickets = args.ticket or triage.SAMPLE_TICKETS
    results: list[dict[str, Any]] = []
    with progress(len(tickets), "triage", unit="tickets") as advance:
        for ticket in tickets:
            try:
                results += triage.run_samples(model, [ticket])
            except EscalationError as exc:  # a target that answers badly is a finding, not a crash
                results.append({"ticket": ticket, "error": f"{type(exc).__name__}: {exc}"})
            advance(1)
    elapsed = time.perf_counter() - start - loaded
    provider.shutdown()

    tally, failed = Tally.of(()), 0
    columns = ["question", "answer", "path", "H/lnK", "gate", "probabilities"]
    for n, result in enumerate(results, 1):
        if "error" in result:
            failed += 1
            print(f"\n[{n}] {result['ticket']}\n    escalation failed: {result['error']}")
            continue
        tally += Tally.of(d["read"] for d in result["decisions"].values())
        rows, lines = [], [f"\n[{n}] {result['ticket']}"]
        for qid, d in result["decisions"].items():
            gate = _gate(d, args.escalate_model)
            probs = "  ".join(f"{k}={v:.2f}" for k, v in d["probabilities"].items())
            rows.append([qid, d["answer"], d["path"], _fmt(d["normalized_entropy"]), gate, probs])
            lines.append(f"    {qid:<9} {d['answer']:<10} path={d['path']:<9} "
                         f"H/lnK={_fmt(d['normalized_entropy'])}  {gate:<15} {probs}")
        lines.append(f"    -> routed to {result['handled_by']}")
        print_table(f"[{n}] {result['ticket']}", columns, rows, notes=[f"-> routed to {result['handled_by']}"],
                    plain="\n".join(lines))
    failures = f"; {failed} decision set(s) failed to escalate" if failed else ""
    print(f"\nsummary: {len(results)} tickets, {tally.decisions} decisions in {len(results) - failed} decision sets"
          f"{failures}; answered: {tally.shares()}; {tally.gate_line()}; gate not passed: {cause_shares(tally)}; "
          f"model load {loaded:.1f}s, "
          f"decisions {elapsed:.2f}s ({1000 * elapsed / max(1, len(results)):.0f} ms per ticket)")
    if target is None and tally.over_gate:
        print(f"{tally.over_gate} of them would have escalated: with no escalation target they were answered "
              f"from the canvas (path unsure). {ADD_TARGET}")
    print(f"trace: {trace_path} (render it: canvasroute dashboard {trace_path} -o report.html)")
    return 0


ADD_TARGET = ("To escalate them, add an OpenAI-compatible AR server: canvasroute demo --escalate-url "
              "http://HOST:8001/v1 --escalate-model MODEL")


ESCALATION_TIMEOUT_S = 120.0
"""How long one escalation may take: the target's HTTP reply timeout, and the escalation's own."""


def escalation_target(url: str, model: str) -> Any:
    """`ChatOpenAI` on an OpenAI-compatible server (`/v1` is added when the URL lacks it), as an
    `Escalation` whose timeout is its client's (an escalation's default, 60 s, would cut short a
    reply the client still waits for)."""
    from langchain_openai import ChatOpenAI

    from canvasroute import Escalation
    from canvasroute.engine import Connection

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    target = Connection(base, api_key=os.environ.get("CANVASROUTE_ESCALATE_API_KEY", "EMPTY"),
                        timeout=ESCALATION_TIMEOUT_S, retries=1)
    chat = ChatOpenAI(model=model, logprobs=True, top_logprobs=5, temperature=0, **target.openai_options())
    return Escalation(chat, timeout=ESCALATION_TIMEOUT_S)


def _gate(d: dict[str, Any], target: str | None) -> str:
    """What the gate did with one decision, in words (and why, when it did not pass it)."""
    from ..observability.report import CAUSE_WORDS

    why = CAUSE_WORDS.get(d["read"].get("cause") or "", "")
    if d["path"] == "escalated":
        return f"escalated to {d['escalation_model'] or target} ({why})"
    if d["confident"]:
        return "sure"
    if d["path"] == "fallback":
        return f"fallback ({why})"
    return f"kept ({why})" if target else "would escalate"


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"
