"""Figure 10: the structure of one decision, as the code runs it (issue #28).

Each path runs warm (twice untraced first), then once under `sys.setprofile`, in every
thread it uses (the sync path's work runs on the `canvasroute-sync` loop thread). Counted
over Python calls (a coroutine's resume is a call), for the modules of one library:

- `modules`: the distinct library modules entered;
- `hops`: calls into a library module from code in any other module (the library's own,
  LangGraph, asyncio...), the first entry included;
- `returns`: hops into a module the run had entered before and left (`hops - modules`).

Paths: `decision_node` in a one-node LangGraph graph (`await graph.ainvoke`) and
`CanvasDecisionModel.decide` (the sync path), both asking the triage node's team (Choice, 5
options) and severity (Score, 4 levels) through `VLLMServerEngine` against the loopback
vLLM-wire server (`canvasroute.engine.testing.spawn`, its own process); and, as the
reference, `httpx.Client.get` against the same server, counted over httpx's modules. A
count, not a time: it does not move with the machine's load.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import httpx
from langchain_core.decisions import Choice, Noul, Score
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from canvasroute.engine import VLLMServerEngine, run_sync
from canvasroute.engine.testing import spawn
from canvasroute.harness import decision_node
from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, TRIAGE, Section

__all__ = ["MAX_MODULES", "MAX_RETURNS", "QUESTIONS", "Structure", "decide_structure", "httpx_structure",
           "node_structure", "run_structure", "traced"]

MAX_MODULES = 18
"""Issue #28's bound on the library modules one `decision_node` run enters."""
MAX_RETURNS = 40
"""Issue #28's bound on that run's returns to a module it had already left."""
QUESTIONS: Mapping[str, Noul | Choice | Score] = {"team": NODES[TRIAGE]["team"], "severity": NODES[TRIAGE]["severity"]}
"""The two questions of the traced runs: a 5-option Choice and a 4-level Score."""


@dataclass(frozen=True, kw_only=True)
class Structure:
    """What one traced run did, counted for one library."""

    library: str
    """The top-level package counted (`canvasroute`, `httpx`)."""
    entries: Mapping[str, int] = field(default_factory=dict)
    """Hops into each library module, by module name, in the order first entered."""

    @property
    def modules(self) -> int:
        """Distinct library modules entered."""
        return len(self.entries)

    @property
    def hops(self) -> int:
        """Calls into a library module from another module."""
        return sum(self.entries.values())

    @property
    def returns(self) -> int:
        """Hops into a module entered before."""
        return self.hops - self.modules

    def as_json(self) -> dict[str, Any]:
        return {"library": self.library, "modules": self.modules, "hops": self.hops, "returns": self.returns,
                "entries": dict(self.entries)}


class _Tracer:
    """A profile function counting hops into one library's modules (this module left out)."""

    def __init__(self, library: str) -> None:
        self.library = library
        self.entries: Counter[str] = Counter()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module == __name__ or not (module == self.library or module.startswith(self.library + ".")):
            return
        back = frame.f_back
        if back is None or back.f_globals.get("__name__") != module:
            self.entries[module] += 1


async def _set_profile(tracer: _Tracer | None) -> None:
    sys.setprofile(tracer)


@contextmanager
def traced(library: str) -> Iterator[Callable[[], Structure]]:
    """Trace this thread and the sync loop's thread for the block; call the result for the counts.

    Example:
        ```python
        with traced("httpx") as structure:
            client.get(url)
        print(structure().hops)
        ```
    """
    tracer = _Tracer(library)
    run_sync(_set_profile(tracer))
    sys.setprofile(tracer)
    try:
        yield lambda: Structure(library=library, entries=dict(tracer.entries))
    finally:
        sys.setprofile(None)
        run_sync(_set_profile(None))


class _State(TypedDict, total=False):
    ticket: str
    decisions: Any


