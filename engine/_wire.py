"""vLLM's structured-read format, shared by `VLLMServerEngine` and `VLLMEngine`.

What a read sends (`max_tokens`, `logprob_token_ids`, `vllm_xargs.diffusion_*`) and how
its rows are checked (docs/wire-format.md sections 3 and 4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._types import CanvasRead
from .errors import EngineRequestError, EngineResponseError, ImagesUnsupported

MAX_LABEL_IDS = 128
"""vLLM caps `logprob_token_ids` at 128 ids per request (`MAX_LOGPROB_TOKEN_IDS`)."""

NARROW_REFUSED = "diffusion_canvas_length"
"""Text of the 400 that a build refusing narrow canvases answers."""


def check_read(read: CanvasRead, served_width: int) -> None:
    """Refuse a read vLLM would refuse: canvas wider than served, too many label ids, no steps."""
    width = len(read.canvas)
    if read.steps < 1:
        raise EngineRequestError(f"a read takes at least one denoising step, not {read.steps}")
    if not 0 < width <= served_width:
        raise EngineRequestError(f"canvas of {width} ids; this engine reads at most {served_width}")
    if len(read.label_ids) > MAX_LABEL_IDS:
        raise EngineRequestError(f"{len(read.label_ids)} label ids; one read carries at most {MAX_LABEL_IDS}")


def seed_canvas(read: CanvasRead, served_width: int, pad_id: int, *, narrow: bool) -> list[int]:
    """The canvas to send: as built, or padded to the served width where narrow canvases
    are refused (the rows the caller reads lie before the padding either way)."""
    if narrow or len(read.canvas) == served_width:
        return list(read.canvas)
    return [*read.canvas, *[pad_id] * (served_width - len(read.canvas))]


def read_xargs(canvas: Sequence[int], served_width: int, *, constrained: bool, steps: int = 1,
               slots: Sequence[int] = ()) -> dict[str, Any]:
    """`vllm_xargs` of a read-only read of `canvas` (booleans as 0/1): one denoising step,
    or `steps` with every position but the `slots` pinned to its seed."""
    xargs: dict[str, Any] = {"diffusion_seed_canvas": list(canvas), "diffusion_max_steps": steps,
                             "diffusion_read_only": 1}
    if len(canvas) < served_width:
        xargs["diffusion_canvas_length"] = len(canvas)
    if steps > 1:
        free = set(slots)
        xargs["diffusion_pinned"] = [p for p in range(len(canvas)) if p not in free]
    if constrained:
        xargs["diffusion_constrained"] = 1
    return xargs


def check_row_count(count: int, width: int) -> None:
    """A read returns one row per canvas position."""
    if count != width:
        raise EngineResponseError(f"the read returned {count} rows for a canvas of {width}")


def token_id(token: str) -> int:
    """The id in vLLM's `"token_id:<id>"` (`return_tokens_as_token_ids`)."""
    if not (isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit()):
        raise EngineResponseError(f"token {token!r} is not 'token_id:<id>' (was return_tokens_as_token_ids honoured?)")
    return int(token[9:])


def parse_rows(data: Mapping[str, Any], endpoint: str, width: int,
               slots: Sequence[int]) -> tuple[dict[int, float], ...]:
    """The `{id: logprob}` rows at `slots` from a chat or completions response body.

    The response holds one row per canvas position (checked); only the slot rows are
    decoded, which keeps the client's cost per read independent of the canvas width.
    """
    try:
        logprobs = data["choices"][0]["logprobs"]
        positions = logprobs["content"] if endpoint == "chat" else logprobs["top_logprobs"]
        check_row_count(len(positions), width)
        if endpoint == "chat":
            return tuple(chat_row(positions[s]) for s in slots)
        return tuple({token_id(t): float(lp) for t, lp in positions[s].items()} for s in slots)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise EngineResponseError(f"the read response has no readable logprob rows ({exc!r})") from exc


def chat_row(position: Mapping[str, Any]) -> dict[int, float]:
    """One chat row: its `top_logprobs` (the label ids) plus the emitted token."""
    row = {token_id(e["token"]): float(e["logprob"]) for e in position["top_logprobs"]}
    row[token_id(position["token"])] = float(position["logprob"])
    return row


def chat_messages(read: CanvasRead) -> list[dict[str, Any]]:
    """The chat `messages` of a read: its images go with the last user message as OpenAI
    image parts (`{"type": "image_url", "image_url": {"url": ...}}`) after its text."""
    msgs: list[dict[str, Any]] = [dict(m) for m in read.messages]
    if not read.images:
        return msgs
    last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    if last is None:
        raise ImagesUnsupported("a read with images needs a user message to carry them")
    msgs[last]["content"] = [{"type": "text", "text": msgs[last]["content"]},
                             *({"type": "image_url", "image_url": {"url": url}} for url in read.images)]
    return msgs


def images_refused(exc: EngineRequestError) -> bool:
    """Whether a 400 refuses image input (vLLM: `At most 0 image(s) may be provided in one
    prompt.` with images off; a text-only model names the modality too)."""
    text = exc.message.casefold()
    return exc.status == 400 and ("image" in text or "multimodal" in text or "multi-modal" in text)
