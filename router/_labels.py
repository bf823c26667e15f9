"""One-token labels: which label texts the served tokenizer keeps whole at a slot.

Fixed alphabets (A-Z, a-z, 1-9, yes/no) cover most questions. A question with more
options than they hold gets labels scanned from `LABEL_POOL`, each checked one by one
in its canvas context: a label counts when the template with it differs from the
template with the reference label in exactly the slot's token, and no other label
already has that token id.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Awaitable, Callable, Sequence

Tokenize = Callable[[str], Awaitable[list[int]]]

LABEL_POOL: tuple[str, ...] = tuple(
    list(string.ascii_uppercase) + list(string.ascii_lowercase) + list(string.digits)
    + [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
    + [a + b for a in string.ascii_uppercase for b in string.ascii_lowercase]
    + [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    + [str(i) for i in range(10, 100)]
)
"""Candidate labels, best first: letters, digits, then two-character labels."""

_BATCH = 64


async def one_token_labels(tokenize: Tokenize, render: Callable[[str], str], want: int,
                           pool: Sequence[str] = LABEL_POOL) -> tuple[str, ...]:
    """Up to `want` labels from `pool` that are each one distinct token at one slot.

    `render(label)` is the canvas text with the question's slot holding `label`. The
    slot is where the first two one-token pool entries differ; returns () when the
    pool offers no such pair.
    """
    found: list[str] = []
    ids: set[int] = set()
    reference: list[int] | None = None
    position: int | None = None
    for start in range(0, len(pool), _BATCH):
        batch = pool[start:start + _BATCH]
        variants = await asyncio.gather(*(tokenize(render(label)) for label in batch))
        for label, toks in zip(batch, variants, strict=True):
            if reference is None:
                reference, reference_label = toks, label
                continue
            if len(toks) != len(reference):
                continue
            diff = [p for p, (x, y) in enumerate(zip(reference, toks)) if x != y]
            if len(diff) != 1 or (position is not None and diff[0] != position):
                continue
            if position is None:  # the first label that differs in one token fixes the slot
                position = diff[0]
                found.append(reference_label)
                ids.add(reference[position])
            if toks[position] not in ids:
                found.append(label)
                ids.add(toks[position])
            if len(found) >= want:
                return tuple(found[:want])
    return tuple(found)
