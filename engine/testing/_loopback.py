"""An instant loopback server that speaks vLLM's structured-read wire.

For tests and `canvasroute bench`: it answers `GET /v1/models`, `POST /tokenize`,
`POST /detokenize` and structured reads on `POST /v1/chat/completions` and
`POST /v1/completions` the way vLLM 0.32 does (see docs/wire-format.md), with no model
behind it, so what is measured against it is the client. Raw asyncio streams, HTTP/1.1
keep-alive, one response body cached per (endpoint, width, label ids). Requests are parsed
by llhttp (`httptools`).

Rows: the read's label ids (`logprob_token_ids`, sorted) get falling logprobs
(`-0.1, -3.1, -6.1, ...`), so every slot confidently picks its lowest label id
(`answer="ranked"`), or all get `-5.0` (`answer="uniform"`: every slot is uncertain), or
a row holds only its argmax (`answer="argmax"`: a server that ignores `logprob_token_ids`).
Its tokenizer makes each word, space and punctuation mark one token (ids from a hash,
so they are the same in every process), and knows Gemma 4's special tokens; `/tokenize`
applies a chat template shaped like the released DiffusionGemma one (the generation
prompt ends with the empty thought block unless `enable_thinking`) and returns
`token_strs` on request. `narrow=False` refuses `diffusion_canvas_length` below the
served width, as some vLLM builds do. `max_images=0` refuses chat reads with image parts
with vLLM's own 400 (a server started with images off).

Faults for tests: `server.inject(Fault(status=429), times=2)` makes the next two reads
answer 429; see `Fault`. `GET /_loopback/stats` returns request counts by path.

In-process (tests), over a socket or with no socket at all:
    ```python
    async with LoopbackVLLM() as server:
        engine = VLLMServerEngine(server.url)
    engine = VLLMServerEngine(Connection("http://vllm.test", transport=LoopbackVLLM().transport()))
    ```
In its own process (the bench, kill tests): `with spawn() as proc: proc.url; proc.kill()`,
or `python -m canvasroute.engine.testing._process --port 8000`.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, cast

import httptools
import httpx

from ._tokens import FIRST_ID, SPECIAL_IDS, chat_text, pieces, token_id

__all__ = ["ANSWERS", "Fault", "LoopbackVLLM", "read_response"]

_READS = ("/v1/chat/completions", "/v1/completions")
ANSWERS = ("ranked", "uniform", "argmax")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(frozen=True, kw_only=True)
class Fault:
    """What the server does instead of a normal answer to a read (applied in this order)."""

    delay: float = 0.0
    """Seconds to wait before answering (a slow server; with a short client timeout, a timeout)."""
    drop: bool = False
    """Close the connection without answering (a crash mid-request)."""
    status: int | None = None
    """Answer with this HTTP status and vLLM's error body."""
    body: bytes | None = None
    """Answer 200 with these raw bytes (malformed JSON, wrong shapes)."""
    rows_delta: int = 0
    """Return this many rows more (or fewer, negative) than the canvas width."""
    logprob: float | None = None
    """Put this value (NaN, inf, a positive number) at every label of every row."""
    respond: Callable[[str, Mapping[str, Any]], tuple[int, bytes]] | None = None
    """Answer with `respond(path, body) -> (status, raw body)` (any shape a test needs)."""


