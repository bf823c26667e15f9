"""`retry_on`: the LangGraph retry predicate for decision nodes, and who owns retries.

Inside a graph one layer retries a fault, never two (their attempts would multiply).
A canvas read's transient faults belong to the engine: `VLLMServerEngine` retries each
request itself (`max_retries=3`: at most 4 attempts, with backoff, jitter, `Retry-After`
and failover to another replica), and the error that leaves it carries those `attempts`.
`retry_on` does not retry such an error again, so a node whose engine keeps answering
503 costs exactly `max_retries + 1` requests, whatever the node's `RetryPolicy.max_attempts`.
To give the retries to LangGraph instead, build the engine with `max_retries=0`: each node
attempt then makes one request. An escalation target that retries itself (a `max_retries`
above 0, as `ChatOpenAI` has by default) owns its retries the same way.

LangGraph's default (`RetryPolicy().retry_on`) retries `ConnectionError`, 5xx
`httpx.HTTPStatusError`/`requests.HTTPError`, and any exception it does not list; it
skips `ValueError`, `TypeError`, `ArithmeticError`, `ImportError`, `LookupError`,
`NameError`, `SyntaxError`, `RuntimeError`, `ReferenceError`, `StopIteration`,
`StopAsyncIteration` and `OSError`. For canvasroute errors that is wrong both ways (a
malformed engine answer, a spent budget or a garbled escalation would be retried), so
`retry_on` decides every canvasroute error by its `retryable` flag (set per class in
`canvasroute.engine.errors`) and its `attempts`, and leaves other exceptions to LangGraph's
default.
"""

from __future__ import annotations

from langgraph.types import RetryPolicy

from canvasroute.engine.errors import CanvasRouteError

_DEFAULT = RetryPolicy().retry_on


def retry_on(exc: Exception) -> bool:
    """Whether LangGraph should retry a node that raised `exc`: a transient canvasroute
    fault that no lower layer has retried already (`exc.attempts == 1`).

    Example:
        ```python
        builder.add_node("triage", node, retry_policy=RetryPolicy(retry_on=retry_on))
        ```
    """
    if isinstance(exc, CanvasRouteError):
        return exc.retryable and exc.attempts <= 1
    return bool(_DEFAULT(exc)) if callable(_DEFAULT) else False
