"""A known-answers decision server for tests: `POST /v1/decisions` (and `/v1/systemone`) from a script.

Real HTTP (starlette on uvicorn, on a free loopback port, in a thread) so real clients (the
`openai` SDK's `client.decisions.create`, langchain-openai's `OpenAIDecisions`,
`SystemOneDecisionModel`) talk to it unchanged. A request is read with canvasroute's own
parser (`canvasroute.apps.server.decisions.parse`) and answered with its renderer, so a client's
request that does not parse, or a response a client cannot read, fails the test.

Each question is answered from the script, found by its name, else by its instructions (exactly,
else the one script key its instructions contain): `Known(0.8)` for a predicate (the probability
of yes), `Known({"billing": 0.7, "tech": 0.3})` for a choice (typed values: `True` and `"true"`
differ), `Known({0: 0.1, 2: 0.9})` for a score (level index -> probability), `REFUSE` for a
refusal. An unscripted question is a 400 naming it. `fail(status, ...)` makes the next requests
fail; the server counts every request and keeps every body and its headers.

Example:
    ```python
    with DecisionsServer({"urgent": Known(0.9)}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test")
        client.decisions.create(model="m", input="Help!", questions=[
            {"type": "predicate", "name": "urgent", "instructions": "Urgent?"}])
        server.bodies[0]["questions"][0]["name"]  # "urgent"
    ```
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from canvasroute.apps.eval.ar_server import ARServer
from canvasroute.apps.server.decisions import (
    DecisionsWireError,
    QuestionResult,
    Usage,
    WireQuestion,
    error_body,
    parse,
    render,
)

__all__ = ["PNG", "REFUSE", "DecisionsServer", "Failure", "Known"]

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/"
       "PchI7wAAAABJRU5ErkJggg==")
"""A 1x1 PNG as a data URL: the image of the decision-wire tests."""


@dataclass(frozen=True)
class Known:
    """One question's scripted answer: a predicate's p(yes), a choice's {value: p}, a score's {level: p}."""

    distribution: float | Mapping[Any, float] | None = None
    confidence: float | None = None
    """The confidence to report (default: the top probability)."""
    refuse: bool = False


REFUSE = Known(refuse=True)


@dataclass(frozen=True)
class Failure:
    """A scripted failure: the status and body (default: OpenAI's error shape) and headers."""

    status: int
    body: Any = None
    headers: Mapping[str, str] | None = None


class DecisionsServer:
    """The server, its script, and what it received."""

    def __init__(self, script: Mapping[str, Known], *, model: str = "known-answers") -> None:
        self.script = dict(script)
        self.model = model
        self.bodies: list[Any] = []
        """Every request body (decoded JSON), in order, failed ones too."""
        self.headers: list[dict[str, str]] = []
        self.failures: deque[Failure] = deque()
        self.usage = Usage(input_tokens=11, output_tokens=2, cached_tokens=3)
        app = Starlette(routes=[Route("/v1/decisions", self._decisions, methods=["POST"]),
                                Route("/v1/systemone", self._systemone, methods=["POST"])])
        self._running = ARServer(app)  # uvicorn on a thread of its own, on a free loopback port
        self.url = ""

    @property
    def count(self) -> int:
        """Requests received."""
        return len(self.bodies)

    def fail(self, status: int, body: Any = None, *, times: int = 1, headers: Mapping[str, str] | None = None) -> None:
        """Answer the next `times` requests with `status` (and `body`, default OpenAI's error shape)."""
        self.failures.extend([Failure(status, body, headers)] * times)

    def __enter__(self) -> Self:
        self.url = self._running.__enter__().url
        return self

    def __exit__(self, *exc: object) -> None:
        self._running.__exit__(*exc)

    # -- routes ---------------------------------------------------------------------------

    async def _received(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        return body

    def _failure(self) -> JSONResponse | None:
        if not self.failures:
            return None
        f = self.failures.popleft()
        body = f.body if f.body is not None else error_body(f"scripted failure {f.status}", status=f.status,
                                                             code="scripted")
        return JSONResponse(body, status_code=f.status, headers=dict(f.headers or {}))

    async def _decisions(self, request: Request) -> JSONResponse:
        body = await self._received(request)
        if (failed := self._failure()) is not None:
            return failed
        try:
            parsed = parse(body)
            results = {q.id: self._result(q.name, q.instructions, q) for q in parsed.questions}
        except DecisionsWireError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(render(parsed, results, model=self.model, usage=self.usage),
                            headers={"x-request-id": f"req_{self.count}"})

    async def _systemone(self, request: Request) -> JSONResponse:
        body = await self._received(request)
        if (failed := self._failure()) is not None:
            return failed
        answers: dict[str, Any] = {}
        try:
            for qid, q in body["questions"].items():
                answers[qid] = self._systemone_answer(qid, q)
        except DecisionsWireError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse({"model": self.model, "answers": answers,
                             "usage": {"input_tokens": self.usage.input_tokens,
                                       "output_tokens": self.usage.output_tokens}})

    # -- answers --------------------------------------------------------------------------

    def _known(self, name: str | None, instructions: str) -> Known:
        if name is not None and name in self.script:
            return self.script[name]
        if instructions in self.script:
            return self.script[instructions]
        inside = [k for k in self.script if k in instructions]
        if len(inside) == 1:
            return self.script[inside[0]]
        raise DecisionsWireError(f"no scripted answer for question {name!r}: {instructions[:80]!r} "
                                 f"({len(inside)} script keys match)", code="unscripted")

    def _result(self, name: str | None, instructions: str, q: WireQuestion) -> QuestionResult:
        known = self._known(name, instructions)
        if known.refuse:
            return QuestionResult(refusal="scripted refusal")
        if q.kind == "predicate":
            p = float(known.distribution)  # type: ignore[arg-type]
            probs = {"yes": p, "no": 1.0 - p}
        elif q.kind == "choice":
            names = dict(zip(((type(v), v) for v in q.values), q.options, strict=True))
            probs = {names[(type(v), v)]: p for v, p in known.distribution.items()}  # type: ignore[union-attr]
        else:
            probs = {str(level): p for level, p in known.distribution.items()}  # type: ignore[union-attr]
        top = max(probs, key=probs.__getitem__)
        return QuestionResult(answer=top, probabilities=probs, confidence=known.confidence)

    def _systemone_answer(self, qid: str, q: Mapping[str, Any]) -> Any:
        instructions = q["instructions"] if isinstance(q["instructions"], str) else str(q["instructions"])
        known = self._known(qid, instructions)
        if known.refuse:
            return None  # the gateway's skipped question
        if q["type"] == "noul":
            return {"type": "noul", "noul": float(known.distribution)}  # type: ignore[arg-type]
        dist = dict(known.distribution)  # type: ignore[arg-type]
        top = max(dist, key=dist.__getitem__)
        confidence = known.confidence if known.confidence is not None else dist[top]
        if q["type"] == "choice":
            return {"type": "choice", "choice": top, "probabilities": dist, "confidence": confidence}
        return {"type": "score", "score": sum(int(k) * p for k, p in dist.items()), "confidence": confidence,
                "legend": dict(enumerate(q["criteria"])), "probabilities": {int(k): p for k, p in dist.items()}}