class LoopbackVLLM:
    """The server; `await start()` (or `async with`) binds 127.0.0.1 and sets `url`.

    Args:
        model: served model name.
        canvas_width: the served canvas (`max_tokens` is capped here).
        vocab_size: noise ids must be below this (vLLM's 400 otherwise).
        max_model_len: reported at `/v1/models`.
        answer: `ranked` (confident rows), `uniform` (every slot uncertain) or `argmax`
            (each row holds only its argmax, not the requested label ids).
        narrow: accept `diffusion_canvas_length` below the served width (False: refuse
            it with a 400, as some vLLM builds do).
    """

    def __init__(self, *, model: str = "loopback", canvas_width: int = 64, vocab_size: int = 262144,
                 max_model_len: int = 4096, answer: Literal["ranked", "uniform", "argmax"] = "ranked",
                 narrow: bool = True, max_images: int | None = None) -> None:
        if answer not in ANSWERS:
            raise ValueError(f"answer must be one of {ANSWERS}, not {answer!r}")
        self.model = model
        self.canvas_width = canvas_width
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.answer = answer
        self.narrow = narrow
        self.max_images = max_images
        """Image parts one chat read may carry (None: any; 0: refused with vLLM's 400, as vLLM answers)."""
        self.url = ""
        self.requests: Counter[str] = Counter()
        """Requests by path (reads, `/tokenize`, `/v1/models`, unknown paths)."""
        self.headers: list[dict[str, str]] = []
        """Headers of the last 100 requests (lower-case names)."""
        self.reads = 0
        """Structured reads received (a seed canvas of 2+ ids, label ids: no probe, no thought block)."""
        self.bodies: deque[dict[str, Any]] = deque(maxlen=100)
        """JSON bodies of the last 100 reads."""
        self._faults: deque[list[Any]] = deque()
        self._cache: dict[tuple[Any, ...], bytes] = {}
        self._pieces: dict[int, str] = {i: text for text, i in SPECIAL_IDS.items()}
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"LoopbackVLLM({self.url or 'not started'!r}, model={self.model!r}, answer={self.answer!r})"

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def inject(self, fault: Fault, times: int | None = 1) -> None:
        """Apply `fault` to the next `times` reads (None: to every read until `clear()`).

        Faults queue up in order; discovery probes and `/tokenize` are never faulted.
        """
        self._faults.append([fault, times])

    def clear(self) -> None:
        """Drop every pending fault."""
        self._faults.clear()

    def transport(self) -> httpx.MockTransport:
        """This server as an `httpx.MockTransport`: the same answers with no socket (any
        host name; requests are counted and recorded as over HTTP)."""

        async def handle(request: httpx.Request) -> httpx.Response:
            path = request.url.path
            self.requests[path] += 1
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            del self.headers[:-100]
            reply = await self._route(request.method, path, request.content)
            if reply is None:  # Fault(drop=True)
                raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
            status, payload = reply
            return httpx.Response(status, content=payload, headers={"content-type": "application/json"})

        return httpx.MockTransport(handle)

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1 (`port=0`: a free port) and return the base URL."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port, backlog=1024)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def close(self) -> None:
        """Stop listening and abort every open connection (like a killed server)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    # -- HTTP ---------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        requests = _Requests()
        try:
            while True:
                while not requests.done:
                    data = await reader.read(65536)
                    if not data:
                        return
                    requests.parser.feed_data(data)
                method, target, headers, body, keep = requests.done.popleft()
                path = target.split("?", 1)[0]
                self.requests[path] += 1
                self.headers.append(headers)
                del self.headers[:-100]
                reply = await self._route(method, path, body)
                if reply is None:  # Fault(drop=True)
                    writer.transport.abort()
                    return
                status, payload = reply
                writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                             % (status, _REASONS.get(status, "Error").encode(), len(payload),
                                b"" if keep else b"connection: close\r\n") + payload)
                await writer.drain()
                if not keep:
                    break
        except (httptools.HttpParserError, ConnectionError):
            pass
        except asyncio.CancelledError:
            writer.transport.abort()
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()

    async def _route(self, method: str, path: str, raw: bytes) -> tuple[int, bytes] | None:
        delay, reply = self.reply(method, path, raw)
        if delay:
            await asyncio.sleep(delay)
        return reply

    def reply(self, method: str, path: str, raw: bytes) -> tuple[float, tuple[int, bytes] | None]:
        """One request's answer, without I/O: (seconds to wait before it, `(status, body)`
        or None to drop the connection). Reads take the next pending `Fault`."""
        if method == "GET" and path == "/v1/models":
            return 0.0, (200, json.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model,
                 "max_model_len": self.max_model_len}]}).encode())
        if method == "GET" and path == "/_loopback/stats":
            return 0.0, (200, json.dumps({"requests": dict(self.requests), "reads": self.reads}).encode())
        if method != "POST" or path not in ("/tokenize", "/detokenize", *_READS):
            return 0.0, _error(404, f"no route {method} {path}", "NotFoundError")
        try:
            body = json.loads(raw)
        except ValueError:
            return 0.0, _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return 0.0, _error(400, "request body is not a JSON object")
        if body.get("model") not in (None, self.model):
            return 0.0, _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if path in ("/tokenize", "/detokenize"):
            return 0.0, (self._tokenize if path == "/tokenize" else self._detokenize)(body)
        seed = (body.get("vllm_xargs") or {}).get("diffusion_seed_canvas")
        if not (isinstance(seed, list) and len(seed) > 1) or "logprob_token_ids" not in body:
            return 0.0, self._read(path, body, None)  # discovery probes and thought blocks: never faulted
        self.reads += 1
        self.bodies.append(body)
        fault = self._next_fault()
        if fault is None:
            return 0.0, self._read(path, body, None)
        if fault.drop:
            return fault.delay, None
        if fault.status is not None:
            return fault.delay, _error(fault.status, f"injected HTTP {fault.status}")
        if fault.body is not None:
            return fault.delay, (200, fault.body)
        if fault.respond is not None:
            return fault.delay, fault.respond(path, body)
        return fault.delay, self._read(path, body, fault)

    def _next_fault(self) -> Fault | None:
        if not self._faults:
            return None
        entry = self._faults[0]
        if entry[1] is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self._faults.popleft()
        return cast(Fault, entry[0])

    # -- endpoints ----------------------------------------------------------------------

    def _tokenize(self, body: Mapping[str, Any]) -> tuple[int, bytes]:
        if "messages" in body:
            thinking = bool((body.get("chat_template_kwargs") or {}).get("enable_thinking"))
            text = chat_text(body["messages"], add_generation_prompt=bool(body.get("add_generation_prompt")),
                             enable_thinking=thinking)
        else:
            text = str(body.get("prompt", ""))
        parts = pieces(text)
        ids = [token_id(p, self.vocab_size) for p in parts]
        self._pieces.update(zip(ids, parts, strict=True))
        return 200, json.dumps({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                "token_strs": parts if body.get("return_token_strs") else None}).encode()

    def _detokenize(self, body: Mapping[str, Any]) -> tuple[int, bytes]:
        """The text of ids this server tokenized (an id it never made reads as empty)."""
        text = "".join(self._pieces.get(t, "") for t in body.get("tokens") or () if isinstance(t, int))
        return 200, json.dumps({"prompt": text}).encode()

    def _read(self, path: str, body: Mapping[str, Any], fault: Fault | None) -> tuple[int, bytes]:
        try:
            return self._answer(path, body, fault)
        except (TypeError, ValueError) as exc:  # ill-typed fields: vLLM's validation answers 400 too
            return _error(400, f"invalid read request: {exc}")

    def _answer(self, path: str, body: Mapping[str, Any], fault: Fault | None) -> tuple[int, bytes]:
        x = body.get("vllm_xargs") or {}
        width = min(int(body.get("max_tokens") or self.canvas_width), self.canvas_width)
        if "diffusion_canvas_length" in x:
            width = int(x["diffusion_canvas_length"])
            if not 0 < width <= self.canvas_width or (not self.narrow and width != self.canvas_width):
                return _error(400, "diffusion_canvas_length must be a positive integer no larger than "
                                   "the served canvas.")
        seed = x.get("diffusion_seed_canvas")
        if seed is not None:
            if any(not 0 <= int(i) < self.vocab_size for i in seed):
                return _error(400, f"diffusion_seed_canvas ids must be in [0, {self.vocab_size}).")
            if len(seed) != width:
                return _error(400, f"diffusion_seed_canvas must hold exactly {width} ids, got {len(seed)}.")
        images = sum(1 for m in body.get("messages") or () if isinstance(m.get("content"), list)
                     for part in m["content"] if isinstance(part, dict) and part.get("type") == "image_url")
        if self.max_images is not None and images > self.max_images:
            return _error(400, f"At most {self.max_images} image(s) may be provided in one prompt. (parameter=image)")
        labels = tuple(sorted(set(body.get("logprob_token_ids") or ())))
        if len(labels) > 128:
            return _error(400, f"logprob_token_ids holds {len(labels)} ids; at most 128.")
        chat = path == "/v1/chat/completions"
        if fault is not None and (fault.rows_delta or fault.logprob is not None):
            return 200, read_response(chat, self.model, width + fault.rows_delta, labels, self.answer, fault.logprob)
        key = (chat, width, labels)
        if key not in self._cache:
            if len(self._cache) > 1024:
                self._cache.clear()
            self._cache[key] = read_response(chat, self.model, width, labels, self.answer, None)
        return 200, self._cache[key]


class _Requests:
    """llhttp callbacks for one connection: the complete requests, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: deque[tuple[str, str, dict[str, str], bytes, bool]] = deque()
        self._target = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def on_message_begin(self) -> None:
        self._target, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_method().decode(), self._target.decode("latin-1"), self._headers,
                          b"".join(self._body), self.parser.should_keep_alive()))


