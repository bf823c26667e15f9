"""The decision server: the Jev wire at /v1/systemone, errors, load shedding, tracing, `canvasroute serve`."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from deadlines import Watch, bounded, finish, patience, run, wait_until
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from opentelemetry.trace import SpanKind, StatusCode
from services import child_env

from canvasroute.apps.server import cli as serve
from canvasroute.apps.server import create_app, run_in_thread
from canvasroute.engine import Connection, EngineOverloaded, EngineUnavailable, FunctionEngine, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy, save_policy

KEY = "sk-test-key"
LABELS = ("yes", "no", "A", "B", "C", "1", "2", "3")
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is this urgent?", "criteria": {"true": "today", "false": "later"}},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None,
                                                                           "sales": "plans"}},
    "sev": {"type": "score", "instructions": "How severe?", "criteria": ["low", "medium", "high"]},
}
BODY = {"state": "I was charged twice, refund me.", "questions": QUESTIONS}


def confident(engine: FunctionEngine):
    """Rows that put almost all mass on each slot's first label (yes / billing / level 0)."""
    return lambda read: [dict.fromkeys(read.label_ids, -5.01) | {engine.token_id(t): -0.01 for t in ("yes", "A", "1")}
                    ] * len(read.slots)


def uniform(engine: FunctionEngine):
    return lambda read: [{engine.token_id(t): -2.0 for t in LABELS}] * len(read.slots)


def function_model(rows=confident, **kwargs) -> CanvasDecisionModel:
    """A model on a FunctionEngine whose rows come from `rows(engine)`."""
    engine = FunctionEngine(lambda read: fn(read))
    fn = rows(engine)
    return CanvasDecisionModel(engine=engine, **kwargs)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://canvasroute.test")


# -- the wire, against the real vLLM server -----------------------------------------------


@pytest.mark.vllm
def test_typesafe_sdk_gets_typed_answers_from_our_server_on_real_vllm(vllm_url):
    from typesafe_sdk import Box as TSBox
    from typesafe_sdk import Choice as TSChoice
    from typesafe_sdk import Noul as TSNoul
    from typesafe_sdk import RetryPolicy, TypeSafeAuthenticationError, TypeSafeClient, TypeSafeUnprocessableEntityError
    from typesafe_sdk import Score as TSScore

    model = CanvasDecisionModel(engine=VLLMServerEngine(vllm_url), policy=GatePolicy(rereads=1))
    app = create_app(model, api_key=KEY, aliases=("jev-latest",))
    questions = {
        "urgent": TSNoul(instructions="Is this urgent?", criteria={"true": "money is lost", "false": "it can wait"}),
        "team": TSChoice(instructions="Which team?", criteria={"billing": "charges", "tech": None, "sales": "plans"}),
        "sev": TSScore(instructions="How severe?", criteria=["low", "medium", "high"]),
    }
    state = "I was charged twice for my subscription and nobody answers."
    with run_in_thread(app) as url:
        # the SDK's defaults: model "jev-latest" (an alias here), zstd only when installed
        with TypeSafeClient(api_key=KEY, base_url=url, retry=RetryPolicy(max_retries=0), timeout=patience(60)) as jev:
            result = jev.system_one(state=state, questions=questions)
            listed = jev.models.list()
            with pytest.raises(TypeSafeUnprocessableEntityError, match="Box questions have no canvas form"):
                jev.system_one(state=state, questions={"where": TSBox(instructions="the logo")})
        with (TypeSafeClient(api_key="wrong", base_url=url, retry=RetryPolicy(max_retries=0)) as bad,
              pytest.raises(TypeSafeAuthenticationError)):
            bad.system_one(state=state, questions=questions)

    assert result.model == "tiny-dgemma"
    assert 0.0 <= result.nouls["urgent"].noul <= 1.0
    team = result.choices["team"]
    assert team.choice in {"billing", "tech", "sales"} and set(team.probabilities) == {"billing", "tech", "sales"}
    assert sum(team.probabilities.values()) == pytest.approx(1.0)
    assert team.confidence == pytest.approx((max(team.probabilities.values()) - 1 / 3) / (1 - 1 / 3))  # System One's
    sev = result.scores["sev"]
    assert sev.legend == {0: "low", 1: "medium", 2: "high"} and set(sev.probabilities) == {0, 1, 2}
    assert sev.score == pytest.approx(sum(i * p for i, p in sev.probabilities.items()))
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0
    assert {m.name for m in listed.models} == {"tiny-dgemma", "jev-latest"}
    # the wire carries exactly what the model decides in-process (reads are seeded and deterministic)
    direct = model.invoke({"state": state, "questions": {
        "urgent": Noul(**questions["urgent"].model_dump()), "team": Choice(**questions["team"].model_dump()),
        "sev": Score(**questions["sev"].model_dump())}})
    assert result.nouls["urgent"].noul == pytest.approx(direct.answers["urgent"].noul, abs=1e-9)
    assert team.probabilities == pytest.approx(direct.answers["team"].probabilities, abs=1e-9)
    assert sev.score == pytest.approx(direct.answers["sev"].score, abs=1e-9)
    extension = result.raw_http_response.json()["answers"]["team"]["x_canvasroute"]
    assert extension["path"] == direct.reads["team"].path and extension["reads"] == direct.reads["team"].reads
    assert extension["normalized_entropy"] == pytest.approx(direct.reads["team"].normalized_entropy)


PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
                       "RU5ErkJggg==")
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 16  # a JPEG's signature: all a wire check reads


def vision_model():
    """A model on the loopback vLLM (as a MockTransport), which takes image parts; (model, its fake)."""
    from test_server_engine import FakeVLLM, engine_for

    fake = FakeVLLM(read=FakeVLLM.ranked)
    return CanvasDecisionModel(engine=engine_for(fake), policy=GatePolicy(rereads=0)), fake


