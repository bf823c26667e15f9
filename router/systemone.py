"""`SystemOneDecisionModel`: a client for any `/v1/systemone` server.

Speaks the Jev wire (TypeSafe's hosted Jev, OpenJev, vLLM's structured-decision
gateway, `canvasroute serve`): one `POST /v1/systemone` per decision set, answers parsed
into langchain-core's `NoulAnswer` / `ChoiceAnswer` / `ScoreAnswer` / `BoxAnswer`.
Usable on its own, as a fast path, or as `CanvasDecisionModel(escalate_to=...)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.decisions import BaseDecisionModel, ClassifierResponse
from opentelemetry.trace import SpanKind
from pydantic import ConfigDict, Field, ValidationError, field_validator

from canvasroute.engine import Connection, DecisionError, EngineResponseError, run_sync

from . import telemetry as tm
from ._compat import SYSTEMONE, systemone_keywords
from ._questions import validate_questions
from ._state import wire_state

__all__ = ["SystemOneDecisionModel", "SystemOneResponse"]


class SystemOneResponse(ClassifierResponse):
    """A `ClassifierResponse` that also names the questions the server refused.

    Example:
        ```python
        resp = await jev.ainvoke({"state": ticket, "questions": questions})
        resp.answers.get("card")   # None: refused, no answer
        resp.refusals["card"]      # "the escalation target refused it: ..."
        ```
    """

    refusals: dict[str, str] = Field(default_factory=dict)
    """Question id -> why it was refused (a canvasroute server whose escalation target refused it).
    A refusal is not an answer: a refused question is not in `answers`."""



class SystemOneDecisionModel(BaseDecisionModel):
    """Answers Noul, Choice, Score (and Box, where the server can) over `/v1/systemone`.

    `connection` is a `Connection` to the server's root (without `/v1/systemone`), or its
    URL for a default one: the same transport as `VLLMServerEngine` (keys, TLS, proxies,
    `Timeout`, `Retries`, `Limits`), with a sync path. Retries with exponential backoff and
    jitter on connection errors, timeouts, 408, 429, 5xx and 529 (honouring `Retry-After`),
    and typed errors: transient faults raise `EngineUnavailable` (`EngineOverloaded` for
    429/503/529, `EngineTimeout`), a request the server refuses raises `EngineRequestError`
    carrying its status and message, unreadable answers raise `EngineResponseError`. A
    question the server answered but would not vouch for (a canvasroute server whose own
    escalation target refused it) is no answer: the response (`SystemOneResponse`) names it
    in `refusals`, so a canvas model escalating here keeps it a refusal.

    Example:
        ```python
        jev = SystemOneDecisionModel("http://127.0.0.1:8000", model="tiny-dgemma")
        resp = await jev.ainvoke({"state": "Refund me!", "questions": {
            "refund": Noul(instructions="Does the customer ask for a refund?")}})
        resp.nouls["refund"].noul
        # or as the escalation target of a canvas model, with a key and no retries:
        hosted = SystemOneDecisionModel(Connection(url, api_key=key, retries=0), model="jev-latest")
        CanvasDecisionModel(engine=..., escalate_to=hosted)
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    connection: Connection
    """The server and how to reach it (a URL given here becomes `Connection(url)`)."""
    model: str
    """Model name sent with every request (and reported as the answering model)."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra top-level request fields (e.g. `{"seed": 7}` for canvasroute servers)."""

    def __init__(self, connection: str | Sequence[str] | Connection | None = None, /, **kwargs: Any) -> None:
        if not SYSTEMONE.isdisjoint(kwargs):  # 0.1's transport fields (base_url=, timeout=, ...), until 0.3.0
            connection, kwargs = systemone_keywords(connection, kwargs)
        if connection is not None:
            kwargs["connection"] = connection
        super().__init__(**kwargs)

    @field_validator("connection", mode="before")
    @classmethod
    def _connect(cls, value: Any) -> Any:
        """A URL (or replica URLs) becomes a default `Connection`."""
        if isinstance(value, (str, list, tuple)):
            return Connection(value)
        return value

    def __repr__(self) -> str:
        urls = self.connection.urls
        return f"SystemOneDecisionModel({urls[0] if len(urls) == 1 else list(urls)!r}, model={self.model!r})"

    @property
    def _provider(self) -> str:
        return "systemone"

    # -- BaseDecisionModel --------------------------------------------------------------

    def _classify(self, state: Any, questions: dict[str, Any]) -> ClassifierResponse:
        return run_sync(self.adecide(state, questions))

    async def _aclassify(self, state: Any, questions: dict[str, Any]) -> ClassifierResponse:
        return await self.adecide(state, questions)

    def decide(self, state: Any, questions: Mapping[str, Any]) -> SystemOneResponse:
        """Sync `adecide`."""
        return run_sync(self.adecide(state, questions))

    async def adecide(self, state: Any, questions: Mapping[str, Any]) -> SystemOneResponse:
        """Send one decision set and return the typed answers (and the questions it refused)."""
        wire_questions = _wire_questions(questions)
        wired, images = _wire_state(state)
        body = {**self.extra_body, "model": self.model, "state": wired, "questions": wire_questions}
        if images:
            body["images"] = [*self.extra_body.get("images", ()), *images]
        attrs = {**tm.genai_attributes("systemone", self._provider, self.model),
                 tm.DECISION_SET: ",".join(wire_questions), tm.QUESTIONS: len(wire_questions)}
        # No token counts on this span: an enclosing `escalate` span already records them.
        with tm.span(f"systemone {self.model}", attrs, SpanKind.CLIENT):
            data, request_id = await self._post(body)
            resp = _parse(data, wire_questions, request_id, self.model)
        return resp

    async def aclose(self) -> None:
        """Close the connection (for whoever shares it)."""
        await self.connection.aclose()

    # -- transport ------------------------------------------------------------------

    async def _post(self, body: Mapping[str, Any]) -> tuple[Any, str | None]:
        reply = await self.connection.request("POST", "/v1/systemone", body)
        return reply.data, reply.headers.get("x-request-id")


# -- wire helpers ----------------------------------------------------------------------


def _wire_questions(questions: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Validate questions locally (typed errors before any request) and dump them."""
    out: dict[str, dict[str, Any]] = {}
    for qid, q in validate_questions(questions, allow_box=True).items():
        dumped = q.model_dump(mode="json")
        if dumped.get("criteria") is None:
            dumped.pop("criteria", None)
        out[qid] = dumped
    return out


def _wire_state(state: Any) -> tuple[Any, tuple[str, ...]]:
    """Text as is, messages as a transcript, anything else as JSON (image blocks kept in it);
    beside it, the images a message's text has no place for, for the body's `images`. The wire
    takes those as data URLs, so a hosted one is refused before any request."""
    wired, images = wire_state(state)
    if hosted := [url for url in images if not url.startswith("data:image/")]:
        raise DecisionError(f"/v1/systemone takes a message's images as data:image/ URLs; the state holds "
                            f"{len(hosted)} hosted image URL(s) in messages", hint="inline the images (data URLs)")
    return wired, images


def _parse(data: Any, questions: Mapping[str, Mapping[str, Any]], request_id: str | None,
           model: str) -> SystemOneResponse:
    """A `SystemOneResponse` with one answer of the asked type per question the server neither
    skipped (vLLM's gateway answers a skipped question null; canvasroute leaves it out and names
    it in `diagnostics.skipped`) nor refused (canvasroute: named in `diagnostics.refused`, and
    an answer whose extension object has a `refusal`, as older canvasroute servers say it)."""
    if not isinstance(data, dict) or not isinstance(data.get("answers"), dict):
        raise EngineResponseError(f"the server answered without an 'answers' object: {str(data)[:200]!r}")
    diagnostics = _object(data.get("diagnostics"))
    skipped, refusals = _object(diagnostics.get("skipped")), _refusals(data["answers"], diagnostics)
    answers = {qid: a for qid, a in data["answers"].items() if a is not None and qid not in refusals}
    missing = [qid for qid in questions if qid not in answers and qid not in skipped and qid not in refusals
               and qid not in data["answers"]]
    if missing:
        raise EngineResponseError(f"the server returned no answer for {missing}")
    asked = {qid: q for qid, q in questions.items() if qid in answers}
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    extension = _extension(data)
    decision_id = next((v for v in (extension.get("decision_id"), data.get("id")) if isinstance(v, str)), None)
    try:
        resp = SystemOneResponse.model_validate({
            "model": data.get("model") or model,
            "answers": {qid: answers[qid] for qid in asked},
            "usage": {k: int(usage.get(k) or 0) for k in ("input_tokens", "output_tokens")} if usage else None,
            "request_id": request_id or decision_id,
            "refusals": {qid: reason for qid, reason in refusals.items() if qid in questions},
        })
    except (ValidationError, TypeError, ValueError) as exc:
        raise EngineResponseError(f"the server's answers do not match the wire: {exc}") from exc
    for qid, q in asked.items():
        got = resp.answers[qid].type
        if got != q["type"]:
            raise EngineResponseError(f"question {qid!r} is a {q['type']}, the server answered a {got}")
    return resp



def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _extension(part: Any) -> dict[str, Any]:
    """A canvasroute server's own fields in a reply or an answer: `x_canvasroute` (System One's prefix
    for fields its spec does not define), or `canvasroute`, as earlier canvasroute servers named them."""
    fields = _object(part)
    return _object(fields.get("x_canvasroute", fields.get("canvasroute")))


def _refusals(answers: Mapping[str, Any], diagnostics: Mapping[str, Any]) -> dict[str, str]:
    """Question id -> why the server refused it: `diagnostics.refused` (canvasroute 0.2), else an
    answer's `x_canvasroute.refusal` (`canvasroute.refusal` on earlier servers: its escalation
    target refused, the answer is the canvas's)."""
    out = {qid: str(why or "refused") for qid, why in _object(diagnostics.get("refused")).items()}
    for qid, answer in answers.items():
        why = _extension(answer).get("refusal")
        if qid not in out and isinstance(why, str) and why:
            out[qid] = why
    return out
