"""How a decision was read: stages, canvases, formats, thoughts (`CanvasResponse.diagnostics`).

Per-question figures (slot, entropy of each read, label mass, argmax) are on each
`ReadReport`; this is what the decision as a whole did, the shape vLLM's gateway reports
as `diagnostics` (`canvasroute serve` sends both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ._options import ReadOptions

__all__ = ["Diagnostics", "DiagnosticsLog", "ThoughtReport"]


class ThoughtReport(BaseModel):
    """A thought the model wrote before a canvas was read (`think`)."""

    model_config = ConfigDict(frozen=True)

    text: str
    tokens: int
    closed: bool
    """Whether the model closed its thought channel (else the budget cut it)."""
    latency_s: float


class Diagnostics(BaseModel):
    """How one decision was read."""

    model_config = ConfigDict(frozen=True)

    stages: list[list[str]] = Field(default_factory=list)
    """Question ids asked per dependency stage, in read order (one stage without `depends_on`)."""
    chunks: list[list[str]] = Field(default_factory=list)
    """Question ids per canvas prompt, over every stage."""
    formats: list[Literal["lines", "compact"]] = Field(default_factory=list)
    """Answer format of each chunk: `q1: A` lines, or `q1A q2B` (many questions)."""
    conditioning: Literal["restated"] | None = None
    """How a later stage saw earlier answers: restated after the state (None: one stage)."""
    constrained: bool = False
    steps: int = 1
    thoughts: list[ThoughtReport] = Field(default_factory=list)
    """The thought each chunk's reads continued (`think`), in chunk order."""
    prompt_tokens: int = 0
    """Prompt tokens of the first read (0 when the engine reports none)."""


@dataclass(slots=True)
class DiagnosticsLog:
    """Collects a decision's stages as they are read."""

    options: ReadOptions
    stages: list[list[str]] = field(default_factory=list)
    chunks: list[list[str]] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    thoughts: list[ThoughtReport] = field(default_factory=list)
    prompt_tokens: int = 0

    def add(self, asked: Sequence[str], reading: Any) -> None:
        """One stage: its questions and, when it was read (`Reading`), its canvases."""
        self.stages.append(list(asked))
        if reading is None:
            return
        for chunk in reading.plan.chunks:
            self.chunks.append([s.question_id for s in chunk.slots if not s.shift])
            self.formats.append("compact" if chunk.compact else "lines")
        self.thoughts += [ThoughtReport(text=t.text, tokens=len(t.ids), closed=t.closed, latency_s=t.latency_s)
                          for t in reading.thoughts]
        self.prompt_tokens = self.prompt_tokens or reading.prompt_tokens

    def build(self) -> Diagnostics:
        return Diagnostics.model_validate({
            "stages": self.stages, "chunks": self.chunks, "formats": self.formats,
            "conditioning": "restated" if len(self.stages) > 1 else None, "constrained": self.options.constrained,
            "steps": self.options.steps, "thoughts": self.thoughts, "prompt_tokens": self.prompt_tokens})