def test_typesafe_sdk_images_are_read_where_their_placeholders_are():
    """System One's `assets` as typesafe-sdk sends them (a multipart body; each image a file part its
    `assets` entry names, its placeholder in the state and the instructions): every image is read
    with the decision, in order of first appearance, and the text says [image N] in its place."""
    from typesafe_sdk import Image, RetryPolicy, TypeSafeClient
    from typesafe_sdk import Noul as TSNoul

    model, fake = vision_model()
    shot, logo = Image(PNG), Image(JPEG)
    with run_in_thread(create_app(model)) as url, \
            TypeSafeClient(api_key="k", base_url=url, retry=RetryPolicy(max_retries=0)) as jev:
        result = jev.system_one(state={"ticket": "The app crashed.", "screenshot": shot},
                                questions={"logo": TSNoul(instructions=f"Does {logo} appear in the screenshot?")},
                                assets={str(logo): logo})  # text naming an image: the SDK sends those passed
    assert 0.0 <= result.nouls["logo"].noul <= 1.0
    (read,) = fake.read_bodies()
    system, (text, *images) = read["messages"][0]["content"], read["messages"][1]["content"]
    assert [i["image_url"]["url"] for i in images] == [f"data:image/png;base64,{base64.b64encode(PNG).decode()}",
                                                       f"data:image/jpeg;base64,{base64.b64encode(JPEG).decode()}"]
    assert json.loads(text["text"]) == {"ticket": "The app crashed.", "screenshot": "[image 1]"}
    assert "Does [image 2] appear in the screenshot?" in system and "<image:" not in system + text["text"]


