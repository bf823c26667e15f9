"""How a `Connection` behaves: small frozen values, in the spirit of `httpx.Timeout` and `httpx.Limits`.

```python
Connection("http://127.0.0.1:8000", timeout=Timeout(read=120, connect=2), retries=Retries(max_retries=0),
           limits=Limits(max_concurrency=16))
```

A plain number stands for the common case: `timeout=60` is `Timeout(read=60)`, `retries=0` is
`Retries(max_retries=0)`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_RESPONSE_BYTES", "Limits", "Retries", "Timeout"]

MAX_RESPONSE_BYTES = 32 << 20
"""Default cap on one reply, raw and decoded (32 MiB; a read of 64 rows x 128 labels is ~1 MiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeout:
    """How long one attempt may take: opening a connection, then the exchange.

    An attempt as a whole is bounded by `total` (`read + connect`), so a trickling reply or a
    custom transport cannot outlast it. Past either bound the attempt is an `EngineTimeout`
    (retried like any transient fault).
    """

    read: float = 30.0
    """Seconds from writing a request to the last byte of its reply."""
    connect: float = 5.0
    """Seconds to open a connection (TCP and TLS)."""

    def __post_init__(self) -> None:
        if not (self.read > 0 and self.connect > 0):
            raise ValueError(f"timeouts must be > 0 seconds, got read={self.read!r}, connect={self.connect!r}")

    @property
    def total(self) -> float:
        """Seconds one attempt may take as a whole."""
        return self.read + self.connect


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """How much one connection holds at once."""

    max_concurrency: int = 64
    """Requests in flight per event loop; more wait for a slot. Each holds one keep-alive
    connection per replica while it runs."""
    keepalive_expiry: float = 4.0
    """Seconds an idle connection is kept for reuse (below uvicorn's 5 s keep-alive, so the
    server never closes one just as it is reused)."""
    max_response_bytes: int = MAX_RESPONSE_BYTES
    """Cap on one reply, raw and decoded; past it, `EngineResponseError` (never retried)."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.keepalive_expiry < 0 or self.max_response_bytes < 1:
            raise ValueError("Limits: max_concurrency must be >= 1, keepalive_expiry >= 0 and max_response_bytes >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Retries:
    """What happens after a transient fault (connection error, timeout, 408, 429, 5xx, 529).

    The next attempt waits `backoff * 2**n` seconds (with jitter, x0.5-1.5), or what the
    server's `Retry-After` asks (capped at 30 s), and goes to the next healthy replica.
    A request the server may have received is sent again only by a retry counted here.
    """

    max_retries: int = 3
    """Attempts after the first; 0: every request is sent at most once."""
    backoff: float = 0.2
    """Seconds before the first retry, doubled per retry."""
    replica_cooldown: float = 5.0
    """Seconds a replica that failed to connect, hung up or timed out is skipped."""

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff < 0 or self.replica_cooldown < 0:
            raise ValueError("Retries: max_retries, backoff and replica_cooldown must be >= 0")
