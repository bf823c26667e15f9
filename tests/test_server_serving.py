"""Issue #23, the server side, each against the running server (uvicorn on loopback, or `canvasroute serve`):
a connection cap, a timeout on slow request heads, the caller's X-Request-ID kept (logged, sent to vLLM,
returned), Prometheus metrics at /metrics, JSON logs, and a bounded graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
from deadlines import Watch, holds, patience, until, wait
from prometheus_client.parser import text_string_to_metric_families
from services import child_env
from test_server_hostile import BODY, KEY, model, recorded

from canvasroute.apps.server import ConnectionLimits, create_app, run_in_thread
from canvasroute.engine import Connection, FunctionEngine, VLLMServerEngine
from canvasroute.engine.testing import Fault, LoopbackVLLM
from canvasroute.router import CanvasDecisionModel, GatePolicy


def _socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=patience(10))


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=patience(10)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_connections_are_capped_and_a_slow_request_head_is_408_however_it_drips():
    app = create_app(model())
    limits = ConnectionLimits(max_connections=4, head_timeout=0.6)
    with run_in_thread(app, limits=limits) as url:
        drippers = [_socket(url) for _ in range(3)]
        silent = _socket(url)
        for s in drippers:
            s.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\n")
        holds(lambda: app.state.metrics.registry.get_sample_value("canvasroute_server_connections") == 4,
              within=5, what="four connections open")
        extra = _socket(url)  # the fifth: over the cap
        assert extra.recv(200).startswith(b"HTTP/1.1 503")
        extra.close()
        started, dripping = time.monotonic(), patience(5)
        replies = []
        for s in drippers:  # a byte every 0.1 s does not keep a head alive
            got = b""
            while time.monotonic() - started < dripping:
                try:
                    s.sendall(b"x")
                    s.settimeout(0.1)
                    got += s.recv(200)
                    if got:
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            replies.append(got)
        silent.settimeout(dripping)
        assert silent.recv(200) == b""  # nothing ever came: closed without a word
        assert time.monotonic() - started < dripping * 3 / 5  # the head timeout ended them, not the dripping
        ok = httpx.post(f"{url}/v1/systemone", json=BODY, timeout=patience(10))  # room again
        seen = _metrics(url)
        for s in (*drippers, silent):
            s.close()
    assert all(r.startswith(b"HTTP/1.1 408") and b"head_timeout" in r for r in replies), replies
    assert ok.status_code == 200
    assert seen[("canvasroute_server_rejections_total", (("reason", "too_many_connections"),))] == 1
    assert seen[("canvasroute_server_rejections_total", (("reason", "head_timeout"),))] == 4


@contextmanager
def loopback_in_thread() -> Iterator[LoopbackVLLM]:
    """A LoopbackVLLM on its own event loop and thread (the server under test has its own too)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = LoopbackVLLM()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(patience(10))
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(patience(10))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(patience(10))
        loop.close()


def test_the_callers_request_id_is_logged_sent_to_vllm_with_each_read_and_returned():
    with loopback_in_thread() as vllm:
        decider = CanvasDecisionModel(engine=VLLMServerEngine(Connection(vllm.url, retries=0)),
                                      policy=GatePolicy(rereads=0))
        with run_in_thread(create_app(decider)) as url, recorded("canvasroute.server.access") as log:
            mine = httpx.post(f"{url}/v1/systemone", json=BODY, headers={"x-request-id": "caller-req-7"},
                              timeout=patience(30))
            theirs = httpx.post(f"{url}/v1/systemone", json=BODY, headers={"x-request-id": "x" * 200},
                                timeout=patience(30))
            holds(lambda: len(log.records) == 2, within=5, what="two access log lines")
        read_headers = [h for h in vllm.headers if "x-session-id" in h]  # the reads (not /tokenize, /v1/models)
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "caller-req-7"
    assert mine.json()["x_canvasroute"]["decision_id"].startswith("decision-")
    assert len(read_headers) == 2 and read_headers[0]["x-request-id"] == "caller-req-7"
    theirs_id = theirs.json()["x_canvasroute"]["decision_id"]
    assert theirs.status_code == 200 and theirs.headers["x-request-id"] == theirs_id  # too long: replaced
    assert read_headers[1]["x-request-id"] == theirs_id
    first = log.records[0]
    assert "caller-req-7" in first.getMessage() and first.status == 200


def test_metrics_count_requests_decisions_latency_and_rejections():
    app = create_app(model(), api_key=KEY)
    auth = {"authorization": f"Bearer {KEY}"}
    with run_in_thread(app) as url:
        limit_s = patience(10)
        assert httpx.post(f"{url}/v1/systemone", json=BODY, headers=auth, timeout=limit_s).status_code == 200
        assert httpx.post(f"{url}/v1/systemone", json=BODY, timeout=limit_s).status_code == 401
        assert httpx.post(f"{url}/v1/systemone", content=b"{", headers=auth | {"content-type": "application/json"},
                          timeout=limit_s).status_code == 422  # malformed JSON: a validation failure (issue 39.5)
        r = httpx.get(f"{url}/metrics", timeout=limit_s)
        seen = _metrics(url)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    route = ("route", "/v1/systemone")
    assert seen[("canvasroute_server_requests_total", (("method", "POST"), route, ("status", "200")))] == 1
    assert seen[("canvasroute_server_requests_total", (("method", "POST"), route, ("status", "401")))] == 1
    assert seen[("canvasroute_server_request_duration_seconds_count", (route,))] == 3
    assert seen[("canvasroute_server_decisions_total", (("cause", "none"), ("path", "canvas")))] == 2  # two questions
    assert seen[("canvasroute_server_rejections_total", (("reason", "authentication_error"),))] == 1
    assert seen[("canvasroute_server_rejections_total", (("reason", "invalid_json"),))] == 1
    assert seen[("canvasroute_server_queue_wait_seconds_count", ())] == 1
    assert seen[("canvasroute_server_requests_in_flight", ())] == 1  # the scrape itself
    assert seen[("canvasroute_server_decisions_running", ())] == 0
    assert seen[("canvasroute_server_connections", ())] >= 1