async def test_json_assets_are_read_and_bad_ones_are_422():
    model, fake = vision_model()
    png = base64.b64encode(PNG).decode()
    body = {"state": "See <shot>.", "questions": {"urgent": QUESTIONS["urgent"]},
            "assets": {"<shot>": {"type": "image", "format": "png", "data_base64": png}}}
    bad = {"assets": ([], "assets"), "part": ({"<shot>": {"type": "image", "part": "asset-0"}}, "assets.<shot>.part"),
           "base64": ({"<shot>": {"format": "png", "data_base64": "not base64!"}}, "assets.<shot>.data_base64"),
           "format": ({"<shot>": {"data_base64": png}}, "assets.<shot>.format"),
           "type": ({"<shot>": {"type": "audio", "data_base64": png}}, "assets.<shot>")}
    async with client(create_app(model)) as http:
        ok = await http.post("/v1/systemone", json=body)
        refused = {name: await http.post("/v1/systemone", json={**body, "assets": assets})
                   for name, (assets, _) in bad.items()}
    assert ok.status_code == 200, ok.text
    (read,) = fake.read_bodies()
    assert read["messages"][1]["content"] == [{"type": "text", "text": "See [image 1]."}, {
        "type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]
    for name, (_, param) in bad.items():
        assert refused[name].status_code == 422 and refused[name].json()["error"]["param"] == param, name
    assert len(fake.read_bodies()) == 1  # nothing refused reached the engine


JEV_ANSWER_KEYS = {"noul": {"type", "noul"}, "choice": {"type", "choice", "probabilities", "confidence"},
                   "score": {"type", "score", "legend", "probabilities", "confidence"}}


async def _gateway(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=patience(120)) as http:
        return await http.post(f"{url}/v1/systemone", json=body)


def _gateway_urls() -> list[str]:
    extra = os.environ.get("CANVASROUTE_VLLM_GATEWAY_URL")
    return ["fixture", *([extra] if extra else [])]


@pytest.mark.vllm
@pytest.mark.parametrize("which", _gateway_urls())
async def test_answer_shapes_match_vllms_own_gateway(vllm_url, which):
    """Same request to vLLM's /v1/systemone and to ours (backed by the same vLLM server).

    vLLM enables its gateway only when `yes`, `no`, `A`-`Z` and `0`-`9` are each one token
    after its template; the fixture's tiny tokenizer splits `yes`, so there it answers 501
    and we check that refusal instead. CANVASROUTE_VLLM_GATEWAY_URL adds a server whose
    tokenizer keeps them whole, where the live shapes are compared.
    """
    url = vllm_url if which == "fixture" else which
    name = (await VLLMServerEngine(url).info()).model
    body = {**BODY, "model": name, "instructions": "Support tickets."}  # a key of vLLM's: its fields come back
    theirs = await _gateway(url, body)
    if theirs.status_code == 501:
        assert theirs.json()["error"]["message"] == "The model does not support the structured decision API"
        return
    assert theirs.status_code == 200, theirs.text
    async with client(create_app(CanvasDecisionModel(engine=VLLMServerEngine(url)))) as http:
        ours = await http.post("/v1/systemone", json=body)
    assert ours.status_code == 200, ours.text
    t, o = theirs.json(), ours.json()
    assert set(t) - {"diagnostics"} <= set(o)  # id, object, created, model, answers, usage
    assert o["object"] == t["object"] and o["model"] == t["model"] and set(o["usage"]) == set(t["usage"])
    for qid, answer in t["answers"].items():
        mine = o["answers"][qid]
        assert set(mine) - {"x_canvasroute"} == set(answer), qid  # vLLM's keys, no more, no fewer
        assert JEV_ANSWER_KEYS[answer["type"]] <= set(mine)
        assert mine["type"] == answer["type"]
        for key in ("probabilities", "legend"):
            if key in answer:
                assert set(mine[key]) == set(answer[key]), (qid, key)
        if "legend" in answer:
            assert mine["legend"] == answer["legend"]


# -- shapes, extension and errors (FunctionEngine) ----------------------------------------


SYSTEM_ONE_KEYS = {"noul": {"type", "noul"}, "choice": {"type", "choice", "probabilities", "confidence"},
                   "score": {"type", "score", "legend", "probabilities", "confidence"}}
"""Each answer's fields as System One defines them (TypeSafe's Jev and vLLM's gateway alike)."""


async def test_answers_carry_the_jev_fields_and_the_x_canvasroute_extension():
    """Issue 34.7 and 39.5: a reply holds System One's fields (`model`, `answers`, `usage`), the
    gateway's `diagnostics` (its contract requires it on every 200), and canvasroute's own figures
    only under `x_canvasroute` objects, System One's prefix for what its spec does not define (on
    main: `canvasroute`): no top-level `id`/`object`/`created`, no `probabilities`/`confidence` on a
    noul. A Choice's and a Score's confidence is System One's: `(p - 1/K) / (1 - 1/K)` of the answer."""
    async with client(create_app(function_model())) as http:
        r = await http.post("/v1/systemone", json=BODY)
    data = r.json()
    assert r.status_code == 200 and r.headers["x-request-id"] == data["x_canvasroute"]["decision_id"]
    assert set(data) == {"model", "answers", "usage", "diagnostics", "x_canvasroute"} and data["model"] == "function"
    assert set(data["x_canvasroute"]) == {"decision_id", "canvas_reads", "ignored"}
    assert data["x_canvasroute"]["canvas_reads"] == 1
    assert set(data["usage"]) == {"input_tokens", "output_tokens"}
    for answer in data["answers"].values():
        assert set(answer) == SYSTEM_ONE_KEYS[answer["type"]] | {"x_canvasroute"}
    urgent, team, sev = (data["answers"][q] for q in ("urgent", "team", "sev"))
    assert urgent["type"] == "noul" and urgent["noul"] > 0.99
    assert team["choice"] == "billing" and team["confidence"] == pytest.approx(
        (team["probabilities"]["billing"] - 1 / 3) / (1 - 1 / 3))
    assert sev["legend"] == {"0": "low", "1": "medium", "2": "high"} and set(sev["probabilities"]) == {"0", "1", "2"}
    assert sev["score"] == pytest.approx(sum(int(k) * p for k, p in sev["probabilities"].items()))
    assert sev["confidence"] == pytest.approx((sev["probabilities"]["0"] - 1 / 3) / (1 - 1 / 3))
    ext = team["x_canvasroute"]
    assert ext["path"] == "canvas" and ext["confident"] is True and ext["reads"] == 1
    assert ext["labels"] == ["A", "B", "C"] and 0 <= ext["normalized_entropy"] < 0.1
    assert ext["confidence"] == team["probabilities"]["billing"]  # the gate's figure: the canvas's top probability


@pytest.mark.parametrize("key", [{"samples": 1}, {"instructions": "Support tickets."}, {"request_id": "r1"},
                                 {"questions": {**QUESTIONS, "urgent": {**QUESTIONS["urgent"], "alone": True}}}])
async def test_a_request_using_the_gateways_keys_gets_its_fields_too(key):
    """vLLM's own /v1/systemone adds `id`, `object`, `created` and a noul's `probabilities` and
    `confidence`: a client that speaks its keys gets them (the confidence System One's, |2p - 1|)."""
    async with client(create_app(function_model())) as http:
        r = await http.post("/v1/systemone", json={**BODY, **key})
    data = r.json()
    assert r.status_code == 200, r.text
    assert (data["id"], data["object"]) == (data["x_canvasroute"]["decision_id"], "structured_decision")
    assert isinstance(data["created"], int)
    urgent = data["answers"]["urgent"]
    assert urgent["probabilities"] == {"yes": urgent["noul"], "no": pytest.approx(1 - urgent["noul"])}
    assert urgent["confidence"] == pytest.approx(abs(2 * urgent["noul"] - 1))
    assert set(data["answers"]["team"]) == SYSTEM_ONE_KEYS["choice"] | {"x_canvasroute"}


async def test_confidence_is_system_ones_on_every_answer():
    """0 at an even distribution, 1 with all the mass on the answer; the library's answers and
    the wire agree."""
    even = function_model(uniform)
    async with client(create_app(even)) as http:
        data = (await http.post("/v1/systemone", json=BODY)).json()
    assert data["answers"]["team"]["confidence"] == pytest.approx(0.0, abs=1e-9)
    assert data["answers"]["sev"]["confidence"] == pytest.approx(0.0, abs=1e-9)
    resp = await function_model().adecide(BODY["state"], BODY["questions"])
    for qid in ("team", "sev"):
        p = resp.reads[qid].probabilities[resp.reads[qid].answer]
        assert resp.answers[qid].confidence == pytest.approx((p - 1 / 3) / (1 - 1 / 3))  # type: ignore[union-attr]


async def test_health_and_models():
    async with client(create_app(function_model(), aliases=("jev-latest",))) as http:
        health = (await http.get("/health")).json()
        models = (await http.get("/v1/models")).json()
        missing = await http.get("/v2/nothing")
    assert health["status"] == "ok" and health["model"] == "function" and health["in_flight"] == 0
    assert [m["id"] for m in models["data"]] == ["function", "jev-latest"]
    assert models["object"] == "list" and {m["name"] for m in models["models"]} == {"function", "jev-latest"}
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"


async def test_health_reports_an_unreachable_engine():
    model = CanvasDecisionModel(engine=VLLMServerEngine(Connection("http://127.0.0.1:9", retries=0)))
    async with client(create_app(model)) as http:
        r = await http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                                     {"authorization": KEY}])
async def test_a_configured_key_is_required(headers):
    async with client(create_app(function_model(), api_key=KEY)) as http:
        r = await http.post("/v1/systemone", json=BODY, headers=headers)
        models = await http.get("/v1/models", headers=headers)
        ok = await http.post("/v1/systemone", json=BODY, headers={"authorization": f"Bearer {KEY}"})
        health = await http.get("/health")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert models.status_code == 401
    assert ok.status_code == 200 and health.status_code == 200


def _q(**fields):
    return {"state": "x", "questions": {"q": fields}}


