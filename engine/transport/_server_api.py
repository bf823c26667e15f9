"""What both server engines ask of an OpenAI-compatible server besides their reads.

`VLLMServerEngine` (DiffusionGemma's structured read) and `CausalServerEngine` (a causal model read
at each slot) discover a model from `/v1/models`, tokenize through `/tokenize` and find which
special-token texts the served tokenizer knows; a burst of cold decisions sends each of those
fetches once (`SingleFlight`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from .._prompts import SPECIAL_CANDIDATES
from ..errors import EngineRequestError, EngineResponseError
from ._connection import Connection

__all__ = ["SingleFlight", "json_object", "positive", "served_entry", "special_texts", "token_ids"]

T = TypeVar("T")


class SingleFlight:
    """Run a fetch once for every concurrent caller on one event loop asking for the same key, so a
    burst of cold decisions sends one discovery and one `/tokenize` per text, not N."""

    def __init__(self) -> None:
        self._inflight: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Future[Any]] = {}

    def __len__(self) -> int:
        """Fetches in flight now."""
        return len(self._inflight)

    async def __call__(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        slot = (asyncio.get_running_loop(), key)
        task = self._inflight.get(slot)
        if task is None:
            task = self._inflight[slot] = asyncio.ensure_future(fetch())

            def done(t: asyncio.Future[Any]) -> None:
                self._inflight.pop(slot, None)
                if not t.cancelled():
                    t.exception()  # retrieved: the waiters re-raise it

            task.add_done_callback(done)
        return await asyncio.shield(task)


def json_object(data: Any, path: str) -> dict[str, Any]:
    """A reply's JSON object, else `EngineResponseError` naming the path."""
    if not isinstance(data, dict):
        raise EngineResponseError(f"{path} answered {type(data).__name__}, not an object")
    return data


def positive(value: Any) -> int | None:
    """A positive int from a JSON field, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def served_entry(connection: Connection, model: str | None) -> dict[str, Any]:
    """The `/v1/models` entry of `model` (the first one served when None)."""
    served = json_object((await connection.request("GET", "/v1/models")).data, "/v1/models").get("data") or []
    if not isinstance(served, list) or not all(isinstance(m, dict) and m.get("id") for m in served):
        raise EngineResponseError(f"the server lists no usable models at /v1/models: {str(served)[:200]}")
    if not served:
        raise EngineResponseError("the server lists no models at /v1/models")
    entry: dict[str, Any] | None = next((m for m in served if m["id"] == model), None) if model else served[0]
    if entry is None:
        raise EngineRequestError(f"model {model!r} is not served here; served: {[m['id'] for m in served]}")
    return entry


async def token_ids(connection: Connection, body: Mapping[str, Any]) -> list[int]:
    """The ids `/tokenize` answers for `body` (a text or chat messages)."""
    tokens = json_object((await connection.request("POST", "/tokenize", body)).data, "/tokenize").get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise EngineResponseError(f"/tokenize answered no token ids: {str(tokens)[:200]}")
    return tokens


async def special_texts(connection: Connection, model: str,
                        tokenize: Callable[[str], Awaitable[list[int]]]) -> tuple[str, ...]:
    """Which special-token texts the served tokenizer knows: one `/tokenize` of them all with
    `return_token_strs` (a special comes back as one token string equal to its text); a server
    without token strings gets each candidate tokenized by `tokenize` (special: exactly one id)."""
    body = {"model": model, "prompt": "\n".join(SPECIAL_CANDIDATES), "add_special_tokens": False,
            "return_token_strs": True}
    strs = json_object((await connection.request("POST", "/tokenize", body)).data, "/tokenize").get("token_strs")
    if isinstance(strs, list) and all(isinstance(t, str) for t in strs):
        found = set(strs)
        return tuple(sorted(t for t in SPECIAL_CANDIDATES if t in found))
    ids = await asyncio.gather(*(tokenize(text) for text in SPECIAL_CANDIDATES))
    return tuple(sorted(t for t, i in zip(SPECIAL_CANDIDATES, ids, strict=True) if len(i) == 1))
