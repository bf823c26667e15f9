"""A server no input can break (issue #16): each test plays a hostile client against the real server.

Where the wire matters (keep-alive, slow uploads, disconnects, the Jev SDK) the app runs
under a real uvicorn on loopback; the rest go through httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from deadlines import holds, patience

from canvasroute.apps.server import create_app, run_in_thread
from canvasroute.apps.server.app import JEV_ALIASES
from canvasroute.apps.server.limits import Limits
from canvasroute.engine import Connection, EngineResponseError, FunctionEngine, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel

KEY = "sk-hostile-test-key"
NOUL = {"type": "noul", "instructions": "Is this urgent?"}
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None}}
BODY = {"state": "I was charged twice, refund me.", "questions": {"urgent": NOUL, "team": CHOICE}}
JSON = {"content-type": "application/json"}


def model(fn=None, **engine_kwargs) -> CanvasDecisionModel:
    """A model on a FunctionEngine: confident rows, or what `fn(engine)` gives."""
    engine = FunctionEngine(lambda read: rows(read), **engine_kwargs)
    rows = fn(engine) if fn else (lambda read: [dict.fromkeys(read.label_ids, -6.0)
                                                | {engine.token_id(t): -0.01 for t in ("yes", "A")}] * len(read.slots))
    return CanvasDecisionModel(engine=engine)


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://canvasroute.test")


def _raw(body: str) -> bytes:
    return body.encode()


# -- 1. inputs that gave 500 ----------------------------------------------------------------

_Q = '{"type": "noul", "instructions": "x"}'
HOSTILE = {
    "surrogate in a question id": '{"state": "x", "questions": {"\\ud800": %s}}' % _Q,
    "surrogate in the state": '{"state": "a\\ud800b", "questions": {"q": %s}}' % _Q,
    "surrogate in an option": '{"state": "x", "questions": {"q": {"type": "choice", "instructions": "x", '
                              '"criteria": {"\\udfff": null, "b": null}}}}',
    "surrogate in instructions": '{"state": "x", "questions": {"q": {"type": "noul", "instructions": "\\ud800"}}}',
    "surrogate in the model": '{"model": "\\ud800", "state": "x", "questions": {"q": %s}}' % _Q,
    "nested 1,000 deep": '{"state": %s, "questions": {"q": %s}}' % ("[" * 1000 + "]" * 1000, _Q),
    "nested 100 deep": '{"state": %s, "questions": {"q": %s}}' % ("[" * 100 + "]" * 100, _Q),
    "a 5,000-digit number": '{"state": "x", "seed": %s, "questions": {"q": %s}}' % ("9" * 5000, _Q),
}


def test_hostile_bodies_get_a_json_4xx_before_any_engine_work_and_the_connection_stays_open():
    m = model()
    with run_in_thread(create_app(m)) as url:
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=patience(10))
        conn.connect()
        sock = conn.sock
        for name, body in HOSTILE.items():
            conn.request("POST", "/v1/systemone", body=_raw(body), headers=JSON)
            r = conn.getresponse()
            data = json.loads(r.read())
            assert 400 <= r.status < 500 and data["error"]["code"] == r.status, (name, r.status, data)
            assert r.getheader("connection", "").lower() != "close", name
        conn.request("POST", "/v1/systemone", body=json.dumps(BODY), headers=JSON)
        ok = conn.getresponse()
        assert ok.status == 200 and json.loads(ok.read())["answers"]["team"]["choice"] == "billing"
        assert conn.sock is sock  # one keep-alive connection carried every request
        conn.close()
    assert len(m.engine.reads) == 1  # only the good request reached the engine


@pytest.mark.parametrize(("body", "loc", "kind"), [
    ('{"state": null, "questions": {"q": %s}}' % _Q, ["body", "state"], "invalid_state"),
    ('{"questions": {"q": %s}}' % _Q, ["body", "state"], "missing"),
    ('{"state": NaN, "questions": {"q": %s}}' % _Q, ["body", "state"], "invalid_number"),
    ('{"state": {"x": [1, -Infinity]}, "questions": {"q": %s}}' % _Q, ["body", "state", "x", 1], "invalid_number"),
    ('{"state": {"x": 1e999}, "questions": {"q": %s}}' % _Q, ["body", "state", "x"], "invalid_number"),
])
async def test_null_state_and_nan_or_infinity_are_422_with_where(body, loc, kind):
    """A null or missing state is a field error (422, with FastAPI's `detail` list Jev clients
    read); NaN and Infinity are not JSON, and a body that is not JSON is a validation failure like
    any other (issue 39.5; on main it was 400, with no `detail`), naming the place."""
    m = model()
    async with asgi(create_app(m)) as http:
        r = await http.post("/v1/systemone", content=body, headers=JSON)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == kind and error["param"] == ".".join(map(str, loc)).removeprefix("body.")
    (detail,) = r.json()["detail"]
    assert detail["loc"] == loc and detail["type"] == kind and detail["msg"]
    assert m.engine.reads == []


def _asking(**fields) -> dict:
    return {"state": "x", "questions": {"q": NOUL}, **fields}


INVALID = {  # a body that fails validation, and the place its detail names
    "a choice of one option": ({"state": "x", "questions": {"q": {"type": "choice", "criteria": {"a": None}}}},
                               ["body", "questions", "q", "criteria"]),
    "a choice of no option": ({"state": "x", "questions": {"q": {"type": "choice", "criteria": {}}}},
                              ["body", "questions", "q", "criteria"]),
    "a score of one level": ({"state": "x", "questions": {"q": {"type": "score", "criteria": ["only"]}}},
                             ["body", "questions", "q", "criteria"]),
    "no questions": ({"state": "x", "questions": {}}, ["body", "questions"]),
    "an unknown type": ({"state": "x", "questions": {"q": {"type": "bool"}}}, ["body", "questions", "q", "type"]),
    "a Box": ({"state": "x", "questions": {"q": {"type": "box"}}}, ["body", "questions", "q"]),
    "a dependency cycle": ({"state": "x", "questions": {"a": {**NOUL, "depends_on": ["b"]},
                                                       "b": {**NOUL, "depends_on": ["a"]}}}, ["body"]),
    "an ask_if answer that is none": (
        {"state": "x", "questions": {"a": NOUL, "b": {**NOUL, "ask_if": {"a": ["maybe"]}}}},
        ["body", "questions", "b", "ask_if", "a"]),
    "samples 0": (_asking(samples=0), ["body", "samples"]),
    "a seed that is a boolean": (_asking(seed=True), ["body", "seed"]),
    "an image that is no image": (_asking(images=["https://example.com/a.png"]), ["body", "images", 0]),
    "ask naming nothing asked": (_asking(ask=["zz"]), ["body", "ask"]),
    "a model not served": (_asking(model="gpt-6-luna"), ["body", "model"]),
    "chunk_prompt shared": (_asking(chunk_prompt="shared"), ["body", "chunk_prompt"]),
}


@pytest.mark.parametrize("case", list(INVALID))
async def test_every_validation_failure_is_422_with_a_detail_list(case):
    """Issue 34.7: a body that fails validation answers 422 with FastAPI's `detail` list (each item
    `loc`, `msg`, `type`), before any read; a one-option Choice was answered 200."""
    body, loc = INVALID[case]
    m = model()
    async with asgi(create_app(m)) as http:
        r = await http.post("/v1/systemone", json=body)
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert (detail["loc"], detail["type"]) == (loc, r.json()["error"]["type"]) and detail["msg"]
    assert m.engine.reads == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "image/png"])
async def test_a_body_that_is_not_json_is_415(content_type):
    m = model()
    async with asgi(create_app(m)) as http:
        r = await http.post("/v1/systemone", content=json.dumps(BODY), headers={"content-type": content_type})
        problem_json = await http.post("/v1/systemone", content=json.dumps(BODY),
                                       headers={"content-type": "application/problem+json; charset=utf-8"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_media_type"
    assert r.json()["detail"][0]["loc"] == ["header", "content-type"]
    assert problem_json.status_code == 200
    assert len(m.engine.reads) == 1


# -- 2. bounds before work ---------------------------------------------------------------------

def _questions(n: int) -> dict:
    return {f"q{i}": NOUL for i in range(n)}


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"state": "x", "questions": _questions(1000)}, 422, "too_many_questions"),
    ({"state": "x", "questions": {"q": {"type": "choice", "instructions": "x",
                                        "criteria": {f"o{i}": None for i in range(256)}}}}, 422, "too_many_options"),
    ({"state": "x", "questions": {"q": {"type": "score", "instructions": "x",
                                        "criteria": [f"l{i}" for i in range(40)]}}}, 422, "too_many_levels"),
    ({"state": "x" * 70_000, "questions": {"q": NOUL}}, 413, "state_too_large"),
    ({"state": {"rows": ["x" * 1000] * 70}, "questions": {"q": NOUL}}, 413, "state_too_large"),
    ({"state": "x", "questions": {"q": {"type": "noul", "instructions": "x" * 9000}}}, 422, "text_too_long"),
    ({"state": "x", "questions": {"q": {"type": "choice", "instructions": "x",
                                        "criteria": {"a": "x" * 9000, "b": None}}}}, 422, "text_too_long"),
    ({"state": "x", "questions": {"q" * 300: NOUL}}, 422, "name_too_long"),
    ({**BODY, "thread_id": "t" * 300}, 422, "name_too_long"),
    ({**BODY, "instructions": "x" * 9000}, 422, "text_too_long"),
])
async def test_bounds_are_decided_before_admission(body, status, kind):
    m = model()
    app = create_app(m)
    async with asgi(app) as http:
        started = time.monotonic()
        r = await http.post("/v1/systemone", json=body)
    assert (r.status_code, r.json()["error"]["type"]) == (status, kind), r.text
    assert time.monotonic() - started < patience(2.0)
    assert m.engine.reads == [] and app.state.gate.peak_admitted == 0  # never took a place


# -- 3. slow bodies cost a socket, not a slot ---------------------------------------------------

def _open_upload(url: str, declared: int, sent: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=patience(10))
    s.sendall(f"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              f"content-length: {declared}\r\n\r\n".encode() + sent)
    return s


def requests_in_flight(app: Any) -> float:
    """HTTP requests the app is answering now (its own `canvasroute_server_requests_in_flight`)."""
    return app.state.metrics.registry.get_sample_value("canvasroute_server_requests_in_flight") or 0.0


def test_slow_uploads_hold_no_slot_and_time_out_408():
    app = create_app(model(), max_in_flight=1, max_queue=0, limits=Limits(body_timeout=1.0))
    with run_in_thread(app) as url:
        slow = [_open_upload(url, 500, b'{"st') for _ in range(4)]  # and then nothing more
        holds(lambda: requests_in_flight(app) == 4, within=5, what="the app reading all four bodies")
        ok = httpx.post(f"{url}/v1/systemone", json=BODY, timeout=patience(10))
        replies = [s.recv(200) for s in slow]
        for s in slow:
            s.close()
    assert ok.status_code == 200  # the only slot was free: the stalled uploads held none
    assert all(r.startswith(b"HTTP/1.1 408") for r in replies), replies
    assert app.state.gate.peak_admitted == 1 and app.state.gate.rejected == 0


# -- 4. engine trouble is not overload ----------------------------------------------------------

@contextmanager
def silent_engine() -> Iterator[str]:
    """A TCP server that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(patience(5))
        for s in [*held, listener]:
            s.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_engine_that_never_answers_is_504_and_an_unreachable_one_503():
    with silent_engine() as url:
        slow_app = create_app(CanvasDecisionModel(engine=VLLMServerEngine(Connection(url, retries=0))),
                              request_timeout=1.0)
        quick_app = create_app(CanvasDecisionModel(engine=VLLMServerEngine(Connection(url, timeout=0.3, retries=0))),
                               request_timeout=5.0)
        async with asgi(slow_app) as a, asgi(quick_app) as b:
            started = time.monotonic()
            hung = await a.post("/v1/systemone", json=BODY)
            hung_s = time.monotonic() - started
            timed_out = await b.post("/v1/systemone", json=BODY)
    down_url = f"http://127.0.0.1:{_closed_port()}"
    async with asgi(create_app(CanvasDecisionModel(engine=VLLMServerEngine(Connection(down_url, retries=0))),
                               request_timeout=5.0)) as c:
        down = await c.post("/v1/systemone", json=BODY)
    # the request timeout (1 s) ended it, not the engine's (60 s)
    assert (hung.status_code, hung.json()["error"]["type"]) == (504, "timeout") and hung_s < patience(3.0)
    assert (timed_out.status_code, timed_out.json()["error"]["type"]) == (504, "engine_timeout")
    assert (down.status_code, down.json()["error"]["type"]) == (503, "engine_unavailable")
    for r in (hung, timed_out, down):
        assert "127.0.0.1" not in r.text and "Error" not in r.text and "Traceback" not in r.text


