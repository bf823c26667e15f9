"""Serving the app with uvicorn: connection bounds, slow request heads, bounded graceful shutdown.

uvicorn neither caps connections nor times out a request head that never completes (a
client dripping one header byte at a time keeps its socket for ever). `ConnectionLimits`
adds both, in a subclass of uvicorn's llhttp protocol: past `max_connections` a new
connection is answered 503 and closed at once; a head not complete within `head_timeout`
is answered 408 (or just closed, when nothing came) and closed. On shutdown, requests in
flight get `shutdown_timeout` seconds to finish, then a 503 `shutting_down` answer (the app's
`Drain`), and uvicorn cancels whatever is left a second later.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .limits import ConnectionLimits

__all__ = ["ConnectionLimits", "run_in_thread", "server"]


_REFUSED = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n")


def _refusal(status: int, reason: str, kind: str, message: str) -> bytes:
    body = b'{"error": {"type": "%s", "message": "%s", "code": %d}}' % (kind.encode(), message.encode(), status)
    return _REFUSED % (status, reason.encode(), len(body)) + body


def guarded_protocol(limits: ConnectionLimits, metrics: Any) -> type:
    """uvicorn's llhttp protocol with the connection cap and the head timeout."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    busy = _refusal(503, "Service Unavailable", "too_many_connections",
                    f"the server holds {limits.max_connections} connections; retry later")
    slow = _refusal(408, "Request Timeout", "head_timeout",
                    f"the request head did not arrive within {limits.head_timeout:g}s")

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_started = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                metrics.rejected("too_many_connections")
                transport.write(busy)
                transport.close()
                return
            metrics.connections.inc()
            self._counted = True
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if getattr(self, "_counted", False):
                self._counted = False
                metrics.connections.dec()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._head_started = True  # the first byte of a request: from now on a late head is a 408
            self._arm()  # (again, for the next request on a kept-alive connection)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._head_started = False
            super().on_headers_complete()

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(limits.head_timeout, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            metrics.rejected("head_timeout")
            if self._head_started:
                self.transport.write(slow)
            self.transport.close()

    return GuardedProtocol


def server(app: Any, *, host: str, port: int, limits: ConnectionLimits | None = None, log_level: str = "info",
           log_config: dict[str, Any] | None = None) -> Any:
    """A uvicorn server for `app` (from `create_app`) with `limits` and the app's drain on shutdown."""
    import uvicorn

    bounds = limits or ConnectionLimits()
    drain = app.state.drain

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            drain.begin(bounds.shutdown_timeout)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config,
                            access_log=False, http=guarded_protocol(bounds, app.state.metrics),
                            timeout_keep_alive=bounds.keep_alive,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=math.ceil(bounds.shutdown_timeout) + 1)
    return DrainingServer(config)


@contextmanager
def run_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                  limits: ConnectionLimits | None = None, startup_timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` with uvicorn on a background thread; yields the base URL.

    For tests and notebooks: `port=0` picks a free port. The server stops (gracefully, within
    `limits.shutdown_timeout`) when the block exits.

    Example:
        ```python
        with run_in_thread(create_app(model)) as url:
            SystemOneDecisionModel(url, model="tiny-dgemma").invoke(...)
        ```
    """
    served = server(app, host=host, port=port, limits=limits, log_level=log_level, log_config=None)
    thread = threading.Thread(target=served.run, name="canvasroute-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not served.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            served.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.01)
    bound = served.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        served.should_exit = True
        thread.join(timeout=30)
