"""`VLLMServerEngine`: structured reads against vLLM's OpenAI-compatible server.

One module for the engine and everything it says to the server, so a read runs through it,
its connection (`engine/transport/_connection.py`) and the values it returns (`engine/_types.py`):

- the engine: discovery, `/tokenize` with a prompt cache, reads on either endpoint, narrow
  canvases, images, prefix affinity (`session_key`);
- vLLM's structured-read wire, shared with `VLLMEngine` (docs/wire-format.md sections 3, 4):
  what a read sends (`max_tokens`, `logprob_token_ids`, `vllm_xargs.diffusion_*`) and how its
  rows are checked;
- thoughts (`think`): what the model writes in its thought channel before a read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from .._compat import SERVER_KEYWORDS, moved_keywords, server_keywords
from .._prompts import EMPTY_CHAT, PromptCache, scaffold_prefix, template_kwargs
from .._types import THOUGHT_SCAFFOLD, CanvasRead, EngineInfo, Message, ReadResult, Thought, check_rows
from ..errors import EngineRequestError, EngineResponseError, ImagesUnsupported
from ..transport import Connection
from ..transport._server_api import SingleFlight, json_object, positive, served_entry, special_texts, token_ids

__all__ = ["MAX_LABEL_IDS", "VLLMServerEngine", "session_key", "structured_vocab"]

_VOCAB_RANGE = re.compile(r"must be in \[0, (\d+)\)")
_NOISE_PROBE_ID = 2**30
T = TypeVar("T")

MAX_LABEL_IDS = 128
"""vLLM caps `logprob_token_ids` at 128 ids per request (`MAX_LOGPROB_TOKEN_IDS`)."""

NARROW_REFUSED = "diffusion_canvas_length"
"""Text of the 400 that a build refusing narrow canvases answers."""

THOUGHT_OPEN = "<|channel>thought\n"
THOUGHT_CLOSE = "<channel|>"


class VLLMServerEngine:
    """Reads canvases from one or more vLLM servers over HTTP.

    `connection` is a `Connection`, or the server's URL (or several replicas' URLs) for a
    default one (`Connection(url)`: 30 s per reply, 5 s to connect, 3 retries, 64 requests in
    flight): a timeout on every attempt, retries with exponential backoff and jitter on
    connection errors, timeouts, 408, 429 and 5xx (moving to the next healthy replica).
    Tokenization goes through the server's `/tokenize`, so no local tokenizer or weights
    are needed. Discovery asks the server once for its model, canvas, vocabulary, special
    tokens, and whether its generation prompt already holds the thought block.

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

    Keys, TLS, proxies, timeouts, retries and limits are the connection's (`Connection`:
    `api_key=`, `verify=`, `cert=`, `trust_env=`, `transport=`, `Timeout`, `Retries`,
    `Limits`); URL userinfo is sent as Basic auth. Discovery needs the served context
    length (`max_model_len` in `/v1/models`, as vLLM lists it); a proxy that drops it gets
    `EngineResponseError` saying so, unless `max_model_len=` is given. `canvas_width=` and
    `vocab_size=` skip their probes too.

    `enable_thinking` goes to the chat template (default False, the read mode). A server
    that refuses `diffusion_canvas_length` below its served width gets the full width from
    then on (`narrow_canvases` turns False).

    `think(messages, budget, seed=...)` writes a thought before a read: block by block, each
    one denoising step from noise drawn from `seed`, so the same seed gives the same thought.

    Example:
        ```python
        engine = VLLMServerEngine("http://127.0.0.1:8000")
        info = await engine.info()          # model, canvas width, vocab size
        tuned = VLLMServerEngine(Connection("http://127.0.0.1:8000", api_key="k", timeout=120, retries=0))
        ```
    """

    @moved_keywords(SERVER_KEYWORDS, server_keywords)  # 0.1's transport keywords, until 0.3.0
    def __init__(self, connection: str | Sequence[str] | Connection, *, model: str | None = None,
                 endpoint: Literal["chat", "completions"] = "chat", canvas_width: int | None = None,
                 max_model_len: int | None = None, vocab_size: int | None = None, enable_thinking: bool = False,
                 chat_template_kwargs: dict[str, Any] | None = None, session_header: str | None = "x-session-id",
                 affinity: bool = True) -> None:
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', not {endpoint!r}")
        if session_header is not None and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", session_header):
            raise ValueError(f"session_header must be an HTTP header name or None, not {session_header!r}")
        self.connection = (connection if isinstance(connection, Connection)
                           else Connection(connection))
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
        self._once = SingleFlight()
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
        return len(self._once)

    # -- protocol -------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self._once("info", self._discover)
        return self._info

    async def _discover(self) -> EngineInfo:
        """Model, context, vocabulary, canvas, specials and scaffold, asked of the server once."""
        entry = await served_entry(self.connection, self._model)
        self._model = model = str(entry["id"])
        max_len = self._max_model_len or positive(entry.get("max_model_len"))
        if max_len is None:  # some proxies drop vLLM's extra fields
            raise EngineResponseError(
                f"the server does not say its context length: /v1/models lists {self._model!r} without "
                "max_model_len", hint="pass VLLMServerEngine(..., max_model_len=N), N the served "
                                      "--max-model-len (a proxy in front of vLLM may drop the field)")
        vocab = self._vocab_size or await self._discover_vocab()
        width = self._canvas_width or await self._discover_canvas(max_len)
        prompt, scaffold, specials = await asyncio.gather(
            self.prompt_ids(EMPTY_CHAT), self.tokenize(THOUGHT_SCAFFOLD),
            special_texts(self.connection, model, self.tokenize))
        return EngineInfo(model=self._model, provider="vllm", canvas_width=width, max_model_len=max_len,
                          vocab_size=vocab, pad_id=0, chat_overhead=len(prompt),
                          canvas_prefix=scaffold_prefix(prompt, scaffold), special_tokens=specials,
                          accepts_images=self.endpoint == "chat")

    async def tokenize(self, text: str) -> list[int]:
        key = PromptCache.text_key(text)
        ids = self._tokens.get(key)
        if ids is None:
            body = {"model": await self._model_name(), "prompt": text, "add_special_tokens": False}
            ids = self._tokens.put(key, await self._once(key, lambda: token_ids(self.connection, body)))
        return list(ids)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(await self.prompt_ids(messages))

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        if len(batch) == 1:  # the common case: no task to gather
            return [await self._read_one(batch[0])]
        return list(await asyncio.gather(*(self._read_one(r) for r in batch)))

    async def think(self, messages: Sequence[Message], budget: int, *, seed: int = 0) -> Thought:
        """What the model writes in its thought channel after `messages`, up to `budget` tokens;
        a `CanvasRead(thought=thought.ids)` then reads after it.

        vLLM's DiffusionGemma refuses a request `seed` and draws its own generation noise from
        the server process's generator, so a thought it generated would differ on every run.
        The engine writes it instead, one canvas-wide block at a time: each block is one
        denoising step (a read-only read, `diffusion_max_steps=1`) from noise drawn from
        `seed`, continuing the prompt and the blocks before it, cut at the channel's close tag
        (or the end of turn) or at `budget`. The same messages and seed give the same thought
        on the same server and weights.
        """
        if budget < 1:
            raise EngineRequestError(f"a thought takes a budget of at least one token, not {budget}")
        info = await self.info()
        opening, closing = await self._thought_tags()
        stops = {closing, *await self.tokenize(info.end_of_turn)} if info.end_of_turn else {closing}
        prompt = [*await self.prompt_ids(messages, thinking=True), *opening]
        draw = random.Random(f"canvasroute thought {seed}").randrange
        ids: list[int] = []
        closed, prompt_tokens = False, 0
        start = time.perf_counter()
        while len(ids) < budget and len(prompt) + len(ids) + info.canvas_width <= info.max_model_len:
            noise = [draw(info.vocab_size) for _ in range(info.canvas_width)]
            body = {"model": info.model, "prompt": [*prompt, *ids], "max_tokens": info.canvas_width, "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                    "vllm_xargs": read_xargs(noise, info.canvas_width, constrained=False)}
            data = await self.post("/v1/completions", body)
            try:
                block = [token_id(t) for t in data["choices"][0]["logprobs"]["tokens"]]
            except (KeyError, IndexError, TypeError) as exc:
                raise EngineResponseError(f"the thought response has no token ids ({exc!r})") from exc
            prompt_tokens += _usage(data, "prompt_tokens", len(prompt) + len(ids))
            stop = next((i for i, t in enumerate(block) if t in stops), None)
            ids.extend(block if stop is None else block[:stop])
            if stop is not None or not block:
                closed = stop is not None
                break
        del ids[budget:]
        text = await self._detokenize(ids) if ids else ""
        return Thought(ids=tuple(ids), text=text, closed=closed, prompt_tokens=prompt_tokens,
                       latency_s=time.perf_counter() - start)

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
            prompt = (await self._thought_prompt(read.messages, read.thought) if read.thought is not None
                      else await self.prompt_ids(read.messages))
            body.update(prompt=list(prompt), logprobs=1)
            path = "/v1/completions"
        key = session_key(read.messages)
        headers = {self.session_header: key} if self.session_header else None
        start = time.perf_counter()
        reply = await self.connection.request("POST", path, body, on_attempt=self._count, headers=headers,
                                              affinity=key if self.affinity else None)
        latency = time.perf_counter() - start
        data = json_object(reply.data, path)
        rows = parse_rows(data, endpoint, width, read.slots)
        check_rows(read, rows)
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        try:  # inline, not `_usage`: a read's path stays short
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
            completion_tokens = int(usage.get("completion_tokens") or width)
        except (TypeError, ValueError) as exc:
            raise EngineResponseError(f"the read response has unreadable usage ({exc!r})") from exc
        return ReadResult(rows=rows, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          latency_s=latency, attrs={"server.address": reply.url})

    def _count(self) -> None:
        self.requests_sent += 1

    async def _thought_tags(self) -> tuple[list[int], int]:
        """The thought channel's open tag ids and its close tag's one id."""
        opening, closing = await self.tokenize(THOUGHT_OPEN), await self.tokenize(THOUGHT_CLOSE)
        if len(closing) != 1:
            raise EngineResponseError(f"this tokenizer splits {THOUGHT_CLOSE!r}: the model has no thought channel",
                                      hint="think needs a DiffusionGemma (Gemma 4) tokenizer")
        return opening, closing[0]

    async def _thought_prompt(self, messages: Sequence[Message], thought: Sequence[int]) -> list[int]:
        """The prompt ids of a read that continues `thought`: the thinking prompt, the channel with it, closed.

        DiffusionGemma's chat template opens the thought channel itself only with
        `enable_thinking=True` (its generation prompt then ends at the model turn); the read
        goes to `/v1/completions` as token ids, so no template can alter the thought, and its
        canvas starts at the answers."""
        opening, closing = await self._thought_tags()
        return [*await self.prompt_ids(messages, thinking=True), *opening, *thought, closing]

    async def _detokenize(self, ids: Sequence[int]) -> str:
        data = await self._request("POST", "/detokenize", {"model": await self._model_name(), "tokens": list(ids)})
        text = data.get("prompt")
        if not isinstance(text, str):
            raise EngineResponseError(f"/detokenize answered no text: {str(data)[:200]}")
        return text

    async def prompt_ids(self, messages: Sequence[Message], *, thinking: bool = False) -> tuple[int, ...]:
        """The chat prompt's token ids (the server's template, generation prompt included;
        `thinking`: with `enable_thinking=True`), cached."""
        key = PromptCache.chat_key(messages) + (":thinking" if thinking else "")
        ids = self._tokens.get(key)
        if ids is None:
            kwargs = {**self._template_kwargs, "enable_thinking": True} if thinking else self._template_kwargs
            body = {"model": await self._model_name(), "messages": [dict(m) for m in messages],
                    "add_generation_prompt": True, "chat_template_kwargs": kwargs}
            ids = self._tokens.put(key, await self._once(key, lambda: token_ids(self.connection, body)))
        return ids

    async def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a JSON body to the server (retries and typed errors as for reads); its JSON object."""
        return await self._request("POST", path, body)

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return json_object((await self.connection.request(method, path, body)).data, path)

    async def _model_name(self) -> str:
        if self._model is None:
            await self.info()
        assert self._model is not None
        return self._model

    async def _discover_vocab(self) -> int:
        """Ask the server for its vocabulary size (`structured_vocab`); a server that serves no
        structured read is named for what it is, with the engine that reads it."""
        assert self._model is not None
        try:
            vocab = await structured_vocab(self.connection, self._model)
        except EngineRequestError as exc:
            raise EngineRequestError(
                f"could not learn the vocabulary size: {exc.message}",
                status=exc.status, hint="is this a DiffusionGemma server? else pass vocab_size=",
            ) from exc
        if vocab is None:
            raise EngineResponseError(
                f"{', '.join(self.connection.urls)} serves {self._model!r} as a plain causal (autoregressive) model, "
                "not DiffusionGemma's structured read: it ignored vllm_xargs.diffusion_seed_canvas",
                hint="read a causal model with CausalServerEngine (canvasroute: --engine-kind causal, or --engine-url "
                     "alone, which detects it); VLLMServerEngine needs vLLM serving DiffusionGemma")
        return vocab

    async def _discover_canvas(self, max_model_len: int) -> int:
        """The server caps `max_tokens` at the served canvas: one tiny read reports it."""
        body = {"model": self._model, "prompt": [0], "max_tokens": max(1, max_model_len - 1),
                "vllm_xargs": {"diffusion_max_steps": 1, "diffusion_read_only": 1}}
        data = await self._request("POST", "/v1/completions", body)
        width = int((data.get("usage") or {}).get("completion_tokens") or 0)
        if width <= 0:
            raise EngineResponseError("could not learn the canvas width; pass canvas_width=")
        return width


