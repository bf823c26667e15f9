"""Images in a decision state: LangChain content blocks as data URLs for the canvas read.

A state can carry images as content blocks anywhere: in a message's content (a
`HumanMessage` whose content is a list of blocks), in a dict message
(`{"role": "user", "content": [...]}`), or as a value of its own; `_state.state_images`
finds them all. Accepted block shapes, LangChain's standard and OpenAI's:

- `{"type": "image", "base64": ..., "mime_type": "image/png"}` (or `"url": ...`)
- `{"type": "image", "source_type": "base64", "data": ..., "mime_type": ...}` (v0.3)
- `{"type": "image_url", "image_url": {"url": "data:..." | "https://..."}}` (or a string)

They are sent as OpenAI image parts (`{"type": "image_url", "image_url": {"url": ...}}`)
beside the state's text in the user message, with the same canvas. The rendered state
text holds no image data (a message's text, `{"type": "image"}` in place of any other
block), so the images take part in the cache key by digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from canvasroute.engine import DecisionError, ImagesUnsupported

__all__ = ["ImageEngine", "check_images", "image_digests", "image_url"]


def image_digests(images: Sequence[str]) -> tuple[str, ...]:
    """A short SHA-256 per image, for keys and spans (never the image itself)."""
    return tuple(hashlib.sha256(url.encode()).hexdigest()[:16] for url in images)


def image_url(block: Mapping[str, Any]) -> str | None:
    """The URL (a data URL for inline data) of an image content block; None for any other
    mapping; `DecisionError` for an image block without a usable source."""
    kind = block.get("type")
    if kind == "image_url":
        inner = block.get("image_url")
        url = inner.get("url") if isinstance(inner, Mapping) else inner
        if not isinstance(url, str) or not url:
            raise DecisionError(f"an image_url block without a url: {str(block)[:120]}")
        return url
    if kind != "image":
        return None
    data = block.get("base64") or (block.get("data") if block.get("source_type") == "base64" else None)
    if data:
        mime = block.get("mime_type")
        if not isinstance(mime, str) or not mime.startswith("image/"):
            raise DecisionError(f"an inline image block needs mime_type 'image/...', got {mime!r}")
        return f"data:{mime};base64,{data}"
    url = block.get("url") or (block.get("data") if block.get("source_type") == "url" else None)
    if isinstance(url, str) and url:
        return url
    raise DecisionError("an image block needs base64 (with mime_type) or url",
                        hint="images in a state are LangChain content blocks, e.g. "
                             "{'type': 'image', 'base64': ..., 'mime_type': 'image/png'}")


def check_images(info: Any, images: Sequence[str]) -> None:
    """Refuse a state with images before any read when the engine cannot take them."""
    if images and not getattr(info, "accepts_images", False):
        raise ImagesUnsupported(
            f"the state holds {len(images)} image(s) and engine {info.model!r} ({info.provider}) cannot take images",
            hint="read images with VLLMServerEngine (endpoint='chat') on a vision-capable vLLM server; the "
                 "completions endpoint and in-process causal LMs read text only")


class ImageEngine:
    """An engine that sends `images` with every read it forwards (one decision's view)."""

    def __init__(self, engine: Any, images: Sequence[str]) -> None:
        self._engine = engine
        self._images = tuple(images)

    async def info(self) -> Any:
        return await self._engine.info()

    async def tokenize(self, text: str) -> list[int]:
        return await self._engine.tokenize(text)

    async def count_prompt(self, messages: Any) -> int:
        return await self._engine.count_prompt(messages)

    async def read(self, batch: Sequence[Any]) -> list[Any]:
        return await self._engine.read([replace(r, images=self._images) for r in batch])

    async def aclose(self) -> None:  # the wrapped engine belongs to the model
        return None
