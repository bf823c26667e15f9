"""`canvasroute serve` held to vLLM's gateway's contract (`gateway_contract.py`), fuzzed with schemathesis.

Schemathesis generates requests from the gateway's own request schema: positive cases (the
requests it allows) must be answered 200, or refused with the contract's 422 (a question,
feature or bound this server does not take) or this server's documented 413 (its size
bound); negative cases get a 4xx. Every reply, whatever the request, must validate
against the contract's response schema for its status (`response_schema_conformance`):
a 200 with `model`, `answers`, `usage` and `diagnostics`, an error with `error.message` and
`error.type`. Over real HTTP, against a uvicorn server on a FunctionEngine (speed: the
same wire on the real vLLM CPU server is `test_server.py::test_the_gateways_requests_on_real_vllm`),
in a background job (tests/background.py): its own app in its own process, started at collection.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from background import job
from fuzzing import CLIENT_S, PATIENT, REQUEST_S, run_cases
from gateway_contract import GATEWAY_CONTRACT, STRICTER
from schemathesis import GenerationMode
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

from canvasroute.apps.server import create_app, run_in_thread
from canvasroute.engine import FunctionEngine
from canvasroute.router import CanvasDecisionModel

REQUESTS = 300
SERVED = {200, 422, *STRICTER}
"""What a request the contract allows may be answered: served, or refused with the contract's or our documented code."""
REFUSED = {400, 413, 415, 422}
ALLOWED_REFUSALS = {
    "invalid_state": "a null state (the gateway too: 'state: required')",
    "invalid_question_id": "an empty or blank question id (the gateway too)",
    "model_not_found": "a model this server neither serves nor aliases (documented)",
    "name_too_long": "an id or name over Limits.max_name_chars (documented)",
    "text_too_long": "a text over Limits.max_text_chars (documented)",
    "state_too_large": "a state over Limits.max_state_chars (413, documented)",
}
"""The refusals an allowed request may get: the gateway's own, and this server's documented bounds."""


def _model() -> CanvasDecisionModel:
    engine = FunctionEngine(lambda read: [{i: math.log(1 / len(read.label_ids)) for i in read.label_ids}]
                            * len(read.slots))
    return CanvasDecisionModel(engine=engine)


@job
def gateway_fuzz(work: Path) -> dict[str, Any]:
    """Schemathesis on the contract's `POST /v1/systemone` (`REQUESTS` cases, 3 positive to 1 negative), in a
    process of its own: the (mode, status) pairs seen, the refusals by kind, the problems found."""
    schema = schemathesis.openapi.from_dict(GATEWAY_CONTRACT)
    operation = schema["/v1/systemone"]["POST"]
    strategies = [operation.as_strategy(generation_mode=GenerationMode.POSITIVE)] * 3 + [
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)]
    app = create_app(_model(), request_timeout=REQUEST_S)
    seen: dict[tuple[str, int], int] = {}
    kinds: dict[str, int] = {}
    problems: list[str] = []
    calls = itertools.count()

    with run_in_thread(app, limits=PATIENT) as url, requests.Session() as session:
        def fuzz(case):
            next(calls)
            response = case.call(base_url=url, session=session, timeout=CLIENT_S)
            mode, status = case.meta.generation.mode.value, response.status_code
            seen[(mode, status)] = seen.get((mode, status), 0) + 1
            where = f"{mode} -> {status}: {json.dumps(case.body, default=str)[:200]} => {response.text[:300]}"
            if status in (400, 413, 422):
                kind = response.json()["error"]["type"]
                kinds[f"{mode} {status} {kind}"] = kinds.get(f"{mode} {status} {kind}", 0) + 1
            if status not in (SERVED if mode == "positive" else SERVED | REFUSED):
                problems.append(f"status: {where}")
            try:
                case.validate_response(response, checks=[response_schema_conformance])
            except (Failure, FailureGroup) as exc:  # a single failure or a group of them
                problems.append(f"schema ({type(exc).__name__}: {str(exc)[:300]}): {where}")

        elapsed = run_cases(strategies, REQUESTS, fuzz)

    return {"seen": seen, "kinds": kinds, "problems": problems, "requests": next(calls), "elapsed": elapsed}


@pytest.mark.slow
def test_every_reply_conforms_to_the_gateway_contract_and_every_allowed_request_is_served(gateway_fuzz):
    seen, kinds, problems = gateway_fuzz["seen"], gateway_fuzz["kinds"], gateway_fuzz["problems"]
    print(f"gateway contract: {gateway_fuzz['requests']} requests in {gateway_fuzz['elapsed']:.1f}s, "
          f"(mode, status) {dict(sorted(seen.items()))}, refusals {dict(sorted(kinds.items()))}")
    assert problems == []
    refused = {k.split()[-1] for k in kinds if k.startswith("positive")}
    assert refused <= set(ALLOWED_REFUSALS), refused - set(ALLOWED_REFUSALS)
    assert seen.get(("positive", 200), 0) >= 40  # allowed requests are served
