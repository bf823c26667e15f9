"""The engine options shared by the offline commands (`calibrate`, `eval`)."""

from __future__ import annotations

import argparse
import os

from canvasroute.engine import Connection, Engine, VLLMServerEngine


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """`--engine`, `--engine-url` (repeatable), `--served-model`, `--api-key-env`."""
    parser.add_argument("--engine", choices=["embedded"], default="embedded",
                        help="in-process engine when no --engine-url is given (embedded: SmolLM2-135M, near chance)")
    parser.add_argument("--engine-url", action="append", metavar="URL",
                        help="vLLM server(s) serving DiffusionGemma (repeat for replicas); overrides --engine")
    parser.add_argument("--served-model", help="model name on the vLLM server (default: the first served)")
    parser.add_argument("--api-key-env", default="CANVASROUTE_API_KEY", metavar="VAR",
                        help="environment variable holding the vLLM API key (default CANVASROUTE_API_KEY)")


def open_engine(args: argparse.Namespace) -> Engine:
    """The engine the options name: the vLLM server(s), else the embedded model."""
    if args.engine_url:
        connection = Connection(args.engine_url, api_key=os.environ.get(args.api_key_env))
        return VLLMServerEngine(connection, model=args.served_model)
    from canvasroute.engine import embedded_engine

    engine: Engine = embedded_engine()  # typed Any there: transformers loads only when called
    return engine
