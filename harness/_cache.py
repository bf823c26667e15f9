"""The LangGraph cache key of a decision node: what it asks, what it reads, its gate.

`DecisionNode.cache_policy()` returns a LangGraph `CachePolicy` whose `key_func` is
`node_cache_key`: a SHA-256 of the node's name, its questions (resolved from the state
when they are a function of it), the decision state it reads (`inputs`, rendered as the
model sees it, images by digest), and the model's policy, name and constrained flag.
The rest of the graph state does not enter the key, so an unrelated key changing does
not cause a re-read; any change to what the node reads does.

LangGraph calls `key_func` with the node's input only, not its config: a run-scoped
`Runtime.context` override (`decision_model`, `gate`) is not part of the key. Do not
combine a node cache with per-run overrides. A hit replays the node's `Command`
(decisions and branch) without running it; LangGraph marks it in the `updates` stream
(`{"__metadata__": {"cached": True}}`), and no decide span is emitted.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from router import render_state
from router import image_digests, state_images

from ._context import select_inputs

if TYPE_CHECKING:
    from ._node import DecisionNode

__all__ = ["node_cache_key"]


def node_cache_key(node: DecisionNode, state: Any) -> str:
    """The cache key of `node` deciding on `state` (hex SHA-256)."""
    questions = node.questions(state) if callable(node.questions) else node.questions
    asked = {qid: q.model_dump(mode="json") if hasattr(q, "model_dump") else q for qid, q in questions.items()}
    decision_state = select_inputs(state, node.inputs, node.output_key)
    model = node.model
    blob = json.dumps([node.name, asked, render_state(decision_state),
                       list(image_digests(state_images(decision_state))), repr(model.policy), model.model,
                       model.constrained, repr(sorted((node.depends_on or {}).items()))], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