@pytest.mark.parametrize(("body", "param"), [
    (json.dumps({"questions": QUESTIONS}).encode(), "state"),
    (json.dumps({"state": None, "questions": QUESTIONS}).encode(), "state"),
    (json.dumps({"state": "x"}).encode(), "questions"),
    (json.dumps({"state": "x", "questions": {}}).encode(), "questions"),
    (json.dumps({"state": "x", "questions": [QUESTIONS["urgent"]]}).encode(), "questions"),
    (json.dumps({"state": "x", "questions": {"q": "is it urgent?"}}).encode(), "questions.q"),
    (json.dumps(_q(instructions="x")).encode(), "questions.q.type"),
    (json.dumps(_q(type="maybe", instructions="x")).encode(), "questions.q.type"),
    (json.dumps(_q(type="noul", instructions="x", criteria=["a", "b"])).encode(), "questions.q.criteria"),
    (json.dumps(_q(type="choice", instructions="x", criteria=["a", "b"])).encode(), "questions.q.criteria"),
    (json.dumps(_q(type="score", instructions="x", criteria={"low": 0})).encode(), "questions.q.criteria"),
    (json.dumps({**BODY, "seed": "seven"}).encode(), "seed"),
    (json.dumps({**BODY, "model": 7}).encode(), "model"),
    (json.dumps({**BODY, "samples": 0}).encode(), "samples"),
    (json.dumps({**BODY, "samples": True}).encode(), "samples"),
    (json.dumps({**BODY, "samples": "auto", "auto_max": 99}).encode(), "auto_max"),
    (json.dumps({**BODY, "auto_threshold": -1}).encode(), "auto_threshold"),
    (json.dumps({**BODY, "steps": 9}).encode(), "steps"),
    (json.dumps({**BODY, "think": -1}).encode(), "think"),
    (json.dumps({**BODY, "ask": ["nope"]}).encode(), "ask"),
    (json.dumps({**BODY, "images": ["https://example.test/a.png"]}).encode(), "images.0"),
    (json.dumps({**BODY, "sequential": True}).encode(), "sequential"),
    (json.dumps({"state": "x", "questions": {"q": {**QUESTIONS["urgent"], "depends_on": "team"}}}).encode(),
     "questions.q.depends_on"),
    (json.dumps({"state": "x", "questions": {"q": {**QUESTIONS["urgent"], "ask_if": {"team": ["finance"]}},
                                             "team": QUESTIONS["team"]}}).encode(), "questions.q.ask_if.team"),
    (json.dumps({"state": "x", "questions": {"q": {**QUESTIONS["urgent"], "alone": "yes"}}}).encode(),
     "questions.q.alone"),
])
async def test_malformed_fields_are_422(body, param):
    """A field, question or feature the server cannot use is 422 (as vLLM's gateway answers)."""
    model = function_model()
    async with client(create_app(model)) as http:
        r = await http.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == 422 and error["message"]
    assert error.get("param") == param
    assert model.engine.reads == []


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"just text"', b"\xff\xfe"])
async def test_a_body_that_is_not_a_json_object_is_422_with_a_detail_list(body):
    """Issue 39.5: a body that is not JSON (or not an object) answers 422 with FastAPI's `detail`
    list, like every other validation failure (on main: 400, vLLM's gateway's code, and no list)."""
    model = function_model()
    async with client(create_app(model)) as http:
        r = await http.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] in ("invalid_json", "invalid_body") and error["message"] and error["code"] == 422
    assert r.json()["detail"] == [{"loc": ["body"], "msg": error["message"], "type": error["type"]}]
    assert model.engine.reads == []


@pytest.mark.parametrize(("question", "kind"), [
    ({"type": "box", "instructions": "the logo"}, "unsupported_question"),
    ({"type": "choice", "instructions": "Which?", "criteria": {}}, "too_few_options"),
    ({"type": "choice", "instructions": "Which?", "criteria": {"only": None}}, "too_few_options"),
    ({"type": "score", "instructions": "How much?", "criteria": ["only one level"]}, "too_few_levels"),
])
async def test_unaskable_questions_are_422(question, kind):
    model = function_model()
    async with client(create_app(model)) as http:
        r = await http.post("/v1/systemone", json={"state": "x", "questions": {"urgent": QUESTIONS["urgent"],
                                                                             "q": question}})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == kind
    assert model.engine.reads == []


async def test_what_the_gateway_takes_is_served():
    """Requests vLLM's gateway serves are served: any JSON state, any JSON instructions and
    criteria, an empty option name, options differing in case, unknown keys (ignored, and
    listed in the diagnostics), a request-level instructions."""
    model = function_model()
    bodies = [
        {"state": 3, "questions": QUESTIONS},
        {"state": True, "questions": QUESTIONS},
        {"state": "x", "questions": {"q": {"type": "noul", "instructions": 5, "weight": 2}}},
        {"state": "x", "questions": {"q": {"type": "noul", "instructions": {"ask": "urgent?"},
                                           "criteria": {"true": 1, "maybe": "?"}}}},
        {"state": "x", "questions": {"q": {"type": "choice", "instructions": None,
                                           "criteria": {"": "none of them", "Billing": None, "billing ": 7}}}},
        {"state": "x", "questions": {"q": {"type": "score", "criteria": [1, 2.5, {"level": "high"}]}}},
        {**BODY, "instructions": ["every ticket is from the EU"], "color": "blue"},
    ]
    async with client(create_app(model)) as http:
        replies = [await http.post("/v1/systemone", json=b) for b in bodies]
    for body, r in zip(bodies, replies, strict=True):
        assert r.status_code == 200, (body, r.text)
        assert set(r.json()["answers"]) == set(body["questions"]) and "diagnostics" in r.json()
    assert replies[2].json()["diagnostics"]["ignored"] == ["questions.q.weight"]
    assert replies[6].json()["diagnostics"]["ignored"] == ["color"]
    assert set(replies[4].json()["answers"]["q"]["probabilities"]) == {"", "Billing", "billing "}
    system = model.engine.reads[-1].messages[0]["content"]
    assert system.startswith('["every ticket is from the EU"]\n\n')  # request instructions head the prompt
    assert [read.messages[1]["content"] for read in model.engine.reads[:2]] == ["3", "true"]