# -- 5. leaks ---------------------------------------------------------------------------------

async def test_health_shows_no_engine_url_and_no_exception_names():
    down_url = f"http://127.0.0.1:{_closed_port()}"
    async with asgi(create_app(CanvasDecisionModel(engine=VLLMServerEngine(Connection(down_url, retries=0))))) as http:
        r = await http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert r.json()["error"] == "engine_unavailable"
    assert down_url.split("//")[1] not in r.text and "Engine" not in r.text and "Error" not in r.text


async def test_a_model_path_is_shown_by_its_name_only():
    async with asgi(create_app(model(model="/opt/models/cache/SmolLM2-135M-Instruct"), api_key=KEY)) as http:
        health = await http.get("/health")
        r = await http.post("/v1/systemone", json={**BODY, "model": "SmolLM2-135M-Instruct"},
                            headers={"authorization": f"Bearer {KEY}"})
    assert health.json()["model"] == "SmolLM2-135M-Instruct" and "/opt" not in health.text
    assert r.status_code == 200 and r.json()["model"] == "SmolLM2-135M-Instruct" and "/opt" not in r.text


@pytest.mark.parametrize("exc", [RuntimeError("boom at /srv/secret/app.py line 7"),
                                 EngineResponseError("http://10.0.0.7:8000 said: <html>internal page</html>")])
