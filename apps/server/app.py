"""The decision server: `POST /v1/systemone` (the Jev wire) and `POST /v1/decisions` (OpenAI
Decisions) over one gated decision model.

Any Jev client (TypeSafe's `typesafe-sdk`, OpenJev clients, `SystemOneDecisionModel`)
can point its base URL here; `jev-latest` (the SDK's default `model`) is accepted and
answered by the served model. Requests and replies follow vLLM's own gateway
(`examples/features/structured_diffusion/` in vllm-project/vllm, and its OpenAPI): its
request keys (`samples`, `instructions`, `steps`, `think`, `ask`, `images` or a multipart
upload, per question `depends_on` / `ask_if` / `alone`: `extensions`), its status codes,
and its reply: the Jev fields, the fields the gateway adds (`probabilities` and
`confidence` on a noul; `id`, `object`, `created`), a `diagnostics` object (`diagnostics`),
and an `x_canvasroute` object per answer (entropy, path, reads, ...; System One's `x_` prefix
for fields its spec does not define) that plain clients ignore (its `path` and `cause`, in the
library's one outcome vocabulary). A question that
`ask_if` skipped has no answer (its reason is in `diagnostics.skipped`).

The `openai` SDK's `client.decisions.create` and langchain-openai's `OpenAIDecisions` can point
their base URL (`.../v1`) here too: `/v1/decisions` takes text, messages of every role (text and
image parts) and agent traffic (tool calls and their outputs), and answers in question order
(`wires.DecisionsWire`, `decisions`; `docs/decisions-wire.md`), with the same figures per answer
in a `canvasroute` object (OpenAI's types have no `x_` prefix). Both wires share everything
below; only reading, replying and error shapes differ.

Each request to a `CanvasDecisionModel` becomes one `DecisionRequest` (`model.request`: state,
questions, the gateway keys as `read`, `depends_on` and `gate`, seed, thread), built before a
slot is taken and run whole (`model.arun`). The model's `OutcomePolicy` is checked once, when
the app is built: an action HTTP cannot carry is refused there (`outcomes`).

A request costs the server nothing but a socket until its body has arrived (within
`Limits.body_timeout`) and passed every check in `parse` (`Limits`). Then it takes one of
`max_in_flight + max_queue` places (else 529 at once) and has `request_timeout` seconds to
be answered; a client that goes away has its work cancelled. Errors are
`{"error": {"type", "message", "code", "param"?}}` (plus FastAPI's `detail` list on
415/422), with a stable `type` and a short message; details go to the log and the span:

| status | when |
|---|---|
| 400 | a body that is not JSON (bad JSON, too deep, lone surrogates, NaN), or multipart without `request` |
| 401 | missing or wrong bearer key, when a key is configured |
| 408 | the body did not arrive within `body_timeout` |
| 413 | the body or the state is too large |
| 415 | not `application/json` or `multipart/form-data`, or an unknown content encoding |
| 422 | a field, question, feature or template that cannot be used (null state, Box, labels, bounds, unknown model) |
| 429 | over the request rate, or the escalation budget (or the cap on engine faults' escalations) is spent |
| 502 | the engine answered garbage or refused, or the escalation target failed (`--on-target-fault raise`) |
| 503 | the engine is unreachable (when the policy does not escalate), or the target's breaker is open (ditto) |
| 504 | the engine (or the whole decision) did not finish within `request_timeout` |
| 529 | every place is taken, no slot freed in time, or the engine itself shed load |

On `/v1/decisions` errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`: every
request error (400, 413, 415, 422 above) is a 400 naming its field, a model not served is a 404,
and the other statuses are kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from datetime import date
from typing import Any

from langchain_core.decisions import BaseDecisionModel
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from canvasroute.engine import forward_headers
from canvasroute.router import CanvasDecisionModel
from canvasroute.router import telemetry as tm

from .body import ClientGone, read_body
from .decisions import DecisionsWireError
from .gate import Drain, Gate, RateLimit
from .limits import Limits
from .logs import caller_request_id, request_scope
from .metrics import Metrics, MetricsMiddleware
from .openapi import openapi
from .outcomes import check_outcomes
from .wire import Refusal, from_exception
from .wires import DecisionsWire, Served, SystemOneWire, Wire

__all__ = ["JEV_ALIASES", "create_app"]

JEV_ALIASES = ("jev-latest",)
"""Model names Jev clients send by default (typesafe-sdk's `DEFAULT_MODEL`), served by the engine's model."""

# OpenTelemetry HTTP server semantic conventions (standard names, not canvasroute's own)
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"

log = logging.getLogger("canvasroute.server")
access = logging.getLogger("canvasroute.server.access")


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body was already read, so nothing else listens)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(work: Awaitable[Any], receive: Receive, drain: Drain) -> Any:
    """`await work`, cancelled (and awaited until it stops) if the client disconnects first,
    or answered 503 when a shutdown's grace period ends first."""
    task, gone, stop = (asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(receive)),
                        asyncio.ensure_future(drain.wait()))
    try:
        await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # the slot stays held until the work has really stopped
    if task.cancelled():
        if drain.expired:
            raise drain.refusal()
        raise ClientGone
    return task.result()


