"""The decision model the demo and the examples run on: a server (DiffusionGemma or a causal model), or the
embedded CPU model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from canvasroute.router import CanvasDecisionModel

from .._engine_options import EngineKind, server_engine

__all__ = ["EMBEDDED_NOTE", "make_model"]

EMBEDDED_NOTE = "embedded SmolLM2-135M: near-chance decisions; this shows the plumbing, not accuracy"


def make_model(engine_url: str | None = None, *, progress: Callable[[str], None] | None = None,
               engine_kind: EngineKind = "auto", **kwargs: Any) -> CanvasDecisionModel:
    """A `CanvasDecisionModel` on the server at `engine_url` (what it serves picks the engine unless
    `engine_kind` says it: `canvasroute.apps._engine_options.server_engine`), or on the embedded engine.

    `progress` hears one line per slow step of the embedded engine's first load. Keyword
    arguments go to `CanvasDecisionModel` (e.g. `policy=`, `escalate_to=`).
    """
    if engine_url:
        from canvasroute.engine import Connection

        engine: Any = server_engine(Connection(engine_url), kind=engine_kind)
    else:
        from canvasroute.engine import embedded_engine

        engine = embedded_engine(progress=progress)
    return CanvasDecisionModel(engine=engine, **kwargs)
