"""The decision server: `POST /v1/systemone` (the Jev wire) over a gated decision model.

Any Jev client (TypeSafe's `typesafe-sdk`, OpenJev clients, `SystemOneDecisionModel`)
can point its base URL here. Answers carry the Jev fields, the fields vLLM's own
gateway adds (`probabilities` and `confidence` on a noul; `id`, `object`, `created` on
the response), and a `canvasroute` object per answer (entropy, path, reads, ...) that
plain clients ignore.

Load is bounded: at most `max_in_flight` decisions run, at most `max_queue` more wait
(their bodies are capped at `max_body_bytes`), and anything beyond is answered 529 at
once. Errors are `{"error": {"type", "message", "code"}}`:

| status | when |
|---|---|
| 400 | a question that cannot be asked (Box, empty options, labels, too long) |
| 401 | missing or wrong bearer key, when a key is configured |
| 404 | a `model` this server does not serve |
| 413 / 415 | a body too large / in an unknown content encoding |
| 422 | a malformed field |
| 429 | over the request rate, or the escalation budget is spent |
| 502 | the escalation target or the engine answered garbage or refused |
| 503 | the engine is unavailable (when the model's policy does not escalate) |
| 504 | the decision did not finish within `request_timeout` |
| 529 | the queue is full, or the engine itself is overloaded |
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import date
from typing import Any

from langchain_core.decisions import BaseDecisionModel, Choice, Noul, Score
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine import (
    CanvasRouteError,
    DecisionError,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    InputTooLong,
    LabelError,
    UnsupportedQuestion,
)
from engine import BudgetExhausted, EscalationError
from router import telemetry as tm

__all__ = ["create_app", "run_in_thread"]

# OpenTelemetry HTTP server semantic conventions (standard names, not canvasroute's own)
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"

log = logging.getLogger("canvasroute.server")
_QUESTION_TYPES = {"noul": Noul, "choice": Choice, "score": Score}
_QUESTION_KEYS = {"type", "instructions", "criteria"}
_MEDIA_FIELDS = ("assets", "images", "audio", "videos")


class _HTTPError(Exception):
    """An error answer: status, wire type, message, and optional headers."""

    def __init__(self, status: int, kind: str, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param
        self.headers = dict(headers or {})

    def response(self, request_id: str | None = None) -> JSONResponse:
        error: dict[str, Any] = {"type": self.kind, "message": self.message, "code": self.status}
        if self.param is not None:
            error["param"] = self.param
        headers = {**self.headers, **({"x-request-id": request_id} if request_id else {})}
        return JSONResponse({"error": error}, status_code=self.status, headers=headers)


def _from_exception(exc: BaseException) -> _HTTPError:
    """The answer for an exception raised while deciding."""
    retry = {"retry-after": "1"}
    message = str(exc)
    if isinstance(exc, UnsupportedQuestion):
        return _HTTPError(400, "unsupported_question", message)
    if isinstance(exc, LabelError):
        return _HTTPError(400, "label_error", message)
    if isinstance(exc, InputTooLong):
        return _HTTPError(400, "input_too_long", message)
    if isinstance(exc, DecisionError):
        return _HTTPError(400, "invalid_question", message)
    if isinstance(exc, BudgetExhausted):
        return _HTTPError(429, "escalation_budget_exhausted", message, headers=retry)
    if isinstance(exc, EngineOverloaded):
        return _HTTPError(529, "engine_overloaded", message, headers=retry)
    if isinstance(exc, EngineTimeout):
        return _HTTPError(503, "engine_timeout", message, headers=retry)
    if isinstance(exc, EngineUnavailable):
        return _HTTPError(503, "engine_unavailable", message, headers=retry)
    if isinstance(exc, EscalationError):
        return _HTTPError(502, "escalation_failed", message)
    if isinstance(exc, (EngineRequestError, EngineResponseError)):
        return _HTTPError(502, "engine_error", message)
    if isinstance(exc, CanvasRouteError):
        return _HTTPError(500, "internal_error", message)
    return _HTTPError(500, "internal_error", f"{type(exc).__name__}: {exc}")


# -- load control ----------------------------------------------------------------------


class _Gate:
    """Admission (running + waiting <= capacity) and a semaphore for running work."""

    def __init__(self, max_in_flight: int, max_queue: int) -> None:
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.admitted = 0
        """Requests holding a place: running or waiting for a slot."""
        self.running = 0
        self.peak_admitted = 0
        self.peak_running = 0
        self.rejected = 0
        self._slots: asyncio.Semaphore | None = None

    def snapshot(self) -> dict[str, int]:
        return {"in_flight": self.running, "queued": self.admitted - self.running,
                "max_in_flight": self.max_in_flight, "max_queue": self.max_queue,
                "peak_in_flight": self.peak_running, "peak_admitted": self.peak_admitted,
                "rejected": self.rejected}

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Hold a place, or raise 529 at once when every place is taken."""
        if self.admitted >= self.max_in_flight + self.max_queue:
            self.rejected += 1
            raise _HTTPError(529, "overloaded", f"the server is at capacity ({self.max_in_flight} running, "
                             f"{self.max_queue} queued); retry later", headers={"retry-after": "1"})
        self.admitted += 1
        self.peak_admitted = max(self.peak_admitted, self.admitted)
        try:
            yield
        finally:
            self.admitted -= 1

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for one of `max_in_flight` slots."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        async with self._slots:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            try:
                yield
            finally:
                self.running -= 1


