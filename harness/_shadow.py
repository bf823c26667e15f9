"""Shadow mode: the graph keeps routing by the existing router while the canvas reads beside it.

`decision_node(..., shadow=existing_router)` runs the user's router (a function of the
state returning a node name, sync or async, or a `Runnable` such as `prompt | llm |
StrOutputParser()`) and a canvas-only read of the node's questions side by side. The graph
goes where the existing router says. What the canvas would have done is recorded, in
three places:

- each decision record in state gets a `shadow` entry: `destination` (the router's),
  `canvas_destination`, `agrees`, `would_escalate` (this question), `canvas_alone` (no
  question of the set would have escalated) and `latency_s: {router, canvas}`;
- a `shadow <node>` span (the canvas `decide` span under it) with the
  `canvasroute.shadow.*` attributes of `canvasroute.router.telemetry`;
- the `canvasroute.decision` custom-stream event, under `shadow`.

The canvas reads without escalating (`CanvasDecisionModel.canvas_only()`: no escalation
target, budget or cache): shadow mode measures what the canvas alone would take at the
current gate, and never pays an escalation the graph does not use. "Would escalate" is an
asked question the gate did not accept (`read.confident` false) at the thresholds in
effect, an abstained one included; a dependent question that was skipped was not asked
and is never counted. A canvas failure is recorded (`canvas_error`) and never fails the
node: the router is in charge.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig

from canvasroute.router import CanvasResponse
from canvasroute.router import telemetry as tm

from ._context import child_config

ExistingRouter = Runnable[Any, Any] | Callable[[Any], str] | Callable[[Any], Awaitable[str]]
"""A function of the state returning a node name (sync or async), or a Runnable doing so."""

__all__ = ["ExistingRouter", "Shadow", "ShadowOutcome"]


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """One decision set in shadow mode: what the router did and what the canvas would have done."""

    destination: str
    """The existing router's choice (where the graph went)."""
    canvas_destination: str | None
    """Where the canvas answers route (None when the canvas read failed)."""
    would_escalate: tuple[str, ...]
    """Questions the gate would have escalated at the current thresholds."""
    router_latency_s: float
    canvas_latency_s: float
    canvas_error: str | None = None

    @property
    def agrees(self) -> bool:
        return self.canvas_destination == self.destination

    @property
    def canvas_alone(self) -> bool:
        """The canvas would have taken this decision on its own (no escalation, no failure)."""
        return self.canvas_error is None and not self.would_escalate

    def record(self, question_id: str | None = None) -> dict[str, Any]:
        """The JSON-able shadow entry (`would_escalate` for one question, or the list)."""
        escalate: Any = list(self.would_escalate) if question_id is None else question_id in self.would_escalate
        return {"destination": self.destination, "canvas_destination": self.canvas_destination,
                "agrees": self.agrees, "would_escalate": escalate, "canvas_alone": self.canvas_alone,
                "latency_s": {"router": self.router_latency_s, "canvas": self.canvas_latency_s},
                **({"canvas_error": self.canvas_error} if self.canvas_error else {})}

    def attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            tm.SHADOW_DESTINATION: self.destination, tm.SHADOW_AGREES: self.agrees,
            tm.SHADOW_WOULD_ESCALATE: ",".join(self.would_escalate), tm.SHADOW_CANVAS_ALONE: self.canvas_alone,
            tm.SHADOW_ROUTER_LATENCY: self.router_latency_s, tm.SHADOW_CANVAS_LATENCY: self.canvas_latency_s,
        }
        if self.canvas_destination is not None:
            attrs[tm.SHADOW_CANVAS_DESTINATION] = self.canvas_destination
        if self.canvas_error is not None:
            attrs[tm.SHADOW_CANVAS_ERROR] = self.canvas_error
        return attrs


CanvasGoto = Callable[[dict[str, dict[str, Any]]], str | None]
Decided = Callable[[CanvasResponse], dict[str, dict[str, Any]]]


