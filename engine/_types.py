"""What an engine reads and returns, and the protocol every backend implements."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .errors import DecisionError, EngineResponseError, ImagesUnsupported

Message = Mapping[str, str]
"""A chat message: `{"role": ..., "content": ...}`."""

THOUGHT_SCAFFOLD = "<|channel>thought\n<channel|>"
"""Gemma 4's empty thought block: the canvas opens with it unless the prompt holds it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineInfo:
    """What the router needs to know about an engine before it builds canvases."""

    model: str
    """Served model name (reported as `gen_ai.request.model`)."""
    provider: str
    """`vllm`, `transformers` or `function` (reported as `gen_ai.provider.name`)."""
    canvas_width: int
    """Widest canvas one read may use."""
    max_model_len: int
    """Prompt plus canvas must fit in this many tokens."""
    vocab_size: int
    """Noise ids are drawn from `[0, vocab_size)`."""
    pad_id: int = 0
    """Token that fills the canvas after the template."""
    chat_overhead: int = 0
    """Tokens the chat template adds around empty messages (for cheap length bounds)."""
    canvas_prefix: str = THOUGHT_SCAFFOLD
    """Text that opens the answer canvas: Gemma 4's empty thought block, or `""` where the
    engine found that its generation prompt already ends with it."""
    end_of_turn: str = "<turn|>"
    """Text that closes the answer (Gemma 4's end of turn)."""
    special_tokens: tuple[str, ...] = ()
    """Special and added token texts of the engine's tokenizer: `canvasroute.engine.defuse` breaks them
    in user text so a state or an instruction cannot forge template tokens."""
    accepts_images: bool = False
    """Whether reads may carry images (`CanvasRead.images`); the router refuses a state
    with images before any read when False (`ImagesUnsupported`)."""
    causal_readout: bool = False
    """Whether a slot's row sees only the canvas before it (a causal LM read at each slot).
    Then fresh noise reaches a slot only through noisy positions before it, and a re-read
    cannot change a slot that has none (the router does not re-read it). False: every slot
    sees the whole canvas (DiffusionGemma), so every re-read can differ."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CanvasRead:
    """One structured read: a prompt, a seeded canvas, and the slots to read back."""

    messages: tuple[Message, ...]
    """Chat messages; the engine applies its chat template with a generation prompt."""
    canvas: tuple[int, ...]
    """Seed canvas: template ids with noise at the slots."""
    slots: tuple[int, ...]
    """Canvas positions whose rows the caller needs, in the caller's order."""
    label_ids: tuple[int, ...]
    """Sorted union of every slot's label ids (the ids each row must carry)."""
    constrained: bool = False
    """Normalize each row over `label_ids` only (label mass is then 1)."""
    images: tuple[str, ...] = ()
    """Image URLs (data URLs for inline images) sent with the last user message, as
    OpenAI image parts; only engines whose `EngineInfo.accepts_images` take them."""
    steps: int = 1
    """Denoising steps before the canvas is read; past 1 every position but the slots is
    held at its seed (vLLM's `diffusion_pinned`), so the template survives the steps."""
    thought: tuple[int, ...] | None = None
    """A thought the model wrote (`Thought.ids`): the read's prompt is the chat prompt with
    thinking on and its thought channel holding these ids, closed; the canvas then starts
    at the answers. Only engines with a `think` method take it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Thought:
    """What the model wrote in its thought channel before a read (`VLLMServerEngine.think`)."""

    ids: tuple[int, ...]
    """The thought's token ids, without the channel's open and close tags."""
    text: str
    closed: bool
    """Whether the model closed the channel itself (else the budget cut it)."""
    prompt_tokens: int = 0
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadResult:
    """Rows of log-probabilities at the requested slots, plus accounting."""

    rows: tuple[Mapping[int, float], ...]
    """One row per requested slot: token id to logprob, holding every requested label id
    (`check_rows`: a row without one is an `EngineResponseError`, never an answer)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    attrs: Mapping[str, object] = field(default_factory=dict)
    """Engine-specific details (replica URL, batch size) for tracing."""

    def __post_init__(self) -> None:
        for i, row in enumerate(self.rows):
            if not row:
                raise EngineResponseError(f"slot row {i} is empty")
            # fast check in C: a NaN or +inf makes the sum NaN or +inf (neither is below inf); a
            # finite logprob > 0 shows in max
            if sum(row.values()) < math.inf and max(row.values()) <= 1e-4:
                continue
            for token, lp in row.items():
                if not math.isfinite(lp) and lp != -math.inf:
                    raise EngineResponseError(f"slot row {i} holds a non-finite logprob {lp!r} for id {token}")
                if lp > 1e-4:
                    raise EngineResponseError(f"slot row {i} holds a positive logprob {lp!r} for id {token}")


def check_rows(read: CanvasRead, rows: Sequence[Mapping[int, float]]) -> None:
    """Every requested label id at every slot, one row per slot; else `EngineResponseError`.

    A server that returns only its argmax (or drops ids) would otherwise make a slot look
    certain: a malformed row fails the read like any engine fault.
    """
    if len(rows) != len(read.slots):
        raise EngineResponseError(f"the engine returned {len(rows)} slot rows for {len(read.slots)} slots")
    for slot, row in zip(read.slots, rows, strict=True):
        missing = [i for i in read.label_ids if i not in row]
        if missing:
            raise EngineResponseError(
                f"the row at canvas position {slot} lacks requested label ids {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} ({len(row)} ids returned)",
                hint="the server must honour logprob_token_ids (vLLM >= 0.32 with the structured read)")


def refuse_images(batch: Sequence[CanvasRead], engine: str) -> None:
    """`ImagesUnsupported` before any read when a text-only engine is handed images."""
    if any(read.images for read in batch):
        raise ImagesUnsupported(f"{engine} reads text only; this read carries images",
                                hint="read images with VLLMServerEngine (chat endpoint) on a vision-capable server")


def refuse_thoughts(batch: Sequence[CanvasRead], engine: str, *, steps: bool = True) -> None:
    """`DecisionError` before any read when an engine is handed a thought (or, unless
    `steps`, more than one denoising step) it cannot read."""
    if any(read.thought is not None for read in batch):
        raise DecisionError(f"{engine} cannot read a thought", hint="think with VLLMServerEngine")
    if not steps and any(read.steps != 1 for read in batch):
        raise DecisionError(f"{engine} reads one denoising step only", hint="steps > 1 needs a vLLM engine")


@dataclass(frozen=True, slots=True)
class Batching:
    """How an in-process engine batches concurrent reads (`TransformersEngine(batching=...)`).

    Reads submitted within `window_s` of the oldest queued one share one forward pass of at
    most `max_batch` canvases; the queue holds at most `max_queue` reads (one more raises
    `EngineOverloaded`)."""

    max_batch: int = 16
    window_s: float = 0.002
    max_queue: int = 1024

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or not self.window_s >= 0:
            raise ValueError(f"Batching needs max_batch and max_queue >= 1 and window_s >= 0, got {self}")


@runtime_checkable
class Engine(Protocol):
    """A single-step canvas reader. Async-first; the router provides the sync path."""

    async def info(self) -> EngineInfo:
        """Describe the served model (cached after the first call)."""
        ...

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of plain text; special-token text maps to its special id."""
        ...

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        """Token count of the chat prompt, generation prompt included."""
        ...

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        """Run one denoising pass per canvas and return the slot rows, in order."""
        ...

    async def aclose(self) -> None:
        """Release connections, threads and models."""
        ...
