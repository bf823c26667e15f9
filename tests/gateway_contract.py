"""vLLM's gateway's `/v1/systemone` contract, as read from its OpenAPI (issue #22).

`examples/features/structured_diffusion/systemone-openapi.yaml` in vllm-project/vllm (read
at commit 98d1cfc0) describes the request and the replies of vLLM's reference gateway.
This is that contract restated here, field by field, so the suite can hold `canvasroute
serve` to it (`test_server_contract.py`); nothing of the gateway's code is in it.

What it says, in short: a request is an object with `state` (anything) and `questions`
(1 to 64 of Choice, Noul or Score, each an open object: extra keys allowed), optionally
`model` (a string) and `samples` (only 1); a 200 is an object with `model`, `answers`
(objects), `usage` and `diagnostics` (objects); 400 means a malformed JSON or multipart
body, 401 a missing or wrong bearer key, 422 a question schema, feature or answer template
that cannot be used, 500 a gateway fault, 502 a failed vLLM request; every error is
`{"error": {"message", "type"}}`. (canvasroute answers a body that is not JSON 422, with FastAPI's
`detail` list, like its other validation failures: issue #39 point 5. No request the contract
allows is such a body.)
"""

from __future__ import annotations

from typing import Any

_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

GATEWAY_CONTRACT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "vLLM structured-diffusion gateway, /v1/systemone (as read at vllm@98d1cfc0)",
             "version": "1.0.0"},
    "paths": {"/v1/systemone": {"post": {
        "operationId": "decide",
        "security": [{"bearerAuth": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object",
            "required": ["state", "questions"],
            "properties": {
                "model": {"type": "string"},
                "state": {},
                "questions": {"type": "object", "minProperties": 1, "maxProperties": 64,
                              "additionalProperties": {"oneOf": [{"$ref": "#/components/schemas/Choice"},
                                                                 {"$ref": "#/components/schemas/Noul"},
                                                                 {"$ref": "#/components/schemas/Score"}]}},
                "samples": {"type": "integer", "enum": [1]},
            },
        }}}},
        "responses": {
            "200": {"description": "typed answers keyed by the question ids", "content": {"application/json": {
                "schema": {"type": "object", "required": ["model", "answers", "usage", "diagnostics"],
                           "properties": {"model": {"type": "string"},
                                          "answers": {"type": "object", "additionalProperties": {"type": "object"}},
                                          "usage": {"type": "object"},
                                          "diagnostics": {"type": "object"}}}}}},
            "400": {"description": "malformed JSON or multipart body", **_ERROR},
            "401": {"description": "missing or wrong bearer key", **_ERROR},
            "422": {"description": "a question schema, feature or answer template that cannot be used", **_ERROR},
            "500": {"description": "a gateway fault", **_ERROR},
            "502": {"description": "the vLLM request failed", **_ERROR},
        },
    }}},
    "components": {
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}}},
            "Choice": {"type": "object", "required": ["type", "criteria"], "properties": {
                "type": {"type": "string", "enum": ["choice"]}, "instructions": {},
                "criteria": {"type": "object", "minProperties": 2, "maxProperties": 26, "additionalProperties": {}}}},
            "Noul": {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["noul"]}, "instructions": {},
                "criteria": {"type": "object", "properties": {"true": {}, "false": {}}}}},
            "Score": {"type": "object", "required": ["type", "criteria"], "properties": {
                "type": {"type": "string", "enum": ["score"]}, "instructions": {},
                "criteria": {"type": "array", "minItems": 2, "maxItems": 26, "items": {}}}},
        },
    },
}

STRICTER = {413: "the state or the body is over this server's size bound (Limits)"}
"""Statuses canvasroute answers an upstream-allowed request with beyond the contract's own, documented."""
