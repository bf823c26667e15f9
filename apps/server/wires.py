"""The two wires `create_app` serves, each as what is its own: reading a body into a parsed request,
the one job a decision is, the reply, the error answer. Everything else (auth, the rate limit,
the body's bounds, admission, the drain, timeouts, ids, logs, metrics, tracing) is the app's, shared.

- `SystemOneWire`: `POST /v1/systemone`, the Jev wire as vLLM's gateway speaks it (`parse`,
  `extensions`, `diagnostics`; errors `{"error": {"type", "message", "code", "param"?}}`).
- `DecisionsWire`: `POST /v1/decisions`, the OpenAI Decisions wire as the `openai` SDK and
  langchain-openai define it (`decisions`; errors in OpenAI's shape, with the statuses the SDK
  maps to its exception classes).

Both build one `DecisionRequest` per request with `CanvasDecisionModel.request` before a slot is
taken, and run it whole with `arun`; another `BaseDecisionModel` is asked its state and questions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.decisions import BaseDecisionModel, ClassifierRequest
from langchain_core.exceptions import ModelRefusalError
from starlette.responses import JSONResponse, Response

from canvasroute.engine import DecisionError
from canvasroute.router import CanvasDecisionModel, DecisionRequest, parse_questions, system_one_confidence

from . import decisions
from .body import request_parts
from .decisions import DecisionsWireError, from_refusal
from .diagnostics import diagnostics
from .limits import Limits
from .metrics import Metrics
from .parse import Parsed, load_json, parse_request
from .wire import Refusal, from_exception, public_name

__all__ = ["EXTENSION_FIELDS", "SYSTEM_ONE_EXTENSION", "DecisionsWire", "Served", "SystemOneWire", "Wire", "extension"]

Job = DecisionRequest | ClassifierRequest
"""What one request asks the model: a canvas model's `DecisionRequest`, or another decision
model's `{"state", "questions"}`."""

EXTENSION_FIELDS = ("path", "confident", "entropy", "normalized_entropy", "margin", "label_mass", "confidence",
                    "reads", "agreement", "stderr", "crossed", "canvas_probabilities", "labels",
                    "escalation_model", "escalation_confidence", "refusal", "cause", "error", "gate", "hedged",
                   "escalation_error")
"""A read report's figures in each answer's extension object (plain clients ignore it)."""
SYSTEM_ONE_EXTENSION = "x_canvasroute"
"""The key of canvasroute's own fields on `/v1/systemone`, in each answer and in the reply: System One
prefixes the fields its spec does not define with `x_`. (Earlier servers named it `canvasroute`, which
`SystemOneDecisionModel` still reads; on `/v1/decisions`, whose OpenAI types have no such prefix, it
keeps that name.)"""


def extension(report: Any) -> dict[str, Any]:
    """An answer's extension object (`x_canvasroute` on /v1/systemone, `canvasroute` on /v1/decisions):
    who answered it (path, cause, escalation model, a target's refusal, a failed escalation's error)
    and the canvas figures."""
    figures = report.model_dump(mode="json")
    return {k: figures[k] for k in EXTENSION_FIELDS}


@dataclass(frozen=True, slots=True)
class Served:
    """What both wires share: the served model and this server's bounds and names."""

    model: BaseDecisionModel
    canvas: CanvasDecisionModel | None
    """`model` when it is a canvas model (its requests are `DecisionRequest`s)."""
    limits: Limits
    aliases: tuple[str, ...]
    """Other names a request may give as `model`, answered by the served model."""

    async def name(self) -> str:
        """The served model's public name (the engine's, once it has said it)."""
        engine = getattr(self.model, "engine", None)
        return public_name((await engine.info()).model if engine is not None else self.model.model)

    async def provider(self) -> str:
        engine = getattr(self.model, "engine", None)
        return (await engine.info()).provider if engine is not None else type(self.model).__name__

    async def decide(self, job: Job) -> Any:
        if isinstance(job, DecisionRequest):
            assert self.canvas is not None
            return await self.canvas.arun(job)
        return await self.model.ainvoke(job)


