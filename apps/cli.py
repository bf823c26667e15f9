"""The canvasroute command line: demo, bench, calibrate, eval, dashboard, serve.

Each command lives in its own module exposing `configure(parser)` and `run(args) -> int`;
it is imported only when invoked, so `canvasroute --help` stays instant. A command's `--help`
needs none of the optional extras; a command that needs a missing one says which, with its pip
command (`ExtraMissing`), and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from canvasroute import __version__

COMMANDS = {
    "demo": ("canvasroute.apps.demo.command",
             "run the support-triage example graph (offline, embedded model by default)"),
    "bench": ("canvasroute.apps.bench.command", "measure overhead, throughput, packing and canvas-vs-AR latency"),
    "calibrate": ("canvasroute.apps.calibration.command", "fit temperatures and thresholds from labelled decisions"),
    "eval": ("canvasroute.apps.eval.command", "measure canvas only, the escalation target alone and the gated cascade"),
    "dashboard": ("canvasroute.apps.observability.dashboard", "render exported decision spans as one HTML page"),
    "serve": ("canvasroute.apps.server.cli", "serve gated decisions over HTTP (/v1/systemone)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The argument parser, with the options of the command `argv` names (only that one is imported)."""
    parser = argparse.ArgumentParser(prog="canvasroute", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"canvasroute {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        if name == chosen:
            import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    command = import_module(COMMANDS[args.command][0])
    from canvasroute.engine import ExtraMissing  # loaded by every command already; not by --help

    try:
        return int(command.run(args) or 0)
    except ExtraMissing as exc:
        print(f"canvasroute {args.command}: {exc.message}\n  hint: {exc.hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