async def test_faults_answer_a_stable_code_and_log_the_details(exc, caplog):
    def failing(engine):
        def read(_):
            raise exc
        return read

    async with asgi(create_app(model(failing))) as http:
        r = await http.post("/v1/systemone", json=BODY)
    assert r.status_code in (500, 502)
    assert r.json()["error"]["type"] in ("internal_error", "engine_error")
    for secret in ("/srv/secret", "10.0.0.7", "<html>", "RuntimeError", "EngineResponseError", "Traceback"):
        assert secret not in r.text
    assert str(exc) in caplog.text and r.headers["x-request-id"] in caplog.text


async def test_a_trailing_slash_with_a_forged_host_is_not_redirected():
    async with asgi(create_app(model())) as http:
        r = await http.post("/v1/systemone/", json=BODY, headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers and "evil.example" not in r.text


# -- 6. disconnects ----------------------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def recorded(*names: str) -> Iterator[_Records]:
    handler = _Records()
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def test_work_for_a_client_that_went_away_is_cancelled():
    started, cancelled = threading.Event(), threading.Event()

    def held(engine):
        async def read(_):
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return read

    app = create_app(model(held), max_in_flight=1)
    with run_in_thread(app) as url, recorded("canvasroute.server", "uvicorn.error") as log:
        body = json.dumps(BODY).encode()
        s = _open_upload(url, len(body), body)
        holds(started.is_set, within=5, what="the read starting")
        s.close()
        holds(cancelled.is_set, within=5, what="the engine call cancelled")  # the slot is free for others
        holds(lambda: app.state.gate.admitted == 0 and app.state.gate.running == 0, within=5, what="the gate empty")
        holds(lambda: any("disconnected" in r.getMessage() for r in log.records), within=5, what="the log line")
    assert not [r for r in log.records if r.levelno >= logging.ERROR]


def test_a_disconnect_during_upload_is_logged_as_a_disconnect_not_an_error():
    app = create_app(model())
    with run_in_thread(app) as url, recorded("canvasroute.server", "uvicorn.error") as log:
        s = _open_upload(url, 400, b'{"state": "x", ')
        holds(lambda: requests_in_flight(app) == 1, within=5, what="the app reading the body")
        s.close()
        holds(lambda: any("disconnected" in r.getMessage() for r in log.records), within=5, what="the log line")
        ok = httpx.post(f"{url}/v1/systemone", json=BODY, timeout=patience(10))
    assert ok.status_code == 200
    assert [r.levelname for r in log.records if r.levelno >= logging.WARNING] == []
    assert app.state.gate.peak_admitted == 1  # only the good request took a place


# -- 8 (the description; the fuzz run is in test_server_fuzz.py) --------------------------------

async def test_the_api_describes_itself():
    async with asgi(create_app(model(), api_key=KEY)) as http:
        r = await http.get("/openapi.json")
    spec = r.json()
    assert r.status_code == 200 and spec["openapi"].startswith("3.1")
    post = spec["paths"]["/v1/systemone"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SystemOneRequest")
    assert {"413", "415", "422", "503", "504", "529"} <= set(post["responses"])
    assert "400" not in post["responses"]  # a body that is not JSON is a 422 too (issue 39.5)
    request = spec["components"]["schemas"]["SystemOneRequest"]
    assert request["required"] == ["state", "questions"]
    assert request["properties"]["questions"]["maxProperties"] == Limits().max_questions


# -- 10. a drop-in for Jev clients ----------------------------------------------------------------

def test_the_typesafe_sdk_with_its_defaults_is_answered_by_the_served_model():
    from typesafe_sdk import Noul as TSNoul
    from typesafe_sdk import RetryPolicy, TypeSafeClient, TypeSafeUnprocessableEntityError
    from typesafe_sdk.constants import DEFAULT_MODEL

    assert DEFAULT_MODEL in JEV_ALIASES
    with (run_in_thread(create_app(model(), api_key=KEY)) as url,
          TypeSafeClient(api_key=KEY, base_url=url, retry=RetryPolicy(max_retries=0)) as jev):  # model: default
        result = jev.system_one(state="I was charged twice.", questions={"urgent": TSNoul(instructions="Urgent?")})
        with pytest.raises(TypeSafeUnprocessableEntityError, match="not served here"):
            jev.system_one(state="x", questions={"urgent": TSNoul(instructions="Urgent?")}, model="gpt-4o")
        names = {m.name for m in jev.models.list().models}
    assert result.model == "function"  # honest: the served model answered, not "jev-latest"
    assert result.nouls["urgent"].noul > 0.9
    assert names == {"function", DEFAULT_MODEL}


async def test_questions_that_cannot_be_labelled_are_refused_before_admission():
    app = create_app(model(), limits=Limits(max_options=300))
    many = {"type": "choice", "instructions": "Which?", "criteria": {f"o{i}": None for i in range(256)}}
    async with asgi(app) as http:
        r = await http.post("/v1/systemone", json={"state": "x", "questions": {"q": many}})
    assert (r.status_code, r.json()["error"]["type"]) == (422, "label_error")
    assert app.state.gate.peak_admitted == 0
