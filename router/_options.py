"""A decision's options: the request keys `invoke` carries, and how its canvases are read.

`request_options` takes the keys beyond `state` and `questions` from a request (they reach
`adecide` through `REQUEST_OPTIONS`). Of those, `instructions` (context for every
question), `alone` (questions read in a canvas of their own), `steps` (denoising steps per
read, the template held), `think` (a thought the model writes before each canvas is read)
and `images` (image URLs sent with every read) shape the reads: checked once per decision
(`read_options`), with whether reads are constrained.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from canvasroute.engine import SPECIAL_CANDIDATES, DecisionError, defuse

from ._policy import GatePolicy
from ._questions import option_text

__all__ = ["MAX_STEPS", "MAX_THINK", "OPTION_KEYS", "READ_KEYS", "REQUEST_OPTIONS", "ReadOptions",
           "fixed_read_options", "read_options",
           "request_options"]

REQUEST_OPTIONS: ContextVar[Mapping[str, Any]] = ContextVar("canvasroute_request_options", default={})
"""Request keys beyond state and questions, from `invoke` to `_classify` (the hooks take only those two)."""
READ_KEYS = ("instructions", "alone", "steps", "think", "images")
"""The keywords that shape how the canvases are read (`read_options`)."""
OPTION_KEYS = ("seed", "thread_id", "policy", "attributes", "depends_on", "budget_meter", *READ_KEYS)


def request_options(request: Any) -> dict[str, Any]:
    """The request keys beyond state and questions; a malformed request is refused here."""
    if not isinstance(request, Mapping) or "state" not in request or "questions" not in request:
        raise DecisionError("a decision request is {'state': ..., 'questions': {...}}")
    return {k: request[k] for k in OPTION_KEYS if request.get(k) is not None}

def fixed_read_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Read options fixed by a graph node or edge (`READ_KEYS` only; values are checked per decision)."""
    if unknown := sorted(set(options or ()) - set(READ_KEYS)):
        raise ValueError(f"read_options takes {', '.join(READ_KEYS)}, not {', '.join(map(str, unknown))}")
    return dict(options or {})


MAX_STEPS = 8
"""Denoising steps one read may take (vLLM's gateway caps `steps` there too)."""
MAX_THINK = 4096
"""Tokens a thought may take (vLLM's gateway's cap)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOptions:
    """One decision's read settings (validated; `instructions` already defused)."""

    constrained: bool = False
    """Rows normalized over the request's label ids (no label mass)."""
    instructions: str = ""
    """Context for every question, at the head of each canvas's system prompt."""
    alone: frozenset[str] = frozenset()
    """Questions each read in a canvas of their own."""
    steps: int = 1
    """Denoising steps per read (the template pinned past the first)."""
    think: int = 0
    """Token budget of the thought written before each canvas is read (0: none)."""
    images: tuple[str, ...] = ()
    """Image URLs sent with every read (besides those in the state's messages)."""

    def key(self) -> str:
        """What in these settings changes a read (for the decision cache's key)."""
        return repr((self.constrained, self.instructions, sorted(self.alone), self.steps, self.think))


def read_options(specs: Mapping[str, Any], policy: GatePolicy, constrained: bool | None, *, instructions: Any = None,
                 alone: Collection[str] = (), steps: int = 1, think: int = 0, images: Sequence[str] = (),
                 special_tokens: Sequence[str] | None = None) -> ReadOptions:
    """Check the keywords against the decision's questions. `constrained`: the model's
    setting (None: constrained unless `policy` gates on label mass).

    Raises:
        DecisionError: an `alone` id that is not a question, `steps` outside 1..MAX_STEPS,
            `think` outside 0..MAX_THINK, or an image that is not a non-empty URL string.
    """
    if isinstance(alone, str) or not isinstance(alone, Collection):
        raise DecisionError(f"alone must be a collection of question ids, got {alone!r}")
    if unknown := sorted(set(alone) - set(specs)):
        raise DecisionError(f"alone names {unknown[:5]}, which are not among the questions")
    for name, value, low, top in (("steps", steps, 1, MAX_STEPS), ("think", think, 0, MAX_THINK)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise DecisionError(f"{name} must be an integer within {low}..{top}, got {value!r}")
    if isinstance(images, str) or not all(isinstance(u, str) and u for u in images):
        raise DecisionError("images must be a sequence of image URLs (data:image/...;base64,... or http(s))")
    text = "" if instructions in (None, "") else defuse(option_text(instructions), special_tokens or SPECIAL_CANDIDATES)
    constrained = not policy.uses_label_mass if constrained is None else constrained
    return ReadOptions(constrained=constrained, instructions=text.strip(), alone=frozenset(alone), steps=steps,
                       think=think, images=tuple(images))