def _model(url: str) -> CanvasDecisionModel:
    return CanvasDecisionModel(engine=VLLMServerEngine(url), policy=GatePolicy(max_normalized_entropy=0.5))


async def _traced_async(library: str, run: Callable[[str], Awaitable[object]]) -> Structure:
    for ticket in TICKETS[:2]:  # warm: the served model learned, the connection open, the plans cached
        await run(ticket)
    with traced(library) as structure:
        await run(TICKETS[2])
    return structure()


def node_structure(url: str) -> Structure:
    """One warm `decision_node` run in a one-node graph, two questions, against the server at `url`."""
    model = _model(url)
    builder = StateGraph(_State)
    builder.add_node("triage", decision_node(model, QUESTIONS, inputs="ticket"))
    builder.add_edge(START, "triage")
    builder.add_edge("triage", END)
    graph = builder.compile()

    async def measure() -> Structure:
        try:
            return await _traced_async("canvasroute", lambda ticket: graph.ainvoke({"ticket": ticket}))
        finally:
            await model.engine.aclose()

    return asyncio.run(measure())


def decide_structure(url: str) -> Structure:
    """One warm `CanvasDecisionModel.decide` (the sync path), two questions, against the server at `url`."""
    model = _model(url)
    try:
        for ticket in TICKETS[:2]:
            model.decide(ticket, QUESTIONS)
        with traced("canvasroute") as structure:
            model.decide(TICKETS[2], QUESTIONS)
        return structure()
    finally:
        run_sync(model.engine.aclose())


def httpx_structure(url: str, library: str = "httpx") -> Structure:
    """One warm `httpx.Client.get` of `url`/v1/models, counted over `library`'s modules."""
    with httpx.Client() as client:
        for _ in range(2):
            client.get(f"{url}/v1/models")
        with traced(library) as structure:
            client.get(f"{url}/v1/models")
    return structure()


def run_structure(quick: bool) -> Section:
    """The figure: one row per path (`quick` changes nothing: each path runs three times)."""
    section = Section("structure", "11. Structure of one warm run: library modules entered, hops between modules, "
                                   "returns to a module already left (sys.setprofile, calls only)",
                      ["path", "counted", "modules", "hops", "returns", "bound"])
    with spawn(canvas_width=64) as server:
        node = node_structure(server.url)
        decide = decide_structure(server.url)
        reference = httpx_structure(server.url)
        with_transport = httpx_structure(server.url, "httpcore")
    bound = f"modules <= {MAX_MODULES}, returns <= {MAX_RETURNS}"
    rows = (("decision_node, 1-node LangGraph graph (ainvoke)", node, bound),
            ("CanvasDecisionModel.decide (sync path)", decide, None),
            ("httpx.Client.get (reference)", reference, None),
            ("  the same get, httpcore's modules", with_transport, None))
    for path, structure, goal in rows:
        section.rows.append({"path": path, "counted": f"{structure.library}.*", "modules": structure.modules,
                             "hops": structure.hops, "returns": structure.returns, "bound": goal})
    section.extra["runs"] = {"decision_node": node.as_json(), "decide": decide.as_json(),
                             "httpx.Client.get": reference.as_json(), "httpcore": with_transport.as_json()}
    met = node.modules <= MAX_MODULES and node.returns <= MAX_RETURNS
    section.notes += [
        f"questions: {', '.join(f'{qid} ({type(q).__name__})' for qid, q in QUESTIONS.items())}; VLLMServerEngine "
        "against the loopback vLLM-wire server in its own process; each path warm (run twice first)",
        f"bound for the decision_node run: {bound} ({'met' if met else 'NOT met'})",
        "most entered by the decision_node run: " + ", ".join(
            f"{m.removeprefix('canvasroute.')} {n}" for m, n in Counter(node.entries).most_common(8)),
        "a hop is a Python call into a library module from code in another module (a coroutine's resume "
        "counts); returns = hops - modules",
    ]
    return section
