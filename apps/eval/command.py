"""`canvasroute eval DATA`: canvas only, the escalation target alone, and the gated cascade, measured.

DATA is what `canvasroute calibrate` reads (JSONL of `{state, questions, gold}`, or a
BIG-bench task). With an escalation target (`--escalate-url/--escalate-model`,
`--escalate-systemone`, or `--escalate-embedded` for offline runs) the target and the
cascade at the gate run too (`gate_of`: the policy file `--policy policy.json` with its
per-question fits, then `--threshold`/`--rereads` over every question; `--hedge-band` hedges
the cascade's escalations, `Escalation(hedge=Hedge(band=...))`), and a sweep of thresholds
mixes the measured canvas and target answers. Prints accuracy, cost (reads, escalations,
target calls, hedges, tokens) and latency per arm, and the AUROC of normalized entropy for
detecting canvas errors; `--json` prints the figures as JSON; writes a risk-coverage plot
(PNG) unless `--no-plots`.

Example:
    ```bash
    canvasroute eval data/bigbench/strategyqa --limit 50 --escalate-embedded \\
        --threshold 0.9 --json --plot eval.png
    ```
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from canvasroute.engine import CanvasRouteError, ExtraMissing
from canvasroute.router import Escalation, GatePolicy, Hedge, load_policy, resolve_gate

from .._console import plain_table, print_table, progress
from .._engine_options import add_engine_options, open_engine
from ..calibration.rows import load_rows
from ..observability.report import near_chance
from .measure import evaluate
from .report import figures
from .target import add_target_options, open_target, wants_target

__all__ = ["configure", "gate_of", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", help="JSONL of {state, questions, gold}, or a BIG-bench task.json / folder")
    parser.add_argument("--limit", type=int, help="evaluate at most N rows (a seeded random sample)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling rows (default 0)")
    add_engine_options(parser)
    parser.add_argument("--policy", metavar="FILE", help="policy file from `canvasroute calibrate`")
    parser.add_argument("--threshold", type=float,
                        help="max_normalized_entropy for every question (over the policy file's, fitted ones too)")
    parser.add_argument("--rereads", type=int,
                        help="re-reads before escalating, for every question (over the policy file's)")
    parser.add_argument("--thresholds", help="comma-separated sweep thresholds (default: every distinct entropy)")
    parser.add_argument("--concurrency", type=int, default=1, help="decisions in flight per arm (default 1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--plot", default="canvasroute-eval.png", help="plot file (PNG)")
    parser.add_argument("--no-plots", action="store_true", help="skip the plot")
    add_target_options(parser)



def gate_of(args: argparse.Namespace) -> GatePolicy:
    """The gate eval measures, resolved in one order (`resolve_gate`): the policy file
    (`--policy`, per-question fits from `canvasroute calibrate` included, else the default
    gate), then the flags (`--threshold`, `--rereads`), which apply to every question, fitted
    ones too."""
    flags: dict[str, Any] = {}
    if args.threshold is not None:
        flags["max_normalized_entropy"] = args.threshold
    if args.rereads is not None:
        flags["rereads"] = args.rereads
    return resolve_gate(load_policy(args.policy) if args.policy else GatePolicy(), flags)


async def _measure(args: argparse.Namespace, policy: GatePolicy, target: Any) -> dict[str, Any]:
    rows = load_rows(args.data, limit=args.limit, seed=args.seed)
    engine = open_engine(args)
    try:
        info = await engine.info()
        arms = 3 if target is not None else 1
        with progress(len(rows) * arms, f"eval {info.model}") as advance:
            hedge = Hedge(band=args.hedge_band) if args.hedge_band is not None else None
            escalation = Escalation(target, timeout=args.escalate_timeout, hedge=hedge) if target is not None else None
            ev = await evaluate(engine, rows, policy=policy, target=escalation, concurrency=args.concurrency,
                                progress=advance)
    finally:
        await engine.aclose()
    thresholds = [float(t) for t in args.thresholds.split(",")] if args.thresholds else None
    out = figures(ev, policy, model=info.model, provider=info.provider,
                  near_chance=near_chance(info.model, info.provider), thresholds=thresholds)
    out["source"] = str(args.data)
    out["command"] = "canvasroute eval " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["eval"] else None
    return out


def run(args: argparse.Namespace) -> int:
    try:
        policy = gate_of(args)
        if not wants_target(args):
            print("canvasroute eval: no escalation target given: measuring the canvas only", file=sys.stderr)
        with open_target(args) as target:
            out = asyncio.run(_measure(args, policy, target))
    except (CanvasRouteError, ValueError) as exc:
        print(f"canvasroute eval: {exc}", file=sys.stderr)
        return 2
    if not args.no_plots:
        try:
            from .plots import plot_eval

            subtitle = f"{out['model']}" + (f" · target {out['target']}" if out["target"] else "")
            if out["near_chance"]:
                subtitle += f"\n{out['note']}"
            out["plot"] = str(plot_eval(out, Path(args.plot), subtitle))
        except ExtraMissing as exc:
            print(f"canvasroute eval: {exc.message}; the figures are printed without the plot (--no-plots "
                  "skips it quietly)\n"
                  f"  hint: {exc.hint}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out)
    return 0


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print(out: dict[str, Any]) -> None:
    columns = ["arm", "accuracy", "reads", "escalations", "target calls", "failures", "tokens in/out",
               "p50 s", "p95 s"]
    rows = [[name, _fmt(a["accuracy"], ".1%"), str(a["reads"]), str(a["escalations"]), str(a["target_calls"]),
             str(a["failures"]), f"{a['input_tokens']}/{a['output_tokens']}", _fmt(a["latency_p50_s"], ".3f"),
             _fmt(a["latency_p95_s"], ".3f")] for name, a in out["arms"].items()]
    title = f"{out['questions']} questions on {out['rows']} rows · model {out['model']}"
    if out["target"]:
        title += f" · target {out['target']}"
    notes = [f"AUROC of normalized entropy for canvas errors: {_fmt(out['auroc_normalized_entropy'], '.3f')}"]
    if cascade := out["arms"].get("cascade"):
        paths = ", ".join(f"{p} {k}" for p, k in cascade["paths"].items()) or "none"
        causes = ", ".join(f"{c} {k}" for c, k in cascade["causes"].items()) or "none"
        notes.append(f"cascade answers by path: {paths}; gate not passed, by cause: {causes}")
    if out.get("note"):
        notes.append(f"** {out['note']} **")
    if out.get("plot"):
        notes.append(f"wrote {out['plot']}")
    print_table(title, columns, rows, notes=notes, plain="\n".join([title, *plain_table(columns, rows), *notes]))
