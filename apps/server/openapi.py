"""The API's OpenAPI 3.1 description (`GET /openapi.json`), built from pydantic models of both wires
(`/v1/systemone` here, `/v1/decisions` in `decisions._schema`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from canvasroute.router import MAX_SAMPLES, MAX_STEPS, MAX_THINK

from .decisions._schema import DecisionsErrorResponse, DecisionsRequest, DecisionsResponse
from .limits import Limits

__all__ = ["openapi"]

Content = str | dict[str, Any] | list[Any]
Text = Annotated[Any, Field(description="Text, or any JSON value (read as its JSON text).")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """Keys it does not know are ignored (and listed in the reply's `diagnostics.ignored`), as vLLM's gateway does."""

    model_config = ConfigDict(extra="allow")


class NoulCriteria(_Open):
    true: Text = None
    false: Text = None


class _Ordering(_Open):
    depends_on: list[str] | None = Field(None, description="Ids of questions answered first; their answers are "
                                                           "restated to this one (vLLM gateway extension).")
    ask_if: dict[str, list[str]] | None = Field(
        None, description="Ask this question only when each named question's answer is among the listed ones "
                          "(yes/no, an option name, a level's text); else it is skipped: no answer, and "
                          "`diagnostics.skipped` says why (vLLM gateway extension).")
    alone: bool = Field(False, description="Read this question in a canvas of its own (vLLM gateway extension).")


class NoulQuestion(_Ordering):
    """Yes or no: answered with the probability of yes."""

    type: Literal["noul"]
    instructions: Text = None
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Ordering):
    """One of named options (2 or more), each with an optional description."""

    type: Literal["choice"]
    instructions: Text = None
    criteria: dict[str, Text] = Field(min_length=2)


class ScoreQuestion(_Ordering):
    """A level on an ordered rubric (2 or more levels), answered as an expected level."""

    type: Literal["score"]
    instructions: Text = None
    criteria: list[Text] = Field(min_length=2)


class BoxQuestion(_Open):
    """Part of the Jev wire; this server answers it 422 (no canvas form)."""

    type: Literal["box"]
    instructions: Text = None


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion, Field(discriminator="type")]


class ImageObject(_Strict):
    content_type: str = Field(pattern="^image/")
    base64: str


class Asset(_Open):
    """An image System One's `assets` names (typesafe-sdk sends them)."""

    type: Literal["image"] = "image"
    format: Literal["png", "jpg", "jpeg"] | None = Field(None, description="The image format, with data_base64.")
    data_base64: str | None = Field(None, description="The image, base64-encoded.")
    part: str | None = Field(None, description="In a multipart body: the name of the file part holding the image.")


class SystemOneRequest(_Open):
    """One decision set: every question is asked about the same state, in one canvas read where they fit."""

    model: str | None = Field(None, description="The served model's name or an alias (default: jev-latest).")
    state: Any = Field(description="What every question refers to: text, or any JSON value but null "
                                   "(read as its JSON text).")
    questions: dict[str, Question] = Field(min_length=1, description="Questions keyed by a name you choose.")
    assets: dict[str, Asset] | None = Field(
        None, min_length=1, description="Images keyed by a placeholder: wherever a placeholder appears as or inside "
                                        "a string of the state, an instruction or a criterion, its image is read with "
                                        "the decision and the text says [image N] (System One).")
    instructions: Text = Field(None, description="Context for every question (vLLM gateway extension).")
    samples: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | Literal["auto"] | None = Field(
        None, description="1: one read per canvas; N: N fixed reads; \"auto\": one read, then up to auto_max in "
                          "all for uncertain questions (default: the server's policy) (vLLM gateway extension).")
    auto_max: int | None = Field(None, ge=1, le=MAX_SAMPLES,
                                 description="Reads at most under samples \"auto\" (default 4).")
    auto_threshold: float | None = Field(None, ge=0, description="Under samples \"auto\": entropy in nats above "
                                                                "which a question is uncertain (besides the "
                                                                "server's gate).")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS,
                              description="Denoising steps per read, the template held (default 1).")
    think: int | None = Field(None, ge=0, le=MAX_THINK,
                              description="Tokens the model may write in its thought channel before the read, "
                                          "which conditions on the thought (default 0).")
    ask: list[str] | None = Field(None, min_length=1, description="Answer only these question ids.")
    images: list[Annotated[str, Field(pattern="^data:image/")] | ImageObject] | None = Field(
        None, description="Images read with the state: data URLs or {content_type, base64}; or upload them as "
                          "multipart/form-data file parts beside a `request` part holding this JSON.")
    chunk_prompt: Literal["own"] | None = Field(None, description="Each chunk lists only its own questions.")
    sequential: Literal[False] | None = Field(None, description="Chunks of one stage are read together.")
    seed: int | None = Field(None, ge=0, description="Seeds the reads (canvasroute extension).")
    thread_id: str | None = Field(None, description="Groups decisions of one conversation (canvasroute extension).")