async def test_too_long_state_media_and_unknown_model():
    engine = FunctionEngine(lambda read: fn(read), max_model_len=200)
    fn = confident(engine)
    async with client(create_app(CanvasDecisionModel(engine=engine))) as http:
        long = await http.post("/v1/systemone", json={**BODY, "state": "word " * 400})
        media = await http.post("/v1/systemone", json={**BODY, "images": ["data:image/png;base64,AAAA"]})
        video = await http.post("/v1/systemone", json={**BODY, "videos": ["data:video/mp4;base64,AAAA"]})
        unknown = await http.post("/v1/systemone", json={**BODY, "model": "gpt-4o"})  # jev-latest is an alias
    assert long.status_code == 422 and long.json()["error"]["type"] == "input_too_long"
    assert media.status_code == 422 and media.json()["error"]["type"] == "images_unsupported"  # this engine reads text
    assert video.status_code == 422 and video.json()["error"]["param"] == "videos"
    assert unknown.status_code == 422 and unknown.json()["error"]["type"] == "model_not_found"
    assert engine.reads == []


async def test_body_limits_and_encodings():
    model = function_model()
    async with client(create_app(model, max_body_bytes=4096)) as http:
        zipped = await http.post("/v1/systemone", content=gzip.compress(json.dumps(BODY).encode()),
                                 headers={"content-type": "application/json", "content-encoding": "gzip"})
        bomb = await http.post("/v1/systemone", content=gzip.compress(b" " * 100_000),
                               headers={"content-encoding": "gzip"})
        big = await http.post("/v1/systemone", json={**BODY, "state": "x" * 5000})
        brotli = await http.post("/v1/systemone", content=b"...", headers={"content-encoding": "br"})
    assert zipped.status_code == 200 and zipped.json()["answers"]["team"]["choice"] == "billing"
    assert bomb.status_code == 413 and big.status_code == 413
    assert brotli.status_code == 415 and brotli.json()["error"]["type"] == "unsupported_media_type"


# -- engine faults, escalation, timeouts --------------------------------------------------