def test_metrics_count_each_question_by_the_path_that_answered_it_and_its_cause():
    unsure = FunctionEngine(lambda read: [dict.fromkeys(read.label_ids, -1.0)] * len(read.slots))
    cascade = CanvasDecisionModel(engine=unsure, policy=GatePolicy(max_normalized_entropy=0.5, rereads=1),
                                  escalate_to=model())  # the sure model answers what the unsure one cannot
    with run_in_thread(create_app(cascade)) as url:
        r = httpx.post(f"{url}/v1/systemone", json=BODY, timeout=patience(10))
        seen = _metrics(url)
    assert r.status_code == 200
    assert {a["x_canvasroute"]["path"] for a in r.json()["answers"].values()} == {"escalated"}
    assert {a["x_canvasroute"]["cause"] for a in r.json()["answers"].values()} == {"uncertain"}
    assert {q["cause"] for q in r.json()["diagnostics"]["questions"].values()} == {"uncertain"}
    decided = {labels: n for (name, labels), n in seen.items() if name == "canvasroute_server_decisions_total"}
    assert decided == {(("cause", "uncertain"), ("path", "escalated")): 2}  # no canvas answer counted


def _stuck(started: threading.Event):
    def held(engine):
        async def read(_):
            started.set()
            await asyncio.sleep(60)
        return read
    return held


def test_a_stuck_request_delays_shutdown_only_by_the_shutdown_timeout():
    started = threading.Event()
    app = create_app(model(_stuck(started)), request_timeout=120)
    answers: list[httpx.Response] = []
    with ExitStack() as stack:
        url = stack.enter_context(run_in_thread(app, limits=ConnectionLimits(shutdown_timeout=1.0)))
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}/v1/systemone", json=BODY, timeout=60)))
        client.start()
        holds(started.is_set, within=10, what="the stuck read starting")
        stopping = time.monotonic()
    stopped = time.monotonic() - stopping
    client.join(patience(10))
    assert stopped < patience(8)  # not the 120 s request timeout, nor the 60 s read
    (r,) = answers
    assert (r.status_code, r.json()["error"]["type"]) == (503, "shutting_down")
    assert app.state.gate.running == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_canvasroute_serve_logs_json_with_the_request_id_and_stops_within_its_shutdown_timeout(tmp_path):
    async with LoopbackVLLM() as vllm:
        port = _free_port()
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; the test drives the child by hand
            [sys.executable, "-m", "canvasroute.apps.cli", "serve", "--engine-url", vllm.url, "--port", str(port),
             "--log-format", "json", "--shutdown-timeout", "1", "--rereads", "0"],
            # cwd: not the repository (a user runs serve from their own folder)
            cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=patience(30)) as http:
                serving = Watch(proc.pid, cpu_s=60, idle_s=60, what="canvasroute serve")
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(f"{url}/health")).status_code == 200:
                            break
                    assert proc.poll() is None
                    assert not (why := serving.overdue()), why
                    await asyncio.sleep(0.2)
                ok = await http.post(f"{url}/v1/systemone", json=BODY, headers={"x-request-id": "req-json-1"})
                vllm.inject(Fault(delay=60), times=None)  # every later read hangs
                stuck = asyncio.ensure_future(http.post(f"{url}/v1/systemone", json=BODY))
                await until(lambda: vllm.reads >= 2, within=30, what="the second read reaching the loopback")
                proc.send_signal(signal.SIGTERM)
                stopping = time.monotonic()
                answer = await stuck
                code = await asyncio.to_thread(wait, proc, Watch(proc.pid, cpu_s=30, idle_s=30, what="serve stopping"))
                stopped = time.monotonic() - stopping
        finally:
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate()[0]  # it exited, or was killed: what is left of its output
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "req-json-1"
    assert (answer.status_code, answer.json()["error"]["type"]) == (503, "shutting_down")
    assert code in (0, -signal.SIGTERM) and stopped < patience(8), out  # uvicorn re-raises the signal it handled
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]  # every line is JSON
    access = [r for r in lines if r["logger"] == "canvasroute.server.access"]
    assert access[0]["request_id"] == "req-json-1" and access[0]["status"] == 200
    assert access[1]["status"] == 503 and access[1]["request_id"].startswith("decision-")
    assert {r["level"] for r in lines} <= {"debug", "info", "warning", "error", "critical"}
    assert any(r["logger"].startswith("uvicorn") for r in lines)
