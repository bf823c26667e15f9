"""`TransformersEngine`: structured reads in-process with torch.

Two model kinds, chosen from the model:

- DiffusionGemma (`DiffusionGemmaForBlockDiffusion`): the encoder prefills the prompt into a
  KV cache, one bidirectional decoder pass over the seed canvas gives a row per position.
- Causal LMs (e.g. SmolLM2): a next-token readout. Prompt + canvas run as one causal
  sequence; the row for canvas position `s` is the next-token distribution after
  position `s - 1`, so one forward pass reads every slot.

Either way the prompt's KV cache is kept in a small LRU keyed by prompt ids, so a re-read
of the same prompt with new noise runs only the canvas pass. A causal LM also prefills a
new prompt on top of the longest cached prompt it starts with (vLLM's prefix caching), so
decisions of one node, which share the system prompt, prefill only their state.

The parts, in this order: the engine; `MicroBatcher`, which merges concurrent reads into one
forward pass on a worker thread; the two readouts (`DiffusionGemma`, `CausalLM`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention for torch.nn.functional
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DiffusionGemmaForBlockDiffusion,
    DynamicCache,
)

from .._compat import TRANSFORMERS, moved_keywords, transformers_keywords
from .._prompts import EMPTY_CHAT, ChatPrompts, scaffold_prefix, template_kwargs, tokenizer_specials
from .._types import (
    THOUGHT_SCAFFOLD,
    Batching,
    CanvasRead,
    EngineInfo,
    Message,
    ReadResult,
    check_rows,
    refuse_images,
    refuse_thoughts,
)
from ..errors import EngineOverloaded, EngineRequestError, EngineResponseError, EngineUnavailable

__all__ = ["CausalLM", "DiffusionGemma", "MicroBatcher", "TransformersEngine"]

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""A prompt's cache: per layer (keys, values), each `[1, kv_heads, n, head_dim]`."""
MAX_MODEL_LEN_CAP = 32768
"""The context assumed when a model states none."""
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Job:
    prompt: tuple[int, ...]
    read: CanvasRead


BATCHING = Batching()
"""The default batching: at most 16 canvases per forward pass, a 2 ms window, 1,024 queued."""