def _failing(exc: Exception):
    def rows(engine):
        def fail(read):
            raise exc
        return fail
    return rows


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (EngineUnavailable("vLLM is down"), 503, "engine_unavailable"),
    (EngineOverloaded("vLLM said 529"), 529, "engine_overloaded"),
])
async def test_engine_faults_without_escalation_are_503_or_529(exc, status, kind, spans, caplog):
    async with client(create_app(function_model(_failing(exc)))) as http:
        r = await http.post("/v1/systemone", json=BODY)
    assert r.status_code == status and r.headers["retry-after"] == "1"
    # the client gets the stable code; the engine's own words go to the log (and the span), never the reply
    assert r.json()["error"]["type"] == kind and str(exc) not in r.text
    assert str(exc) in caplog.text and r.headers["x-request-id"] in caplog.text
    (server,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert server.status.status_code == StatusCode.ERROR and server.attributes["error.type"] == kind


async def test_engine_faults_escalate_when_the_policy_says_so():
    fake = GenericFakeChatModel(messages=iter([AIMessage('{"urgent": "no", "team": "tech", "sev": "2"}')]))
    model = function_model(_failing(EngineUnavailable("vLLM is down")), escalate_to=fake)
    async with client(create_app(model)) as http:
        r = await http.post("/v1/systemone", json=BODY)
    assert r.status_code == 200, r.text
    answers = r.json()["answers"]
    assert answers["team"]["choice"] == "tech" and answers["urgent"]["noul"] == 0.0 and answers["sev"]["score"] == 2
    assert {a["x_canvasroute"]["path"] for a in answers.values()} == {"escalated"}
    assert "vLLM is down" in answers["team"]["x_canvasroute"]["error"]


async def test_timeouts_running_are_504_and_waiting_are_529():
    """The first request holds the only slot past the second's deadline (its engine
    takes a while to abort), so the second times out waiting."""
    reading = asyncio.Event()

    async def slow_to_abort(read):
        reading.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(1.0)
            raise

    app = create_app(function_model(lambda engine: slow_to_abort), max_in_flight=1, max_queue=4,
                     request_timeout=0.3)
    async with client(app) as http:
        first = asyncio.ensure_future(http.post("/v1/systemone", json=BODY))
        await bounded(reading.wait(), 10, what="the first read")  # the first holds the only slot
        second = await http.post("/v1/systemone", json=BODY)
        first = await first
    assert (first.status_code, first.json()["error"]["type"]) == (504, "timeout")
    assert (second.status_code, second.json()["error"]["type"]) == (529, "overloaded")
    assert app.state.gate.admitted == 0 and app.state.gate.running == 0


async def test_over_the_rate_is_429():
    async with client(create_app(function_model(), rate_limit=0.01, rate_burst=2)) as http:
        codes = [(await http.post("/v1/systemone", json=BODY)).status_code for _ in range(3)]
        last = await http.post("/v1/systemone", json=BODY)
    assert codes == [200, 200, 429]
    assert last.json()["error"]["type"] == "rate_limit_exceeded" and int(last.headers["retry-after"]) >= 1


# -- the gate in one order; outcomes a server can honour -----------------------------------


def by_state(engine: FunctionEngine):
    """A Noul read p(yes) = 0.95 about the state "sure" (0.20 nats, 0.29 of ln 2: within a 0.5 gate),
    uniform about any other state."""
    def rows(read):
        if read.messages[1]["content"] == "sure":
            return [{i: math.log(0.05) for i in read.label_ids} | {engine.token_id("yes"): math.log(0.95)}
                    ] * len(read.slots)
        return [dict.fromkeys(read.label_ids, -1.0)] * len(read.slots)
    return rows


async def test_auto_threshold_asks_for_more_reads_never_for_an_escalation():
    """Defect 8: a request's auto_threshold is where re-reading starts (GatePolicy.reread_above), not
    a stricter gate. An answer the server's gate passes whose first read is over the client's
    threshold is re-read and answered from the canvas: the (paid) escalation target is never
    called. An answer over the server's gate still escalates."""
    target = function_model()
    model = function_model(by_state, policy=GatePolicy(max_normalized_entropy=0.5), escalate_to=target)
    auto = {"samples": "auto", "auto_max": 3, "auto_threshold": 0.1}
    urgent = {"urgent": QUESTIONS["urgent"]}
    async with client(create_app(model)) as http:
        sure = await http.post("/v1/systemone", json={"state": "sure", "questions": urgent, **auto})
        calls_when_sure = len(target.engine.reads)
        unsure = await http.post("/v1/systemone", json={"state": "unsure", "questions": urgent, **auto})
    assert sure.status_code == 200, sure.text
    ext = sure.json()["answers"]["urgent"]["x_canvasroute"]
    assert ext["entropy"] > 0.1 and ext["normalized_entropy"] <= 0.5  # over the client's threshold, within the gate
    assert (ext["path"], ext["cause"], ext["reads"], ext["confident"]) == ("reread", None, 3, True)
    assert sure.json()["diagnostics"]["samples"]["policy"] == {
        "mode": "auto", "max": 3, "threshold": 0.1, "extended": True,
        "first_read_entropy": {"urgent": pytest.approx(ext["entropy"])}}
    assert calls_when_sure == 0  # the client's threshold bought reads, not an escalation
    over = unsure.json()["answers"]["urgent"]["x_canvasroute"]
    assert (over["path"], over["cause"]) == ("escalated", "uncertain")
    assert len(target.engine.reads) == 1


async def test_on_uncertain_answer_keeps_the_canvas_answer_though_a_target_is_set():
    target = function_model()
    model = function_model(uniform, escalate_to=target, outcomes=OutcomePolicy(uncertain="answer"))
    async with client(create_app(model)) as http:
        r = await http.post("/v1/systemone", json=BODY)
    assert r.status_code == 200, r.text
    assert {(a["x_canvasroute"]["path"], a["x_canvasroute"]["cause"]) for a in r.json()["answers"].values()} == {
        ("unsure", "uncertain")}
    assert target.engine.reads == []


@pytest.mark.parametrize("outcomes", [
    OutcomePolicy(uncertain="review"),
    OutcomePolicy(uncertain="raise"),
    OutcomePolicy(uncertain="fallback", fallback={"team": "billing"}),
    OutcomePolicy(abstained="fallback", fallback={"team": "billing"}),
    OutcomePolicy(engine_fault="fallback", fallback={"team": "billing"}),
    OutcomePolicy(over_budget="fallback", fallback={"team": "billing"}),
])
def test_create_app_refuses_an_outcome_the_wire_cannot_carry(outcomes):
    """Defect 16: refused when the app is built, naming the field (not a 500 or a 422 per request)."""
    field = next(f for f in ("uncertain", "abstained", "engine_fault", "over_budget")
                 if getattr(outcomes, f) != getattr(OutcomePolicy(), f))
    action = getattr(outcomes, field)
    with pytest.raises(ValueError, match=re.escape(f"OutcomePolicy.{field}={action!r} cannot be served over HTTP")):
        create_app(function_model(outcomes=outcomes))


def test_create_app_refuses_abstaining_questions_with_nowhere_to_go():
    policy = GatePolicy(per_question={"team": GatePolicy(abstain=True)})
    with pytest.raises(ValueError, match=r"OutcomePolicy.abstained='escalate'.*no escalation target"):
        create_app(function_model(policy=policy))
    create_app(function_model(policy=policy, outcomes=OutcomePolicy(abstained="answer")))
    create_app(function_model(policy=policy, escalate_to=function_model()))


# -- load shedding -------------------------------------------------------------------------


async def test_overload_sheds_529_and_answers_every_accepted_request():
    """40 clients at once, 4 running + 8 queued: exactly 12 accepted (all answered), 28 shed."""
    release = asyncio.Event()
    running = peak = 0

    def rows(engine):
        async def held(read):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            try:
                await release.wait()
            finally:
                running -= 1
            return [dict.fromkeys(read.label_ids, -5.01) | {engine.token_id(t): -0.01 for t in ("yes", "A", "1")}
                    ] * len(read.slots)
        return held

    app = create_app(function_model(rows), max_in_flight=4, max_queue=8)
    gate = app.state.gate
    async with client(app) as http:
        tasks = [asyncio.ensure_future(http.post("/v1/systemone", json=BODY)) for _ in range(40)]
        for _ in range(500):  # the shed ones come back while the accepted ones are held
            if sum(t.done() for t in tasks) == 28 and running == 4:
                break
            await asyncio.sleep(0.01)
        assert sum(t.done() for t in tasks) == 28 and gate.admitted == 12 and gate.running == running == 4
        release.set()
        results = await asyncio.gather(*tasks)
    codes = [r.status_code for r in results]
    assert codes.count(200) == 12 and codes.count(529) == 28 and len(codes) == 40
    for r in results:
        if r.status_code == 200:
            assert set(r.json()["answers"]) == set(QUESTIONS)
        else:
            assert r.json()["error"]["type"] == "overloaded" and r.headers["retry-after"] == "1"
    assert peak == 4 and gate.peak_running == 4 and gate.peak_admitted == 12
    assert gate.admitted == 0 and gate.rejected == 28


async def test_a_burst_stays_within_its_bounds():
    """300 clients at once against slots held by a short sleep: counts stay bounded."""
    running = peak = 0

    def rows(engine):
        async def napping(read):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.005)
            running -= 1
            return [dict.fromkeys(read.label_ids, -5.01) | {engine.token_id(t): -0.01 for t in ("yes", "A", "1")}
                    ] * len(read.slots)
        return napping

    app = create_app(function_model(rows), max_in_flight=4, max_queue=16)
    async with client(app) as http:
        results = await asyncio.gather(*(http.post("/v1/systemone", json=BODY) for _ in range(300)))
    codes = [r.status_code for r in results]
    assert codes.count(200) + codes.count(529) == 300
    assert codes.count(200) >= 20  # at least the first max_in_flight + max_queue
    gate = app.state.gate
    assert peak <= 4 and gate.peak_running <= 4 and gate.peak_admitted <= 20
    assert gate.rejected == codes.count(529) and gate.admitted == 0


