"""Images in a decision state: LangChain content blocks as data URLs for the canvas read.

A state can carry images inside its messages (a `HumanMessage` whose content is a list
of blocks). Accepted block shapes, LangChain's standard and OpenAI's:

- `{"type": "image", "base64": ..., "mime_type": "image/png"}` (or `"url": ...`)
- `{"type": "image", "source_type": "base64", "data": ..., "mime_type": ...}` (v0.3)
- `{"type": "image_url", "image_url": {"url": "data:..." | "https://..."}}` (or a string)

They are sent as OpenAI image parts (`{"type": "image_url", "image_url": {"url": ...}}`)
beside the state's text in the user message, with the same canvas. The rendered state
text keeps only the text blocks, so the images take part in the cache key by digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from langchain_core.messages import BaseMessage

from canvasroute.engine import DecisionError, ImagesUnsupported

__all__ = ["ImageEngine", "check_images", "image_digests", "state_images"]

_MAX_DEPTH = 6


def state_images(state: Any) -> tuple[str, ...]:
    """The image URLs (data URLs for inline images) in `state`'s messages, in order."""
    found: list[str] = []
    _walk(state, found, 0)
    return tuple(found)


def image_digests(images: Sequence[str]) -> tuple[str, ...]:
    """A short SHA-256 per image, for keys and spans (never the image itself)."""
    return tuple(hashlib.sha256(url.encode()).hexdigest()[:16] for url in images)


def _walk(value: Any, found: list[str], depth: int) -> None:
    if depth > _MAX_DEPTH or isinstance(value, (str, bytes)):
        return
    if isinstance(value, BaseMessage):
        if isinstance(value.content, list):
            for block in value.content:
                if isinstance(block, Mapping) and (url := _image_url(block)) is not None:
                    found.append(url)
        return
    if isinstance(value, Mapping):
        for v in value.values():
            _walk(v, found, depth + 1)
    elif isinstance(value, Sequence):
        for v in value:
            _walk(v, found, depth + 1)


def _image_url(block: Mapping[str, Any]) -> str | None:
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
