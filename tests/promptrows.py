"""A FunctionEngine that answers from the system prompt it is read with.

The router lists each question of a canvas as a block "Question qN: <instructions>"
followed by "<label>: <option>" lines, in slot order. `PromptRows` gives each slot a
row built by a rule of the block (its instructions, labels and option texts), so tests
can script answers per question whatever chunk or read the question lands in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from canvasroute.engine import CanvasRead, FunctionEngine


@dataclass(frozen=True, slots=True)
class Block:
    """One question as the prompt lists it."""

    instructions: str
    labels: tuple[str, ...]
    texts: tuple[str, ...]
    """Each label's line text after "label: " (option name, description...)."""


Rule = Callable[[Block], Sequence[float]]
"""Probabilities over a block's labels, in label order."""


def blocks(system: str) -> list[Block]:
    out = []
    for part in system.split("\n\n"):
        lines = part.splitlines()
        if not lines or not lines[0].startswith("Question q"):
            continue
        pairs = [line.split(": ", 1) for line in lines[1:]]
        out.append(Block(lines[0].split(": ", 1)[1], tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)))
    return out


class PromptRows:
    """`rule(block)` gives each slot's probabilities; every read is kept in `engine.reads`."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.engine = FunctionEngine(self._rows, model="prompt-rows")
        self.systems: list[str] = []
        self.users: list[str] = []
        """The user message (the state, and any restated answers) of every read."""

    def _rows(self, read: CanvasRead) -> list[dict[int, float]]:
        system = read.messages[0]["content"]
        self.systems.append(system)
        self.users.append(read.messages[1]["content"])
        found = blocks(system)
        assert len(found) == len(read.slots), (found, read.slots)
        rows = []
        for block in found:
            probs = self.rule(block)
            rows.append({self.engine.token_id(label): math.log(p) if p > 0 else -math.inf
                         for label, p in zip(block.labels, probs, strict=True)})
        return rows


def pick(index_or_text: int | str, p: float = 0.9) -> Callable[[Block], list[float]]:
    """A rule part: probability `p` on one label (by index, or the label whose line starts
    with the given text), the rest shared evenly."""

    def rule(block: Block) -> list[float]:
        k = len(block.labels)
        if isinstance(index_or_text, int):
            at = index_or_text % k
        else:
            at = next(i for i, t in enumerate(block.texts) if t.startswith(index_or_text))
        return [p if i == at else (1 - p) / (k - 1) for i in range(k)]

    return rule


def by_instructions(table: dict[str, Callable[[Block], list[float]]]) -> Rule:
    """Dispatch on the block's instructions (the first key they start with)."""

    def rule(block: Block) -> list[float]:
        for start, part in table.items():
            if block.instructions.startswith(start):
                return part(block)
        raise AssertionError(f"no rule for {block.instructions!r}")

    return rule
