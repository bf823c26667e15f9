"""The engine options of the commands, and the engine an `--engine-url` names.

`--engine-url` names an OpenAI-compatible server (a URL ending in `/v1` works as is); what it serves
decides the engine, told on first use by one probe (`canvasroute.engine.server_kind`):
DiffusionGemma's structured read (`VLLMServerEngine`) or a plain causal model
(`CausalServerEngine`, read at each slot for its exact label distribution). `--engine-kind` says
it instead, and nothing is probed. `calibrate` and `eval` take `add_engine_options`; `serve` and
`demo` have flags of their own and share `server_engine`.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

from canvasroute.engine import (
    CanvasRead,
    CausalServerEngine,
    Connection,
    Engine,
    EngineInfo,
    Message,
    ReadResult,
    VLLMServerEngine,
    server_kind,
)

__all__ = ["ENGINE_KINDS", "KIND_HELP", "DetectedEngine", "EngineKind", "add_engine_options", "open_engine",
           "server_engine"]

EngineKind = Literal["auto", "diffusion", "causal"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("auto", "diffusion", "causal")
KIND_HELP = ("what the --engine-url server serves: diffusion (DiffusionGemma's structured read, VLLMServerEngine), "
             "causal (a plain causal LM read at each slot, CausalServerEngine), or auto (asked of the server on "
             "first use; default)")
log = logging.getLogger("canvasroute.engine")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """`--engine`, `--engine-url` (repeatable), `--engine-kind`, `--served-model`, `--api-key-env`."""
    parser.add_argument("--engine", choices=["embedded"], default="embedded",
                        help="in-process engine when no --engine-url is given (embedded: SmolLM2-135M, near chance)")
    parser.add_argument("--engine-url", action="append", metavar="URL",
                        help="OpenAI-compatible server(s) (repeat for replicas): vLLM serving DiffusionGemma, or a "
                             "causal model; overrides --engine")
    parser.add_argument("--engine-kind", choices=ENGINE_KINDS,
                        default=os.environ.get("CANVASROUTE_ENGINE_KIND", "auto"),
                        help=KIND_HELP + " [CANVASROUTE_ENGINE_KIND]")
    parser.add_argument("--served-model", help="model name on the server (default: the first served)")
    parser.add_argument("--api-key-env", default="CANVASROUTE_API_KEY", metavar="VAR",
                        help="environment variable holding the server's API key (default CANVASROUTE_API_KEY)")


def open_engine(args: argparse.Namespace) -> Engine:
    """The engine the options name: the server(s), else the embedded model."""
    if args.engine_url:
        connection = Connection(args.engine_url, api_key=os.environ.get(args.api_key_env))
        return server_engine(connection, kind=args.engine_kind, model=args.served_model)
    from canvasroute.engine import embedded_engine

    engine: Engine = embedded_engine()  # typed Any there: transformers loads only when called
    return engine


def server_engine(connection: Connection, *, kind: EngineKind = "auto", model: str | None = None) -> Engine:
    """The engine for the server behind `connection`: the one `kind` names, or, for `auto`, the one it
    turns out to need on first use (`DetectedEngine`)."""
    if kind == "diffusion":
        return VLLMServerEngine(connection, model=model)
    if kind == "causal":
        return CausalServerEngine(connection, model=model)
    if kind != "auto":
        raise ValueError(f"--engine-kind must be one of {', '.join(ENGINE_KINDS)}, not {kind!r}")
    return DetectedEngine(connection, model=model)


class DetectedEngine:
    """`VLLMServerEngine` or `CausalServerEngine`, whichever the server needs, told on first use.

    Nothing is asked until the first call (a command may start before its server), then one probe
    (`server_kind`) picks the engine, logged, and every call and attribute goes to it.
    """

    def __init__(self, connection: Connection, *, model: str | None = None) -> None:
        self.connection = connection
        self._model = model
        self._engine: VLLMServerEngine | CausalServerEngine | None = None

    def __repr__(self) -> str:
        return f"DetectedEngine({', '.join(self.connection.urls)!r}, engine={self._engine!r})"

    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("_engine")
        if engine is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(engine, name)

    async def engine(self) -> VLLMServerEngine | CausalServerEngine:
        """The engine the server needs (asked once)."""
        if self._engine is None:
            kind = await server_kind(self.connection, model=self._model)
            chosen = (VLLMServerEngine if kind == "diffusion" else CausalServerEngine)(self.connection,
                                                                                      model=self._model)
            if self._engine is None:  # a concurrent first call may have chosen already
                log.info("%s serves %s: reading it with %s", ", ".join(self.connection.urls),
                         "DiffusionGemma's structured read" if kind == "diffusion" else "a causal model",
                         type(chosen).__name__)
                self._engine = chosen
        return self._engine

    async def info(self) -> EngineInfo:
        return await (await self.engine()).info()

    async def tokenize(self, text: str) -> list[int]:
        return await (await self.engine()).tokenize(text)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return await (await self.engine()).count_prompt(messages)

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        return await (await self.engine()).read(batch)

    async def aclose(self) -> None:
        await self.connection.aclose()
