"""Figure 8: the HTTP client candidates side by side (issue #23), the same reads through each.

Every candidate is a lane under the same `VLLMServerEngine` (apps/bench/lanes.py), reading
the reference triage canvas from the instant loopback server in its own process, at
several concurrencies, interleaved in rounds so a change of machine speed moves all alike.
Client CPU is `time.process_time()` of this process per read.
"""

from __future__ import annotations

import asyncio

from canvasroute.engine import Connection, Limits, VLLMServerEngine
from canvasroute.engine.testing import spawn

from .client import TARGET_READS_S, _measure, _reference_read, _Tally
from .common import Section
from .lanes import CLIENTS, available, use

__all__ = ["run_clients"]

LEVELS = (1, 16, 64)
CHOSEN = "llhttp"


def run_clients(quick: bool) -> Section:
    per_level = 300 if quick else 2400
    rounds = 3 if quick else 6
    section = Section("clients", f"8. HTTP client candidates: the same reads through each lane (instant loopback "
                                 f"server in its own process, {per_level} reads per level, interleaved)",
                      ["client", "concurrency", "reads/s", "p50 ms", "p99 ms", "client CPU us/read",
                       f"CPU vs {CHOSEN}"])
    clients = [c for c in CLIENTS if available(c) is None]
    section.notes += [f"{c}: skipped, {available(c)}" for c in CLIENTS if available(c) is not None]
    combos = [(client, c) for client in clients for c in LEVELS]
    with spawn(canvas_width=64) as server:
        read = asyncio.run(_reference_read(server.url))

        async def go() -> list[_Tally]:
            engines = []
            for client, c in combos:
                engine = VLLMServerEngine(Connection(server.url, limits=Limits(max_concurrency=c)))
                use(engine.connection, client)
                await engine.info()
                await asyncio.gather(*(engine.read([read]) for _ in range(c)))  # open the connections
                engines.append(engine)
            tallies = [_Tally() for _ in combos]
            for _ in range(rounds):
                for engine, (_, c), tally in zip(engines, combos, tallies, strict=True):
                    await _measure(engine, read, c, max(per_level // rounds, 2 * c), tally)
            for engine in engines:
                await engine.aclose()
            return tallies

        tallies = asyncio.run(go())
    stats = {combo: t.stats() for combo, t in zip(combos, tallies, strict=True)}
    for (client, c), s in stats.items():
        base = stats.get((CHOSEN, c))
        section.rows.append({"client": client, "concurrency": c, "reads/s": s["per_s"], "p50 ms": s["p50"],
                             "p99 ms": s["p99"], "client CPU us/read": s["cpu_us"],
                             f"CPU vs {CHOSEN}": s["cpu_us"] / base["cpu_us"] if base else None})
    best = {client: max((r for r in section.rows if r["client"] == client), key=lambda r: r["reads/s"])
            for client in clients}
    section.extra["best"] = best
    if CHOSEN in best:
        top = best[CHOSEN]
        section.notes.append(
            f"goal: >= {TARGET_READS_S:,.0f} reads/s with the chosen client ({CHOSEN}); best here "
            f"{top['reads/s']:,.0f} at c={top['concurrency']} "
            f"({'met' if top['reads/s'] >= TARGET_READS_S else 'NOT met'})")
    section.notes += [
        "best concurrency per client: " + "; ".join(
            f"{name} {r['reads/s']:,.0f} reads/s at c={r['concurrency']}, {r['client CPU us/read']:.0f} us CPU/read"
            for name, r in best.items()),
        f"{CHOSEN}: the engine's SocketLane (asyncio protocol, llhttp via httptools); h11: h11 over asyncio "
        "streams; aiohttp: a ClientSession per lane; httpx: an AsyncClient per lane (httpcore, h11, anyio)",
        "the loopback server runs in a second process; both share this 2-core machine (and its other users)",
    ]
    return section
