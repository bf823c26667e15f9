"""Reading a request body: JSON only, bounded in bytes and in time, decoded; before any slot is taken."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from .limits import Limits
from .wire import Refusal

__all__ = ["ClientGone", "read_body"]


class ClientGone(Exception):  # noqa: N818 - control flow inside the server, never raised to a caller
    """The client closed the connection; nobody is left to answer."""


def _check_content_type(value: str | None) -> None:
    """JSON, or no content type at all (read as JSON, as FastAPI does); anything else is 415."""
    if not value:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise Refusal(415, "unsupported_media_type", "send the body as application/json")


async def read_body(request: Request, limits: Limits) -> bytes:
    """The whole body, decoded: 415 not JSON, 413 too large, 408 too slow; `ClientGone` on a disconnect."""
    _check_content_type(request.headers.get("content-type"))
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity", *_DECODERS):
        raise Refusal(415, "unsupported_media_type", f"content-encoding {encoding[:40]!r} is not supported; "
                      f"send {', '.join(['identity', *_DECODERS])}")
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise Refusal(413, "payload_too_large", f"the body is over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise Refusal(413, "payload_too_large", f"the body is over {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise Refusal(408, "body_timeout", f"the body did not arrive within {limits.body_timeout:g}s",
                      headers={"connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone from None
    return _decode(b"".join(chunks), encoding, limit)


def _decode(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    try:
        out = _DECODERS[encoding](body, limit + 1)
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's bad body
        raise Refusal(422, "invalid_body", f"the {encoding} body could not be decoded", loc=()) from exc
    if len(out) > limit:
        raise Refusal(413, "payload_too_large", f"the decoded body is over {limit} bytes")
    return out


def _gunzip(data: bytes, max_length: int) -> bytes:
    return zlib.decompressobj(wbits=31).decompress(data, max_length)


_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {"gzip": _gunzip}
try:  # zstd (what typesafe-sdk sends when zstd is available): Python 3.14+ or backports.zstd
    try:
        from compression.zstd import ZstdDecompressor  # type: ignore[import-not-found]
    except ImportError:
        from backports.zstd import ZstdDecompressor  # type: ignore[import-not-found,no-redef]

    _DECODERS["zstd"] = lambda data, max_length: ZstdDecompressor().decompress(data, max_length)
except ImportError:
    pass