class _RateLimit:
    """A token bucket: `rate` requests per second, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            wait = (1 - self.tokens) / self.rate
            raise _HTTPError(429, "rate_limit_exceeded", f"over {self.rate:g} requests per second",
                             headers={"retry-after": str(max(1, round(wait)))})
        self.tokens -= 1


# -- request parsing -------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, decoded, refused past `limit` bytes (before and after decoding)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _HTTPError(413, "payload_too_large", f"the body is over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _HTTPError(413, "payload_too_large", f"the body is over {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    decoder = _DECODERS.get(encoding)
    if decoder is None:
        raise _HTTPError(415, "unsupported_media_type", f"content-encoding {encoding!r} is not supported; "
                         f"send {', '.join(['identity', *_DECODERS])}")
    try:
        out = decoder(body, limit + 1)
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's bad body
        raise _HTTPError(422, "invalid_body", f"the {encoding} body could not be decoded: {exc}") from exc
    if len(out) > limit:
        raise _HTTPError(413, "payload_too_large", f"the decoded body is over {limit} bytes")
    return out


def _gunzip(data: bytes, max_length: int) -> bytes:
    return zlib.decompressobj(wbits=31).decompress(data, max_length)


_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {"gzip": _gunzip}
try:  # zstd (what typesafe-sdk sends when zstd is available): Python 3.14+ or backports.zstd
    try:
        from compression.zstd import ZstdDecompressor  # type: ignore[import-not-found]
    except ImportError:
        from backports.zstd import ZstdDecompressor  # type: ignore[import-not-found,no-redef]

    _DECODERS["zstd"] = lambda data, max_length: ZstdDecompressor().decompress(data, max_length)
except ImportError:
    pass


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A validated `/v1/systemone` request."""

    model: str | None
    state: Any
    questions: dict[str, Any]
    seed: int | None
    thread_id: str | None


def _malformed(param: str, message: str) -> _HTTPError:
    return _HTTPError(422, "invalid_request", f"{param}: {message}", param=param)


def _is_content(value: Any) -> bool:
    return value is None or isinstance(value, (str, dict, list))


