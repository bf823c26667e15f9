"""Figure 1: router + harness overhead per decision over an instant engine.

The engine answers in microseconds (`instant_engine`), so what is timed is the library:
parsing questions, the cached plan, building the seeded canvas, distribution math, the
gate, the report and answer objects, OTel spans, and for the graph row LangGraph's own
step. The rows run interleaved, in rounds of a few dozen decisions each, so a change in
the machine's speed during the run moves every row alike. A cProfile run of the
reference node says where the time goes.
"""

from __future__ import annotations

import asyncio
import cProfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, TRIAGE, Section, instant_engine, profile_summary, summary

__all__ = ["run_overhead"]

TARGETS_US = {"1 Noul": 70.0, TRIAGE: 120.0}
"""p50 targets of `decide` per node (issue #15); other rows are read against the triage one."""
TARGET_GRAPH_US = 300.0
"""What a one-node graph running `decision_node` may add over the same graph with an empty node."""
ROUND = 40
"""Decisions per row per round."""


def run_overhead(quick: bool) -> Section:
    n = 400 if quick else 4000
    section = Section("overhead", f"1. Router + harness overhead per decision (instant engine, n={n} per row, "
                                  f"rows interleaved)",
                      ["path", "node", "p50 us", "p99 us", "mean us", "target us"])
    policy = GatePolicy(max_normalized_entropy=0.5)
    triage = NODES[TRIAGE]

    def model() -> CanvasDecisionModel:
        return CanvasDecisionModel(engine=instant_engine(), policy=policy)

    noul, reference, invoked, sync_model, graph_model, sdk_model = (model() for _ in range(6))
    graph, empty = _graph(graph_model, triage), _empty_graph(triage)
    sdk = _sdk_provider()
    # (path, node, async function of the state or None, sync function or None, context per round)
    rows: list[tuple[str, str, Callable[[str], Awaitable[Any]] | None, Callable[[str], Any] | None, Any]] = [
        ("CanvasDecisionModel.decide", "1 Noul", lambda s: noul.adecide(s, NODES["1 Noul"]), None, nullcontext),
        ("CanvasDecisionModel.decide", TRIAGE, lambda s: reference.adecide(s, triage), None, nullcontext),
        ("CanvasDecisionModel.ainvoke", TRIAGE, lambda s: invoked.ainvoke({"state": s, "questions": triage}),
         None, nullcontext),
        ("CanvasDecisionModel.invoke (sync path)", TRIAGE, None,
         lambda s: sync_model.invoke({"state": s, "questions": triage}), nullcontext),
    ]
    if graph is not None:
        rows.append(("LangGraph 1-node graph (decision_node)", TRIAGE,
                     lambda s: graph.ainvoke({"ticket": s}), None, nullcontext))
        rows.append(("LangGraph 1-node graph, empty node (baseline)", TRIAGE,
                     lambda s: empty.ainvoke({"ticket": s}), None, nullcontext))
    else:
        section.notes.append("LangGraph row skipped: harness.decision_node is not importable")
    if sdk is not None:
        rows.append(("decide, OTel SDK + in-memory exporter", TRIAGE, lambda s: sdk_model.adecide(s, triage),
                     None, sdk))
    samples: list[list[float]] = [[] for _ in rows]
    loop = asyncio.new_event_loop()
    try:
        for warm in (True, *([False] * -(-n // ROUND))):
            for (_, _, afn, sfn, ctx), out in zip(rows, samples, strict=True):
                with ctx():
                    if afn is not None:
                        batch = loop.run_until_complete(_timed_async(afn))
                    else:
                        assert sfn is not None  # each row times one of the two
                        batch = _timed_sync(sfn)
                if not warm:
                    out.extend(batch)
        profile = loop.run_until_complete(_profile(n // 2))
    finally:
        loop.close()
    p50 = {}
    for (path, node, *_), out in zip(rows, samples, strict=True):
        s = summary(out[:n])
        p50[path, node] = s["p50"]
        target = TARGETS_US.get(node) if path == "CanvasDecisionModel.decide" else None
        section.rows.append({"path": path, "node": node, "p50 us": s["p50"], "p99 us": s["p99"],
                             "mean us": s["mean"], "target us": target})
    section.extra["targets_us_p50"] = {**TARGETS_US, "graph over empty graph": TARGET_GRAPH_US}
    section.extra["profile"] = profile
    top = ", ".join(f"{a} {p:.0f}%" for a, p in list(profile["by_area"].items())[:5])
    decide = {node: p50["CanvasDecisionModel.decide", node] for node in TARGETS_US}
    met = [f"decide {node}: {decide[node]:.0f} us p50 vs <= {t:.0f} ({'met' if decide[node] <= t else 'NOT met'})"
           for node, t in TARGETS_US.items()]
    if graph is not None:
        ours = p50["LangGraph 1-node graph (decision_node)", TRIAGE] - p50[
            "LangGraph 1-node graph, empty node (baseline)", TRIAGE]
        section.extra["graph_over_empty_us_p50"] = ours
        met.append(f"graph with decision_node over the same graph with an empty node: {ours:.0f} us p50 vs <= "
                   f"{TARGET_GRAPH_US:.0f} ({'met' if ours <= TARGET_GRAPH_US else 'NOT met'})")
    section.notes += [
        "targets: " + "; ".join(met) + "; the engine itself costs ~nothing here",
        f"cProfile of decide ({TRIAGE}), own time by area: {top}",
        "top functions (own time): " + "; ".join(f"{f['function']} {f['share']:.0f}%"
                                                for f in profile["top"][:6]),
        "cProfile inflates small-function costs; shares are indicative, the p50 column is the figure",
    ]
    return section


async def _timed_async(fn: Callable[[str], Awaitable[Any]]) -> list[float]:
    out = []
    for i in range(ROUND):
        t = time.perf_counter_ns()
        await fn(TICKETS[i % len(TICKETS)])
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def _timed_sync(fn: Callable[[str], Any]) -> list[float]:
    out = []
    for i in range(ROUND):
        t = time.perf_counter_ns()
        fn(TICKETS[i % len(TICKETS)])
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def _empty_graph(questions: Mapping[str, Any]) -> Any:
    """The graph of `_graph` with a node that does nothing but return a `Command` with one
    plain entry per question: LangGraph's own step, for the baseline row."""
    try:
        from langgraph.types import Command
    except ImportError:
        return None

    async def empty(state: Any) -> Command[str]:
        return Command(update={"decisions": {qid: {"answer": None} for qid in questions}})

    return _one_node_graph(empty)


def _graph(model: CanvasDecisionModel, questions: Mapping[str, Any]) -> Any:
    try:
        from canvasroute.harness import decision_node
    except ImportError:
        return None
    return _one_node_graph(decision_node(model, questions, inputs="ticket"))


def _one_node_graph(node: Any) -> Any:
    """START -> triage -> END over a `{ticket, decisions}` state, or None without LangGraph."""
    try:
        from langgraph.graph import END, START, StateGraph
        from typing_extensions import TypedDict
    except ImportError:
        return None

    class State(TypedDict, total=False):
        ticket: str
        decisions: dict[str, Any]

    builder = StateGraph(State)
    builder.add_node("triage", node)
    builder.add_edge(START, "triage")
    builder.add_edge("triage", END)
    return builder.compile()


async def _profile(n: int) -> dict[str, Any]:
    """Own time of the reference decision, grouped by library area and by function."""
    model = CanvasDecisionModel(engine=instant_engine(), policy=GatePolicy())
    questions = NODES[TRIAGE]
    for s in TICKETS:
        await model.adecide(s, questions)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        await model.adecide(TICKETS[i % len(TICKETS)], questions)
    prof.disable()
    return profile_summary(prof, n)


def _sdk_provider() -> Callable[[], Any] | None:
    """A context that installs an OTel SDK tracer provider (spans exported in memory) for
    one round and puts the previous global provider back afterwards (as
    opentelemetry-test-utils does), so every other row runs as an app without the SDK."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from opentelemetry.util._once import Once
    except ImportError:
        return None
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    @contextmanager
    def installed() -> Iterator[None]:
        saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
        trace.set_tracer_provider(provider)
        try:
            yield
        finally:
            exporter.clear()
            trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved

    return installed
