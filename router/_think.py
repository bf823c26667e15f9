"""Thinking before a read: the model writes a thought per canvas prompt, and the reads condition on it.

`think=N` (`CanvasDecisionModel.decide`) lets the model write up to N tokens in its
thought channel once for each canvas prompt of the decision (each chunk, each dependency
stage); that canvas's first reads and re-reads all continue the same thought. The engine
must be able to write one (`VLLMServerEngine.think`), and writes it from the read's noise
seed, so a replayed decision thinks the same thought.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from canvasroute.engine import DecisionError, Thought

__all__ = ["write_thoughts"]


async def write_thoughts(engine: Any, prompts: Sequence[Sequence[Mapping[str, str]]], budget: int,
                         seed: int) -> list[Thought]:
    """One thought of up to `budget` tokens per prompt, written concurrently, each from `seed`."""
    think = getattr(engine, "think", None)
    if think is None:
        raise DecisionError(f"think needs an engine that can write a thought; {type(engine).__name__} cannot"
                            + (" (nor can a decision whose state holds images)" if type(engine).__name__ ==
                               "ImageEngine" else ""),
                            hint="use VLLMServerEngine, with a text state")
    return list(await asyncio.gather(*(think(msgs, budget, seed=seed) for msgs in prompts)))
