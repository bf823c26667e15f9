"""`VLLMServerEngine`: structured reads against vLLM's OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx

from ._http import MAX_RESPONSE_BYTES, Connection
from ._prompts import EMPTY_CHAT, PromptCache, template_kwargs
from ._text import SPECIAL_CANDIDATES, THOUGHT_SCAFFOLD, scaffold_prefix
from ._thought import thought_prompt, write_thought
from ._types import CanvasRead, EngineInfo, Message, ReadResult, Thought, check_rows
from ._wire import NARROW_REFUSED, chat_messages, check_read, images_refused, parse_rows, read_xargs, seed_canvas
from .errors import EngineRequestError, EngineResponseError, ImagesUnsupported

_VOCAB_RANGE = re.compile(r"must be in \[0, (\d+)\)")
_NOISE_PROBE_ID = 2**30
T = TypeVar("T")

class VLLMServerEngine:
    """Reads canvases from one or more vLLM servers over HTTP.

    The HTTP part is a `Connection` (engine/_http.py): at most `max_concurrency` requests in
    flight per event loop, a timeout on every attempt, retries with exponential backoff and
    jitter on connection errors, timeouts, 408, 429 and 5xx (moving to the next healthy
    replica). Tokenization goes through the server's `/tokenize`, so no local tokenizer or
    weights are needed. Discovery asks the server once for its model, canvas, vocabulary,
    special tokens, and whether its generation prompt already holds the thought block.

    Prefix affinity: every read carries `session_header` (default `x-session-id`; None
    sends none) with a stable key of its prompt (`session_key`: a hash of the chat
    messages, i.e. system prompt + questions + state), the same for a decision's first
    read and its re-reads. Behind one base URL, a session-aware router keeps those reads
    on one replica, where the prompt is a prefix-cache hit: the vLLM Router's
    `consistent_hash` policy reads `X-Session-ID`; the vLLM production-stack router
    reads the header named by `--routing-logic session --session-key x-session-id`.
    Prefix-aware routers (production-stack `prefixaware`, llm-d's inference gateway,
    Ray Serve's prefix-cache-affinity router) match the prompt itself and need no header.
    Given several base URLs and `affinity=True` (default), the client routes each key by
    rendezvous hashing over them, failing over to the key's next replica while one cools
    down: a convenience for a handful of replicas, not a replacement for those routers
    (no load awareness, no shared view between clients beyond the same URL list).

    HTTP (`Connection`'s arguments): `verify=` (True, False, a CA bundle, an `ssl.SSLContext`)
    and `cert=` (a client certificate) for TLS; idle connections are reused for
    `keepalive_expiry` seconds; a reply over `max_response_bytes` is an
    `EngineResponseError`; `HTTP(S)_PROXY`/`ALL_PROXY`/`NO_PROXY` are followed unless
    `trust_env=False`; URL userinfo is sent as Basic auth; `transport=` sends through httpx.
    Discovery needs the served context length (`max_model_len` in `/v1/models`, as vLLM
    lists it); a proxy that drops it gets `EngineResponseError` saying so, unless
    `max_model_len=` is given. `canvas_width=` and `vocab_size=` skip their probes too.

    `enable_thinking` goes to the chat template (default False, the read mode). A server
    that refuses `diffusion_canvas_length` below its served width gets the full width from
    then on (`narrow_canvases` turns False).

    Example:
        ```python
        engine = VLLMServerEngine("http://127.0.0.1:8000")
        info = await engine.info()          # model, canvas width, vocab size
        ```
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        model: str | None = None,
        api_key: str | None = None,
        endpoint: Literal["chat", "completions"] = "chat",
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        max_concurrency: int = 64,
        max_retries: int = 3,
        backoff: float = 0.2,
        replica_cooldown: float = 5.0,
        canvas_width: int | None = None,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        enable_thinking: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        verify: bool | str | ssl.SSLContext = True,
        cert: str | tuple[str, ...] | None = None,
        keepalive_expiry: float = 4.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        trust_env: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        session_header: str | None = "x-session-id",
        affinity: bool = True,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("VLLMServerEngine needs at least one base URL")
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', not {endpoint!r}")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        if session_header is not None and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", session_header):
            raise ValueError(f"session_header must be an HTTP header name or None, not {session_header!r}")
        self.connection = Connection(urls, api_key=api_key, timeout=timeout, connect_timeout=connect_timeout,
                                     max_concurrency=max_concurrency, max_retries=max_retries, backoff=backoff,
                                     replica_cooldown=replica_cooldown, verify=verify, cert=cert,
                                     keepalive_expiry=keepalive_expiry, max_response_bytes=max_response_bytes,
                                     trust_env=trust_env, transport=transport, service="vLLM server")
        """The HTTP connection (replicas, lanes, retries)."""
        self.session_header = session_header
        """Header carrying each read's `session_key` (None: not sent)."""
        self.affinity = affinity
        """Route reads over several base URLs by rendezvous hashing of `session_key` (else round-robin)."""
        self._model = model
        self.endpoint = endpoint
        self._canvas_width = canvas_width
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._template_kwargs = template_kwargs(enable_thinking, chat_template_kwargs)
        self._info: EngineInfo | None = None
        self._inflight: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Future[Any]] = {}
        self._tokens = PromptCache(4096)
        self.narrow_canvases = True
        """Whether reads narrower than the served canvas go out narrow (False once the
        server refused `diffusion_canvas_length`: they are padded to the full width)."""
        self.requests_sent = 0
        """Read requests sent (retries included); `/tokenize` and discovery excluded."""

    def __repr__(self) -> str:
        urls = ", ".join(self.connection.urls)
        return f"VLLMServerEngine({urls!r}, model={self._model!r}, endpoint={self.endpoint!r})"

    @property
    def cached_prompts(self) -> int:
        """Token id lists held by the prompt cache (chats and texts)."""
        return len(self._tokens)

    @property
    def pending_fetches(self) -> int:
        """Discovery and `/tokenize` fetches in flight, shared by their concurrent callers."""
        return len(self._inflight)

    # -- protocol -------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self._once("info", self._discover)
        return self._info

    async def _discover(self) -> EngineInfo:
        """Model, context, vocabulary, canvas, specials and scaffold, asked of the server once."""
        served = (await self._request("GET", "/v1/models")).get("data") or []
        if not isinstance(served, list) or not all(isinstance(m, dict) and m.get("id") for m in served):
            raise EngineResponseError(f"the server lists no usable models at /v1/models: {str(served)[:200]}")
        if not served:
            raise EngineResponseError("the server lists no models at /v1/models")
        entry = next((m for m in served if m["id"] == self._model), None) if self._model else served[0]
        if entry is None:
            raise EngineRequestError(f"model {self._model!r} is not served here; served: {[m['id'] for m in served]}")
        self._model = str(entry["id"])
        max_len = self._max_model_len or _positive(entry.get("max_model_len"))
        if max_len is None:  # some proxies drop vLLM's extra fields
            raise EngineResponseError(
                f"the server does not say its context length: /v1/models lists {self._model!r} without "
                "max_model_len", hint="pass VLLMServerEngine(..., max_model_len=N), N the served "
                                      "--max-model-len (a proxy in front of vLLM may drop the field)")
        vocab = self._vocab_size or await self._discover_vocab()
        width = self._canvas_width or await self._discover_canvas(max_len)
        prompt, scaffold, specials = await asyncio.gather(
            self.prompt_ids(EMPTY_CHAT), self.tokenize(THOUGHT_SCAFFOLD), self._discover_specials())
        return EngineInfo(model=self._model, provider="vllm", canvas_width=width, max_model_len=max_len,
                          vocab_size=vocab, pad_id=0, chat_overhead=len(prompt),
                          canvas_prefix=scaffold_prefix(prompt, scaffold), special_tokens=specials,
                          accepts_images=self.endpoint == "chat")

    async def tokenize(self, text: str) -> list[int]:
        key = PromptCache.text_key(text)
        ids = self._tokens.get(key)
        if ids is None:
            body = {"model": await self._model_name(), "prompt": text, "add_special_tokens": False}
            ids = self._tokens.put(key, await self._once(key, lambda: self._tokenize_request(body)))
        return list(ids)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(await self.prompt_ids(messages))

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        return list(await asyncio.gather(*(self._read_one(r) for r in batch)))

    async def think(self, messages: Sequence[Message], budget: int) -> Thought:
        """What the model writes in its thought channel after `messages`, up to `budget` tokens
        (`engine._thought`); a `CanvasRead(thought=thought.ids)` then reads after it."""
        return await write_thought(self, messages, budget)

    async def aclose(self) -> None:
        await self.connection.aclose()

    # -- reads ----------------------------------------------------------------------

    async def _read_one(self, read: CanvasRead) -> ReadResult:
        info = await self.info()
        check_read(read, info.canvas_width)
        if read.images:
            return await self._read_images(read, info)
        return await self._read_text(read, info)

    async def _read_images(self, read: CanvasRead, info: EngineInfo) -> ReadResult:
        """A read with images: refused before sending where they cannot go, and typed when
        the server refuses them (remembered: later decisions fail before any request)."""
        if not info.accepts_images:
            raise ImagesUnsupported(
                f"this engine ({self.endpoint} endpoint of {info.model}) cannot take images",
                hint="use endpoint='chat' against a vLLM server with image input enabled")
        try:
            return await self._read_text(read, info)
        except EngineRequestError as exc:
            if not images_refused(exc):
                raise
            self._info = dataclasses.replace(info, accepts_images=False)
            raise ImagesUnsupported(f"the vLLM server refused the images: {exc.message}",
                                    hint="serve a model with image input (e.g. no --limit-mm-per-prompt "
                                         "'{\"image\": 0}'), or keep images out of the decision state") from exc

    async def _read_text(self, read: CanvasRead, info: EngineInfo) -> ReadResult:
        narrow = self.narrow_canvases
        try:
            return await self._read_at(read, info, narrow=narrow)
        except EngineRequestError as exc:
            if not (narrow and exc.status == 400 and NARROW_REFUSED in exc.message
                    and len(read.canvas) < info.canvas_width):
                raise
            self.narrow_canvases = False  # this build reads only the served width: remember it
            return await self._read_at(read, info, narrow=False)

    async def _read_at(self, read: CanvasRead, info: EngineInfo, *, narrow: bool) -> ReadResult:
        canvas = seed_canvas(read, info.canvas_width, info.pad_id, narrow=narrow)
        width = len(canvas)
        body: dict[str, Any] = {
            "model": info.model,
            "max_tokens": width,
            "logprob_token_ids": sorted(read.label_ids),
            "return_tokens_as_token_ids": True,
            "vllm_xargs": read_xargs(canvas, info.canvas_width, constrained=read.constrained, steps=read.steps,
                                     slots=read.slots),
        }
        endpoint = "completions" if read.thought is not None else self.endpoint
        if endpoint == "chat":
            body.update(messages=chat_messages(read), logprobs=True, top_logprobs=1,
                        chat_template_kwargs=self._template_kwargs)
            path = "/v1/chat/completions"
        else:
            prompt = (await thought_prompt(self, read.messages, read.thought) if read.thought is not None
                      else await self.prompt_ids(read.messages))
            body.update(prompt=list(prompt), logprobs=1)
            path = "/v1/completions"
        key = session_key(read.messages)
        headers = {self.session_header: key} if self.session_header else None
        start = time.perf_counter()
        reply = await self.connection.request("POST", path, body, on_attempt=self._count, headers=headers,
                                              affinity=key if self.affinity else None)
        latency = time.perf_counter() - start
        data = _object(reply.data, path)
        rows = parse_rows(data, endpoint, width, read.slots)
        check_rows(read, rows)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        try:
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
            completion_tokens = int(usage.get("completion_tokens") or width)
        except (TypeError, ValueError) as exc:
            raise EngineResponseError(f"the read response has unreadable usage ({exc!r})") from exc
        return ReadResult(rows=rows, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          latency_s=latency, attrs={"server.address": reply.url})

    def _count(self) -> None:
        self.requests_sent += 1

    async def prompt_ids(self, messages: Sequence[Message], *, thinking: bool = False) -> tuple[int, ...]:
        """The chat prompt's token ids (the server's template, generation prompt included;
        `thinking`: with `enable_thinking=True`), cached."""
        key = PromptCache.chat_key(messages) + (":thinking" if thinking else "")
        ids = self._tokens.get(key)
        if ids is None:
            kwargs = {**self._template_kwargs, "enable_thinking": True} if thinking else self._template_kwargs
            body = {"model": await self._model_name(), "messages": [dict(m) for m in messages],
                    "add_generation_prompt": True, "chat_template_kwargs": kwargs}
            ids = self._tokens.put(key, await self._once(key, lambda: self._tokenize_request(body)))
        return ids

    async def _tokenize_request(self, body: Mapping[str, Any]) -> list[int]:
        tokens = (await self._request("POST", "/tokenize", body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineResponseError(f"/tokenize answered no token ids: {str(tokens)[:200]}")
        return tokens

    async def _once(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """Run `fetch` once for every concurrent caller on this loop asking for `key`, so a
        burst of cold decisions sends one discovery and one `/tokenize` per text, not N."""
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

    async def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a JSON body to the server (retries and typed errors as for reads); its JSON object."""
        return await self._request("POST", path, body)

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return _object((await self.connection.request(method, path, body)).data, path)

    async def _model_name(self) -> str:
        if self._model is None:
            await self.info()
        assert self._model is not None
        return self._model

    async def _discover_specials(self) -> tuple[str, ...]:
        """Which special-token texts this server's tokenizer knows, by tokenizing candidates:
        one `/tokenize` of them all with `return_token_strs` (a special comes back as one
        token string equal to its text); a server without token strings gets each candidate
        probed (special: exactly one id)."""
        body = {"model": self._model, "prompt": "\n".join(SPECIAL_CANDIDATES), "add_special_tokens": False,
                "return_token_strs": True}
        strs = (await self._request("POST", "/tokenize", body)).get("token_strs")
        if isinstance(strs, list) and all(isinstance(t, str) for t in strs):
            found = set(strs)
            return tuple(sorted(t for t in SPECIAL_CANDIDATES if t in found))
        ids = await asyncio.gather(*(self._tokenize_request(
            {"model": self._model, "prompt": text, "add_special_tokens": False}) for text in SPECIAL_CANDIDATES))
        return tuple(sorted(t for t, i in zip(SPECIAL_CANDIDATES, ids, strict=True) if len(i) == 1))

    async def _discover_vocab(self) -> int:
        """Ask the server for its vocabulary size: a seed id out of range is refused with
        the valid range in the message (validated before any model work)."""
        body = {"model": self._model, "prompt": [0], "max_tokens": 1,
                "vllm_xargs": {"diffusion_seed_canvas": [_NOISE_PROBE_ID], "diffusion_max_steps": 1,
                               "diffusion_read_only": 1}}
        try:
            await self._request("POST", "/v1/completions", body)
        except EngineRequestError as exc:
            if m := _VOCAB_RANGE.search(exc.message):
                return int(m.group(1))
            raise EngineRequestError(
                f"could not learn the vocabulary size: {exc.message}",
                status=exc.status, hint="is this a DiffusionGemma server? else pass vocab_size=",
            ) from exc
        raise EngineResponseError("the server accepted an out-of-range seed id; pass vocab_size=")

    async def _discover_canvas(self, max_model_len: int) -> int:
        """The server caps `max_tokens` at the served canvas: one tiny read reports it."""
        body = {"model": self._model, "prompt": [0], "max_tokens": max(1, max_model_len - 1),
                "vllm_xargs": {"diffusion_max_steps": 1, "diffusion_read_only": 1}}
        data = await self._request("POST", "/v1/completions", body)
        width = int((data.get("usage") or {}).get("completion_tokens") or 0)
        if width <= 0:
            raise EngineResponseError("could not learn the canvas width; pass canvas_width=")
        return width


def session_key(messages: Sequence[Message]) -> str:
    """A stable key of a read's prompt (system prompt + questions + state): 32 hex digits,
    the same in every process for the same messages, so all reads of one decision share it."""
    blob = json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _positive(value: Any) -> int | None:
    """A positive int from a JSON field, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _object(data: Any, path: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise EngineResponseError(f"{path} answered {type(data).__name__}, not an object")
    return data

