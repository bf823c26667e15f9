"""The loopback server's tokenizer and chat template (same ids in every process)."""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FIRST_ID", "SPECIAL_IDS", "chat_text", "pieces", "token_id", "tokenize"]

SPECIAL_IDS: Mapping[str, int] = {
    "<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|think|>": 98, "<|channel>": 100,
    "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
}
"""Special-token text and its id (Gemma 4's ids for turn and channel markers)."""
FIRST_ID = 256
_PIECES = re.compile(r"<\|?[a-z_]+\|?>|\w+|\s|[^\w\s]")
_PLAIN = re.compile(r"\w+|\s|[^\w\s]")


def token_id(piece: str, vocab_size: int = 262144) -> int:
    """The id of one piece: a special id, else a stable hash into `[256, vocab_size)`."""
    if piece in SPECIAL_IDS:
        return SPECIAL_IDS[piece]
    return FIRST_ID + zlib.crc32(piece.encode()) % (vocab_size - FIRST_ID)


def pieces(text: str) -> list[str]:
    """The loopback tokenizer's pieces: specials whole, else words, spaces, punctuation."""
    out: list[str] = []
    for piece in _PIECES.findall(text):
        out.extend([piece] if piece in SPECIAL_IDS or piece[0] != "<" or len(piece) == 1 else _PLAIN.findall(piece))
    return out


def tokenize(text: str, vocab_size: int = 262144) -> list[int]:
    """Ids of `text` under the loopback tokenizer (words, spaces, punctuation, specials)."""
    return [token_id(p, vocab_size) for p in pieces(text)]


def chat_text(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
              enable_thinking: bool = False) -> str:
    """The loopback chat template, shaped like the released DiffusionGemma one (version 2)."""
    text, msgs = "<bos>", list(messages)
    system = msgs[0].get("content", "") if msgs and msgs[0].get("role") == "system" else None
    if enable_thinking or system is not None:
        text += "<|turn>system\n" + ("<|think|>\n" if enable_thinking else "") + (system or "") + "<turn|>\n"
        msgs = msgs[1:] if system is not None else msgs
    for m in msgs:
        role = "model" if m.get("role") == "assistant" else m.get("role", "")
        text += f"<|turn>{role}\n{m.get('content', '')}<turn|>\n"
    if add_generation_prompt:
        text += "<|turn>model\n" + ("" if enable_thinking else "<|channel>thought\n<channel|>")
    return text