class Shadow:
    """The existing router of a shadowed decision node, and the side-by-side run."""

    def __init__(self, router: ExistingRouter, destinations: tuple[str, ...]) -> None:
        if not (isinstance(router, Runnable) or callable(router)):
            raise TypeError(f"shadow must be a function of the state or a Runnable, not {type(router).__name__}")
        if not destinations:
            raise ValueError("shadow= needs a routing decision node (route=...): the canvas must have "
                             "somewhere to route to compare with the existing router")
        self.router = router
        self.destinations = destinations

    def __repr__(self) -> str:
        return f"Shadow({getattr(self.router, '__name__', type(self.router).__name__)})"

    # -- the existing router ---------------------------------------------------------------

    def _check(self, goto: Any) -> str:
        text = getattr(goto, "content", goto)  # a chat model's message: its text
        text = text.strip() if isinstance(text, str) else text
        if text not in self.destinations:
            raise ValueError(f"shadow router returned {goto!r}, which is not one of the declared "
                             f"destinations {list(self.destinations)}")
        return text

    def route(self, state: Any, config: RunnableConfig) -> str:
        if isinstance(self.router, Runnable):
            return self._check(self.router.invoke(state, child_config(config)))
        out = self.router(state)
        if inspect.isawaitable(out):
            raise TypeError("an async shadow router needs the async path (graph.ainvoke)")
        return self._check(out)

    async def aroute(self, state: Any, config: RunnableConfig) -> str:
        if isinstance(self.router, Runnable):
            return self._check(await self.router.ainvoke(state, child_config(config)))
        out = self.router(state)
        return self._check(await out if inspect.isawaitable(out) else out)

    # -- side by side ------------------------------------------------------------------------

    def run(self, state: Any, config: RunnableConfig, read: Callable[[], CanvasResponse],
            canvas_goto: Callable[[CanvasResponse], str | None],
            attributes: Mapping[str, Any], node: str) -> tuple[CanvasResponse | None, ShadowOutcome]:
        """Sync: the router on a worker thread while the canvas reads on this one."""
        with tm.span(f"{tm.OPERATION_SHADOW} {node}", attributes) as span:
            with ThreadPoolExecutor(1, thread_name_prefix="canvasroute-shadow") as pool:
                routed = pool.submit(contextvars.copy_context().run, _timed, lambda: self.route(state, config))
                canvas = _canvas(read, canvas_goto)
                destination, router_s = routed.result()
            outcome = _outcome(destination, router_s, *canvas)
            span.set_attributes(outcome.attributes())
        return canvas[0], outcome

    async def arun(self, state: Any, config: RunnableConfig, aread: Callable[[], Awaitable[CanvasResponse]],
                   canvas_goto: Callable[[CanvasResponse], str | None],
                   attributes: Mapping[str, Any], node: str) -> tuple[CanvasResponse | None, ShadowOutcome]:
        """Async: the router and the canvas read concurrently (a router failure cancels the read)."""
        with tm.span(f"{tm.OPERATION_SHADOW} {node}", attributes) as span:
            async with asyncio.TaskGroup() as group:
                routed = group.create_task(_atimed(self.aroute(state, config)))
                canvas_task = group.create_task(_acanvas(aread, canvas_goto))
            (destination, router_s), canvas = routed.result(), canvas_task.result()
            outcome = _outcome(destination, router_s, *canvas)
            span.set_attributes(outcome.attributes())
        return canvas[0], outcome


_Canvas = tuple[CanvasResponse | None, str | None, float, str | None]


def _timed(fn: Callable[[], str]) -> tuple[str, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


async def _atimed(aw: Awaitable[str]) -> tuple[str, float]:
    start = time.perf_counter()
    return await aw, time.perf_counter() - start


def _canvas(read: Callable[[], CanvasResponse], goto: Callable[[CanvasResponse], str | None]) -> _Canvas:
    start = time.perf_counter()
    try:
        response = read()
        return response, goto(response), time.perf_counter() - start, None
    except Exception as exc:  # noqa: BLE001 - the router is in charge: a canvas fault is recorded, not raised
        return None, None, time.perf_counter() - start, type(exc).__qualname__


async def _acanvas(aread: Callable[[], Awaitable[CanvasResponse]],
                   goto: Callable[[CanvasResponse], str | None]) -> _Canvas:
    start = time.perf_counter()
    try:
        response = await aread()
        return response, goto(response), time.perf_counter() - start, None
    except Exception as exc:  # noqa: BLE001 - as in `_canvas`: recorded, not raised
        return None, None, time.perf_counter() - start, type(exc).__qualname__


def _outcome(destination: str, router_s: float, response: CanvasResponse | None, canvas_destination: str | None,
             canvas_s: float, error: str | None) -> ShadowOutcome:
    unsure = () if response is None else tuple(q for q, r in response.reads.items()
                                               if not r.confident and r.path != "skipped")
    return ShadowOutcome(destination=destination, canvas_destination=canvas_destination, would_escalate=unsure,
                         router_latency_s=router_s, canvas_latency_s=canvas_s, canvas_error=error)
