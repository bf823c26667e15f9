"""`VLLMServerEngine`: structured reads against vLLM's OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx
from opentelemetry import propagate

from .errors import (
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
)
from ._types import CanvasRead, EngineInfo, Message, ReadResult

try:  # optional: decodes the large read responses ~3x faster than the json module
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = None

_RETRY_STATUS = {429, 500, 502, 503, 504, 529}
_OVERLOAD_STATUS = {429, 503, 529}
_VOCAB_RANGE = re.compile(r"must be in \[0, (\d+)\)")
_NOISE_PROBE_ID = 2**30
T = TypeVar("T")


class _LoopState:
    """Per event loop: the bound on requests in flight, idle HTTP clients, shared fetches.

    Each request borrows one client (a "lane": one keep-alive connection per replica)
    instead of sharing one big pool: httpcore scans every pooled connection on each
    request, so one pool of `max_concurrency` connections costs O(n) per request, while
    n one-connection pools cost O(1). Lanes are reused last-in first-out, so a light load
    keeps few connections open.
    """

    __slots__ = ("slots", "idle", "clients", "inflight")

    def __init__(self, max_concurrency: int) -> None:
        self.slots = asyncio.Semaphore(max_concurrency)
        self.idle: list[httpx.AsyncClient] = []
        self.clients: list[httpx.AsyncClient] = []
        self.inflight: dict[str, asyncio.Future[Any]] = {}


class _Replica:
    """One server URL and when it may be tried again after a connection failure."""

    __slots__ = ("url", "down_until")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.down_until = 0.0


class VLLMServerEngine:
    """Reads canvases from one or more vLLM servers over HTTP.

    One pooled `httpx.AsyncClient` per event loop, at most `max_concurrency` requests
    in flight per loop, a timeout on every request, and retries with exponential
    backoff and jitter on connection errors, timeouts, 429 and 5xx (moving to the next
    healthy replica). Tokenization goes through the server's `/tokenize`, so no local
    tokenizer or weights are needed.

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
        vocab_size: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("VLLMServerEngine needs at least one base URL")
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', not {endpoint!r}")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        self._replicas = [_Replica(u) for u in urls]
        self._next = 0
        self._model = model
        self._api_key = api_key
        self.endpoint = endpoint
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._deadline = timeout + connect_timeout
        """Whole-attempt bound: httpx's timeouts are per operation (a trickling reply or a
        custom transport could outlast them)."""
        self._max_concurrency = max_concurrency
        self._max_retries = max_retries
        self._backoff = backoff
        self._cooldown = replica_cooldown
        self._canvas_width = canvas_width
        self._vocab_size = vocab_size
        self._transport = transport
        self._info: EngineInfo | None = None
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._ssl: Any = None
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self.requests_sent = 0
        """Read requests sent (retries included); `/tokenize` and discovery excluded."""

    def __repr__(self) -> str:
        urls = ", ".join(r.url for r in self._replicas)
        return f"VLLMServerEngine({urls!r}, model={self._model!r}, endpoint={self.endpoint!r})"

    # -- protocol -------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self._once("info", self._discover)
        return self._info

    async def _discover(self) -> EngineInfo:
        """Model, context, vocabulary and canvas width, asked of the server once."""
        served = (await self._request("GET", "/v1/models")).get("data") or []
        if not isinstance(served, list) or not all(isinstance(m, dict) and m.get("id") for m in served):
            raise EngineResponseError(f"the server lists no usable models at /v1/models: {str(served)[:200]}")
        if not served:
            raise EngineResponseError("the server lists no models at /v1/models")
        entry = next((m for m in served if m["id"] == self._model), None) if self._model else served[0]
        if entry is None:
            raise EngineRequestError(f"model {self._model!r} is not served here; served: {[m['id'] for m in served]}")
        self._model = str(entry["id"])
        max_len = int(entry.get("max_model_len") or 0)
        vocab = self._vocab_size or await self._discover_vocab()
        width = self._canvas_width or await self._discover_canvas(max_len)
        overhead = await self.count_prompt([{"role": "system", "content": ""}, {"role": "user", "content": ""}])
        return EngineInfo(model=self._model, provider="vllm", canvas_width=width, max_model_len=max_len,
                          vocab_size=vocab, pad_id=0, chat_overhead=overhead)

    async def tokenize(self, text: str) -> list[int]:
        key = "t:" + text
        if key not in self._tokens:
            body = {"model": await self._model_name(), "prompt": text, "add_special_tokens": False}
            self._remember(key, await self._once(key, lambda: self._tokenize_request(body)))
        self._tokens.move_to_end(key)
        return list(self._tokens[key])

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(await self._prompt_ids(messages))

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        return list(await asyncio.gather(*(self._read_one(r) for r in batch)))

    async def aclose(self) -> None:
        loops, self._loops = self._loops, {}
        for state in loops.values():
            for client in state.clients:
                try:
                    await client.aclose()
                except RuntimeError:  # client bound to a loop that is already closed
                    pass

    # -- reads ----------------------------------------------------------------------

    async def _read_one(self, read: CanvasRead) -> ReadResult:
        info = await self.info()
        width = len(read.canvas)
        if not 0 < width <= info.canvas_width:
            raise EngineRequestError(f"canvas of {width} ids; this server reads at most {info.canvas_width}")
        if len(read.label_ids) > 128:
            raise EngineRequestError(f"{len(read.label_ids)} label ids; one request carries at most 128")
        xargs: dict[str, Any] = {
            "diffusion_seed_canvas": list(read.canvas),
            "diffusion_max_steps": 1,
            "diffusion_read_only": 1,
        }
        if width < info.canvas_width:
            xargs["diffusion_canvas_length"] = width
        if read.constrained:
            xargs["diffusion_constrained"] = 1
        body: dict[str, Any] = {
            "model": info.model,
            "max_tokens": width,
            "logprob_token_ids": sorted(read.label_ids),
            "return_tokens_as_token_ids": True,
            "vllm_xargs": xargs,
        }
        if self.endpoint == "chat":
            body.update(messages=[dict(m) for m in read.messages], logprobs=True, top_logprobs=1,
                        chat_template_kwargs={"enable_thinking": False})
            path = "/v1/chat/completions"
        else:
            body.update(prompt=await self._prompt_ids(read.messages), logprobs=1)
            path = "/v1/completions"
        start = time.perf_counter()
        data = await self._request("POST", path, body, count=True)
        latency = time.perf_counter() - start
        rows = _parse_rows(data, self.endpoint, width, read.slots)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        try:
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
            completion_tokens = int(usage.get("completion_tokens") or width)
        except (TypeError, ValueError) as exc:
            raise EngineResponseError(f"the read response has unreadable usage ({exc!r})") from exc
        return ReadResult(
            rows=rows,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_s=latency,
            attrs={"server.address": data.get("_replica", "")},
        )

    async def _prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        blob = json.dumps([dict(m) for m in messages], sort_keys=True)
        key = "c:" + hashlib.sha256(blob.encode()).hexdigest()
        if key not in self._tokens:
            body = {"model": await self._model_name(), "messages": [dict(m) for m in messages],
                    "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}}
            self._remember(key, await self._once(key, lambda: self._tokenize_request(body)))
        self._tokens.move_to_end(key)
        return list(self._tokens[key])

    async def _tokenize_request(self, body: Mapping[str, Any]) -> list[int]:
        tokens = (await self._request("POST", "/tokenize", body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineResponseError(f"/tokenize answered no token ids: {str(tokens)[:200]}")
        return tokens

    async def _once(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """Run `fetch` once for every concurrent caller on this loop asking for `key`, so a
        burst of cold decisions sends one discovery and one `/tokenize` per text, not N."""
        inflight = self._session().inflight
        task = inflight.get(key)
        if task is None:
            task = inflight[key] = asyncio.ensure_future(fetch())

            def done(t: asyncio.Future[Any]) -> None:
                inflight.pop(key, None)
                if not t.cancelled():
                    t.exception()  # retrieved: the waiters re-raise it

            task.add_done_callback(done)
        return await asyncio.shield(task)

    def _remember(self, key: str, tokens: list[int]) -> None:
        self._tokens[key] = list(tokens)
        while len(self._tokens) > 4096:  # bounded cache
            self._tokens.popitem(last=False)

    async def _model_name(self) -> str:
        if self._model is None:
            await self.info()
        assert self._model is not None
        return self._model

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

    # -- transport ------------------------------------------------------------------

    def _session(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            for dead in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[dead]
            self._loops[loop] = _LoopState(self._max_concurrency)
        return self._loops[loop]

    def _lane(self, state: _LoopState) -> httpx.AsyncClient:
        """An idle client, or a new one (at most `max_concurrency` exist per loop)."""
        if state.idle:
            return state.idle.pop()
        if self._ssl is None:  # one TLS context for every lane (each costs ~20 ms to build)
            self._ssl = httpx.create_ssl_context()
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        n = len(self._replicas)
        client = httpx.AsyncClient(timeout=self._timeout, headers=headers, verify=self._ssl,
                                   limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                                   transport=self._transport)
        state.clients.append(client)
        return client

    def _pick(self) -> _Replica:
        """Round-robin over replicas that are not cooling down (all of them if none is)."""
        now = time.monotonic()
        n = len(self._replicas)
        for i in range(n):
            replica = self._replicas[(self._next + i) % n]
            if replica.down_until <= now:
                self._next = (self._next + i + 1) % n
                return replica
        return min(self._replicas, key=lambda r: r.down_until)

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None,
                       *, count: bool = False) -> dict[str, Any]:
        state = self._session()
        async with state.slots:
            client = self._lane(state)
            try:
                return await self._send(client, method, path, body, count)
            finally:
                state.idle.append(client)

    async def _send(self, client: httpx.AsyncClient, method: str, path: str, body: Mapping[str, Any] | None,
                    count: bool) -> dict[str, Any]:
        """One request with retries and backoff, moving to the next healthy replica."""
        headers: dict[str, str] = {}
        propagate.inject(headers)  # traceparent, when a trace is active
        last: Exception | None = None
        for attempt in range(self._max_retries + 1):
            if attempt:
                delay = self._backoff * 2 ** (attempt - 1)
                await asyncio.sleep(delay * (0.5 + random.random()))
            replica = self._pick()
            if count:
                self.requests_sent += 1
            try:
                async with asyncio.timeout(self._deadline):
                    resp = await client.request(method, replica.url + path, json=body, headers=headers)
            except (httpx.TimeoutException, TimeoutError) as exc:
                last = EngineTimeout(f"{method} {replica.url}{path} timed out ({type(exc).__name__})",
                                     hint="raise timeout= or check the server's load")
                replica.down_until = time.monotonic() + self._cooldown
                continue
            except httpx.TransportError as exc:
                last = EngineUnavailable(f"{method} {replica.url}{path} failed: {exc!r}",
                                         hint="is the vLLM server running at this URL?")
                replica.down_until = time.monotonic() + self._cooldown
                continue
            if resp.status_code in _RETRY_STATUS:
                kind = EngineOverloaded if resp.status_code in _OVERLOAD_STATUS else EngineUnavailable
                last = kind(f"{method} {replica.url}{path} -> HTTP {resp.status_code}: {_message(resp)}")
                continue
            if resp.status_code >= 400:
                raise EngineRequestError(_message(resp), status=resp.status_code,
                                         hint=f"{method} {replica.url}{path} was refused")
            try:
                data = _loads(resp.content)
            except ValueError as exc:
                raise EngineResponseError(f"{replica.url}{path} answered non-JSON: {resp.text[:200]!r}") from exc
            if not isinstance(data, dict):
                raise EngineResponseError(f"{replica.url}{path} answered {type(data).__name__}, not an object")
            data["_replica"] = replica.url
            return data
        assert last is not None
        raise last


def _loads(content: bytes) -> Any:
    """JSON from bytes: orjson when installed, the json module otherwise (and for the
    NaN/Infinity literals orjson refuses, so both decode exactly the same documents)."""
    if _fast_loads is not None:
        try:
            return _fast_loads(content)
        except ValueError:
            pass
    return json.loads(content)


def _message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        return str(err.get("message") if isinstance(err, dict) else err or resp.text)
    except (ValueError, AttributeError):
        return resp.text[:500]


def _token_id(token: str) -> int:
    if not (isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit()):
        raise EngineResponseError(f"token {token!r} is not 'token_id:<id>' (was return_tokens_as_token_ids honoured?)")
    return int(token[9:])


def _parse_rows(data: Mapping[str, Any], endpoint: str, width: int,
                slots: Sequence[int]) -> tuple[dict[int, float], ...]:
    """The `{id: logprob}` rows at `slots`, from either endpoint's shape.

    The response holds one row per canvas position (checked); only the slot rows are
    decoded, which keeps the client's cost per read independent of the canvas width.
    """
    try:
        logprobs = data["choices"][0]["logprobs"]
        positions = logprobs["content"] if endpoint == "chat" else logprobs["top_logprobs"]
        if len(positions) != width:
            raise EngineResponseError(f"the read returned {len(positions)} rows for a canvas of {width}")
        if endpoint == "chat":
            rows = tuple(
                {_token_id(e["token"]): float(e["logprob"]) for e in [*positions[s]["top_logprobs"], positions[s]]}
                for s in slots
            )
        else:
            rows = tuple({_token_id(t): float(lp) for t, lp in positions[s].items()} for s in slots)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise EngineResponseError(f"the read response has no readable logprob rows ({exc!r})") from exc
    return rows
