"""`FunctionEngine`: a test double whose slot rows come from a function you write."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._types import CanvasRead, EngineInfo, Message, ReadResult, refuse_images

RowsFunction = Callable[[CanvasRead], Any]
"""`fn(read) -> rows | ReadResult` (sync or async): one `{id: logprob}` row per slot."""

_PIECES = re.compile(r"<\|?[a-z_]+\|?>|\w+|\s|[^\w\s]")
_SPECIALS = ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>")


class FunctionEngine:
    """An engine driven by a function, like httpx's `MockTransport` for canvases.

    Its tokenizer is a small deterministic word tokenizer (words, single spaces and
    punctuation are tokens; ids are assigned on first sight), so every label is one
    token and slot resolution always succeeds. Raise from `fn` to inject a fault. A row
    only needs its own slot's label ids (the router refuses a row without one, with
    `EngineResponseError`); `canvasroute.engine.check_rows(read, rows)` holds rows to the full wire
    contract. Its special tokens (`<|turn>`, `<turn|>`, ...) are reported in
    `EngineInfo.special_tokens` and each tokenize to one reserved id.

    Example:
        ```python
        engine = FunctionEngine(lambda read: [{engine.token_id("A"): -0.1}] * len(read.slots))
        ```
    """

    def __init__(self, fn: RowsFunction, *, model: str = "function", canvas_width: int = 64,
                 max_model_len: int = 4096, vocab_size: int = 32000, keep_reads: bool = True,
                 causal_readout: bool = False) -> None:
        self._fn = fn
        self._info = EngineInfo(model=model, provider="function", canvas_width=canvas_width,
                                max_model_len=max_model_len, vocab_size=vocab_size, pad_id=0,
                                special_tokens=tuple(sorted(_SPECIALS)), causal_readout=causal_readout)
        self._vocab: dict[str, int] = {s: i for i, s in enumerate(_SPECIALS)}
        self.reads: list[CanvasRead] = []
        """Every canvas read so far, in order (none with `keep_reads=False`, for long benchmarks)."""
        self._keep = keep_reads
        self.calls = 0
        """Calls of `read` (a batch counts once)."""

    def __repr__(self) -> str:
        return f"FunctionEngine({getattr(self._fn, '__name__', self._fn)!r}, model={self._info.model!r})"

    def token_id(self, piece: str) -> int:
        """The id of one piece of text (assigned on first sight)."""
        if piece not in self._vocab:
            self._vocab[piece] = len(self._vocab)
            if len(self._vocab) > self._info.vocab_size:
                raise ValueError("FunctionEngine vocabulary is full")
        return self._vocab[piece]

    async def info(self) -> EngineInfo:
        return self._info

    async def tokenize(self, text: str) -> list[int]:
        return [self.token_id(p) for p in _PIECES.findall(text)]

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        counts = [3 + len(await self.tokenize(m["content"])) for m in messages]
        return sum(counts) + 2

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        refuse_images(batch, "FunctionEngine")
        self.calls += 1
        out = []
        for read in batch:
            if self._keep:
                self.reads.append(read)
            start = time.perf_counter()
            result = self._fn(read)
            if inspect.isawaitable(result):
                result = await result
            if not isinstance(result, ReadResult):
                rows: Sequence[Mapping[int, float]] = result
                result = ReadResult(rows=tuple(dict(r) for r in rows), prompt_tokens=0,
                                    completion_tokens=len(read.canvas),
                                    latency_s=time.perf_counter() - start)
            out.append(result)
        return out

    async def aclose(self) -> None:
        return None
