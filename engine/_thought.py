"""Thoughts on vLLM's server: the model writes in its thought channel, a read continues after it.

DiffusionGemma's chat template opens the thought channel itself only with
`enable_thinking=True` (its generation prompt then ends at the model turn). A thought is an
ordinary generation after that prompt and the channel's open tag (`<|channel>thought\\n`),
cut at the close tag (`<channel|>`) or the budget. A read that continues it is sent to
`/v1/completions` as token ids (prompt + open tag + thought + close tag), so no template
can alter it; its canvas starts at the answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ._types import Message, Thought
from ._wire import token_id
from .errors import EngineResponseError

THOUGHT_OPEN = "<|channel>thought\n"
THOUGHT_CLOSE = "<channel|>"


async def _tags(engine: Any) -> tuple[list[int], list[int]]:
    opening, closing = await engine.tokenize(THOUGHT_OPEN), await engine.tokenize(THOUGHT_CLOSE)
    if len(closing) != 1:
        raise EngineResponseError(f"this tokenizer splits {THOUGHT_CLOSE!r}: the model has no thought channel",
                                  hint="think needs a DiffusionGemma (Gemma 4) tokenizer")
    return opening, closing


async def write_thought(engine: Any, messages: Sequence[Message], budget: int) -> Thought:
    """Up to `budget` tokens the model writes in its thought channel after `messages`
    (`engine`: a `VLLMServerEngine`, for its `tokenize`, `prompt_ids` and `post`)."""
    opening, closing = await _tags(engine)
    prompt = [*await engine.prompt_ids(messages, thinking=True), *opening]
    body = {"model": (await engine.info()).model, "prompt": prompt, "max_tokens": budget, "logprobs": 0,
            "return_tokens_as_token_ids": True, "stop_token_ids": closing}
    start = time.perf_counter()
    data = await engine.post("/v1/completions", body)
    try:
        choice = data["choices"][0]
        ids = [token_id(t) for t in choice["logprobs"]["tokens"]]
        text = str(choice.get("text") or "")
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineResponseError(f"the thought response has no token ids ({exc!r})") from exc
    closed = closing[0] in ids or choice.get("finish_reason") == "stop"
    if closing[0] in ids:
        ids = ids[:ids.index(closing[0])]
    usage: Any = data.get("usage") or {}
    return Thought(ids=tuple(ids), text=text.split(THOUGHT_CLOSE)[0], closed=closed,
                   prompt_tokens=int(usage.get("prompt_tokens") or len(prompt)),
                   latency_s=time.perf_counter() - start)


async def thought_prompt(engine: Any, messages: Sequence[Message], thought: Sequence[int]) -> list[int]:
    """The prompt ids of a read that continues `thought`: the thinking prompt, the channel with it, closed."""
    opening, closing = await _tags(engine)
    return [*await engine.prompt_ids(messages, thinking=True), *opening, *thought, *closing]
