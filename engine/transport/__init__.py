"""How canvasroute's clients reach a server: one `Connection`, told by three small values.

- `Connection`: replicas, lanes of keep-alive HTTP/1.1 connections parsed by llhttp,
  retries, typed errors; `openai_options()` gives an OpenAI client the same settings.
- `Timeout`, `Limits`, `Retries`: frozen values with a docstring per field.
- `forward_headers`: headers every request inside a block carries (e.g. a caller's request id).

Modules: `_connection.py` (the whole way of a request), `_config.py` (the values),
`_origin.py` (URLs, proxies, TLS: worked out when a connection is made).
"""

from ._config import MAX_RESPONSE_BYTES, Limits, Retries, Timeout
from ._connection import Connection, Reply, forward_headers

__all__ = ["MAX_RESPONSE_BYTES", "Connection", "Limits", "Reply", "Retries", "Timeout", "forward_headers"]
