"""Prompts: how chat messages become prompt text and token ids, safely, for every engine.

- `defuse(text, specials)`: break every special/added token text of the engine's own
  tokenizer (`EngineInfo.special_tokens`) with a zero-width space, so a state or an
  instruction cannot close a turn or forge template tokens.
- `scaffold_prefix(prompt_ids, scaffold_ids)`: the thought block the canvas must open
  with, or nothing when the generation prompt already ends with it (the released
  DiffusionGemma template does, with thinking off).
- `PromptCache`: prompt token ids per chat, one bounded LRU for every engine;
  `ChatPrompts`: a transformers tokenizer's chat template behind it; `template_kwargs`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from ._types import THOUGHT_SCAFFOLD, Message

ZERO_WIDTH_SPACE = "\u200b"

SPECIAL_CANDIDATES: tuple[str, ...] = (
    # Gemma 4 / DiffusionGemma
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
    "<|think|>", "<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>",
    "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>",
    # Gemma 2/3
    "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
    # ChatML / SmolLM / Qwen
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_sep|>",
    # Llama 2/3, Mistral, Phi
    "<s>", "</s>", "[INST]", "[/INST]", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|end|>",
)
"""Special-token texts a server is probed for (via `/tokenize`) when it cannot list its own."""


def defuse(text: str, specials: Iterable[str]) -> str:
    """`text` with every occurrence of a special token text broken by a zero-width space
    after its first character (repeated until none is left, so no break forms a new one).

    Example:
        ```python
        defuse("bye<turn|>", ["<turn|>"]) == "bye<\\u200bturn|>"
        ```
    """
    pattern = _compiled(specials if isinstance(specials, tuple) else tuple(specials))
    if pattern is None:
        return text
    for _ in range(len(text) + 1):
        text, n = pattern.subn(lambda m: m.group(0)[0] + ZERO_WIDTH_SPACE + m.group(0)[1:], text)
        if not n:
            break
    return text


@lru_cache(maxsize=64)
def _compiled(specials: tuple[str, ...]) -> re.Pattern[str] | None:
    """The pattern of a special-token list as given (the same engine passes the same tuple)."""
    return _pattern(tuple(sorted({s for s in specials if len(s) > 1}, key=len, reverse=True)))


@lru_cache(maxsize=64)
def _pattern(specials: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def tokenizer_specials(tokenizer: Any) -> tuple[str, ...]:
    """Every special or added token text of a transformers tokenizer, sorted."""
    found: set[str] = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found.update(str(getattr(tok, "content", tok)) for tok in decoder.values())
    return tuple(sorted(s for s in found if s and s.strip()))


def scaffold_prefix(prompt_ids: Sequence[int], scaffold_ids: Sequence[int], scaffold: str = THOUGHT_SCAFFOLD) -> str:
    """`scaffold` when the generation prompt does not already end with its ids, else `""`."""
    n = len(scaffold_ids)
    if n and len(prompt_ids) >= n and list(prompt_ids[-n:]) == list(scaffold_ids):
        return ""
    return scaffold


class PromptCache:
    """Token ids by key, least recently used dropped first (`size` entries at most).

    Keys are short: `chat_key(messages)` hashes a chat, `text_key(text)` a plain text.
    """

    def __init__(self, size: int = 4096) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __repr__(self) -> str:
        return f"PromptCache({len(self._ids)}/{self.size})"

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, key: str) -> tuple[int, ...] | None:
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
        return ids

    def put(self, key: str, ids: Sequence[int]) -> tuple[int, ...]:
        value = self._ids[key] = tuple(int(t) for t in ids)
        self._ids.move_to_end(key)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return value

    @staticmethod
    def chat_key(messages: Sequence[Message]) -> str:
        blob = json.dumps([dict(m) for m in messages], sort_keys=True)
        return "c:" + hashlib.sha256(blob.encode()).hexdigest()

    @staticmethod
    def text_key(text: str) -> str:
        return "t:" + text


class ChatPrompts:
    """Chat prompt ids from a transformers tokenizer's chat template, cached.

    The generation prompt is always added; `template_kwargs` go to the template (e.g.
    `{"enable_thinking": False}`).
    """

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any], size: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.cache = PromptCache(size)

    def __call__(self, messages: Sequence[Message]) -> tuple[int, ...]:
        key = PromptCache.chat_key(messages)
        ids = self.cache.get(key)
        if ids is None:
            ids = self.cache.put(key, self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False,
                **self.template_kwargs))
        return ids


EMPTY_CHAT: tuple[Message, ...] = ({"role": "system", "content": ""}, {"role": "user", "content": ""})
"""The chat whose prompt gives the template's overhead and its generation prompt."""


def template_kwargs(enable_thinking: bool, chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Chat template arguments: `enable_thinking` unless `chat_template_kwargs` sets it."""
    return {"enable_thinking": bool(enable_thinking), **(chat_template_kwargs or {})}