def _error(status: int, message: str, kind: str = "BadRequestError") -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "type": kind, "param": None,
                                         "code": status}}).encode()


def read_response(chat: bool, model: str, width: int, labels: Sequence[int], answer: str = "ranked",
                  forced: float | None = None) -> bytes:
    """A read response body: one row per canvas position, the label ids in every row.

    Args:
        chat: the chat endpoint's shape (else the completions endpoint's).
        model: model name in the body.
        width: rows to return (the canvas width).
        labels: the request's `logprob_token_ids`, sorted.
        answer: `ranked` (logprobs -0.1, -3.1, ... in id order), `uniform` (all -5.0) or
            `argmax` (each row holds only its argmax, none of the other label ids).
        forced: put this value at every label instead (NaN, inf: invalid rows).
    """
    if forced is not None:
        lps = [forced] * len(labels)
    elif answer == "uniform":
        lps = [-5.0] * len(labels)
    else:
        lps = [-0.1 - 3.0 * i for i in range(len(labels))]
    top_id, top_lp = (labels[0], lps[0]) if labels else (FIRST_ID, -0.1)
    if answer == "argmax":
        labels, lps = [top_id], [-0.02]
        top_lp = -0.02
    usage = {"prompt_tokens": 32, "completion_tokens": max(width, 0), "total_tokens": 32 + max(width, 0)}
    if chat:
        tops = [{"token": f"token_id:{i}", "logprob": lp, "bytes": list(b"token_id:%d" % i)}
                for i, lp in zip(labels, lps, strict=True)]
        entry = {"token": f"token_id:{top_id}", "logprob": top_lp, "bytes": list(b"<unk>"), "top_logprobs": tops}
        choice = {"index": 0, "message": {"role": "assistant", "content": ""},
                  "logprobs": {"content": [entry] * max(width, 0)}, "finish_reason": "length"}
        obj = "chat.completion"
    else:
        row = {f"token_id:{i}": lp for i, lp in zip(labels, lps, strict=True)} or {f"token_id:{top_id}": top_lp}
        n = max(width, 0)
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": {
            "tokens": [f"token_id:{top_id}"] * n, "token_logprobs": [top_lp] * n,
            "top_logprobs": [row] * n, "text_offset": list(range(n))}}
        obj = "text_completion"
    return json.dumps({"id": "loopback", "object": obj, "created": 0, "model": model, "choices": [choice],
                       "usage": usage}, allow_nan=True).encode()