def create_app(
    model: BaseDecisionModel,
    *,
    api_key: str | None = None,
    max_in_flight: int = 64,
    max_queue: int = 256,
    request_timeout: float = 120.0,
    rate_limit: float | None = None,
    rate_burst: int | None = None,
    limits: Limits | None = None,
    max_body_bytes: int | None = None,
    aliases: Sequence[str] = JEV_ALIASES,
    refuse_unsure: bool = False,
    close_engine: bool = False,
) -> Starlette:
    """An ASGI app serving `model` at `POST /v1/systemone`, `POST /v1/decisions`, `GET /v1/models`,
    `GET /health`, `GET /metrics` (Prometheus) and `GET /openapi.json`. Serve it with
    `serving.server` or `run_in_thread` (they add the connection cap, the head timeout and the
    bounded shutdown), or any ASGI server.

    A caller's `X-Request-ID` (1-128 visible ASCII characters) is kept: logged with every record
    of the request, sent to the engine with each of its reads, returned; without one, the
    decision's `id` is the request id.

    Args:
        model: A `CanvasDecisionModel` (answers carry its read reports; each request is one
            `DecisionRequest`, its gateway keys applied over the model's gate), or any
            `BaseDecisionModel`. A canvas model's `OutcomePolicy` must be one a server can honour
            (`outcomes.SERVED`: no `review`, no `raise` for uncertain, no `fallback`).
        api_key: When set, `/v1/*` needs `Authorization: Bearer <api_key>` (else 401).
            `/health`, `/metrics` and `/openapi.json` stay open.
        max_in_flight: Decisions running at once (both wires together).
        max_queue: Requests allowed to wait for a running slot; beyond it, 529 at once.
        request_timeout: Seconds from admission to answer (queue wait included).
        rate_limit: Requests per second over all clients (None: no limit; over it, 429).
        rate_burst: Bucket size for `rate_limit` (default: one second's worth).
        limits: Bounds on what one request may carry (default `Limits()`), on both wires.
        max_body_bytes: Shorthand for `limits.max_body_bytes`.
        aliases: Other names accepted in the request's `model`, answered by the served
            model (default: `jev-latest`, what Jev clients send).
        refuse_unsure: On `/v1/decisions`, answer a question on path `unsure` (the gate did not
            pass it and nothing answered it instead) with a `refusal` (default: the canvas's best
            option, as `/v1/systemone` answers it). A question the escalation target refused is
            a refusal either way.
        close_engine: Close the model's engine when the app shuts down.

    Raises:
        ValueError: a bound out of range, or an outcome the wire cannot carry (naming the
            `OutcomePolicy` field).

    Example:
        ```python
        app = create_app(CanvasDecisionModel(engine=VLLMServerEngine(url)), api_key="secret")
        uvicorn.run(app, port=8000)
        ```
    """
    if max_in_flight < 1 or max_queue < 0:
        raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
    if request_timeout <= 0:
        raise ValueError("request_timeout must be positive")
    if rate_limit is not None and rate_limit <= 0:
        raise ValueError("rate_limit must be > 0 requests per second")
    canvas = model if isinstance(model, CanvasDecisionModel) else None
    if canvas is not None:  # before anything is served: an outcome the wire cannot carry is refused here
        check_outcomes(canvas.outcomes, canvas.policy, canvas.escalation is not None)
    limits = limits or Limits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    aliases = tuple(dict.fromkeys(aliases))
    gate = Gate(max_in_flight, max_queue)
    metrics, drain = Metrics(gate, canvas), Drain()
    limiter = RateLimit(rate_limit, rate_burst or max(1, round(rate_limit))) if rate_limit else None
    key = api_key.encode() if api_key else None
    started = int(time.time())
    today = date.today().isoformat()
    description = openapi(limits)
    served = Served(model, canvas, limits, aliases)

    def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(errors="replace"), key):
            raise Refusal(401, "authentication_error", "missing or invalid API key; send "
                          "'Authorization: Bearer <key>'", headers={"www-authenticate": "Bearer"})

    def endpoint(wire: Wire) -> Any:
        async def decide(request: Request) -> Response:
            decision_id = f"decision-{uuid.uuid4().hex}"
            request_id = caller_request_id(request.headers.get("x-request-id")) or decision_id
            started = time.perf_counter()
            with request_scope(request_id), forward_headers({"x-request-id": request_id}):
                response = await traced(wire, request, decision_id, request_id)
            access.info("POST %s %d %.1f ms (request %s)", request.url.path[:200], response.status_code,
                        (time.perf_counter() - started) * 1000, request_id,
                        extra={"request_id": request_id, "status": response.status_code, "decision_id": decision_id,
                               "duration_ms": round((time.perf_counter() - started) * 1000, 2)})
            return response
        return decide

    async def traced(wire: Wire, request: Request, decision_id: str, request_id: str) -> Response:
        attrs = {HTTP_METHOD: "POST", HTTP_ROUTE: wire.route, URL_PATH: request.url.path}
        tracer = trace.get_tracer("canvasroute.server")
        with tracer.start_as_current_span(f"POST {wire.route}", context=propagate.extract(request.headers),
                                          kind=SpanKind.SERVER, attributes=attrs,
                                          record_exception=False, set_status_on_exception=False) as span:
            try:
                payload = await answer(wire, request, decision_id, request_id, span)
                response: Response = JSONResponse(payload, headers={"x-request-id": request_id})
            except ClientGone:
                log.info("request %s: the client disconnected before its answer; its work (if any) was cancelled",
                         request_id)
                span.set_attribute(tm.ERROR_TYPE, "client_disconnected")
                return Response(status_code=499)  # nobody reads it
            except Exception as exc:
                known = exc if isinstance(exc, (Refusal, DecisionsWireError)) else from_exception(exc)
                if known is not exc:
                    log.error("request %s: unexpected %s", request_id, type(exc).__name__, exc_info=exc)
                    span.record_exception(exc)
                response, kind = wire.error(known, request_id)
                metrics.refused(response.status_code, kind)
                span.set_attribute(tm.ERROR_TYPE, kind)
                if response.status_code >= 500:
                    span.set_status(Status(StatusCode.ERROR, kind))
            span.set_attribute(HTTP_STATUS, response.status_code)
            return response

    async def answer(wire: Wire, request: Request, decision_id: str, request_id: str,
                     span: trace.Span) -> dict[str, Any]:
        if drain.draining:
            raise drain.refusal()
        authorize(request)
        if limiter is not None:
            limiter.take()
        parsed = wire.read(await read_body(request, limits), request.headers.get("content-type"))  # no slot yet
        ids = wire.ids(parsed)
        span.set_attribute(tm.QUESTIONS, len(ids))
        with gate.admission():
            resp, name = await _unless_gone(admitted(wire, parsed, ids, request_id, span), request.receive, drain)
        metrics.decided(getattr(resp, "reads", None) or {}, getattr(getattr(resp, "diagnostics", None), "hedges", ()))
        return await wire.reply(parsed, resp, name, decision_id)

    async def admitted(wire: Wire, parsed: Any, ids: Sequence[str], request_id: str,
                       span: trace.Span) -> tuple[Any, str]:
        waiting = False
        deadline = asyncio.timeout(request_timeout)
        try:
            async with deadline:
                name = await served.name()
                wire.check_model(parsed, name)
                span.set_attribute(tm.DECISION_SET, ",".join(ids))
                job = wire.job(parsed)
                waiting, queued = True, time.perf_counter()
                async with gate.slot():
                    waiting = False
                    metrics.queue_wait.observe(time.perf_counter() - queued)
                    return await wire.decide(parsed, job), name
        except (Refusal, DecisionsWireError):
            raise
        except Exception as exc:  # every fault becomes a typed answer; details to the log
            if isinstance(exc, TimeoutError) and deadline.expired():
                if waiting:
                    raise Refusal(529, "overloaded", f"no slot freed within {request_timeout:g}s; retry later",
                                  headers={"retry-after": "1"}) from exc
                raise Refusal(504, "timeout", f"the decision took over {request_timeout:g}s") from exc
            refusal = from_exception(exc)
            level = {500: logging.ERROR}.get(refusal.status, logging.WARNING if refusal.status >= 500 else logging.INFO)
            log.log(level, "request %s: %s (%s): %s", request_id, refusal.kind, type(exc).__name__, exc,
                    exc_info=exc if refusal.status == 500 else None)
            span.record_exception(exc)
            raise refusal from exc

    async def models(request: Request) -> JSONResponse:
        try:
            authorize(request)
            name = await asyncio.wait_for(served.name(), request_timeout)
        except Refusal as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001
            log.warning("/v1/models: the engine is not ready: %s: %s", type(exc).__name__, exc)
            return (from_exception(exc) if not isinstance(exc, TimeoutError) else
                    Refusal(504, "timeout", "the engine did not answer in time")).response()
        names = [name, *(a for a in aliases if a != name)]
        return JSONResponse({
            "object": "list",
            "data": [{"id": n, "object": "model", "created": started, "owned_by": "canvasroute", "root": name}
                     for n in names],
            # the Jev shape; release_date is the day this server started serving it
            "models": [{"name": n, "description": f"canvasroute gated canvas reads on {name}",
                        "release_date": today} for n in names],
        })

    async def health(request: Request) -> JSONResponse:
        load = gate.snapshot()
        try:
            name = await asyncio.wait_for(served.name(), 5.0)
        except Exception as exc:  # noqa: BLE001 - health reports, never raises; details only to the log
            log.warning("/health: the engine is not ready: %s: %s", type(exc).__name__, exc)
            return JSONResponse({"status": "unavailable", "error": "engine_unavailable", **load}, status_code=503)
        return JSONResponse({"status": "ok", "model": name, **load})

    async def spec(request: Request) -> JSONResponse:
        return JSONResponse(description)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return Refusal(status, kind, f"{request.method} {request.url.path[:200]}: {getattr(exc, 'detail', '')}",
                       headers=getattr(exc, "headers", None)).response()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(served.name(), 30.0)  # warm up: learn the model before traffic
        except Exception as exc:  # noqa: BLE001 - the engine may come up after the server
            log.warning("engine not ready at startup: %s", exc)
        yield
        live = canvas.escalation.audit_state if canvas is not None and canvas.escalation is not None else None
        if live is not None:
            await live.aclose()  # audits still in the background: cancelled, their rows dropped
        engine = getattr(model, "engine", None)
        if close_engine and engine is not None:
            await engine.aclose()

    wires: list[Wire] = [SystemOneWire(served), DecisionsWire(served, metrics, refuse_unsure=refuse_unsure)]
    app = Starlette(
        routes=[*(Route(w.route, endpoint(w), methods=["POST"]) for w in wires),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/metrics", metrics.endpoint, methods=["GET"]),
                Route("/openapi.json", spec, methods=["GET"])],
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(MetricsMiddleware, metrics=metrics)],
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # a redirect is built from the Host header, which the client forges
    app.state.gate = gate
    app.state.model = model
    app.state.limits = limits
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.refuse_unsure = refuse_unsure
    return app