class TransformersEngine:
    """Reads canvases in-process with a transformers model (DiffusionGemma or causal LM).

    Concurrent `read` calls share forward passes as `batching` says (`Batching`: at most
    16 canvases, 2 ms window, 1,024 queued), run on one worker thread so the event loop stays free. Prompts
    are left-padded with an attention mask, so a batched read equals an unbatched one.
    `enable_thinking` goes to the chat template (default False); a DiffusionGemma canvas
    opens with the thought block only when the generation prompt does not end with it.
    `EngineInfo.special_tokens` lists the tokenizer's special and added tokens.
    The prompt KV LRU holds at most `prompt_cache_size` prompts and `prompt_cache_bytes`
    bytes of keys and values (a prompt larger than that is not kept), so large requests
    cannot grow memory without bound.

    Example:
        ```python
        engine = TransformersEngine.from_pretrained("/models/tiny-dgemma")
        info = await engine.info()
        [result] = await engine.read([CanvasRead(messages=..., canvas=..., slots=(3,), label_ids=(...))])
        ```
    """

    @moved_keywords(TRANSFORMERS, transformers_keywords)  # 0.1's batching keywords, until 0.3.0
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        canvas_width: int | None = None,
        max_model_len: int | None = None,
        batching: Batching = BATCHING,
        prompt_cache_size: int = 64,
        prompt_cache_bytes: int = 256 * 2**20,
        enable_thinking: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
        model.eval()
        diffusion = isinstance(model, DiffusionGemmaForBlockDiffusion)
        self._kind: DiffusionGemma | CausalLM = (
            DiffusionGemma(model, canvas_width) if diffusion else CausalLM(model, canvas_width))
        self._tokenizer = tokenizer
        self._device = torch.device(device)
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._prompts = ChatPrompts(tokenizer, template_kwargs(enable_thinking, chat_template_kwargs))
        self._kv: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._kv_size = prompt_cache_size
        self._kv_bytes_cap = prompt_cache_bytes
        self._kv_bytes = 0
        """Bytes of keys and values held by the LRU now."""
        self._closed = False
        self.prompt_cache_hits = 0
        """Prompts whose KV cache came from the LRU instead of a prefill."""
        self.prefix_tokens_reused = 0
        """Prompt tokens not prefilled because a cached prompt started with them (causal LMs)."""
        self._batcher: MicroBatcher[_Job, tuple[tuple[dict[int, float], ...], dict[str, object]]] = MicroBatcher(
            self._forward, max_batch=batching.max_batch, window_s=batching.window_s, max_queue=batching.max_queue,
            name="canvasroute-transformers")

        limits = [self._kind.max_positions, max_model_len or MAX_MODEL_LEN_CAP]
        if (tok_max := getattr(tokenizer, "model_max_length", None)) and tok_max < 10**7:
            limits.append(int(tok_max))
        empty = self._prompt_ids(EMPTY_CHAT)
        scaffold = tokenizer(THOUGHT_SCAFFOLD, add_special_tokens=False).input_ids
        defaults = ({"canvas_prefix": scaffold_prefix(empty, scaffold)} if diffusion
                    else {"canvas_prefix": "", "end_of_turn": tokenizer.eos_token or ""})
        self._info = EngineInfo(
            model=name or Path(str(model.config.name_or_path or type(model).__name__)).name,
            provider="transformers", canvas_width=self._kind.canvas_width, max_model_len=min(limits),
            vocab_size=min(len(tokenizer), self._kind.vocab), pad_id=self._pad, chat_overhead=len(empty),
            special_tokens=tokenizer_specials(tokenizer), causal_readout=not diffusion,
            **defaults,
        )

    @classmethod
    def from_pretrained(cls, path_or_dir: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        **kwargs: Any) -> TransformersEngine:
        """Load a local checkpoint (DiffusionGemma or causal LM) and its tokenizer.

        `dtype` defaults to float32, which reproduces a `--dtype float32` vLLM server;
        other keyword arguments go to the constructor.
        """
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        path = str(path_or_dir)
        config = AutoConfig.from_pretrained(path)
        loader = DiffusionGemmaForBlockDiffusion if config.model_type == "diffusion_gemma" else AutoModelForCausalLM
        model = loader.from_pretrained(path, dtype=dtype)
        kwargs.setdefault("name", Path(path).name)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    def __repr__(self) -> str:
        return (f"TransformersEngine({self._info.model!r}, kind={type(self._kind).__name__.strip('_')!r}, "
                f"device={str(self._device)!r})")

    @property
    def model(self) -> Any:
        """The transformers model."""
        return self._kind.model

    @property
    def tokenizer(self) -> Any:
        """The tokenizer whose chat template builds the prompts."""
        return self._tokenizer

    @property
    def forward_passes(self) -> int:
        """Forward passes run so far (one per micro-batch)."""
        return self._batcher.batches

    # -- protocol -------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        return self._info

    async def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False).input_ids)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(self._prompt_ids(messages))

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        refuse_images(batch, "TransformersEngine")
        refuse_thoughts(batch, "TransformersEngine", steps=False)
        if self._closed:
            raise EngineRequestError("the engine is closed", hint="create a new engine")
        jobs = [self._job(read) for read in batch]
        start = time.perf_counter()
        done = await self._batcher.submit(jobs)
        latency = time.perf_counter() - start
        for job, (rows, _) in zip(jobs, done, strict=True):
            check_rows(job.read, rows)
        return [ReadResult(rows=rows, prompt_tokens=len(job.prompt), completion_tokens=len(job.read.canvas),
                           latency_s=latency, attrs=attrs) for job, (rows, attrs) in zip(jobs, done, strict=True)]

    async def aclose(self) -> None:
        self._closed = True
        await self._batcher.aclose()
        self._kv.clear()

    # -- requests -------------------------------------------------------------------

    def _prompt_ids(self, messages: Sequence[Message]) -> tuple[int, ...]:
        return self._prompts(messages)

    def _job(self, read: CanvasRead) -> _Job:
        """Check a read before it is queued, so a bad one never fails a whole batch."""
        width, vocab = len(read.canvas), self._kind.vocab
        if not 0 < width <= self._info.canvas_width:
            raise EngineRequestError(f"canvas of {width} ids; this engine reads at most {self._info.canvas_width}")
        for what, ids in (("canvas", read.canvas), ("label", read.label_ids)):
            if any(not 0 <= t < vocab for t in ids):
                raise EngineRequestError(f"{what} ids must be in [0, {vocab})")
        if any(not 0 <= s < width for s in read.slots):
            raise EngineRequestError(f"slots must lie inside the canvas [0, {width})")
        if read.constrained and not read.label_ids:
            raise EngineRequestError("a constrained read needs label_ids: they are the allowed set")
        prompt = self._prompt_ids(read.messages)
        if len(prompt) < 2:
            raise EngineRequestError("the chat prompt must hold at least 2 tokens")
        if len(prompt) + width > self._info.max_model_len:
            raise EngineRequestError(f"prompt of {len(prompt)} tokens + canvas of {width} exceed the "
                                     f"{self._info.max_model_len}-token context")
        return _Job(prompt, read)

    # -- model work (worker thread) -------------------------------------------------

    def _forward(self, jobs: list[_Job]) -> list[tuple[tuple[dict[int, float], ...], dict[str, object]]]:
        start = time.perf_counter()
        with torch.inference_mode():
            kvs, hits = self._prefix_kv([self._kind.prefix(j.prompt) for j in jobs])
            cache, lengths = self._stack(kvs)
            inputs = [self._kind.canvas_inputs(j.prompt, j.read) for j in jobs]
            width = max(len(x) for x in inputs)
            canvas = torch.tensor([list(x) + [self._pad] * (width - len(x)) for x in inputs], device=self._device)
            widths = torch.tensor([len(x) for x in inputs], device=self._device)
            wanted = sorted({s for j in jobs for s in j.read.slots})  # only these rows reach the vocabulary
            row_of = {s: i for i, s in enumerate(wanted)}
            logits = self._kind.logits(cache, lengths, canvas, widths, torch.tensor(wanted, device=self._device))
            out = [_rows(logits[b, [row_of[s] for s in j.read.slots]], j.read) for b, j in enumerate(jobs)]
        attrs = {"batch_size": len(jobs), "forward_s": time.perf_counter() - start}
        return [(rows, {**attrs, "prompt_cache_hit": hit}) for rows, hit in zip(out, hits, strict=True)]

    def _prefix_kv(self, prefixes: list[tuple[int, ...]]) -> tuple[list[KV], list[bool]]:
        """Each prefix's KV cache: from the LRU, else from one batched prefill of the missing
        ones. A causal prefill starts from the longest cached prefix of it (the KV of an
        entry's first `n` tokens is the KV of those tokens), so decisions sharing a system
        prompt prefill only their own state; and prompts of one batch that share a leading part
        no entry holds (a decision's isolated reads: the state, then each question) prefill that
        part once, then each its own rest."""
        found: dict[tuple[int, ...], KV] = {}
        for p in dict.fromkeys(prefixes):
            if p in self._kv:
                self._kv.move_to_end(p)
                found[p] = self._kv[p]
        hits = [p in found for p in prefixes]
        self.prompt_cache_hits += sum(hits)
        missing = [p for p in dict.fromkeys(prefixes) if p not in found]
        if missing:
            bases = [self._cached_base(p) for p in missing]
            shared = _shared_prefix(missing) if isinstance(self._kind, CausalLM) and len(missing) > 1 else ()
            if len(shared) >= SHARED_MIN and len(shared) > max(_kv_len(b) for b in bases):
                (kv,), _ = self._prefix_kv([shared])  # prefilled once (and kept, when it fits the LRU)
                self.prefix_tokens_reused += len(shared) * (len(missing) - 1)
                bases = [kv if _kv_len(b) < len(shared) else b for b in bases]
            past: tuple[DynamicCache, torch.Tensor] | None = None
            if some := next((b for b in bases if b is not None), None):
                empty = tuple((k[:, :, :0], v[:, :, :0]) for k, v in some)
                past = self._stack([empty if b is None else b for b in bases])
            suffixes = [p[_kv_len(b):] for p, b in zip(missing, bases, strict=True)]
            n = max(len(x) for x in suffixes)
            ids = torch.tensor([[self._pad] * (n - len(x)) + list(x) for x in suffixes], device=self._device)
            lengths = torch.tensor([len(x) for x in suffixes], device=self._device)
            if past is None:
                cache = self._kind.encode(ids, lengths)
            else:  # only a causal LM reuses a cached prefix (`_cached_base`)
                assert isinstance(self._kind, CausalLM)
                cache = self._kind.encode(ids, lengths, *past)
            c = cache.get_seq_length() - n  # the stacked bases' padded length
            layers = _layers(cache)
            for b, (p, base) in enumerate(zip(missing, bases, strict=True)):
                lo, hi = c - _kv_len(base), c + n - len(suffixes[b])
                found[p] = tuple((torch.cat([keys[b:b + 1, :, lo:c], keys[b:b + 1, :, hi:]], 2),
                                  torch.cat([values[b:b + 1, :, lo:c], values[b:b + 1, :, hi:]], 2))
                                 for keys, values in layers)
                size = _kv_bytes(found[p])
                if self._kv_size > 0 and size <= self._kv_bytes_cap:
                    self._kv[p] = found[p]
                    self._kv_bytes += size
            while len(self._kv) > self._kv_size or self._kv_bytes > self._kv_bytes_cap:
                self._kv_bytes -= _kv_bytes(self._kv.popitem(last=False)[1])
        return [found[p] for p in prefixes], hits

    def _cached_base(self, prefix: tuple[int, ...]) -> KV | None:
        """The KV of the longest leading part of `prefix` (at most all but its last token)
        that some LRU entry starts with; None for DiffusionGemma or when none shares one."""
        best, key = 0, None
        if isinstance(self._kind, CausalLM):
            for k in self._kv:
                if (n := _common_prefix_len(prefix[:-1], k)) > best:
                    best, key = n, k
        if key is None:
            return None
        self._kv.move_to_end(key)
        self.prefix_tokens_reused += best
        return tuple((keys[:, :, :best], values[:, :, :best]) for keys, values in self._kv[key])

    def _stack(self, kvs: list[KV]) -> tuple[DynamicCache, torch.Tensor]:
        """Left-pad per-prompt caches to one batched cache; also return the true lengths."""
        lengths = [kv[0][0].shape[2] for kv in kvs]
        n = max(lengths)
        layers = [
            tuple(torch.cat([F.pad(kv[i][part], (0, 0, n - kv[i][part].shape[2], 0)) for kv in kvs])
                  for part in (0, 1))
            for i in range(len(kvs[0]))
        ]
        return DynamicCache(ddp_cache_data=layers), torch.tensor(lengths, device=self._device)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of a prefilled cache."""
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
            raise EngineRequestError(f"the model's cache has a {type(layer).__name__} layer without keys and values",
                                     hint="TransformersEngine reads attention-only models")
        out.append((keys, values))
    return out


def _kv_len(kv: KV | None) -> int:
    """Tokens held by one prompt's cache (0 for none)."""
    return 0 if kv is None else kv[0][0].shape[2]


