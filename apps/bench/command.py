"""`canvasroute bench`: overhead, throughput, packing and canvas-vs-AR latency.

Every figure is a ratio or a distribution measured side by side in one run:

1. `overhead`     router + harness time per decision over an instant engine (p50/p99 us),
                  with a cProfile breakdown.
2. `throughput`   `VLLMServerEngine` reads/s and client CPU per read vs concurrency against
                  an instant loopback server in its own process.
3. `packing`      questions per canvas read for typical nodes, and the canvas widths.
4. `canvas_vs_ar` one canvas read vs AR JSON generation on SmolLM2-135M (CPU).
5. `vllm`         reads/s and p50/p95 against a real vLLM CPU server (`--vllm-url`).
6. `affinity`     prefix-cache hit rate on two real vLLM servers, rendezvous routing vs
                  round-robin (`--affinity-urls`; skipped without two).
7. `inprocess`    embedded SmolLM2 decisions/s, 8 sequential vs 8 concurrent, with and
                  without the engine's prompt (prefix) cache.
8. `clients`      the HTTP client candidates (llhttp lane, h11, aiohttp, httpx) side by side:
                  reads/s and client CPU per read through the same engine.
9. `gateway`      `canvasroute serve` vs vLLM's reference gateway (`--gateway-url`) in front of
                  the same vLLM server (`--vllm-url`): latency, calls/s and vLLM reads per call
                  at c=1 and c=8, interleaved; and the library path (skipped without both).
10. `isolation`   each question read without its neighbours vs one joint canvas: reads and ms
                  per decision set on the embedded SmolLM2 and on a real vLLM server (`--vllm-url`).
11. `structure`   library modules entered, hops between modules and returns to a module
                  already left, in one warm `decision_node` run and one `decide` (a count, not
                  a time), beside `httpx.Client.get`.
12. `risk`        the certified gate (`calibrate --max-error`) on simulated streams with known
                  truth: how often its passed answers' error exceeds the bound, over many
                  calibrations, and the coverage it keeps against the oracle's and the
                  single-threshold limit, beside the split-half test it replaced and the naive
                  threshold, on the same rows.
13. `controller`  the escalation-rate controller on a drifting simulated stream, 4 workers on
                  one LangGraph store: realised rate against the target before and after the
                  drift, decisions until it holds +-2 points, beside the same stream without it.
14. `hedge`       hedged escalation vs none on a simulated stream (borderline first reads,
                  re-reads that settle a known share, lognormal engine and target latencies):
                  p50/p99 of the decisions over the gate and the extra target calls.
15. `causal`      a causal model on an OpenAI-compatible server (`--causal-url`) read for its label
                  distribution (`CausalServerEngine`): decisions/s and p50 beside the DiffusionGemma
                  read (`--vllm-url`) on the same CPU and beside the same causal model asked for the
                  answers as generated JSON on the same server (skipped without `--causal-url`).
16. `live`        live certification on generated streams with known truth (stationary, abrupt
                  and slow drift): how often the certified threshold's true disagreement exceeds
                  the target, coverage after 1k/10k decisions against the oracle, audits spent,
                  decisions to tighten after a drift; and 4 workers on one store end to end.

`--quick` runs each with fewer iterations (well under a minute); the full run takes a
few minutes on 2 cores. Figures depend on the machine and its load: see BENCHMARKS.md
for what each does and does not say.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from .._console import progress
from .common import Section, loop_ns, machine

__all__ = ["SECTIONS", "configure", "run"]

SECTIONS = ("overhead", "throughput", "packing", "canvas_vs_ar", "vllm", "affinity", "inprocess", "clients",
            "gateway", "isolation", "structure", "risk", "controller", "hedge", "causal", "live")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (well under a minute)")
    parser.add_argument("--vllm-url", default=os.environ.get("CANVASROUTE_VLLM_URL"),
                        help="a running vLLM DiffusionGemma server (default $CANVASROUTE_VLLM_URL); "
                             "without one, its rows are skipped")
    parser.add_argument("--affinity-urls", default=os.environ.get("CANVASROUTE_AFFINITY_URLS", ""),
                        help="two vLLM DiffusionGemma servers, comma-separated, for the affinity section "
                             "(default $CANVASROUTE_AFFINITY_URLS); without two it is skipped")
    parser.add_argument("--gateway-url", default=os.environ.get("CANVASROUTE_GATEWAY_URL"),
                        help="a running vLLM reference gateway (structured_server.py) in front of --vllm-url, for "
                             "the gateway section (default $CANVASROUTE_GATEWAY_URL); without one it is skipped")
    parser.add_argument("--causal-url", default=os.environ.get("CANVASROUTE_CAUSAL_VLLM_URL"),
                        help="a running OpenAI-compatible server with a causal model (e.g. vllm serving SmolLM2) for "
                             "the causal section (default $CANVASROUTE_CAUSAL_VLLM_URL); without one it is skipped")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")


def run(args: argparse.Namespace) -> int:
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        print(f"canvasroute bench: unknown section(s) {unknown}; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    runners: dict[str, Callable[[], Section]] = {
        "overhead": lambda: _overhead(args.quick),
        "throughput": lambda: _throughput(args.quick),
        "packing": lambda: _packing(args.vllm_url),
        "canvas_vs_ar": lambda: _ar(args.quick),
        "vllm": lambda: _vllm(args.vllm_url, args.quick),
        "affinity": lambda: _affinity(args.affinity_urls, args.quick),
        "inprocess": lambda: _inprocess(args.quick),
        "clients": lambda: _clients(args.quick),
        "gateway": lambda: _gateway(args.gateway_url, args.vllm_url, args.quick),
        "isolation": lambda: _isolation(args.vllm_url, args.quick),
        "structure": lambda: _structure(args.quick),
        "risk": lambda: _risk(args.quick),
        "controller": lambda: _controller(args.quick),
        "hedge": lambda: _hedge(args.quick),
        "causal": lambda: _causal(args.causal_url, args.vllm_url, args.quick),
        "live": lambda: _live(args.quick),
    }
    start = time.perf_counter()
    info = machine()
    results: dict[str, Section] = {}
    chosen = [name for name in SECTIONS if name in wanted]
    with progress(len(chosen), "canvasroute bench", unit="sections") as advance:
        for name in chosen:
            t, speed = time.perf_counter(), loop_ns()
            section = runners[name]()
            section.extra["seconds"] = round(time.perf_counter() - t, 1)
            section.extra["loop_ns"] = speed
            section.notes.append(f"Python speed reference before this section: {speed} ns per loop iteration")
            results[name] = section
            if not args.json:
                section.show()
            advance(1)
    total = time.perf_counter() - start
    info["loop_ns_at_end"] = loop_ns()
    if args.json:
        print(json.dumps({"machine": info, "quick": args.quick, "seconds": round(total, 1),
                          "sections": {k: v.as_json() for k, v in results.items()}}, indent=2, default=str))
    else:
        print(f"machine: {info['cpus']} CPUs ({info['processor']}), Python {info['python']}, "
              f"load average {info['loadavg_1m_at_start']} at start; Python speed reference "
              f"{info['loop_ns']} -> {info['loop_ns_at_end']} ns per loop iteration (start -> end); "
              f"{total:.0f} s in all" + (" (--quick)" if args.quick else ""))
    return 0


# each section imports its heavy dependencies only when it runs
def _overhead(quick: bool) -> Section:
    from .overhead import run_overhead
    return run_overhead(quick)


def _throughput(quick: bool) -> Section:
    from .client import run_throughput
    return run_throughput(quick)


def _packing(url: str | None) -> Section:
    from .packing import run_packing
    return run_packing(url)


def _ar(quick: bool) -> Section:
    from .canvas_vs_ar import run_canvas_vs_ar
    return run_canvas_vs_ar(quick)


def _vllm(url: str | None, quick: bool) -> Section:
    from .client import run_real_server
    return run_real_server(url, quick)


def _affinity(urls: str, quick: bool) -> Section:
    from .affinity import run_affinity
    return run_affinity([u.strip() for u in urls.split(",") if u.strip()], quick)


def _inprocess(quick: bool) -> Section:
    from .inprocess import run_inprocess
    return run_inprocess(quick)


def _clients(quick: bool) -> Section:
    from .clients import run_clients
    return run_clients(quick)


def _gateway(reference: str | None, vllm_url: str | None, quick: bool) -> Section:
    from .gateway import run_gateway
    return run_gateway(reference, vllm_url, quick)


def _isolation(vllm_url: str | None, quick: bool) -> Section:
    from .isolation import run_isolation

    return run_isolation(vllm_url, quick)


def _structure(quick: bool) -> Section:
    from .structure import run_structure

    return run_structure(quick)


def _risk(quick: bool) -> Section:
    from .risk import run_risk

    return run_risk(quick)


def _controller(quick: bool) -> Section:
    from .controller import run_controller

    return run_controller(quick)


def _hedge(quick: bool) -> Section:
    from .hedge import run_hedge

    return run_hedge(quick)


def _causal(causal_url: str | None, vllm_url: str | None, quick: bool) -> Section:
    from .causal import run_causal

    return run_causal(causal_url, vllm_url, quick)
def _live(quick: bool) -> Section:
    from .live import run_live

    return run_live(quick)
