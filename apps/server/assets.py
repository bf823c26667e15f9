"""System One's `assets`: images a request names by a placeholder, as `typesafe-sdk` sends them.

`assets` maps a placeholder (typesafe-sdk writes `<image:32 hex digits>`) to an image:
`{"type": "image", "format": "png" | "jpg" | "jpeg", "data_base64": ...}`, or, in a
multipart body, `{"type": "image", "part": name}`, the file part of that name. Wherever a
placeholder appears as or inside a string of the state, a question's instructions or its
criteria, its image is read with the decision (`ReadOptions.images`, in order of first
appearance; assets no text names follow) and the text says `[image N]` in its place: a
canvas read sees a decision's images beside its text, not at a position inside it. Every
error is a 422 about one place in the body (a part neither named by an asset nor an image
is the multipart body's 400, in `body`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .wire import malformed

__all__ = ["Placed", "place_assets", "sniff_image"]

_FORMATS = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg"}
_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}


def sniff_image(data: bytes) -> str | None:
    """The content type of PNG or JPEG bytes by their signature (None: neither)."""
    return next((kind for signature, kind in _SIGNATURES.items() if data.startswith(signature)), None)


@dataclass(frozen=True, slots=True)
class Placed:
    """A request with its asset placeholders replaced."""

    state: Any
    questions: dict[str, Any]
    """The raw questions, placeholders replaced in instructions and criteria."""
    images: list[str]
    """Data URLs of the assets, in order of first appearance (those no text names last)."""
    parts: frozenset[str]
    """The multipart file parts the assets claimed (the others are the gateway's `images`)."""


def place_assets(value: Any, state: Any, questions: Mapping[str, Any],
                 parts: Sequence[tuple[str, str]]) -> Placed:
    """Resolve `assets` (`value`, the body's) against the multipart file `parts` ((name, data
    URL), in body order) and replace each placeholder in `state` and the questions'
    instructions and criteria."""
    if not isinstance(value, dict) or not value:
        raise malformed(("assets",), "must be a non-empty object of placeholder to image asset")
    urls: dict[str, str] = {}
    claimed: set[str] = set()
    for alias, asset in value.items():
        where = ("assets", alias)
        if not alias.strip():
            raise malformed(("assets",), "placeholders must be non-empty")
        if not isinstance(asset, dict) or asset.get("type", "image") != "image":
            raise malformed(where, "must be an image asset: {\"type\": \"image\", \"data_base64\" or \"part\"}")
        if (part := asset.get("part")) is not None:
            url = next((u for name, u in parts if name == part), None)
            if not isinstance(part, str) or url is None:
                raise malformed((*where, "part"), "names no image part of this multipart body")
            urls[alias] = url
            claimed.add(part)
            continue
        data, fmt = asset.get("data_base64"), asset.get("format")
        if not isinstance(data, str) or not data:
            raise malformed(where, "needs data_base64 (with format) or, in a multipart body, part")
        if fmt not in _FORMATS:
            raise malformed((*where, "format"), "must be png, jpg or jpeg with data_base64")
        try:
            base64.b64decode("".join(data.split()), validate=True)
        except (binascii.Error, ValueError):
            raise malformed((*where, "data_base64"), "is not base64") from None
        urls[alias] = f"data:{_FORMATS[fmt]};base64,{''.join(data.split())}"
    order: dict[str, int] = {}  # alias -> its image's place in the request, by first appearance

    def put(text: str) -> str:
        for alias in urls:
            if alias in text:
                n = order.setdefault(alias, len(order) + 1)
                text = text.replace(alias, f"[image {n}]")
        return text

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return put(item)
        if isinstance(item, list):
            return [walk(x) for x in item]
        if isinstance(item, dict):  # keys stay: a Choice's option names are its answers
            return {k: walk(v) for k, v in item.items()}
        return item

    placed_state = walk(state)
    placed = {qid: {k: walk(v) if k in ("instructions", "criteria") else v for k, v in q.items()}
              if isinstance(q, dict) else q for qid, q in questions.items()}
    for alias in urls:
        order.setdefault(alias, len(order) + 1)
    images = [urls[alias] for alias in sorted(order, key=order.__getitem__)]
    return Placed(placed_state, placed, images, frozenset(claimed))