SHARED_MIN = 16
"""Tokens a batch's prompts must share before that part is prefilled once for all of them."""


def _shared_prefix(prompts: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The leading tokens every prompt starts with, short of each one's last token."""
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = min(n, _common_prefix_len(prompts[0][:n], p))
    return prompts[0][:max(n, 0)]


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common leading run of `a` and `b` (binary search on slices)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _kv_bytes(kv: KV) -> int:
    """Bytes of one prompt's cached keys and values."""
    return sum(t.numel() * t.element_size() for layer in kv for t in layer)


def _rows(logits: torch.Tensor, read: CanvasRead) -> tuple[dict[int, float], ...]:
    """Slot rows: the label ids' logprobs plus the argmax (renormalized over the labels
    alone when the read is constrained, as vLLM's `diffusion_constrained` does)."""
    logp = logits.float().log_softmax(-1)
    labels = list(read.label_ids)
    if read.constrained:
        logp = logp[:, labels].log_softmax(-1)
        return tuple(dict(zip(labels, row, strict=True)) for row in logp.tolist())
    best_lp, best = logp.max(-1)
    picked = logp[:, labels].tolist() if labels else [[] for _ in range(len(read.slots))]
    return tuple({**dict(zip(labels, row, strict=True)), b: lp}
                 for row, b, lp in zip(picked, best.tolist(), best_lp.tolist(), strict=True))


# -- micro-batches -------------------------------------------------------------------------


class MicroBatcher(Generic[T, R]):
    """Run `fn(items) -> results` on one worker thread, over batches of queued items.

    Items submitted by concurrent callers within `window_s` of the oldest queued item
    share one call of at most `max_batch` items; an item never waits longer than
    `window_s` for company. Results go back to each caller in its own order; an
    exception raised by `fn` goes to every caller in that batch. The queue holds at most
    `max_queue` items: a submission that does not fit raises `EngineOverloaded`.
    The worker thread is the only thread that calls `fn`, so `fn` needs no locking.

    Example:
        ```python
        batcher = MicroBatcher(lambda xs: [x * 2 for x in xs], max_batch=8)
        assert await batcher.submit([1, 2]) == [2, 4]
        ```
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], *, max_batch: int = 16,
                 window_s: float = 0.002, max_queue: int = 1024, name: str = "canvasroute-batcher") -> None:
        if max_batch < 1 or max_queue < 1 or window_s < 0:
            raise ValueError("max_batch and max_queue must be >= 1 and window_s >= 0")
        self._fn = fn
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_queue = max_queue
        self._name = name
        self._queue: deque[tuple[float, T, Future[R]]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0
        """Calls of `fn` so far (one per forward pass)."""

    def __repr__(self) -> str:
        return f"MicroBatcher(max_batch={self.max_batch}, window_s={self.window_s}, max_queue={self.max_queue})"

    async def submit(self, items: Sequence[T]) -> list[R]:
        """Queue `items` and wait for their results, in order."""
        if not items:
            return []
        if len(items) > self.max_queue:
            raise EngineRequestError(f"{len(items)} canvases in one read; the queue holds {self.max_queue}",
                                     hint="split the batch or raise max_queue")
        futures: list[Future[R]] = [Future() for _ in items]
        with self._cond:
            if self._closed:
                raise EngineUnavailable("the engine is closed", hint="create a new engine")
            if len(self._queue) + len(items) > self.max_queue:
                raise EngineOverloaded(f"{len(self._queue)} canvases already queued (max_queue={self.max_queue})",
                                       hint="retry later, or raise max_queue / max_batch")
            now = time.monotonic()
            self._queue.extend((now, item, fut) for item, fut in zip(items, futures, strict=True))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        outcomes = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes  # type: ignore[return-value]

    async def aclose(self) -> None:
        """Fail queued items with `EngineUnavailable`, finish the running batch, stop the thread."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        for _, _, fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineUnavailable("the engine was closed before this read ran"))
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join)

    def _take(self) -> list[tuple[float, T, Future[R]]] | None:
        """The next batch: wait for a first item, then for company until its window ends."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = self._queue[0][0] + self.window_s
            while len(self._queue) < self.max_batch and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            n = min(len(self._queue), self.max_batch)
            return [self._queue.popleft() for _ in range(n)]

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            live = [(item, fut) for _, item, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            self.batches += 1
            try:
                results = list(self._fn([item for item, _ in live]))
                if len(results) != len(live):
                    raise EngineResponseError(f"the forward pass returned {len(results)} results for {len(live)} items")
            except Exception as exc:  # noqa: BLE001 - any fault goes to every caller in the batch, or they wait forever
                for _, fut in live:
                    fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                fut.set_result(result)


# -- readouts: how each model family turns a prompt's cache and a canvas into slot logits ---


class DiffusionGemma:
    """Encoder prefill of the prompt, then one bidirectional decoder pass over the canvas.

    The attention masks are built here, as vLLM applies them: in sliding-window layers
    every query sees the keys less than `sliding_window` positions away, prompt and
    canvas alike. (transformers 5.24's own forward instead shows the canvas the last
    `sliding_window - 1` prompt tokens; the two differ, by up to 0.5 nats on the tiny
    checkpoint, once prompt + canvas exceed the window.)
    """

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, canvas_width: int | None) -> None:
        text, served = model.config.text_config, model.config.canvas_length
        if text is None or isinstance(text, dict) or not served:
            raise ValueError("this DiffusionGemma config has no text config or no canvas_length")
        self.model = model
        self.window = int(text.sliding_window or 0)
        self.vocab = int(text.vocab_size)
        self.max_positions = int(text.max_position_embeddings)
        self.canvas_width = min(canvas_width or int(served), int(served))
        self.cache_kw = _cache_kwarg(model)

    def prefix(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        return prompt

    def canvas_inputs(self, prompt: tuple[int, ...], read: CanvasRead) -> tuple[int, ...]:
        return read.canvas

    def encode(self, ids: torch.Tensor, lengths: torch.Tensor) -> DynamicCache:
        n = ids.shape[1]
        steps = torch.arange(n, device=ids.device)
        valid = steps[None] >= (n - lengths)[:, None]
        causal = steps[None, :] <= steps[:, None]
        cache = DynamicCache()
        self.model.get_encoder()(
            input_ids=ids, attention_mask=self._masks(valid, steps, steps, causal),
            position_ids=(steps[None] - (n - lengths)[:, None]).clamp(min=0), **{self.cache_kw: cache},
        )
        return cache

    def logits(self, cache: DynamicCache, lengths: torch.Tensor, canvas: torch.Tensor, widths: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        """`[batch, len(rows), vocab]`: the canvas rows at `rows` (every slot sees the whole canvas)."""
        p, c = cache.get_seq_length(), canvas.shape[1]
        steps = torch.arange(p + c, device=canvas.device)
        valid = torch.cat([steps[None, :p] >= (p - lengths)[:, None],
                           steps[None, :c] < widths[:, None]], dim=1)
        masks = self._masks(valid, steps[p:], steps, None)
        positions = lengths[:, None] + steps[None, :c]
        out: torch.Tensor = self.model(decoder_input_ids=canvas, decoder_attention_mask=masks,
                                       decoder_position_ids=positions, **{self.cache_kw: cache}).logits
        return out[:, rows]

    def _masks(self, valid: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               causal: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Additive `[batch, 1, queries, keys]` masks per layer type. Every query may see
        itself, so padded rows stay finite."""
        allowed = valid[:, None, :] & (causal if causal is not None else True)
        allowed = allowed | (q[:, None] == k[None, :])
        near = (q[:, None] - k[None, :]).abs() < self.window if self.window else True
        dtype = self.model.dtype

        def additive(ok: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device)
            return mask.masked_fill(~ok, torch.finfo(dtype).min)[:, None]

        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & near)}


