"""Shared pieces of `canvasroute bench`: results, percentiles, question sets, engines."""

from __future__ import annotations

import cProfile
import math
import os
import platform
import pstats
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.decisions import Choice, Noul, Score
from pydantic import JsonValue

from canvasroute.apps.observability.stats import percentile
from canvasroute.engine import CanvasRead, Engine, EngineInfo, FunctionEngine, Message, ReadResult

from .._console import plain_table, print_table

__all__ = ["NODES", "TICKETS", "Recorder", "Section", "instant_engine", "loop_ns", "machine", "percentile",
           "profile_summary", "summary"]

TEAMS: dict[str, JsonValue] = {"billing": "payments, invoices, refunds", "technical": "bugs, errors, outages",
         "account": "login, password, access", "sales": "pricing, plans, quotes", "other": None}
NODES: Mapping[str, Mapping[str, Any]] = {
    "1 Noul": {"urgent": Noul(instructions="Does the customer need an answer within the hour?")},
    "triage: Choice5+Noul+Score4": {
        "team": Choice(instructions="Which team should handle this ticket?", criteria=TEAMS),
        "urgent": Noul(instructions="Does the customer need an answer within the hour?"),
        "severity": Score(instructions="How badly is the customer affected?",
                          criteria=["not at all", "a little", "badly", "cannot work at all"]),
    },
    "8 Nouls": {f"flag{i}": Noul(instructions=f"Does the ticket mention topic {i}?") for i in range(1, 9)},
    "16 Nouls": {f"flag{i}": Noul(instructions=f"Does the ticket mention topic {i}?") for i in range(1, 17)},
    "26-option Choice": {"topic": Choice(instructions="Which topic is this ticket about?",
                                         criteria={f"topic_{chr(97 + i)}": None for i in range(26)})},
}
"""Typical decision nodes, by name (the triage node is the reference for every section)."""
TRIAGE = "triage: Choice5+Noul+Score4"
TICKETS = (
    "I was charged twice for my subscription this month. Please refund one payment.",
    "Our whole team gets a 500 error on every page since this morning. Nothing works!",
    "How do I change the email address on my profile?",
    "Can I get a quote for 40 seats on the annual plan?",
)


@dataclass(slots=True)
class Section:
    """One figure of the bench: a small table plus notes."""

    key: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Detail kept for --json only (profiles, raw settings)."""
    skipped: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "rows": self.rows, "notes": self.notes, "skipped": self.skipped,
                **self.extra}

    def table(self) -> str:
        lines = [f"== {self.title}"]
        if self.skipped:
            lines.append(f"   skipped: {self.skipped}")
        if self.rows:
            lines += plain_table(self.columns, self.cells())
        lines += [f"   - {n}" for n in self.notes]
        return "\n".join(lines)

    def cells(self) -> list[list[str]]:
        """The rows as formatted text, one cell per column."""
        return [[_fmt(r.get(c)) for c in self.columns] for r in self.rows]

    def show(self) -> None:
        """Print the section: a rich table on a terminal, `table()` otherwise."""
        notes = [f"skipped: {self.skipped}"] if self.skipped else []
        print_table(self.title, self.columns, self.cells(), notes=[*notes, *self.notes], plain=self.table() + "\n")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        return ",".join(_fmt(v) for v in value)
    return str(value)


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50, p95, p99 and mean of `values`, multiplied by `scale`."""
    return {"p50": percentile(values, 50) * scale, "p95": percentile(values, 95) * scale,
            "p99": percentile(values, 99) * scale, "mean": sum(values) / len(values) * scale}


def machine() -> dict[str, Any]:
    """What the figures were measured on, and how fast its Python runs right now."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "processor": _cpu_model(), "loadavg_1m_at_start": round(load[0], 2), "loop_ns": loop_ns()}


def loop_ns(n: int = 1_000_000) -> float:
    """Nanoseconds per iteration of a plain Python `x += i` loop (best of 3): a speed
    reference, since a shared or throttled CPU moves every absolute figure with it."""
    best = math.inf
    for _ in range(3):
        t = time.perf_counter_ns()
        x = 0
        for i in range(n):
            x += i
        best = min(best, (time.perf_counter_ns() - t) / n)
    return round(best, 1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def instant_engine(canvas_width: int = 64) -> FunctionEngine:
    """A FunctionEngine that answers every read instantly with fixed, confident rows.

    The read's label ids (sorted) get logprobs `-0.1, -3.1, -6.1, ...`, the same rows the
    loopback server sends, so each slot picks its lowest label id with low entropy. Each
    read is a new `ReadResult` (its rows are checked as any engine's are); the engine keeps
    no history, so a long run does not grow the heap.
    """
    cache: dict[tuple[tuple[int, ...], int], tuple[dict[int, float], ...]] = {}

    def rows(read: CanvasRead) -> ReadResult:
        key = (read.label_ids, len(read.slots))
        if key not in cache:
            row = {i: -0.1 - 3.0 * k for k, i in enumerate(read.label_ids)}
            cache[key] = (row,) * len(read.slots)
        return ReadResult(rows=cache[key], completion_tokens=len(read.canvas))

    return FunctionEngine(rows, model="instant", canvas_width=canvas_width, keep_reads=False)


class Recorder:
    """Wraps an engine and keeps every canvas it is asked to read (for packing figures)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.batches: list[list[CanvasRead]] = []

    async def info(self) -> EngineInfo:
        return await self.inner.info()

    async def tokenize(self, text: str) -> list[int]:
        return await self.inner.tokenize(text)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return await self.inner.count_prompt(messages)

    async def read(self, batch: Sequence[CanvasRead]) -> list[ReadResult]:
        self.batches.append(list(batch))
        return await self.inner.read(batch)

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def reads(self) -> list[CanvasRead]:
        return [r for b in self.batches for r in b]


_AREAS = (("/router/", "router"), ("/engine/", "engine"), ("/harness/", "harness"),
          ("langchain_core", "langchain-core"), ("pydantic", "pydantic"), ("opentelemetry", "opentelemetry"),
          ("langgraph", "langgraph"), ("httpcore", "httpx/httpcore"), ("httpx", "httpx/httpcore"),
          ("h11", "httpx/httpcore"), ("anyio", "anyio"), ("sniffio", "anyio"), ("json", "json"),
          ("asyncio", "asyncio"))


def _area(filename: str, name: str) -> str:
    for marker, area in _AREAS:
        if marker in filename:
            return area
    if filename == "~":  # C functions: name the interesting ones
        if "socket" in name or "select" in name or "epoll" in name:
            return "sockets (syscalls)"
        if "json" in name or "scanner" in name:
            return "json"
        return "builtins"
    return "stdlib/other"


def profile_summary(prof: cProfile.Profile, n: int) -> dict[str, Any]:
    """Own time grouped by library area and the top functions, per unit of work (n units)."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0
    areas: dict[str, float] = defaultdict(float)
    funcs = []
    for (filename, _, name), (_, _, tottime, _, _) in stats.items():
        area = _area(filename, name)
        areas[area] += tottime
        funcs.append((tottime, f"{area}:{name}"))
    funcs.sort(reverse=True)
    return {
        "units": n,
        "by_area": {a: 100 * t / total for a, t in sorted(areas.items(), key=lambda kv: -kv[1])},
        "top": [{"function": f, "share": 100 * t / total, "us_per_unit": t / n * 1e6} for t, f in funcs[:12]],
    }
