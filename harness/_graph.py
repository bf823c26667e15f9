"""What a decision node can tell about the graph running it: a checkpointer, its state keys.

Both are read from the step's config. A review lane pauses with `interrupt()`, which only a
graph compiled with a checkpointer can resume; a node's records go to its `output_key`,
which LangGraph drops without a word when the state schema has no such key.
"""

from __future__ import annotations

import warnings

from langchain_core.runnables import RunnableConfig
from langgraph.constants import CONF, CONFIG_KEY_CHECKPOINTER

from canvasroute.engine import GraphSetupError

__all__ = ["check_review", "has_checkpointer", "state_lacks", "warn_dropped"]

_READ = "__pregel_read"
"""The step's state reader in its config (LangGraph's `CONFIG_KEY_READ`; not public)."""


def has_checkpointer(config: RunnableConfig) -> bool:
    """Whether the running graph saves checkpoints (its own, or a parent graph's)."""
    return (config.get(CONF) or {}).get(CONFIG_KEY_CHECKPOINTER) is not None


def check_review(config: RunnableConfig, node: str) -> None:
    """Refuse a review lane that could never be resumed: no checkpointer (or no graph at all)."""
    if not has_checkpointer(config):
        raise GraphSetupError(f"decision node {node!r} has a review lane, but the graph has no checkpointer: "
                              "its interrupt() could never be resumed",
                              hint="compile with a checkpointer, e.g. builder.compile(checkpointer=InMemorySaver())")


def state_lacks(config: RunnableConfig, key: str) -> bool | None:
    """True when the running graph's state has no key `key`, False when it has, None when
    this cannot be told (outside a graph run, or a reader this LangGraph does not have)."""
    read = (config.get(CONF) or {}).get(_READ)
    if read is None:
        return None
    try:
        read(key, False)
    except KeyError:
        return True
    except Exception:  # a reader that works differently: no warning rather than a wrong one
        return None
    return False


def warn_dropped(node: str, key: str) -> None:
    """Say once that a node's records are dropped, and how to keep them."""
    warnings.warn(f"decision node {node!r} writes its records to the state key {key!r}, which the graph's state "
                  f"schema does not have: LangGraph drops them. Add `{key}: Annotated[dict, merge_decisions]` "
                  "to the state (or pass output_key= naming a key it has).", UserWarning, stacklevel=3)
