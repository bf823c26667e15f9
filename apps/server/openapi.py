"""The API's OpenAPI 3.1 description (`GET /openapi.json`), built from pydantic models of the wire."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from .limits import Limits

__all__ = ["openapi"]

Content = str | dict[str, Any] | list[Any]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoulCriteria(_Strict):
    true: str | None = None
    false: str | None = None


class NoulQuestion(_Strict):
    """Yes or no: answered with the probability of yes."""

    type: Literal["noul"]
    instructions: Content | None = None
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Strict):
    """One of named options (2 or more), each with an optional description."""

    type: Literal["choice"]
    instructions: Content | None = None
    criteria: dict[str, str | None] = Field(min_length=2)


class ScoreQuestion(_Strict):
    """A level on an ordered rubric (2 or more levels), answered as an expected level."""

    type: Literal["score"]
    instructions: Content | None = None
    criteria: list[str] = Field(min_length=2)


class BoxQuestion(_Strict):
    """Part of the Jev wire; this server answers it 400 (no canvas form)."""

    type: Literal["box"]
    instructions: Content | None = None


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion, Field(discriminator="type")]


class SystemOneRequest(_Strict):
    """One decision set: every question is asked about the same state, in one canvas read."""

    model: str | None = Field(None, description="The served model's name or an alias (default: jev-latest).")
    state: Content = Field(description="The content every question refers to: text, a JSON object or array.")
    questions: dict[str, Question] = Field(min_length=1, description="Questions keyed by a name you choose.")
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


class SystemOneResponse(BaseModel):
    id: str
    object: Literal["structured_decision"]
    created: int
    model: str = Field(description="The served model that answered (also when the request named an alias).")
    answers: dict[str, dict[str, Any]]
    usage: dict[str, int]


_ERRORS = {
    "400": "a question that cannot be asked, or over a count or length bound",
    "401": "missing or wrong bearer key",
    "404": "a model this server does not serve",
    "408": "the body did not arrive within the body timeout",
    "413": "the body or the state is too large",
    "415": "not application/json, or an unknown content encoding",
    "422": "a malformed body or field",
    "429": "over the request rate, or the escalation budget is spent",
    "502": "the engine or the escalation model answered garbage or refused",
    "503": "the engine is unreachable",
    "504": "the engine did not answer within the request timeout",
    "529": "the server is at capacity (running and queued), or the engine shed load",
}


def openapi(limits: Limits) -> dict[str, Any]:
    """The OpenAPI document for a server with these limits."""
    _, schemas = models_json_schema([(m, "validation") for m in (SystemOneRequest, SystemOneResponse,
                                                                  ErrorResponse)],
                                    ref_template="#/components/schemas/{model}")
    components = schemas["$defs"]
    request = components["SystemOneRequest"]["properties"]
    request["questions"]["maxProperties"] = limits.max_questions
    request["model"]["anyOf"][0]["maxLength"] = limits.max_name_chars
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    errors = {code: {"description": text, **error} for code, text in _ERRORS.items()}
    ok = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/SystemOneResponse"}}}}
    plain = {"content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "canvasroute serve", "version": "1",
                 "description": "Gated decisions on the Jev wire. Bounds: " + limits.describe()},
        "paths": {
            "/v1/systemone": {"post": {
                "operationId": "systemone", "summary": "Answer a decision set",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}},
                "responses": {"200": {"description": "the answers", **ok}, **errors},
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
