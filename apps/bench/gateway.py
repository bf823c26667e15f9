"""Figure 9: `canvasroute serve` beside vLLM's reference gateway, in front of the same vLLM server.

The reference gateway (`examples/features/structured_diffusion/structured_server.py` in
vllm-project/vllm) runs wherever you started it (`--gateway-url`); this section starts
`canvasroute serve` in a process of its own on the same vLLM server (`--vllm-url`) and
sends both the same `/v1/systemone` requests, interleaved in rounds (gateway at c=1,
canvasroute at c=1, gateway at c=8, ...), so a change in the machine's speed moves both
alike. vLLM reads per call come from vLLM's own `/metrics` (`vllm:request_success_total`;
meaningful only when nothing else uses that server). The library path, `CanvasDecisionModel`
on `VLLMServerEngine` in this process, runs the same decisions in the same rounds.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from canvasroute.engine import Connection, Limits, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import Section, summary

__all__ = ["REQUEST", "run_gateway"]

REQUEST: dict[str, Any] = {
    "model": "jev-latest",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Does the customer need an answer today?"},
        "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
                 "criteria": {"billing": "payments, refunds", "technical": "bugs, errors", "sales": "plans, quotes"}},
        "severity": {"type": "score", "instructions": "How badly is the customer affected?",
                     "criteria": ["a little", "badly", "cannot work at all"]},
    },
}
"""The 3-question request both gateways answer (a state per call is added)."""
SETTINGS: dict[str, dict[str, Any]] = {"auto": {"samples": "auto", "auto_max": 4, "auto_threshold": 0.1},
                                     "one read": {"samples": 1}}
"""Equal read settings sent to both: vLLM's gateway's default (`auto`), and exactly one read."""
LEVELS = (1, 8)
TARGETS = {"latency c=1": 0.9, "latency c=8": 0.9, "calls/s c=8": 1.1}
"""canvasroute / reference: latency at most 0.9x, calls/s at least 1.1x (issue #22)."""
_SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\}\s+([0-9.e+]+)$', re.MULTILINE)


def run_gateway(reference: str | None, vllm_url: str | None, quick: bool) -> Section:
    section = Section("gateway", "9. canvasroute serve vs vLLM's reference gateway (same vLLM server, same requests, "
                                 "interleaved)", ["path", "settings", "concurrency", "calls", "p50 ms", "p95 ms",
                                                  "calls/s", "vLLM reads/call"])
    if not reference or not vllm_url:
        section.skipped = ("needs --gateway-url (a running reference gateway) and --vllm-url (the vLLM server it "
                           "reads from)")
        return section
    rounds, per = (2, {1: 4, 8: 16}) if quick else (4, {1: 8, 8: 32})
    try:
        with _Serve(vllm_url) as ours:
            tallies = asyncio.run(_interleaved(reference, ours, vllm_url, rounds, per))
    except Exception as exc:  # noqa: BLE001 - a bench row, not a test: say why and go on
        section.skipped = f"{type(exc).__name__}: {exc}"
        return section
    for (path, settings, c), t in tallies.items():
        s = summary(t["latencies"], 1000)
        section.rows.append({"path": path, "settings": settings, "concurrency": c, "calls": len(t["latencies"]),
                             "p50 ms": s["p50"], "p95 ms": s["p95"], "calls/s": len(t["latencies"]) / t["wall"],
                             "vLLM reads/call": t["reads"] / len(t["latencies"])})
    ratios = _ratios(section.rows)
    section.extra.update(ratios=ratios, request=REQUEST, settings=SETTINGS, reference=reference, vllm=vllm_url)
    for name, value in ratios.items():
        goal = TARGETS[name.split(" (")[0]]
        met = value <= goal if name.startswith("latency") else value >= goal
        section.notes.append(f"canvasroute serve / reference, {name}: {value:.2f}x "
                             f"(goal {'<=' if name.startswith('latency') else '>='} {goal}x: "
                             f"{'met' if met else 'NOT met'})")
    section.notes += [
        "each call: the same 3-question request (Noul, Choice of 3, Score of 3) about a new ticket text; both "
        "gateways answer it with constrained reads, their default",
        "vLLM reads per call are read from the vLLM server's /metrics around each batch: they count every request "
        "that server finished, so run this on a vLLM server nothing else uses",
        "'library' is CanvasDecisionModel.adecide on VLLMServerEngine in this process: the same decisions "
        "without any gateway",
    ]
    return section


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {(r["path"], r["settings"], r["concurrency"]): r for r in rows}
    out = {}
    for settings in SETTINGS:
        ref1, ours1 = by.get(("reference", settings, 1)), by.get(("canvasroute serve", settings, 1))
        ref8, ours8 = by.get(("reference", settings, 8)), by.get(("canvasroute serve", settings, 8))
        if ref1 and ours1:
            out[f"latency c=1 ({settings})"] = ours1["p50 ms"] / ref1["p50 ms"]
        if ref8 and ours8:
            out[f"latency c=8 ({settings})"] = ours8["p50 ms"] / ref8["p50 ms"]
            out[f"calls/s c=8 ({settings})"] = ours8["calls/s"] / ref8["calls/s"]
    return out


