"""`CausalServerEngine`: canvases read from a causal LM on an OpenAI-compatible server.

The server-side twin of `TransformersEngine`'s causal readout (`CausalLM` in
`engine/local/_transformers.py`): prompt + canvas are one causal sequence, and the row for canvas
slot `s` is the model's next-token distribution after the chat prompt and `canvas[:s]` (noise at
earlier slots included), so a slot with no noisy position before it reads the same row on every
read (`EngineInfo.causal_readout`). A read batch is ONE `/v1/completions` request whose `prompt`
lists every slot's prefix as token ids (the server's prefix cache shares the chat prompt among
them; a prefix two reads share is sent once).

Every row is exact, never a top-k guess: the logprob of every label id at the slot. How the
server is asked (`readout`, detected on first use unless given):

- `token_ids`: vLLM's `logprob_token_ids` (vLLM 0.32+): one prompt per slot, one greedy token,
  and beside it the raw logprob of every listed id at that position.
- `echo`: the legacy `echo: true` + `logprobs` prompt logprobs (SGLang's completions, older
  vLLM): one prompt per slot and label, the label appended, its logprob read back as the last
  prompt token's. Exact too, and dearer: K prompts per slot (and vLLM V1 computes prompt
  logprobs without its prefix cache).

A server that offers neither is refused on first use with a typed error saying so, and so is a
DiffusionGemma server (its structured read is `VLLMServerEngine`'s). Prompts come from the
server's `/tokenize`, which on vLLM takes chat messages and applies the served chat template; a
server whose `/tokenize` takes text only needs `tokenizer=` (the served model's transformers
tokenizer), which then tokenizes in this process.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

from .._prompts import EMPTY_CHAT, ChatPrompts, PromptCache, template_kwargs, tokenizer_specials
from .._types import CanvasRead, EngineInfo, Message, ReadResult, check_rows, refuse_images, refuse_thoughts
from ..errors import EngineRequestError, EngineResponseError
from ..transport import Connection
from ..transport._server_api import SingleFlight, json_object, positive, served_entry, special_texts, token_ids
from ..vllm._server import MAX_LABEL_IDS, session_key, structured_vocab, token_id

__all__ = ["CausalServerEngine", "Readout", "ServerKind", "server_kind"]

Readout = Literal["auto", "token_ids", "echo"]
"""How rows are asked for: `token_ids` (vLLM's `logprob_token_ids`), `echo` (prompt logprobs), or
`auto` (the first the server supports, found on first use)."""
ServerKind = Literal["diffusion", "causal"]
"""What a server serves: DiffusionGemma's structured read (`VLLMServerEngine`) or a causal LM."""

_VOCAB = re.compile(r"[Vv]ocabulary size:? (\d+)")
_PROBE_ID = 2**30
"""A token id past any vocabulary: vLLM refuses it in `logprob_token_ids` naming its vocabulary size."""
_MARK = "canvasroute"
"""The assistant text whose following token is the template's end of turn."""
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_NEITHER = ("canvasroute reads a causal model's exact label distribution through vLLM's logprob_token_ids "
            "(vLLM >= 0.32) or completions prompt logprobs (echo: true with logprobs: SGLang, older vLLM); a server "
            "that returns only the top-k of generated tokens (e.g. llama.cpp's server) cannot be read exactly")
T = TypeVar("T")


async def server_kind(connection: Connection, *, model: str | None = None) -> ServerKind:
    """Which engine the server behind `connection` needs: `diffusion` (vLLM serving DiffusionGemma's
    structured read: `VLLMServerEngine`) or `causal` (any other model behind `/v1/completions`:
    `CausalServerEngine`).

    Two small requests: `/v1/models`, and the structured read's probe (`structured_vocab`), which a
    server without it ignores or refuses. A refused key (401, 403) is raised, not taken for an answer.

    Example:
        ```python
        kind = await server_kind(Connection("http://127.0.0.1:8000/v1"))   # "causal" or "diffusion"
        ```
    """
    name = str((await served_entry(connection, model))["id"])
    try:
        return "diffusion" if await structured_vocab(connection, name) is not None else "causal"
    except EngineRequestError as exc:
        if exc.status in (401, 403):
            raise
        return "causal"


class CausalServerEngine:
    """Reads canvases from a causal LM on an OpenAI-compatible server (vLLM; SGLang by its docs).

    `connection` is a `Connection`, or the server's URL (or several replicas' URLs) for a default
    one; a URL ending in `/v1` works as is. A read batch is one `/v1/completions` request: one
    prompt per slot (per slot and label, `readout="echo"`), the greedy token and the exact logprob
    of every label id; a batch whose label ids together exceed `MAX_LABEL_IDS` (vLLM's cap per
    request) is split into as few requests as fit, sent at once. The same canvases give the same
    request, so the same rows (temperature 0, raw logprobs: keep vLLM's default
    `--logprobs-mode raw_logprobs`).

    Discovery, once: the served model and context (`/v1/models`; `max_model_len=` where a proxy
    drops it), that the server is no DiffusionGemma, the readout (`readout="auto"`: vLLM's
    `logprob_token_ids` when the server knows it, whose refusal of an out-of-range id also names
    the vocabulary size; else echo prompt logprobs, which need `vocab_size=` or `tokenizer=`), the
    special tokens, and the end of turn (the token the chat template writes after an answer; it
    also pads the canvas). `canvas_width` bounds one read's canvas (no server-side canvas here).

    Prefix affinity as `VLLMServerEngine`'s: every request carries `session_header` with the
    `session_key` of its first read's prompt, and several base URLs are routed by it.

    Example:
        ```python
        engine = CausalServerEngine("http://127.0.0.1:8000/v1")       # vllm serve <causal model>
        model = CanvasDecisionModel(engine=engine)
        big = CanvasDecisionModel.reader(CausalServerEngine(Connection(url, api_key="k", timeout=120)))
        ```
    """

    def __init__(self, connection: str | Sequence[str] | Connection, *, model: str | None = None,
                 readout: Readout = "auto", tokenizer: Any = None, canvas_width: int = 64,
                 max_model_len: int | None = None, vocab_size: int | None = None, enable_thinking: bool = False,
                 chat_template_kwargs: dict[str, Any] | None = None, session_header: str | None = "x-session-id",
                 affinity: bool = True) -> None:
        if readout not in get_args(Readout):
            raise ValueError(f"readout must be one of {', '.join(get_args(Readout))}, not {readout!r}")
        if not (isinstance(canvas_width, int) and canvas_width >= 2):
            raise ValueError(f"canvas_width must be an int >= 2, not {canvas_width!r}")
        if session_header is not None and not _HEADER.fullmatch(session_header):
            raise ValueError(f"session_header must be an HTTP header name or None, not {session_header!r}")
        self.connection = connection if isinstance(connection, Connection) else Connection(connection)
        """The HTTP connection (replicas, lanes, retries)."""
        self.readout: Readout = readout
        """How rows are asked for (`auto` until the first use found out)."""
        self.session_header = session_header
        """Header carrying each request's `session_key` (None: not sent)."""
        self.affinity = affinity
        """Route requests over several base URLs by rendezvous hashing of `session_key`."""
        self._model = model
        self._tokenizer = tokenizer
        self._kwargs = template_kwargs(enable_thinking, chat_template_kwargs)
        self._local = ChatPrompts(tokenizer, self._kwargs) if tokenizer is not None else None
        self._canvas_width = canvas_width
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._info: EngineInfo | None = None
        self._tokens = PromptCache(4096)
        self._once = SingleFlight()
        self.requests_sent = 0
        """Read requests sent (retries included); discovery and `/tokenize` excluded."""

    def __repr__(self) -> str:
        return (f"CausalServerEngine({', '.join(self.connection.urls)!r}, model={self._model!r}, "
                f"readout={self.readout!r})")

    @property
    def cached_prompts(self) -> int:
        """Token id lists held by the prompt cache (chats and texts)."""
        return len(self._tokens)

    # -- protocol -------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self._once("info", self._discover)
        return self._info

    async def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return list(self._tokenizer(text, add_special_tokens=False).input_ids)
        key = PromptCache.text_key(text)
        ids = self._tokens.get(key)
        if ids is None:
            body = {"model": await self._model_name(), "prompt": text, "add_special_tokens": False}
            ids = self._tokens.put(key, await self._once(key, lambda: token_ids(self.connection, body)))
        return list(ids)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(await self.prompt_ids(messages))

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        refuse_images(batch, "CausalServerEngine")
        refuse_thoughts(batch, "CausalServerEngine", steps=False)
        if not batch:
            return []
        info = await self.info()
        prompts = await asyncio.gather(*(self._prompt_of(read, info) for read in batch))
        groups = _label_groups(batch) if self.readout == "token_ids" else [list(range(len(batch)))]
        key = session_key(batch[0].messages)
        parts = await asyncio.gather(*(self._read_group([batch[i] for i in g], [prompts[i] for i in g], info, key)
                                       for g in groups))
        out: list[ReadResult | None] = [None] * len(batch)
        for group, results in zip(groups, parts, strict=True):
            for i, result in zip(group, results, strict=True):
                out[i] = result
        return [r for r in out if r is not None]

    async def aclose(self) -> None:
        await self.connection.aclose()

    # -- reads ----------------------------------------------------------------------

    async def _prompt_of(self, read: CanvasRead, info: EngineInfo) -> tuple[int, ...]:
        """The read's chat prompt ids, after refusing a read the server would refuse or could not read."""
        width = len(read.canvas)
        if not 0 < width <= info.canvas_width:
            raise EngineRequestError(f"canvas of {width} ids; this engine reads at most {info.canvas_width}")
        if not read.slots or any(not 0 <= s < width for s in read.slots):
            raise EngineRequestError(f"slots must lie inside the canvas [0, {width})")
        if len(read.label_ids) > MAX_LABEL_IDS:
            raise EngineRequestError(f"{len(read.label_ids)} label ids; one read carries at most {MAX_LABEL_IDS}")
        if not read.label_ids:
            raise EngineRequestError("a read needs label_ids: they are the ids each row must carry")
        if min(*read.canvas, *read.label_ids) < 0 or max(*read.canvas, *read.label_ids) >= info.vocab_size:
            raise EngineRequestError(f"canvas and label ids must be in [0, {info.vocab_size})")
        prompt = await self.prompt_ids(read.messages)
        longest = len(prompt) + max(read.slots) + (1 if self.readout == "echo" else 0) + 1  # + the one token asked
        if longest > info.max_model_len:
            raise EngineRequestError(f"prompt of {len(prompt)} tokens + canvas up to position {max(read.slots)} "
                                     f"exceed the {info.max_model_len}-token context")
        return prompt

    async def _read_group(self, reads: Sequence[CanvasRead], prompts: Sequence[tuple[int, ...]], info: EngineInfo,
                          key: str) -> list[ReadResult]:
        """One request for `reads`: each distinct prompt once, every read's rows from the answers."""
        echo = self.readout == "echo"
        index: dict[tuple[int, ...], int] = {}
        for read, prompt in zip(reads, prompts, strict=True):
            for s in read.slots:
                prefix = (*prompt, *read.canvas[:s])
                for ends in ([(label,) for label in read.label_ids] if echo else [()]):
                    index.setdefault((*prefix, *ends), len(index))
        body: dict[str, Any] = {"model": info.model, "prompt": [list(p) for p in index], "max_tokens": 1,
                                "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
        if echo:
            body["echo"] = True
        else:
            body["logprob_token_ids"] = sorted({i for r in reads for i in r.label_ids})
        headers = {self.session_header: key} if self.session_header else None
        start = time.perf_counter()
        reply = await self.connection.request("POST", "/v1/completions", body, on_attempt=self._count,
                                              headers=headers, affinity=key if self.affinity else None)
        latency = time.perf_counter() - start
        choices = _choices(reply.data, len(index))
        attrs = {"server.address": reply.url, "prompts": len(index), "readout": self.readout}
        results = []
        for read, prompt in zip(reads, prompts, strict=True):
            rows = []
            for s in read.slots:
                prefix = (*prompt, *read.canvas[:s])
                if echo:
                    found = {label: _echoed(choices[index[(*prefix, label)]], len(prefix), label)
                             for label in read.label_ids}
                    row = {i: lp for i, lp in found.items() if lp is not None}
                    best = _echo_top(choices[index[(*prefix, read.label_ids[0])]], len(prefix))
                else:
                    full = _generated_row(choices[index[prefix]])
                    row = {i: full[i] for i in read.label_ids if i in full}
                    best = max(full.items(), key=lambda kv: kv[1], default=None)
                rows.append(_finished(row, read, best))
            check_rows(read, rows)
            results.append(ReadResult(rows=tuple(rows), prompt_tokens=len(prompt) + max(read.slots),
                                      completion_tokens=len(read.slots), latency_s=latency, attrs=attrs))
        return results

    def _count(self) -> None:
        self.requests_sent += 1

    # -- prompts --------------------------------------------------------------------

    async def prompt_ids(self, messages: Sequence[Message]) -> tuple[int, ...]:
        """The chat prompt's token ids (the served chat template, or `tokenizer=`'s), generation prompt
        included, cached."""
        if self._local is not None:
            return self._local(messages)
        return await self._chat_ids(messages, generation=True)

    async def _chat_ids(self, messages: Sequence[Message], *, generation: bool) -> tuple[int, ...]:
        """A chat's ids as the server's `/tokenize` renders it (with or without the generation prompt), cached."""
        key = PromptCache.chat_key(messages) + ("" if generation else ":turn")
        ids = self._tokens.get(key)
        if ids is None:
            body = {"model": await self._model_name(), "messages": [dict(m) for m in messages],
                    "add_generation_prompt": generation, "chat_template_kwargs": self._kwargs}
            try:
                fetched = await self._once(key, lambda: token_ids(self.connection, body))
            except EngineRequestError as exc:
                raise EngineRequestError(
                    f"the server cannot render a chat prompt at /tokenize: {exc.message}", status=exc.status,
                    hint="vLLM's /tokenize takes chat messages; for a server whose /tokenize takes text only, pass "
                         "CausalServerEngine(..., tokenizer=AutoTokenizer.from_pretrained(<the served model>))",
                ) from exc
            ids = self._tokens.put(key, fetched)
        return ids

    async def _model_name(self) -> str:
        if self._model is None:
            await self.info()
        assert self._model is not None
        return self._model

    # -- discovery ------------------------------------------------------------------

    async def _discover(self) -> EngineInfo:
        """Model, context, kind, readout, vocabulary, specials and end of turn, asked of the server once."""
        entry = await served_entry(self.connection, self._model)
        self._model = model = str(entry["id"])
        urls = ", ".join(self.connection.urls)
        max_len = self._max_model_len or positive(entry.get("max_model_len"))
        if max_len is None:
            raise EngineResponseError(
                f"the server does not say its context length: /v1/models lists {model!r} without max_model_len",
                hint="pass CausalServerEngine(..., max_model_len=N), N the served context length")
        try:
            structured = await structured_vocab(self.connection, model)
        except EngineRequestError:
            structured = None  # refused the probe: no structured read
        if structured is not None:
            raise EngineRequestError(
                f"{urls} serves {model!r} with DiffusionGemma's structured read, not as a causal model",
                hint="read it with VLLMServerEngine (canvasroute: --engine-kind diffusion, or --engine-url alone, "
                     "which detects it)")
        prompt = await self.prompt_ids(EMPTY_CHAT)
        readout, vocab = await self._detect_readout(prompt, model)
        if self._tokenizer is not None:
            vocab = min(v for v in (vocab, len(self._tokenizer)) if v)
        vocab = self._vocab_size or vocab
        if not vocab:
            raise EngineResponseError(
                f"{urls} does not say the vocabulary size of {model!r} (readout {readout!r})",
                hint="pass CausalServerEngine(..., vocab_size=N) (the model's config.json vocab_size), or tokenizer=")
        self.readout = readout
        specials, (end, pad) = await asyncio.gather(self._specials(model), self._turn_end())
        return EngineInfo(model=model, provider=str(entry.get("owned_by") or "openai"),
                          canvas_width=self._canvas_width, max_model_len=max_len, vocab_size=vocab, pad_id=pad,
                          chat_overhead=len(prompt), canvas_prefix="", end_of_turn=end, special_tokens=specials,
                          causal_readout=True)

    async def _detect_readout(self, prompt: Sequence[int], model: str) -> tuple[Readout, int | None]:
        """The readout to use and, where the server names it, the vocabulary size.

        `logprob_token_ids` with an id past any vocabulary: vLLM 0.32+ refuses it naming its size
        (the field is known); a server that does not know the field answers. Then echo prompt
        logprobs, checked to hold a logprob per prompt token."""
        probe: dict[str, Any] = {"model": model, "prompt": [list(prompt)], "max_tokens": 1, "temperature": 0,
                                 "logprobs": 1, "return_tokens_as_token_ids": True}
        if self.readout in ("auto", "token_ids"):
            try:
                await self.connection.request("POST", "/v1/completions", {**probe, "logprob_token_ids": [_PROBE_ID]})
            except EngineRequestError as exc:
                if m := _VOCAB.search(exc.message):
                    return "token_ids", int(m.group(1))
                if self.readout == "token_ids":
                    raise EngineRequestError(f"the server refused logprob_token_ids: {exc.message}",
                                             status=exc.status, hint=_NEITHER) from exc
            else:
                if self.readout == "token_ids":
                    raise EngineRequestError("the server ignores logprob_token_ids (it accepted an id past any "
                                             "vocabulary)", hint=_NEITHER + "; try readout='echo'")
        try:
            data = (await self.connection.request("POST", "/v1/completions", {**probe, "echo": True})).data
        except EngineRequestError as exc:
            raise EngineRequestError(f"the server gives no exact label logprobs: it ignores logprob_token_ids and "
                                     f"refused echo prompt logprobs ({exc.message})", status=exc.status,
                                     hint=_NEITHER) from exc
        (choice,) = _choices(data, 1)
        if _echoed(choice, len(prompt) - 1, prompt[-1]) is None:
            raise EngineRequestError("the server gives no exact label logprobs: it ignores logprob_token_ids and "
                                     "answered echo without prompt logprobs", hint=_NEITHER)
        return "echo", None

    async def _specials(self, model: str) -> tuple[str, ...]:
        """The special-token texts of the served tokenizer (`tokenizer=`'s), by one `/tokenize` of the
        candidates with `return_token_strs` where the server gives them, else each candidate alone
        (special: exactly one id)."""
        if self._tokenizer is not None:
            return tokenizer_specials(self._tokenizer)
        return await special_texts(self.connection, model, self.tokenize)

    async def _turn_end(self) -> tuple[str, int]:
        """The end of turn and the pad id: with `tokenizer=`, its eos and pad tokens (as `TransformersEngine`
        takes them); else the token the served chat template writes right after an assistant answer,
        its text and its id ("" and 0 where the template writes none)."""
        if self._tokenizer is not None:
            pad = self._tokenizer.pad_token_id
            return str(self._tokenizer.eos_token or ""), int(pad if pad is not None else 0)
        turn = await self._chat_ids([*EMPTY_CHAT, {"role": "assistant", "content": _MARK}], generation=False)
        mark = await self.tokenize(_MARK)
        after = next((i + len(mark) for i in range(len(turn) - len(mark), -1, -1)
                      if list(turn[i:i + len(mark)]) == mark), len(turn))
        if after >= len(turn):
            return "", 0
        text = json_object((await self.connection.request("POST", "/detokenize", {
            "model": await self._model_name(), "tokens": [turn[after]]})).data, "/detokenize").get("prompt")
        return (text, turn[after]) if isinstance(text, str) and text else ("", 0)


# -- the wire ---------------------------------------------------------------------------------


def _label_groups(batch: Sequence[CanvasRead]) -> list[list[int]]:
    """Reads in order, grouped so each group's label ids together fit one request (`MAX_LABEL_IDS`)."""
    groups: list[list[int]] = []
    ids: set[int] = set()
    for i, read in enumerate(batch):
        if groups and len(ids | set(read.label_ids)) <= MAX_LABEL_IDS:
            groups[-1].append(i)
            ids |= set(read.label_ids)
        else:
            groups.append([i])
            ids = set(read.label_ids)
    return groups


def _choices(data: Any, n: int) -> list[Mapping[str, Any]]:
    """A completions reply's choices in prompt order (`index`), one per prompt sent."""
    choices = json_object(data, "/v1/completions").get("choices")
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise EngineResponseError(f"the completions reply holds {len(choices) if isinstance(choices, list) else 'no'} "
                                  f"choices for {n} prompts")
    try:
        ordered = sorted(choices, key=lambda c: int(c.get("index", 0)))
    except (TypeError, ValueError) as exc:
        raise EngineResponseError(f"the completions reply has unreadable choice indices ({exc!r})") from exc
    if [int(c.get("index", 0)) for c in ordered] != list(range(n)):
        raise EngineResponseError("the completions reply's choice indices are not 0..n-1")
    return ordered


def _generated_row(choice: Mapping[str, Any]) -> dict[int, float]:
    """The row at the one generated position: the greedy token and every requested id (`logprob_token_ids`)."""
    try:
        top = choice["logprobs"]["top_logprobs"][0]
        return {token_id(t): float(lp) for t, lp in top.items()}
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise EngineResponseError(f"the read response has no readable logprob row ({exc!r})",
                                  hint="the server must honour logprob_token_ids and "
                                       "return_tokens_as_token_ids (vLLM >= 0.32)") from exc


def _echoed(choice: Mapping[str, Any], position: int, label: int) -> float | None:
    """The logprob of the prompt token at `position` (the label appended to a slot's prefix), from echoed
    prompt logprobs; None when the reply has none there. A reply whose token there is another id is refused."""
    try:
        logprobs = choice["logprobs"]
        value = logprobs["token_logprobs"][position]
        tokens = logprobs.get("tokens") or []
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    sent = tokens[position] if position < len(tokens) else None
    if isinstance(sent, str) and sent.startswith("token_id:") and token_id(sent) != label:
        raise EngineResponseError(f"the echoed prompt holds {sent!r} where label id {label} was sent")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _echo_top(choice: Mapping[str, Any], position: int) -> tuple[int, float] | None:
    """The most likely token at `position` of an echoed prompt, where the reply names it by id."""
    try:
        top = choice["logprobs"]["top_logprobs"][position]
        pairs = [(token_id(t), float(lp)) for t, lp in top.items() if isinstance(t, str) and t.startswith("token_id:")]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    return max(pairs, key=lambda p: p[1], default=None)


def _finished(row: dict[int, float], read: CanvasRead, best: tuple[int, float] | None) -> dict[int, float]:
    """A slot's row as `TransformersEngine` gives it: the label ids' logprobs plus the argmax, or, for a
    constrained read, the labels alone renormalized over themselves (a row missing a label is left for
    `check_rows` to refuse)."""
    if read.constrained:
        if len(row) != len(read.label_ids):
            return row
        top = max(row.values())
        norm = top + math.log(sum(math.exp(v - top) for v in row.values()))
        return {i: v - norm for i, v in row.items()}
    if best is not None:
        row[best[0]] = best[1]
    return row