# -- tracing -------------------------------------------------------------------------------


async def test_a_server_span_continues_the_callers_trace_and_holds_the_decision(spans):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    async with client(create_app(function_model())) as http:
        ok = await http.post("/v1/systemone", json=BODY, headers=headers)
        bad = await http.post("/v1/systemone", json={"state": "x", "questions": {"q": {"type": "box"}}})
    assert ok.status_code == 200 and bad.status_code == 422
    finished = spans.get_finished_spans()
    server_ok, server_bad = [s for s in finished if s.kind == SpanKind.SERVER]
    assert server_ok.name == "POST /v1/systemone"
    assert format(server_ok.context.trace_id, "032x") == trace_id
    assert format(server_ok.parent.span_id, "016x") == parent_id
    assert server_ok.attributes["http.response.status_code"] == 200
    assert server_ok.attributes["canvasroute.questions"] == 3
    (decide,) = [s for s in finished if s.name.startswith("decide ")]
    assert decide.parent.span_id == server_ok.context.span_id
    assert server_bad.attributes["http.response.status_code"] == 422
    assert server_bad.attributes["error.type"] == "unsupported_question"
    assert server_bad.status.status_code != StatusCode.ERROR  # a client error is not a server fault


# -- canvasroute serve ---------------------------------------------------------------------


def _args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    serve.configure(parser)
    return parser.parse_args(argv)


def test_serve_flags_build_the_model_and_app(tmp_path):
    from langchain_openai import ChatOpenAI

    args = _args(["--engine-url", "http://127.0.0.1:9,http://127.0.0.1:10", "--max-normalized-entropy", "0.3",
                  "--rereads", "1", "--escalate-url", "http://127.0.0.1:11/v1", "--escalate-model", "big-model",
                  "--api-key", KEY, "--max-in-flight", "3", "--max-queue", "5", "--model-alias", "jev-latest"])
    app = serve.build_app(args)
    model = app.state.model
    assert model.policy.max_normalized_entropy == 0.3 and model.policy.rereads == 1
    target = model.escalate_to.target
    assert isinstance(target, ChatOpenAI) and target.model_name == "big-model"
    assert str(target.openai_api_base) == "http://127.0.0.1:11/v1"
    assert model.outcomes == OutcomePolicy()  # escalate what the gate does not pass, engine faults too
    assert "http://127.0.0.1:9, http://127.0.0.1:10" in repr(model.engine)
    assert app.state.gate.max_in_flight == 3 and app.state.gate.max_queue == 5


def test_serve_loads_a_policy_file_and_flags_override_it(tmp_path):
    path = save_policy(tmp_path / "policy.json", GatePolicy(
        max_normalized_entropy=0.2, min_margin=0.1, rereads=2,
        per_question={"team": GatePolicy(max_normalized_entropy=0.7, temperature=1.5)}))
    policy = serve.build_model(_args(["--engine-url", "http://127.0.0.1:9", "--policy", str(path),
                                      "--rereads", "0"])).policy
    assert (policy.max_normalized_entropy, policy.min_margin, policy.rereads) == (0.2, 0.1, 0)
    assert policy.for_question("team").temperature == 1.5
    assert serve.run(_args(["--engine-url", "http://127.0.0.1:9", "--policy", str(tmp_path / "none.json")])) == 2


def test_serve_gate_flags_reach_the_questions_calibrate_fitted(tmp_path, monkeypatch):
    """Defect 7: the gate in one order, policy file (with its per-question fits), then the flags for
    every question (fits included), then the request's own keys. The file fits `team` a looser
    gate and two re-reads; the flags say 0.4 and none, and reach `team` too."""
    from canvasroute import engine

    path = save_policy(tmp_path / "policy.json", GatePolicy(max_normalized_entropy=0.2, rereads=2, per_question={
        "team": GatePolicy(max_normalized_entropy=0.9, temperature=1.5, rereads=2)}))

    def rows(read):  # p = (0.8, 0.1, 0.1): 0.79 of ln 3 at temperature 1.5
        return [{i: math.log(0.1) for i in read.label_ids} | {fitted.token_id("A"): math.log(0.8)}] * len(read.slots)

    fitted = FunctionEngine(rows)
    monkeypatch.setattr(engine, "embedded_engine", lambda: fitted)
    model = serve.build_model(_args(["--engine", "embedded", "--policy", str(path),
                                     "--max-normalized-entropy", "0.4", "--rereads", "0"]))
    team = model.policy.for_question("team")
    assert (team.max_normalized_entropy, team.rereads, team.temperature) == (0.4, 0, 1.5)  # the fit's temperature kept
    body = {"state": "I was charged twice.", "questions": {"team": QUESTIONS["team"]}}

    async def post(**keys):
        async with client(create_app(model)) as http:
            return (await http.post("/v1/systemone", json={**body, **keys})).json()["answers"]["team"]["x_canvasroute"]
    flags, asked = asyncio.run(post()), asyncio.run(post(samples="auto", auto_max=3))
    assert 0.4 < flags["normalized_entropy"] < 0.9  # the file's gate would pass it; the flag's does not
    assert (flags["path"], flags["cause"], flags["reads"]) == ("unsure", "uncertain", 1)  # --rereads 0, not the fit's 2
    assert (asked["path"], asked["reads"]) == ("unsure", 3)  # the request's own samples come last


