"""Where a decision node can go: its route, its destinations, and the `__call__` drawings read."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from langchain_core.runnables import RunnableConfig
from langgraph.types import Command

__all__ = ["Route", "annotated_call", "parse_route", "route_destinations"]

Route = tuple[str, Mapping[Any, str]] | Callable[[dict[str, dict[str, Any]]], str] | None
"""`(question_id, {option: node})`, a function of the decisions returning a node, or None."""


def parse_route(route: Route) -> tuple[str | None, dict[str, str] | None, Callable[..., str] | None]:
    if route is None:
        return None, None, None
    if callable(route):
        return None, None, route
    if (isinstance(route, tuple) and len(route) == 2 and isinstance(route[0], str)
            and isinstance(route[1], Mapping) and route[1]):
        paths = {str(option): target for option, target in route[1].items()}
        bad = [t for t in paths.values() if not isinstance(t, str) or not t]
        if bad:
            raise ValueError(f"route targets must be node names, got {bad}")
        return route[0], paths, None
    raise TypeError("route must be (question_id, {option: node}), a function of the decisions, or None")


def route_destinations(route_map: dict[str, str] | None, route_fn: Callable[..., str] | None,
                  declared: Sequence[str] | None) -> tuple[str, ...]:
    if route_fn is not None:
        if not declared or isinstance(declared, str):
            raise ValueError("a route function needs destinations=(node, ...) naming every node it may return")
        return tuple(dict.fromkeys(declared))
    if declared is not None:
        raise ValueError("destinations= is only for route functions; a route mapping declares its own")
    return tuple(dict.fromkeys(route_map.values())) if route_map else ()


def annotated_call(destinations: tuple[str, ...]) -> Callable[..., Command]:
    """A `__call__` whose return annotation is `Command[Literal[destinations]]` (read by `add_node`)."""

    def __call__(self: Any, state: Any, config: RunnableConfig | None = None) -> Command:
        return self.invoke(state, config)

    __call__.__annotations__ = {"return": Command[Literal[destinations]]}  # type: ignore[valid-type]
    return __call__
