"""`PromptCache`: prompt token ids per chat, one bounded LRU for every engine."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ._types import Message


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