def _parse_request(body: bytes) -> _Parsed:
    """Shape checks (422) first, then what cannot be asked (400)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _HTTPError(422, "invalid_json", f"the body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise _HTTPError(422, "invalid_request", "the body must be a JSON object")
    for name in ("state", "questions"):
        if name not in data:
            raise _malformed(name, "field required")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _malformed("model", "must be a string")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise _malformed("seed", "must be a non-negative integer")
    thread_id = data.get("thread_id")
    if thread_id is not None and not isinstance(thread_id, str):
        raise _malformed("thread_id", "must be a string")
    raw_questions = data["questions"]
    if not isinstance(raw_questions, dict) or not raw_questions:
        raise _malformed("questions", "must be a non-empty object of question id to question")
    shaped = {qid: _shape_question(qid, q) for qid, q in raw_questions.items()}
    for name in _MEDIA_FIELDS:
        if data.get(name):
            raise _HTTPError(400, "unsupported_media", f"{name}: this server reads text and JSON state only",
                             param=name)
    if data.get("instructions"):
        raise _HTTPError(400, "unsupported_field", "instructions: put request-wide context in the state",
                         param="instructions")
    questions: dict[str, Any] = {}
    for qid, q in shaped.items():
        if q["type"] == "box":
            raise _HTTPError(400, "unsupported_question", f"question {qid!r}: Box questions have no canvas form; "
                             "ask Noul, Choice or Score questions", param=f"questions.{qid}")
        try:
            questions[qid] = _QUESTION_TYPES[q["type"]].model_validate(q)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise _HTTPError(400, "invalid_question", f"question {qid!r} cannot be asked: {problems}",
                             param=f"questions.{qid}") from exc
    return _Parsed(model, data["state"], questions, seed, thread_id)


def _shape_question(qid: str, q: Any) -> dict[str, Any]:
    where = f"questions.{qid}"
    if not qid:
        raise _malformed("questions", "question ids must be non-empty")
    if not isinstance(q, dict):
        raise _malformed(where, "must be an object with 'type', 'instructions' and 'criteria'")
    kind = q.get("type")
    if kind not in ("noul", "choice", "score", "box"):
        raise _malformed(f"{where}.type", f"must be 'noul', 'choice', 'score' or 'box', not {kind!r}")
    if unknown := sorted(set(q) - _QUESTION_KEYS):
        raise _malformed(where, f"unknown field(s) {unknown}")
    if not _is_content(q.get("instructions")):
        raise _malformed(f"{where}.instructions", "must be text, a JSON object or a JSON array")
    criteria = q.get("criteria")
    if kind == "noul" and criteria is not None and (not isinstance(criteria, dict)
                                                    or not set(criteria) <= {"true", "false"}):
        raise _malformed(f"{where}.criteria", "a noul's criteria is an object with 'true' and/or 'false'")
    if kind == "choice" and not isinstance(criteria, dict):
        raise _malformed(f"{where}.criteria", "a choice's criteria is an object of option name to description")
    if kind == "score" and not isinstance(criteria, list):
        raise _malformed(f"{where}.criteria", "a score's criteria is an ordered list of level descriptions")
    shaped = {"type": kind, "instructions": q.get("instructions") or ""}
    if criteria is not None and kind != "box":
        shaped["criteria"] = criteria
    return shaped


# -- answers ---------------------------------------------------------------------------

_EXTENSION_FIELDS = ("path", "confident", "entropy", "normalized_entropy", "margin", "label_mass", "confidence",
                     "reads", "agreement", "stderr", "crossed", "canvas_probabilities", "labels",
                     "escalation_model", "over_budget", "error")


def _answer_json(answer: Any, report: Any) -> dict[str, Any]:
    out = answer.model_dump(mode="json")
    if out["type"] == "noul":  # vLLM's gateway also reports these for a noul
        p = out["noul"]
        out["probabilities"] = {"yes": p, "no": 1.0 - p}
        out["confidence"] = max(p, 1.0 - p)
    if report is not None:
        figures = report.model_dump(mode="json")
        out["canvasroute"] = {k: figures[k] for k in _EXTENSION_FIELDS}
    return out


# -- the app ---------------------------------------------------------------------------


def create_app(
    model: BaseDecisionModel,
    *,
    api_key: str | None = None,
    max_in_flight: int = 64,
    max_queue: int = 256,
    request_timeout: float = 120.0,
    rate_limit: float | None = None,
    rate_burst: int | None = None,
    max_body_bytes: int = 1 << 20,
    aliases: Sequence[str] = (),
    close_engine: bool = False,
) -> Starlette:
    """An ASGI app serving `model` at `POST /v1/systemone`, `GET /v1/models`, `GET /health`.

    Args:
        model: A `CanvasDecisionModel` (answers carry its read reports), or any
            `BaseDecisionModel`.
        api_key: When set, `/v1/*` needs `Authorization: Bearer <api_key>` (else 401).
            `/health` stays open for probes.
        max_in_flight: Decisions running at once.
        max_queue: Requests allowed to wait for a running slot; beyond it, 529 at once.
        request_timeout: Seconds from admission to answer (queue wait included).
        rate_limit: Requests per second over all clients (None: no limit; over it, 429).
        rate_burst: Bucket size for `rate_limit` (default: one second's worth).
        max_body_bytes: Largest request body, raw and decoded (else 413).
        aliases: Extra names accepted in the request's `model` (e.g. `jev-latest`).
        close_engine: Close the model's engine when the app shuts down.

    Example:
        ```python
        app = create_app(CanvasDecisionModel(engine=VLLMServerEngine(url)), api_key="secret")
        uvicorn.run(app, port=8000)
        ```
    """
    if max_in_flight < 1 or max_queue < 0:
        raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
    if request_timeout <= 0 or max_body_bytes < 1:
        raise ValueError("request_timeout and max_body_bytes must be positive")
    if rate_limit is not None and rate_limit <= 0:
        raise ValueError("rate_limit must be > 0 requests per second")
    gate = _Gate(max_in_flight, max_queue)
    limiter = _RateLimit(rate_limit, rate_burst or max(1, round(rate_limit))) if rate_limit else None
    key = api_key.encode() if api_key else None
    started = int(time.time())
    today = date.today().isoformat()

    def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise _HTTPError(401, "authentication_error", "missing or invalid API key; send "
                             "'Authorization: Bearer <key>'", headers={"www-authenticate": "Bearer"})

    async def served_name() -> str:
        engine = getattr(model, "engine", None)
        return (await engine.info()).model if engine is not None else model.model

    async def decide(parsed: _Parsed) -> tuple[Any, dict[str, Any]]:
        if hasattr(model, "decide"):
            resp = await model.decide(parsed.state, parsed.questions, seed=parsed.seed, thread_id=parsed.thread_id)
        else:
            resp = await model.ainvoke({"state": parsed.state, "questions": parsed.questions})
        return resp, getattr(resp, "reads", {}) or {}

    async def systemone(request: Request) -> JSONResponse:
        request_id = f"decision-{uuid.uuid4().hex}"
        attrs = {HTTP_METHOD: "POST", HTTP_ROUTE: "/v1/systemone", URL_PATH: request.url.path}
        tracer = trace.get_tracer("canvasroute.server")
        with tracer.start_as_current_span("POST /v1/systemone", context=propagate.extract(request.headers),
                                          kind=SpanKind.SERVER, attributes=attrs,
                                          record_exception=False, set_status_on_exception=False) as span:
            try:
                payload = await answer(request, request_id, span)
                response = JSONResponse(payload, headers={"x-request-id": request_id})
            except _HTTPError as exc:
                response = exc.response(request_id)
                span.set_attribute(tm.ERROR_TYPE, exc.kind)
                if exc.status >= 500:
                    span.set_status(Status(StatusCode.ERROR, exc.message))
            span.set_attribute(HTTP_STATUS, response.status_code)
            return response

    async def answer(request: Request, request_id: str, span: trace.Span) -> dict[str, Any]:
        authorize(request)
        if limiter is not None:
            limiter.take()
        with gate.admission():
            body = await _read_body(request, max_body_bytes)
            parsed = _parse_request(body)
            span.set_attribute(tm.QUESTIONS, len(parsed.questions))
            span.set_attribute(tm.DECISION_SET, ",".join(parsed.questions))
            running = False
            deadline = asyncio.timeout(request_timeout)
            try:
                async with deadline:
                    name = await served_name()
                    if parsed.model and parsed.model not in (name, *aliases):
                        raise _HTTPError(404, "model_not_found", f"model {parsed.model!r} is not served here; "
                                         f"served: {[name, *aliases]}", param="model")
                    async with gate.slot():
                        running = True
                        resp, reads = await decide(parsed)
            except _HTTPError:
                raise
            except Exception as exc:  # noqa: BLE001 - every fault becomes a typed answer
                if isinstance(exc, TimeoutError) and deadline.expired():
                    if running:
                        raise _HTTPError(504, "timeout", f"the decision took over {request_timeout}s") from exc
                    raise _HTTPError(529, "overloaded", f"no slot freed within {request_timeout}s; retry later",
                                     headers={"retry-after": "1"}) from exc
                span.record_exception(exc)
                raise _from_exception(exc) from exc
        usage = resp.usage or {}
        return {
            "id": request_id,
            "object": "structured_decision",
            "created": int(time.time()),
            "model": resp.model,
            "answers": {qid: _answer_json(resp.answers[qid], reads.get(qid)) for qid in parsed.questions},
            "usage": {"input_tokens": int(usage.get("input_tokens", 0)),
                      "output_tokens": int(usage.get("output_tokens", 0))},
        }

    async def models(request: Request) -> JSONResponse:
        try:
            authorize(request)
            name = await served_name()
        except _HTTPError as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001
            return _from_exception(exc).response()
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
            name = await asyncio.wait_for(served_name(), 5.0)
        except Exception as exc:  # noqa: BLE001 - health reports, never raises
            return JSONResponse({"status": "unavailable", "error": f"{type(exc).__name__}: {exc}", **load},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": name, **load})

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return _HTTPError(status, kind, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}",
                          headers=getattr(exc, "headers", None)).response()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(served_name(), 30.0)  # warm up: learn the model before traffic
        except Exception as exc:  # noqa: BLE001 - the engine may come up after the server
            log.warning("engine not ready at startup: %s", exc)
        yield
        engine = getattr(model, "engine", None)
        if close_engine and engine is not None:
            await engine.aclose()

    app = Starlette(
        routes=[Route("/v1/systemone", systemone, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"])],
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
    )
    app.state.gate = gate
    app.state.model = model
    return app


@contextmanager
def run_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                  startup_timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` with uvicorn on a background thread; yields the base URL.

    For tests and notebooks: `port=0` picks a free port. The server stops when the
    block exits.

    Example:
        ```python
        with run_in_thread(create_app(model)) as url:
            SystemOneDecisionModel(url, model="tiny-dgemma").invoke(...)
        ```
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="canvasroute-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
