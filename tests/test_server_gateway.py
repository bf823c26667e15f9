"""vLLM's gateway's request keys through `canvasroute serve`, on the real vLLM CPU server (issue #22).

Each request is one a client of vLLM's reference gateway sends: `samples` (1, N,
"auto"), request `instructions`, `depends_on` / `ask_if` / `alone`, `think`, `steps`, `ask`,
images as a multipart upload, Choices of 16 and 60 options. Every 200 must validate against the
gateway's response schema (`gateway_contract.py`) and parse with `typesafe-sdk`; what reached vLLM
is recorded on the way (`Recording`).
"""

from __future__ import annotations

import base64
import json

import httpx
import httpx2
import jsonschema
import pytest
from deadlines import patience
from gateway_contract import GATEWAY_CONTRACT
from test_core_read import Recording
from typesafe_sdk import SystemOneResponse

from canvasroute.apps.server import create_app
from canvasroute.engine import Connection, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy

pytestmark = pytest.mark.vllm

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does the customer need an answer today?"},
    "team": {"type": "choice", "instructions": "Which team owns this ticket?",
             "criteria": {"billing": "charges, refunds", "technical": "bugs", "sales": None}},
    "severity": {"type": "score", "instructions": "How severe is it?", "criteria": ["minor", "major", "blocking"]},
}
STATE = "I was charged twice for my subscription this month."
OK = GATEWAY_CONTRACT["paths"]["/v1/systemone"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
                       "RU5ErkJggg==")


def sdk(r: httpx.Response) -> SystemOneResponse:
    """A reply as `typesafe-sdk` parses it (its own strict answer types)."""
    return SystemOneResponse.from_http_response(httpx2.Response(
        r.status_code, content=r.content, headers=dict(r.headers), request=httpx2.Request("POST", str(r.request.url))))


@pytest.fixture
async def gateway(vllm_url):
    """(POST a body to /v1/systemone, the recorded vLLM requests) for a canvasroute app on the real server."""
    transport = Recording()
    model = CanvasDecisionModel(engine=VLLMServerEngine(Connection(vllm_url, transport=transport)),
                                policy=GatePolicy(max_normalized_entropy=0.0))  # the random model: always unsure
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(model)), base_url="http://serve.test",
                                 timeout=patience(120)) as http:
        async def post(body=None, **kwargs):
            r = await http.post("/v1/systemone", json=body, **kwargs) if body is not None else \
                await http.post("/v1/systemone", **kwargs)
            if r.status_code == 200:
                jsonschema.validate(r.json(), OK)  # the gateway's response schema
                sdk(r)
            return r
        yield post, transport
    await model.engine.aclose()


async def test_samples_one_n_and_auto(gateway):
    post, transport = gateway
    one = await post({"state": STATE, "questions": QUESTIONS, "samples": 1})
    assert one.status_code == 200, one.text
    assert len(transport.reads()) == 1 and one.json()["diagnostics"]["timing"]["reads"] == 1
    assert one.json()["diagnostics"]["samples"]["policy"] == {"mode": "fixed", "n": 1}
    three = await post({"state": STATE, "questions": QUESTIONS, "samples": 3})
    assert len(transport.reads()) == 4 and three.json()["diagnostics"]["samples"]["n"] == 3
    # fixed reads, none of them re-reads; the gate (0.0) passes none and nothing escalates: unsure
    assert {a["x_canvasroute"]["path"] for a in three.json()["answers"].values()} == {"unsure"}
    auto = await post({"state": STATE, "questions": QUESTIONS, "samples": "auto", "auto_max": 2})
    assert len(transport.reads()) == 6  # one read, then one more: every question is unsure
    diag = auto.json()["diagnostics"]
    assert diag["samples"]["policy"]["mode"] == "auto" and diag["samples"]["policy"]["extended"] is True
    assert {q["reads"] for q in diag["questions"].values()} == {2}
    assert all(len(q["entropy"]) == 2 and isinstance(q["pos"], int) for q in diag["questions"].values())
    sure = await post({"state": STATE, "questions": QUESTIONS, "samples": "auto", "auto_threshold": 10.0})
    assert sure.status_code == 200 and len(transport.reads()) == 6 + 4  # the server's gate still re-reads


