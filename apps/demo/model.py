"""The decision model the demo and the examples run on: a vLLM server, or the embedded CPU model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from canvasroute.router import CanvasDecisionModel

__all__ = ["EMBEDDED_NOTE", "make_model"]

EMBEDDED_NOTE = "embedded SmolLM2-135M: near-chance decisions; this shows the plumbing, not accuracy"


def make_model(engine_url: str | None = None, *, progress: Callable[[str], None] | None = None,
               **kwargs: Any) -> CanvasDecisionModel:
    """A `CanvasDecisionModel` on a vLLM server at `engine_url`, or on the embedded engine.

    `progress` hears one line per slow step of the embedded engine's first load. Keyword
    arguments go to `CanvasDecisionModel` (e.g. `policy=`, `escalate_to=`).
    """
    if engine_url:
        from canvasroute.engine import VLLMServerEngine

        engine: Any = VLLMServerEngine(engine_url)
    else:
        from canvasroute.engine import embedded_engine

        engine = embedded_engine(progress=progress)
    return CanvasDecisionModel(engine=engine, **kwargs)