class ErrorDetail(BaseModel):
    type: str = Field(description="A stable error code, e.g. `too_many_questions`, `engine_timeout`.")
    message: str
    code: int = Field(description="The HTTP status.")
    param: str | None = Field(None, description="The dotted body path the error is about.")


class ValidationItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(BaseModel):
    error: ErrorDetail
    detail: list[ValidationItem] | None = Field(None, description="On 415 and 422: FastAPI's validation list.")


class ValidationErrorResponse(ErrorResponse):
    """A 415 or 422: the error, and FastAPI's validation list, which Jev clients read."""

    detail: list[ValidationItem] = Field(min_length=1, description="Where the body failed: `loc`, `msg`, `type`.")


_EXTENSION = ("How it was answered: canvasroute's own fields, x_-prefixed as System One names what its spec does "
              "not define.")


class SystemOneNoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(ge=0, le=1, description="The probability of yes.")
    probabilities: dict[str, float] | None = Field(None, description="yes and no (vLLM's field: only for a "
                                                                     "request using its keys).")
    confidence: float | None = Field(None, ge=0, le=1, description="System One's |2p - 1| (vLLM's field, as "
                                                                   "`probabilities`).")
    x_canvasroute: dict[str, Any] | None = Field(None, description=_EXTENSION)


class SystemOneChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str
    probabilities: dict[str, float]
    confidence: float = Field(ge=0, le=1, description="System One's: (p - 1/K) / (1 - 1/K) of the answer, clipped "
                                                      "to [0, 1] (K options).")
    x_canvasroute: dict[str, Any] | None = Field(None, description=_EXTENSION)


class SystemOneScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="The expected level, Σ i·p_i (levels from 0).")
    legend: dict[str, Any]
    probabilities: dict[str, float]
    confidence: float = Field(ge=0, le=1, description="System One's: (p - 1/K) / (1 - 1/K) of the most likely "
                                                      "level, clipped to [0, 1] (K levels).")
    x_canvasroute: dict[str, Any] | None = Field(None, description=_EXTENSION)


class SystemOneExtension(BaseModel):
    decision_id: str = Field(description="The decision's id (the reply's x-request-id when the caller sent none).")
    canvas_reads: int
    ignored: list[str] = Field(description="Request keys this server did not read.")


SystemOneAnswer = Annotated[SystemOneNoulAnswer | SystemOneChoiceAnswer | SystemOneScoreAnswer,
                            Field(discriminator="type")]


class SystemOneResponse(BaseModel):
    """System One's `model`, `answers`, `usage`; vLLM's gateway's `diagnostics`; canvasroute's own figures
    only in `x_canvasroute` objects (System One's prefix for fields its spec does not define). A request
    that uses a key of vLLM's gateway also gets vLLM's `id`, `object` and `created`, and a noul's
    `probabilities` and `confidence`, as that contract names them."""

    id: str | None = Field(None, description="The decision id (vLLM's field: only for a request using its keys).")
    object: Literal["structured_decision"] | None = Field(None, description="vLLM's field, as `id`.")
    created: int | None = Field(None, description="vLLM's field, as `id`.")
    model: str = Field(description="The served model that answered (also when the request named an alias).")
    answers: dict[str, SystemOneAnswer] = Field(
        description="One answer per asked question; a question that ask_if skipped has none. A question the "
                    "escalation target refused keeps the canvas's answer, named in diagnostics.refused; one whose "
                    "escalation failed keeps it too, the failure named in diagnostics.escalation_errors.")
    usage: dict[str, int]
    diagnostics: dict[str, Any] = Field(description="How the decision was read, in vLLM's gateway's keys "
                                                    "(stages, skipped, chunks, thought, samples, timing, "
                                                    "prompt_tokens, questions, ...) and canvasroute's (refused, "
                                                    "escalation_errors, ...).")
    x_canvasroute: SystemOneExtension


_ERRORS = {
    "401": "missing or wrong bearer key",
    "408": "the body did not arrive within the body timeout",
    "413": "the body or the state is too large",
    "415": "not application/json or multipart/form-data, or an unknown content encoding",
    "422": "a body that is not JSON (or a multipart body without its request part), a field, question, feature "
           "or answer template that cannot be used, over a bound, or a model this server does not serve",
    "429": "over the request rate, or the escalation budget (or the cap on engine faults' escalations) is spent",
    "502": "the engine or the escalation model answered garbage or refused",
    "503": "the engine is unreachable, or the escalation model's breaker is open",
    "504": "the engine did not answer within the request timeout",
    "529": "the server is at capacity (running and queued), or the engine shed load",
}


