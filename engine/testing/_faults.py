"""Fault-injection transports: HTTP faults in front of any server, for the engine's callers' tests."""

from __future__ import annotations

import asyncio
from collections.abc import Container

import httpx


class SleepingTransport(httpx.AsyncBaseTransport):
    """Never answers: sleeps far past the request's read timeout. Like httpcore's network
    backends it enforces that timeout (httpx leaves timeouts to the transport), raising
    `httpx.ReadTimeout` when it expires."""

    def __init__(self) -> None:
        self.requests = 0
        """Requests received."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        timeout = request.extensions.get("timeout", {}).get("read") or 3600
        try:
            await asyncio.wait_for(asyncio.sleep(3600), timeout)
        except TimeoutError:
            raise httpx.ReadTimeout("timed out", request=request) from None
        raise AssertionError("unreachable")


class FailingPaths(httpx.AsyncBaseTransport):
    """Forwards requests to `inner` (a real server by default), except those to `paths`:
    they get HTTP `status` with `message` in vLLM's error body, or (`status=None`) a
    `SleepingTransport` timeout.

    Example:
        ```python
        reads_fail = FailingPaths({"/v1/chat/completions"}, status=500)  # discovery still works
        engine = VLLMServerEngine(Connection(url, transport=reads_fail))
        ```
    """

    def __init__(self, paths: Container[str], *, status: int | None = 500, message: str = "injected fault",
                 inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.paths = paths
        self.status = status
        self.message = message
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.failed = 0
        """Requests that got the fault."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.paths:
            self.failed += 1
            if self.status is not None:
                return httpx.Response(self.status, json={"error": {"message": self.message, "code": self.status}})
            await SleepingTransport().handle_async_request(request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