class Wire:
    """One wire's part of a request (the app calls these in order)."""

    route: str

    def read(self, body: bytes, content_type: str | None) -> Any:
        """The parsed request (checked in full; no slot is held yet)."""
        raise NotImplementedError

    def ids(self, parsed: Any) -> Sequence[str]:
        """The question ids asked (for the span)."""
        raise NotImplementedError

    def check_model(self, parsed: Any, served: str) -> None:
        """Refuse a `model` this server does not serve."""
        raise NotImplementedError

    def job(self, parsed: Any) -> Job:
        """The one job the decision is (built before a slot is taken)."""
        raise NotImplementedError

    async def decide(self, parsed: Any, job: Job) -> Any:
        raise NotImplementedError

    async def reply(self, parsed: Any, response: Any, name: str, decision_id: str) -> dict[str, Any]:
        """The 200 body."""
        raise NotImplementedError

    def error(self, exc: Refusal | DecisionsWireError, request_id: str | None) -> tuple[Response, str]:
        """The error answer, and its stable kind (for the metric and the span)."""
        raise NotImplementedError


class SystemOneWire(Wire):
    """`POST /v1/systemone`: the Jev wire (vLLM's gateway's keys, status codes and `diagnostics`)."""

    route = "/v1/systemone"

    def __init__(self, served: Served) -> None:
        self.served = served

    def read(self, body: bytes, content_type: str | None) -> Parsed:
        data, parts = request_parts(body, content_type)
        return parse_request(data, self.served.limits, parts)

    def ids(self, parsed: Parsed) -> Sequence[str]:
        return list(parsed.questions)

    def check_model(self, parsed: Parsed, served: str) -> None:
        if parsed.model and parsed.model not in (served, *self.served.aliases):
            raise Refusal(422, "model_not_found", f"model {parsed.model[:80]!r} is not served here; "
                          f"served: {[served, *self.served.aliases]}", loc=("model",))

    def job(self, parsed: Parsed) -> Job:
        ext, canvas = parsed.extensions, self.served.canvas
        if canvas is None:
            if ext.read or ext.gate or ext.depends_on:
                raise Refusal(422, "unsupported_field", "this server's decision model reads no samples, "
                              "instructions, steps, think, images, depends_on, ask_if or alone")
            return {"state": parsed.state, "questions": parsed.questions}
        return canvas.request(parsed.state, parsed.questions, read=ext.read or None, depends_on=ext.depends_on,
                              gate=ext.gate or None, seed=parsed.seed, thread_id=parsed.thread_id)

    async def decide(self, parsed: Parsed, job: Job) -> Any:
        return await self.served.decide(job)

    async def reply(self, parsed: Parsed, response: Any, name: str, decision_id: str) -> dict[str, Any]:
        """System One's `model`, `answers` and `usage`; the gateway's `diagnostics` (its contract
        requires it on every 200); canvasroute's own figures only in `x_canvasroute` objects, one
        per answer and one for the decision (System One's prefix for fields its spec does not
        define). A request that uses the gateway's keys (`Parsed.gateway`) also gets the fields
        vLLM's `/v1/systemone` adds, unprefixed as that contract names them: `id`, `object`,
        `created`, and a noul's `probabilities` and `confidence`."""
        reads: Mapping[str, Any] = getattr(response, "reads", {}) or {}
        usage = response.usage or {}
        vllm = ({"id": decision_id, "object": "structured_decision", "created": int(time.time())}
                if parsed.gateway else {})
        return {
            **vllm,
            "model": public_name(response.model or name),
            "answers": {qid: _jev_answer(response.answers[qid], reads.get(qid), parsed.gateway)
                        for qid in parsed.questions
                        if qid in response.answers},  # a skipped question has none: diagnostics.skipped says why
            "usage": {"input_tokens": int(usage.get("input_tokens", 0)),
                      "output_tokens": int(usage.get("output_tokens", 0))},
            "diagnostics": diagnostics(response, parsed, await self.served.provider()),
            SYSTEM_ONE_EXTENSION: {"decision_id": decision_id, "canvas_reads": getattr(response, "canvas_reads", 0),
                                   "ignored": list(parsed.ignored)},
        }

    def error(self, exc: Refusal | DecisionsWireError, request_id: str | None) -> tuple[Response, str]:
        refusal = exc if isinstance(exc, Refusal) else Refusal(exc.status, exc.code or "invalid_request", exc.message)
        return refusal.response(request_id), refusal.kind


def _jev_answer(answer: Any, report: Any, gateway: bool) -> dict[str, Any]:
    """An answer in System One's shape (a noul: `noul` alone; a choice and a score: their
    `probabilities` and `confidence`), with the read report's figures in its `x_canvasroute` object;
    for a gateway client, a noul's `probabilities` and `confidence` (System One's, `|2p - 1|`) too."""
    out: dict[str, Any] = answer.model_dump(mode="json")
    if gateway and out["type"] == "noul":
        p = out["noul"]
        out["probabilities"] = {"yes": p, "no": 1.0 - p}
        out["confidence"] = system_one_confidence(max(p, 1.0 - p), 2)
    if report is not None:
        out[SYSTEM_ONE_EXTENSION] = extension(report)
    return out


