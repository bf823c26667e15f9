"""Reading a request body: JSON or multipart, bounded in bytes and in time, decoded; before any slot is taken.

A multipart/form-data body (vLLM's gateway's image upload, typesafe-sdk's assets) holds the
JSON request in a part named `request` and each image as a file part (`image/*`, or PNG or
JPEG bytes labelled `application/octet-stream`): `request_parts` splits it.
"""

from __future__ import annotations

import asyncio
import base64
import zlib
from collections.abc import Callable
from email.parser import BytesParser
from email.policy import HTTP

from starlette.requests import ClientDisconnect, Request

from .assets import sniff_image
from .limits import Limits
from .wire import Refusal

__all__ = ["ClientGone", "read_body", "request_parts"]


class ClientGone(Exception):  # control flow inside the server, never raised to a caller
    """The client closed the connection; nobody is left to answer."""


def _media(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def _check_content_type(value: str | None) -> None:
    """JSON or multipart/form-data, or no content type at all (read as JSON, as FastAPI
    does); anything else is 415."""
    media = _media(value)
    if media in ("", "application/json", "multipart/form-data") or (media.startswith("application/")
                                                                     and media.endswith("+json")):
        return
    raise Refusal(415, "unsupported_media_type", "send the body as application/json (or multipart/form-data "
                  "with the JSON in a part named request and images as file parts)")


def request_parts(body: bytes, content_type: str | None) -> tuple[bytes, list[tuple[str, str]]]:
    """(the JSON request, its file parts as (name, image data URL)): a JSON body as it is, or a
    multipart body split into its `request` part and its image parts, in order (422 for anything else)."""
    if content_type is None or _media(content_type) != "multipart/form-data":
        return body, []
    try:
        message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
        parts = list(message.iter_parts()) if message.is_multipart() else []
    except Exception as exc:  # any parser failure is the client's malformed body
        raise Refusal(422, "invalid_body", "the multipart body could not be parsed", loc=()) from exc
    request: bytes | None = None
    images: list[tuple[str, str]] = []
    for part in parts:
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        media = part.get_content_type()
        if media == "application/octet-stream":  # typesafe-sdk's label for bytes it did not recognize
            media = sniff_image(data) or media
        if name == "request" and request is None:
            request = data
        elif media.startswith("image/"):
            images.append((str(name or ""), f"data:{media};base64,{base64.b64encode(data).decode()}"))
        else:
            shown = str(name)[:40] if name is not None else "unnamed"
            raise Refusal(422, "invalid_body", f"multipart part {shown!r} is neither the request nor an image "
                          "(an image/* file, or PNG or JPEG bytes)", loc=())
    if request is None:
        raise Refusal(422, "invalid_body", "a multipart body needs a part named request holding the JSON", loc=())
    return request, images


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
    except Exception as exc:  # any decoder failure is the client's bad body
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
        from backports.zstd import ZstdDecompressor  # type: ignore[import-not-found]

    _DECODERS["zstd"] = lambda data, max_length: ZstdDecompressor().decompress(data, max_length)
except ImportError:
    pass
