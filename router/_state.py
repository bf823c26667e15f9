"""The state as the model sees it: prompt text (defused), and the noise seed it implies."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from canvasroute.engine import SPECIAL_CANDIDATES, defuse

from ._plan import Plan

__all__ = ["default_seed", "json_default", "render_state"]


def render_state(state: Any, special_tokens: Sequence[str] | None = None) -> str:
    """The user message: a string as is, messages as a transcript, anything else as JSON.

    Every special-token text of the engine's tokenizer (`EngineInfo.special_tokens`;
    default: the texts `engine` probes servers for) is defused with a zero-width space, so
    a state cannot close the turn or forge template tokens.
    """
    if isinstance(state, str):
        text = state
    elif isinstance(state, BaseMessage):
        text = f"{state.type}: {state.text}"
    elif isinstance(state, Sequence) and state and all(isinstance(m, BaseMessage) for m in state):
        text = "\n".join(f"{m.type}: {m.text}" for m in state)
    else:
        text = json.dumps(state, ensure_ascii=False, default=json_default, sort_keys=False)
    return defuse(text, special_tokens or SPECIAL_CANDIDATES)


def json_default(value: Any) -> Any:
    if isinstance(value, BaseMessage):
        return {"role": value.type, "content": value.text}
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    raise TypeError(f"state holds a {type(value).__name__}, which is not JSON")


def default_seed(state_text: str, the_plan: Plan) -> int:
    blob = state_text + "\x00" + "\x00".join(c.system for c in the_plan.chunks)
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "big")