@dataclass(frozen=True, slots=True)
class _Asked:
    """A parsed `/v1/decisions` request and what it asks the model."""

    wire: decisions.WireRequest
    inputs: decisions.DecisionInputs


class DecisionsWire(Wire):
    """`POST /v1/decisions`: the OpenAI Decisions wire.

    A question the escalation target refused is a `refusal` answer; with `refuse_unsure`, so is
    a question on path `unsure` (the gate did not pass it and nothing answered it instead).
    Every request error is a 400 naming its field; the server's other error answers keep their
    status (401, 404 for a model not served, 408, 429, 5xx) in OpenAI's shape.
    """

    route = "/v1/decisions"

    def __init__(self, served: Served, metrics: Metrics, *, refuse_unsure: bool = False) -> None:
        self.served, self.metrics, self.refuse_unsure = served, metrics, refuse_unsure

    def read(self, body: bytes, content_type: str | None) -> _Asked:
        if (content_type or "").split(";", 1)[0].strip().lower() == "multipart/form-data":
            raise DecisionsWireError("send the body as application/json (images as input_image parts)",
                                     code="unsupported_media_type")
        wire = decisions.parse(load_json(body, self.served.limits), limits=self.served.limits)
        inputs = decisions.decision_inputs(wire)
        if self.served.canvas is None and any(q.images for q in wire.questions):
            raise DecisionsWireError("this server's decision model reads no images in question instructions",
                                     param="questions", code="unsupported_value")
        try:
            parse_questions(inputs.questions)  # labels and option names, before any place is taken
        except DecisionError as exc:
            raise from_refusal(from_exception(exc)) from exc
        return _Asked(wire, inputs)

    def ids(self, parsed: _Asked) -> Sequence[str]:
        return list(parsed.inputs.questions)

    def check_model(self, parsed: _Asked, served: str) -> None:
        names = [served, *self.served.aliases]
        if parsed.wire.model not in names:
            raise DecisionsWireError(f"The model {parsed.wire.model[:80]!r} is not served here; served: {names}",
                                     status=404, param="model", code="model_not_found")

    def job(self, parsed: _Asked) -> Job:
        canvas, inputs = self.served.canvas, parsed.inputs
        if canvas is None:  # another decision model reads the messages themselves (their images included)
            state = parsed.wire.state
            return {"state": list(state) if isinstance(state, tuple) else state, "questions": inputs.questions}
        return canvas.request(inputs.state, inputs.questions, read={"images": inputs.images} if inputs.images else None)

    async def decide(self, parsed: _Asked, job: Job) -> Any:
        try:
            return await self.served.decide(job)
        except ModelRefusalError as exc:  # a decision model's refusal: every question, none answered
            return exc

    async def reply(self, parsed: _Asked, response: Any, name: str, decision_id: str) -> dict[str, Any]:
        wire = parsed.wire
        refused = isinstance(response, ModelRefusalError)
        results = decisions.question_results(wire, None if refused else response, refuse_unsure=self.refuse_unsure,
                                             refused=f"the decision model refused: {response}" if refused else None)
        body = decisions.render(wire, results, model=name if refused else public_name(response.model or name),
                                usage=decisions.Usage() if refused else decisions.usage_of(response))
        reads: Mapping[str, Any] = {} if refused else getattr(response, "reads", None) or {}
        for answer, q in zip(body["answers"], wire.questions, strict=True):
            report = reads.get(q.id)
            if report is not None:
                answer["canvasroute"] = extension(report)
            if results[q.id].refusal is not None:
                kind = ("model_refused" if refused else decisions.refusal_kind(report, self.refuse_unsure)
                        if report is not None else None)
                self.metrics.refusals.labels(kind or "no_answer").inc()
        body["canvasroute"] = {"decision_id": decision_id, "canvas_reads": getattr(response, "canvas_reads", 0),
                               "ignored": list(wire.ignored)}
        return body

    def error(self, exc: Refusal | DecisionsWireError, request_id: str | None) -> tuple[Response, str]:
        error = exc if isinstance(exc, DecisionsWireError) else from_refusal(exc)
        headers = {**error.headers, **({"x-request-id": request_id} if request_id else {})}
        return JSONResponse(error.body(), status_code=error.status, headers=headers), error.code or "invalid_request"