def test_serve_refuses_at_start_an_outcome_it_cannot_honour(tmp_path, monkeypatch, capsys):
    """Defect 16: exit 2 and a message naming the field, before any engine is built."""
    url = ["--engine-url", "http://127.0.0.1:9"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "canvasroute.policy/1", "policy": {
        "max_normalized_entropy": 0.4, "per_question": {"team": {"on_unsure": "fallback", "on_abstain": "fallback"}}}}))
    with pytest.warns(DeprecationWarning, match="policy file: on_abstain= is"):  # a 0.1 file: it loads, then
        assert serve.run(_args([*url, "--policy", str(old)])) == 2  # its outcomes cannot be served
    err = capsys.readouterr().err
    assert "OutcomePolicy.uncertain" in err and "OutcomePolicy.abstained" in err and "--on-uncertain" in err
    assert "on_unsure='fallback'" in err
    defaults = tmp_path / "defaults.json"  # what 0.1's calibrate wrote: every key, at its default
    defaults.write_text(json.dumps({"format": "canvasroute.policy/1", "policy": {
        "max_normalized_entropy": 0.4, "on_unsure": "answer", "on_abstain": "escalate"}}))
    with pytest.warns(DeprecationWarning, match="policy file: on_abstain= is"):
        served = serve.build_model(_args([*url, "--policy", str(defaults)]))
    assert served.policy == GatePolicy(max_normalized_entropy=0.4) and served.outcomes == OutcomePolicy()
    monkeypatch.setenv("CANVASROUTE_ON_UNCERTAIN", "review")
    assert serve.run(_args(url)) == 2
    assert "OutcomePolicy.uncertain='review' cannot be served over HTTP: there is no human review lane" in \
        capsys.readouterr().err
    monkeypatch.delenv("CANVASROUTE_ON_UNCERTAIN")
    for flag, action in (("--on-uncertain", "raise"), ("--on-uncertain", "fallback"), ("--on-abstain", "fallback"),
                         ("--on-engine-error", "fallback")):
        with pytest.raises(SystemExit) as refused:
            _args([*url, flag, action])
        assert refused.value.code == 2 and f"invalid choice: '{action}'" in capsys.readouterr().err
    abstaining = save_policy(tmp_path / "abstain.json", GatePolicy(abstain=True))
    assert serve.run(_args([*url, "--policy", str(abstaining)])) == 2
    assert "--on-abstain answer" in capsys.readouterr().err
    model = serve.build_model(_args([*url, "--policy", str(abstaining), "--on-abstain", "answer",
                                     "--on-uncertain", "answer", "--on-engine-error", "raise"]))
    assert model.outcomes == OutcomePolicy(uncertain="answer", abstained="answer", engine_fault="raise")


def test_canvasroute_serve_exits_2_on_an_outcome_it_cannot_honour(tmp_path):
    proc = run([sys.executable, "-m", "canvasroute.apps.cli", "serve", "--engine-url", "http://127.0.0.1:9"],
               cwd=tmp_path, env=child_env(CANVASROUTE_ON_UNCERTAIN="raise"), cpu_s=60)
    assert proc.returncode == 2, proc.stderr
    assert "OutcomePolicy.uncertain='raise' cannot be served over HTTP" in proc.stderr


def test_serve_reads_canvasroute_environment_variables(monkeypatch):
    monkeypatch.setenv("CANVASROUTE_ENGINE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CANVASROUTE_API_KEY", KEY)
    monkeypatch.setenv("CANVASROUTE_REREADS", "2")
    monkeypatch.setenv("CANVASROUTE_MAX_QUEUE", "7")
    args = _args([])
    assert (args.engine_url, args.api_key, args.rereads, args.max_queue) == ("http://127.0.0.1:9", KEY, 2, 7)
    assert _args(["--rereads", "0"]).rereads == 0  # a flag wins over its variable


def test_serve_embedded_engine_says_it_is_near_chance(monkeypatch, caplog):
    from canvasroute import engine

    stand_in = FunctionEngine(lambda read: [], model="SmolLM2-135M-Instruct")
    monkeypatch.setattr(engine, "embedded_engine", lambda: stand_in)  # the real one loads weights (tested elsewhere)
    with caplog.at_level("WARNING", logger="canvasroute.serve"):
        model = serve.build_model(_args(["--engine", "embedded"]))
    assert model.engine is stand_in
    assert "near chance" in caplog.text


def test_serve_refuses_an_incomplete_configuration(capsys, monkeypatch):
    for name in ("CANVASROUTE_ENGINE_URL", "CANVASROUTE_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    assert serve.run(_args([])) == 2
    assert "no engine" in capsys.readouterr().err
    assert serve.run(_args(["--engine-url", "http://127.0.0.1:9", "--escalate-model", "big"])) == 2
    assert "--escalate-url" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_canvasroute_serve_answers_over_http(vllm_url, tmp_path):
    port = _free_port()
    env = child_env(CANVASROUTE_API_KEY=KEY, CANVASROUTE_REREADS="0")
    proc = subprocess.Popen([sys.executable, "-m", "canvasroute.apps.cli", "serve", "--engine-url", vllm_url,
                             "--port", str(port), "--log-level", "warning"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=patience(2)).status_code == 200,
                   Watch(proc.pid, cpu_s=60, idle_s=60, what="canvasroute serve"), what="canvasroute serve", proc=proc)
        r = httpx.post(f"{url}/v1/systemone", json=BODY, headers={"authorization": f"Bearer {KEY}"},
                       timeout=patience(60))
        denied = httpx.post(f"{url}/v1/systemone", json=BODY, timeout=patience(10))
    finally:
        proc.send_signal(signal.SIGINT)
        out = finish(proc, Watch(proc.pid, cpu_s=30, idle_s=30, what="canvasroute serve stopping"))[0]
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-dgemma"
    assert {a["x_canvasroute"]["reads"] for a in r.json()["answers"].values()} == {1}  # CANVASROUTE_REREADS=0
    assert denied.status_code == 401
    assert proc.returncode == 0, out
