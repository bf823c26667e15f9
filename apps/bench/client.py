"""Figures 2 and 5: `VLLMServerEngine` reads per second against a server.

Figure 2 reads from the instant loopback server (engine.testing) running in its
own process, so the client's CPU time per read (`time.process_time` of this process) is
measured honestly; figure 5 reads from a real vLLM CPU server (a protocol check: the tiny
random model on 2 cores says nothing about GPU speed). Each level sends the same
canvas the router builds for the reference triage node, `c` reads in flight at a time.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from canvasroute.engine import CanvasRead, Connection, Limits, VLLMServerEngine
from canvasroute.engine.testing import read_response, spawn
from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, TRIAGE, Recorder, Section, profile_summary, summary

__all__ = ["run_real_server", "run_throughput"]

LEVELS = (1, 4, 16, 64, 256)
TARGET_READS_S = 3000.0
"""Issue #23's goal for the chosen HTTP client at its best concurrency (issue #15's was 1,500)."""


def run_throughput(quick: bool) -> Section:
    per_level = 300 if quick else 3000
    rounds = 3 if quick else 6
    section = Section("throughput", f"2. Client reads/s vs concurrency (instant loopback server in its own "
                                    f"process, {per_level} reads per level, levels interleaved)",
                      ["endpoint", "concurrency", "reads/s", "p50 ms", "p99 ms", "client CPU us/read"])
    combos = [*(("chat", c) for c in LEVELS), ("completions", 64)]
    with spawn(canvas_width=64) as server:
        read = asyncio.run(_reference_read(server.url))
        tallies, decisions = asyncio.run(_interleaved(server.url, read, combos, per_level, rounds))
        for (endpoint, c), tally in zip(combos, tallies, strict=True):
            stats = tally.stats()
            section.rows.append({"endpoint": endpoint, "concurrency": c, "reads/s": stats["per_s"],
                                 "p50 ms": stats["p50"], "p99 ms": stats["p99"],
                                 "client CPU us/read": stats["cpu_us"]})
        section.rows.append({"endpoint": "decide (whole triage decision, chat)", "concurrency": 64,
                             "reads/s": decisions["per_s"], "p50 ms": decisions["p50"], "p99 ms": decisions["p99"],
                             "client CPU us/read": decisions["cpu_us"]})
        profile = asyncio.run(_profiled(server.url, read, 16, per_level))
    best = max(r["reads/s"] for r in section.rows if r["endpoint"] == "chat")
    best_c = max((r for r in section.rows if r["endpoint"] == "chat"), key=lambda r: r["reads/s"])["concurrency"]
    body = read_response(True, "loopback", len(read.canvas), read.label_ids, "ranked", None)
    decode_us = _decode_cost(body)
    cpu = min(r["client CPU us/read"] for r in section.rows if r["endpoint"] == "chat")
    section.extra.update(read={"canvas_width": len(read.canvas), "slots": len(read.slots),
                               "label_ids": len(read.label_ids), "response_bytes": len(body)},
                         decisions=decisions, json_decode_us=decode_us, target_reads_s=TARGET_READS_S,
                         profile=profile)
    section.notes += [
        f"target: >= {TARGET_READS_S:,.0f} reads/s; best here {best:,.0f} reads/s at c={best_c} "
        f"({'met' if best >= TARGET_READS_S else 'NOT met'})",
        f"each read: canvas {len(read.canvas)} ids, {len(read.slots)} slots, {len(read.label_ids)} label ids; "
        f"the chat response is {len(body):,} bytes (vLLM sends one row per canvas position, with byte arrays)",
        "decoding that response alone: " + ", ".join(f"{name} {us:.0f} us" for name, us in decode_us.items())
        + f" (the engine uses {'orjson' if 'orjson' in decode_us else 'json'}; lowest client CPU per read: "
        f"{cpu:.0f} us)",
        "completions row: the same reads as token ids; rows come without byte arrays (a smaller body), but each "
        "new prompt first costs a /tokenize round trip (cached here: one prompt)",
        f"whole decisions (CanvasDecisionModel.decide, {TRIAGE}) through the client at c=64, interleaved "
        f"with the levels (the 'decide' row: its columns are per decision): {decisions['per_s']:,.0f} "
        f"decisions/s, p50 {decisions['p50']:.1f} ms, {decisions['cpu_us']:.0f} us client CPU per decision",
        "cProfile of the client at c=16, own time by area: "
        + ", ".join(f"{a} {p:.0f}%" for a, p in list(profile["by_area"].items())[:6]),
        "the loopback server runs in a second process on the other core; both share this 2-core machine",
    ]
    return section


