"""`retry_on`: the LangGraph retry predicate for decision nodes.

LangGraph's default (`RetryPolicy().retry_on`) retries `ConnectionError`, 5xx
`httpx.HTTPStatusError`/`requests.HTTPError`, and any exception it does not list; it
skips `ValueError`, `TypeError`, `ArithmeticError`, `ImportError`, `LookupError`,
`NameError`, `SyntaxError`, `RuntimeError`, `ReferenceError`, `StopIteration`,
`StopAsyncIteration` and `OSError`. For canvasroute errors that is wrong both ways (a
malformed engine answer, a spent budget or a garbled escalation would be retried), so
`retry_on` decides every canvasroute error by its `retryable` flag (set per class in
`canvasroute.engine.errors`) and leaves other exceptions to LangGraph's default.
"""

from __future__ import annotations

from langgraph.types import RetryPolicy

from canvasroute.engine.errors import CanvasRouteError

_DEFAULT = RetryPolicy().retry_on


def retry_on(exc: Exception) -> bool:
    """Whether LangGraph should retry a node that raised `exc`.

    Example:
        ```python
        builder.add_node("triage", node, retry_policy=RetryPolicy(retry_on=retry_on))
        ```
    """
    if isinstance(exc, CanvasRouteError):
        return exc.retryable
    return bool(_DEFAULT(exc)) if callable(_DEFAULT) else False
