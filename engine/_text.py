"""Text that must not become template tokens, and the thought scaffold of the canvas.

- `defuse(text, specials)`: break every special/added token text of the engine's own
  tokenizer (`EngineInfo.special_tokens`) with a zero-width space, so a state or an
  instruction cannot close a turn or forge template tokens.
- `scaffold_prefix(prompt_ids, scaffold_ids)`: the thought block the canvas must open
  with, or nothing when the generation prompt already ends with it (the released
  DiffusionGemma template does, with thinking off).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

THOUGHT_SCAFFOLD = "<|channel>thought\n<channel|>"
"""Gemma 4's empty thought block: the canvas opens with it unless the prompt holds it."""

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