def run_real_server(url: str | None, quick: bool) -> Section:
    section = Section("vllm", "5. Real vLLM CPU server (tiny random DiffusionGemma): reads/s and latency, "
                              "constrained and full-vocabulary reads interleaved",
                      ["read", "concurrency", "reads", "reads/s", "p50 ms", "p95 ms"])
    if not url:
        section.skipped = "no server: pass --vllm-url or set CANVASROUTE_VLLM_URL"
        return section
    counts = {1: 4, 4: 8, 16: 16} if quick else {1: 12, 4: 24, 16: 48}
    rounds = 2 if quick else 3

    async def go() -> None:
        read = await _reference_read(url)
        kinds = {"constrained": replace(read, constrained=True), "full vocabulary": replace(read, constrained=False)}
        engine = VLLMServerEngine(Connection(url, timeout=120, limits=Limits(max_concurrency=16)))
        await engine.info()
        await engine.read(list(kinds.values()))
        tallies = {(k, c): _Tally() for c in counts for k in kinds}
        for _ in range(rounds):
            for c, n in counts.items():
                for k, r in kinds.items():
                    await _measure(engine, r, c, max(1, n // rounds), tallies[(k, c)])
        for (k, c), tally in tallies.items():
            stats = tally.stats()
            section.rows.append({"read": k, "concurrency": c, "reads": stats["n"], "reads/s": stats["per_s"],
                                 "p50 ms": stats["p50"], "p95 ms": stats["p95"]})
        info = await engine.info()
        section.extra["server"] = {"url": url, "model": info.model, "canvas_width": info.canvas_width,
                                   "read_canvas": len(read.canvas), "slots": len(read.slots)}
        await engine.aclose()

    try:
        asyncio.run(go())
    except Exception as exc:  # noqa: BLE001 - a bench row, not a test: say why and go on
        section.skipped = f"{type(exc).__name__}: {exc}"
        return section
    by = {(r["read"], r["concurrency"]): r for r in section.rows}
    section.notes += [
        f"the canvas the router builds for {TRIAGE} on the server's tokenizer; every read must answer 200",
        "constrained (vLLM's diffusion_constrained, the default since issue #22) vs full vocabulary, p50 ratio: "
        + ", ".join(f"c={c} {by[('constrained', c)]['p50 ms'] / by[('full vocabulary', c)]['p50 ms']:.2f}x"
                    for c in counts),
        "a protocol and scheduling check: Triton's interpreter on 2 shared cores, a 0.3M-parameter random "
        "model; nothing here says anything about GPU speed or decision quality",
    ]
    return section


async def _reference_read(url: str) -> CanvasRead:
    """The canvas the router sends for the reference triage node (first read only)."""
    recorder = Recorder(VLLMServerEngine(Connection(url, timeout=120)))
    model = CanvasDecisionModel(engine=recorder, policy=GatePolicy(max_normalized_entropy=None, rereads=0))
    await model.adecide(TICKETS[0], NODES[TRIAGE])
    await recorder.aclose()
    return recorder.reads[0]


class _Tally:
    """Reads (or decisions) measured in several batches: latencies, wall and CPU time."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.wall = self.cpu = 0.0

    def stats(self) -> dict[str, float]:
        n = len(self.latencies)
        s = summary(self.latencies, 1000)
        return {"n": n, "per_s": n / self.wall, "p50": s["p50"], "p95": s["p95"], "p99": s["p99"],
                "cpu_us": self.cpu / n * 1e6}


async def _interleaved(url: str, read: CanvasRead, combos: list[tuple[str, int]], per_level: int,
                       rounds: int) -> tuple[list[_Tally], dict[str, float]]:
    """Every (endpoint, concurrency) level, plus whole decisions at c=64, measured in
    rounds, so a change in the machine's speed during the run moves every level alike."""
    engines = [VLLMServerEngine(Connection(url, limits=Limits(max_concurrency=c)),
                                endpoint=endpoint)  # type: ignore[arg-type]
               for endpoint, c in combos]
    deciding = VLLMServerEngine(Connection(url, limits=Limits(max_concurrency=64)))
    model = CanvasDecisionModel(engine=deciding, policy=GatePolicy())
    for engine, (_, c) in zip(engines, combos, strict=True):  # discovery, and open the connections
        await engine.info()
        await asyncio.gather(*(engine.read([read]) for _ in range(c)))
    await asyncio.gather(*(model.adecide(f"warm-up {i}", NODES[TRIAGE]) for i in range(64)))
    tallies, decided = [_Tally() for _ in combos], _Tally()
    for r in range(rounds):
        for engine, (_, c), tally in zip(engines, combos, tallies, strict=True):
            await _measure(engine, read, c, max(per_level // rounds, 2 * c), tally)
        await _decide(model, 64, per_level // rounds, decided, offset=r * per_level)
    for engine in (*engines, deciding):
        await engine.aclose()
    return tallies, decided.stats()


async def _measure(engine: VLLMServerEngine, read: CanvasRead, c: int, n: int,
                   tally: _Tally | None = None) -> dict[str, float]:
    """n reads, c in flight at a time, added to `tally`: rate, latency percentiles, CPU per read."""
    tally = tally or _Tally()

    async def one(_: int) -> None:
        [result] = await engine.read([read])
        if len(result.rows) != len(read.slots):
            raise RuntimeError("short read")

    await _drive(one, c, n, tally)
    return tally.stats()


async def _decide(model: CanvasDecisionModel, c: int, n: int, tally: _Tally, offset: int) -> None:
    """n whole decisions, c in flight at a time, each about a new state, added to `tally`."""
    questions = NODES[TRIAGE]

    async def one(i: int) -> None:
        await model.adecide(f"{TICKETS[i % len(TICKETS)]} (#{offset + i})", questions)

    await _drive(one, c, n, tally)


async def _drive(one: Callable[[int], Awaitable[None]], c: int, n: int, tally: _Tally) -> None:
    """Run `one(i)` for i = n-1 .. 0 with c workers; latencies, wall and CPU go to `tally`."""
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            await one(left)
            tally.latencies.append(time.perf_counter() - t)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    tally.wall += time.perf_counter() - wall
    tally.cpu += time.process_time() - cpu


async def _profiled(url: str, read: CanvasRead, c: int, n: int) -> dict[str, Any]:
    """Where the client's time goes for n reads at concurrency c."""
    engine = VLLMServerEngine(Connection(url, limits=Limits(max_concurrency=c)))
    await engine.info()
    await asyncio.gather(*(engine.read([read]) for _ in range(c)))
    prof = cProfile.Profile()
    prof.enable()
    try:
        await _measure(engine, read, c, n)
    finally:
        prof.disable()
        await engine.aclose()
    return profile_summary(prof, n)


def _decode_cost(body: bytes, repeat: int = 200) -> dict[str, float]:
    """Microseconds to decode one response body, with json and (if installed) orjson."""
    decoders: dict[str, Callable[[bytes], Any]] = {"json": json.loads}
    try:
        import orjson
    except ImportError:
        pass
    else:
        decoders["orjson"] = orjson.loads
    out = {}
    for name, loads in decoders.items():
        t = time.perf_counter()
        for _ in range(repeat):
            loads(body)
        out[name] = (time.perf_counter() - t) / repeat * 1e6
    return out