async def test_instructions_depends_on_ask_if_and_alone(gateway):
    post, transport = gateway

    def body(wanted):
        return {"state": STATE, "samples": 1, "instructions": "Every ticket is from an EU customer.", "questions": {
            "team": QUESTIONS["team"],
            "urgent": {**QUESTIONS["urgent"], "depends_on": ["team"]},
            "severity": {**QUESTIONS["severity"], "ask_if": {"team": wanted}},
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?", "alone": True},
        }}

    every = await post(body(list(QUESTIONS["team"]["criteria"])))
    assert set(every.json()["answers"]) == set(body([])["questions"])  # the condition holds: all answered
    team = every.json()["answers"]["team"]["choice"]  # the same read as below: same stage, prompt and seed
    other = next(o for o in QUESTIONS["team"]["criteria"] if o != team)
    r = await post(body([other]))
    assert r.status_code == 200, r.text
    data = r.json()
    diag = data["diagnostics"]
    assert set(data["answers"]) == {"team", "urgent", "refund"}  # severity was skipped: no answer
    assert diag["stages"][1] == ["urgent"] and diag["conditioning"] == "restated"
    assert diag["skipped"]["severity"]["because"] == "team" and diag["skipped"]["severity"]["wanted"] == [other]
    assert ["refund"] in diag["chunks"]  # alone: a canvas of its own
    later = transport.reads()[-1]
    assert later["messages"][0]["content"].startswith("Every ticket is from an EU customer.\n\n")
    assert "Earlier answers about this input:" in later["messages"][1]["content"]


async def test_think_steps_and_ask(gateway):
    post, transport = gateway
    r = await post({"state": STATE, "questions": QUESTIONS, "samples": 1, "think": 4, "steps": 2,
                    "ask": ["team", "urgent"]})
    assert r.status_code == 200, r.text
    data = r.json()
    assert set(data["answers"]) == {"team", "urgent"}
    thought = data["diagnostics"]["thought"]
    assert set(thought) == {"tokens", "closed", "ms", "text"} and 0 < thought["tokens"] <= 4
    (read,) = transport.reads()
    assert read["vllm_xargs"]["diffusion_max_steps"] == 2 and "diffusion_pinned" in read["vllm_xargs"]
    assert data["diagnostics"]["steps"] == 2


async def test_a_multipart_upload_reaches_vllm_which_here_refuses_images(gateway):
    """The images go to vLLM as image parts; this CPU server runs with images off, so the
    typed refusal comes back as the gateway's 422 (the tiny checkpoint's chat template
    renders no image placeholders: a positive image read needs another checkpoint)."""
    post, transport = gateway
    files = {"request": (None, json.dumps({"state": STATE, "questions": QUESTIONS, "samples": 1}), "application/json"),
             "screenshot": ("screen.png", PNG, "image/png")}
    r = await post(files=files)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "images_unsupported" and "images" in r.json()["error"]["message"]
    assert "tiny-dgemma" not in r.text and "127.0.0.1" not in r.text  # the engine's details stay in the log
    sent = [json.loads(q.content) for q in transport.requests if q.url.path == "/v1/chat/completions"]
    assert sent[-1]["messages"][1]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}
    bad = await post(files={"screenshot": ("screen.png", PNG, "image/png")})
    assert bad.status_code == 422 and "request" in bad.json()["error"]["message"]  # issue 39.5: no 400 left


async def test_sixteen_and_sixty_options_are_read_with_labels_this_tokenizer_keeps_whole(gateway):
    """System One takes 2 to 255 options. On the test checkpoint's tokenizer neither fixed alphabet
    of 16 (A-P, a-p) is one token at the slot ('J' and 'k' change the template's length), so the
    planner scans the tokenizer for labels it keeps whole (16 options were refused with
    label_error while 60, which have no fixed alphabet, read)."""
    post, _ = gateway
    for k in (16, 60):
        options = {f"topic {i}": None for i in range(k)}
        r = await post({"state": STATE, "samples": 1, "questions": {
            "topic": {"type": "choice", "instructions": "Which topic is this ticket about?", "criteria": options}}})
        assert r.status_code == 200, r.text
        answer = r.json()["answers"]["topic"]
        labels = answer["x_canvasroute"]["labels"]
        assert len(set(labels)) == k and set(answer["probabilities"]) == set(options)
        assert sum(answer["probabilities"].values()) == pytest.approx(1.0)
        assert sdk(r).choices["topic"].choice in options
    assert "J" not in labels[:16]  # the scanned labels, not the fixed alphabet