class _Serve:
    """`canvasroute serve` on a free loopback port, in a process of its own, for the section's length."""

    def __init__(self, vllm_url: str) -> None:
        self.vllm_url = vllm_url

    def __enter__(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # started outside any checkout, so `-m canvasroute` is the package this bench runs from
        self.proc = subprocess.Popen([sys.executable, "-m", "canvasroute", "serve", "--engine-url", self.vllm_url,
                                      "--port", str(port), "--log-level", "warning", "--request-timeout", "600"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     cwd=tempfile.gettempdir())
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr is not None else ""
                raise RuntimeError(f"canvasroute serve exited: {err[-500:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("canvasroute serve did not start within 120 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _reads(http: httpx.AsyncClient, vllm_url: str) -> float:
    text = (await http.get(f"{vllm_url}/metrics")).text
    return sum(float(v) for v in _SUCCESS.findall(text))


async def _interleaved(reference: str, ours: str, vllm_url: str, rounds: int,
                       per: dict[int, int]) -> dict[tuple[str, str, int], dict[str, Any]]:
    engine = VLLMServerEngine(Connection(vllm_url, timeout=600, limits=Limits(max_concurrency=64)))
    # what serve makes of SETTINGS: "auto" re-reads above 0.1 nats (`reread_above`), the gate unchanged
    policies = {"auto": GatePolicy(samples=1, rereads=3, reread_above=0.1),
                "one read": GatePolicy(samples=1, rereads=0)}
    model = CanvasDecisionModel(engine=engine)
    questions = REQUEST["questions"]
    tallies: dict[tuple[str, str, int], dict[str, Any]] = {}
    calls = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        def gateway(url: str, settings: str) -> Callable[[str], Awaitable[None]]:
            async def one(state: str) -> None:
                r = await http.post(f"{url}/v1/systemone", json={**REQUEST, **SETTINGS[settings], "state": state})
                if r.status_code != 200:
                    raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
            return one

        def library(settings: str) -> Callable[[str], Awaitable[None]]:
            async def one(state: str) -> None:
                await model.adecide(state, questions, gate=policies[settings])
            return one

        for warm in ("auto", "one read"):  # discovery, tokenizer, connections, prefix cache
            for one in (gateway(reference, warm), gateway(ours, warm), library(warm)):
                await asyncio.gather(*(one(f"warm-up ticket {i}") for i in range(8)))
        for r in range(rounds):
            for settings in SETTINGS:
                for c in LEVELS:
                    for path, one in (("reference", gateway(reference, settings)),
                                      ("canvasroute serve", gateway(ours, settings)), ("library", library(settings))):
                        states = [f"Ticket {calls + i}: I was charged twice and support has not replied "
                                  f"(round {r})." for i in range(per[c])]
                        calls += per[c]
                        tally = tallies.setdefault((path, settings, c), {"latencies": [], "wall": 0.0, "reads": 0.0})
                        before = await _reads(http, vllm_url)
                        await _drive(one, states, c, tally)
                        tally["reads"] += await _reads(http, vllm_url) - before
    await engine.aclose()
    return tallies


async def _drive(one: Callable[[str], Awaitable[None]], states: list[str], c: int, tally: dict[str, Any]) -> None:
    """Every state through `one`, c at a time; latencies and wall time go to `tally`."""
    left = list(reversed(states))

    async def worker() -> None:
        while left:
            state = left.pop()
            t = time.perf_counter()
            await one(state)
            tally["latencies"].append(time.perf_counter() - t)

    wall = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    tally["wall"] += time.perf_counter() - wall