_DECISIONS_ERRORS = {
    "400": "a request error, its field named in `param`: a body that is not JSON, a field or question that "
           "cannot be used, over a bound, a body or input too large",
    "401": "missing or wrong bearer key (`invalid_api_key`)",
    "404": "a model this server does not serve (`model_not_found`)",
    "408": "the body did not arrive within the body timeout",
    **{code: text for code, text in _ERRORS.items() if code in ("429", "502", "503", "504", "529")},
}


def openapi(limits: Limits) -> dict[str, Any]:
    """The OpenAPI document for a server with these limits."""
    _, schemas = models_json_schema([(m, "validation") for m in (SystemOneRequest, SystemOneResponse, ErrorResponse,
                                                                  ValidationErrorResponse, DecisionsRequest,
                                                                  DecisionsResponse, DecisionsErrorResponse)],
                                    ref_template="#/components/schemas/{model}")
    components = schemas["$defs"]
    request = components["SystemOneRequest"]["properties"]
    request["questions"]["maxProperties"] = limits.max_questions
    request["model"]["anyOf"][0]["maxLength"] = limits.max_name_chars
    request["state"]["not"] = {"type": "null"}
    choice = components["ChoiceQuestion"]["properties"]["criteria"]
    choice["maxProperties"] = limits.max_options
    choice["description"] = f"Option name -> description (null: the name alone), 2 to {limits.max_options} options."
    score = components["ScoreQuestion"]["properties"]["criteria"]
    score["maxItems"] = limits.max_levels
    score["description"] = f"Level descriptions in order (level 0 first), 2 to {limits.max_levels} levels."
    decisions = components["DecisionsRequest"]["properties"]
    decisions["questions"]["maxItems"] = min(limits.max_questions, decisions["questions"]["maxItems"])
    decisions["model"]["maxLength"] = limits.max_name_chars
    components["DecisionChoice"]["properties"]["choices"]["maxItems"] = min(limits.max_options,
                                                                     components["DecisionChoice"]["properties"]["choices"]["maxItems"])
    components["DecisionScore"]["properties"]["levels"]["maxItems"] = limits.max_levels
    multipart = {"type": "object", "required": ["request"], "properties": {
        "request": {"type": "string", "description": "the JSON request (SystemOneRequest)"},
        "image": {"type": "string", "format": "binary",
                  "description": "an image file part (image/*, or PNG or JPEG bytes), under any name: one that "
                                 "`assets` names is placed there, any other is read with every question"}}}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    invalid = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ValidationErrorResponse"}}}}
    errors = {code: {"description": text, **(invalid if code in ("415", "422") else error)}
              for code, text in _ERRORS.items()}
    ok = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/SystemOneResponse"}}}}
    plain = {"content": {"application/json": {"schema": {"type": "object"}}}}
    openai_error = {"content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/DecisionsErrorResponse"}}}}
    decided = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/DecisionsResponse"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "canvasroute serve", "version": "1",
                 "description": "Gated decisions on the Jev wire (/v1/systemone) and the OpenAI Decisions wire "
                                "(/v1/decisions). Bounds: " + limits.describe()},
        "paths": {
            "/v1/systemone": {"post": {
                "operationId": "systemone", "summary": "Answer a decision set",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}},
                    "multipart/form-data": {"schema": multipart}}},
                "responses": {"200": {"description": "the answers", **ok}, **errors},
                "security": [{"bearer": []}, {}]}},
            "/v1/decisions": {"post": {
                "operationId": "decisions", "summary": "Answer every question about one input (OpenAI Decisions)",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/DecisionsRequest"}}}},
                "responses": {"200": {"description": "the answers, in question order", **decided},
                              **{code: {"description": text, **openai_error}
                                 for code, text in _DECISIONS_ERRORS.items()}},
                "security": [{"bearer": []}, {}]}},
            "/v1/models": {"get": {"operationId": "models", "summary": "The served model and its aliases",
                                   "responses": {"200": {"description": "the models", **plain},
                                                 "401": errors["401"], "503": errors["503"]},
                                   "security": [{"bearer": []}, {}]}},
            "/health": {"get": {"operationId": "health", "summary": "Liveness and load (no key needed)",
                                "responses": {"200": {"description": "ready", **plain},
                                              "503": {"description": "the engine is not ready", **plain}}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics (no key needed)",
                                 "responses": {"200": {"description": "the Prometheus text format", "content": {
                                     "text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"operationId": "openapi", "summary": "This description (no key needed)",
                                      "responses": {"200": {"description": "OpenAPI 3.1", **plain}}}},
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