async def structured_vocab(connection: Connection, model: str) -> int | None:
    """Whether the server reads DiffusionGemma canvases, and its vocabulary if it does.

    One tiny request, validated before any model work: a DiffusionGemma server refuses a seed
    id out of range with the valid range in its message (its vocabulary size, returned); a
    server that serves no structured read ignores `vllm_xargs` and answers (None). Any other
    refusal is raised (`EngineRequestError`).
    """
    body = {"model": model, "prompt": [0], "max_tokens": 1,
            "vllm_xargs": {"diffusion_seed_canvas": [_NOISE_PROBE_ID], "diffusion_max_steps": 1,
                           "diffusion_read_only": 1}}
    try:
        await connection.request("POST", "/v1/completions", body)
    except EngineRequestError as exc:
        if m := _VOCAB_RANGE.search(exc.message):
            return int(m.group(1))
        raise
    return None


def session_key(messages: Sequence[Message]) -> str:
    """A stable key of a read's prompt (system prompt + questions + state): 32 hex digits,
    the same in every process for the same messages, so all reads of one decision share it."""
    blob = json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _usage(data: Mapping[str, Any], field: str, default: int) -> int:
    """A count from a reply's `usage` (`default` where it is missing or zero)."""
    usage = data.get("usage")
    try:
        return int((usage.get(field) if isinstance(usage, dict) else None) or default)
    except (TypeError, ValueError) as exc:
        raise EngineResponseError(f"the response has unreadable usage ({exc!r})") from exc


# -- the structured-read wire (shared with VLLMEngine) --------------------------------------


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


_TOKEN_IDS: dict[str, int] = {}
"""`token_id`'s memo of valid tokens: every read returns the same label ids again (up to `_TOKEN_IDS_MAX`)."""
_TOKEN_IDS_MAX = 1 << 16


def token_id(token: str) -> int:
    """The id in vLLM's `"token_id:<id>"` (`return_tokens_as_token_ids`)."""
    if isinstance(token, str) and (known := _TOKEN_IDS.get(token)) is not None:
        return known
    if not (isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit()):
        raise EngineResponseError(f"token {token!r} is not 'token_id:<id>' (was return_tokens_as_token_ids honoured?)")
    ident = int(token[9:])
    if len(_TOKEN_IDS) < _TOKEN_IDS_MAX:
        _TOKEN_IDS[token] = ident
    return ident


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