class CausalLM:
    """Next-token readout: the prompt minus its last token is the cached prefix; the
    canvas pass feeds `[last prompt token, canvas[:last slot]]`, so output `s` is the
    distribution over canvas position `s` (nothing after the last slot can change a row).

    The canvas runs as given, noise included, so an earlier slot's noise conditions the
    rows of later slots: the causal mirror of DiffusionGemma, where every slot sees the
    noise at every other slot, and re-reads with new noise average it out. Putting the
    template's label-0 id at earlier slots instead was measured on SmolLM2-135M (5 tickets,
    3 questions, 8 noise draws): noise moves later slots' label distributions by a mean
    total variation of 0.02 (max 0.09) from the label-0 fill and never changes their
    argmax, while a label at an earlier slot is copied (P(yes) at q3 is 1.0 after
    "q2: yes" but 0.76-0.99 after "q2: no"), a first-option bias the noise avoids.
    """

    def __init__(self, model: Any, canvas_width: int | None) -> None:
        if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
            raise ValueError("causal LMs with sliding-window layers are not supported by TransformersEngine")
        self.model = model
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or MAX_MODEL_LEN_CAP)
        self.canvas_width = canvas_width or 64
        self.cache_kw = _cache_kwarg(model)
        self.keeps_rows = "logits_to_keep" in inspect.signature(model.forward).parameters

    def prefix(self, prompt: tuple[int, ...]) -> tuple[int, ...]:
        return prompt[:-1]

    def canvas_inputs(self, prompt: tuple[int, ...], read: CanvasRead) -> tuple[int, ...]:
        """Up to the last slot: a causal row sees nothing after it, so the rest is not fed."""
        return (prompt[-1], *read.canvas[:max(read.slots, default=0)])

    def encode(self, ids: torch.Tensor, lengths: torch.Tensor, past: DynamicCache | None = None,
               past_lengths: torch.Tensor | None = None) -> DynamicCache:
        """Prefill left-padded `ids`, on top of `past` (left-padded cached prefixes of
        `past_lengths` tokens) when given: the suffixes then start at those positions."""
        n = ids.shape[1]
        steps = torch.arange(n, device=ids.device)
        valid = steps[None] >= (n - lengths)[:, None]
        positions = (steps[None] - (n - lengths)[:, None]).clamp(min=0)
        if past is not None and past_lengths is not None:
            p = past.get_seq_length()
            valid = torch.cat([torch.arange(p, device=ids.device)[None] >= (p - past_lengths)[:, None], valid], 1)
            positions = positions + past_lengths[:, None]
        cache = past if past is not None else DynamicCache()
        self.model.base_model(input_ids=ids, attention_mask=valid.long(), position_ids=positions,
                              use_cache=True, **{self.cache_kw: cache})
        return cache

    def logits(self, cache: DynamicCache, lengths: torch.Tensor, inputs: torch.Tensor, widths: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        """`[batch, len(rows), vocab]`, projecting only those rows onto the vocabulary where
        the model takes `logits_to_keep`. `widths` goes unused: the causal mask already
        hides a canvas's right padding."""
        p, c = cache.get_seq_length(), inputs.shape[1]
        steps = torch.arange(p, device=inputs.device)
        mask = torch.cat([steps[None] >= (p - lengths)[:, None], inputs.new_ones(inputs.shape, dtype=torch.bool)], 1)
        positions = lengths[:, None] + torch.arange(c, device=inputs.device)[None]
        keep = {"logits_to_keep": rows} if self.keeps_rows else {}
        out: torch.Tensor = self.model(input_ids=inputs, attention_mask=mask.long(), position_ids=positions,
                                       use_cache=True, **{self.cache_kw: cache}, **keep).logits
        return out if self.keeps_rows else out[:, rows]


def _cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
