"""The graph on the dashboard: LangGraph's own description, recorded and drawn as inline SVG.

Where the structure comes from, in this order:

1. `canvasroute dashboard ... --graph module:attr`: a compiled graph (anything with
   `get_graph()`), or a function of no arguments returning one;
2. a `graph <name>` span in the trace file, written by `record_graph(graph)` (the demo
   writes one), holding `graph.get_graph()`'s nodes and edges as JSON;
3. otherwise the edges the decisions were seen taking (`route <node>` spans).

Each node is a link to `#only-<n>`: clicking it filters the page's decision tables to
that node with CSS `:target` rules, so the page still has no scripts.
"""

from __future__ import annotations

import html
import json
from collections import deque
from collections.abc import Mapping
from importlib import import_module
from typing import Any

from canvasroute.router import telemetry as tm

__all__ = ["graph_structure", "graph_svg", "load_graph", "record_graph"]

START, END = "__start__", "__end__"


def graph_structure(graph: Any) -> dict[str, Any]:
    """`{"nodes": [id, ...], "edges": [{"source", "target", "conditional"}]}` of a compiled
    graph (`graph.get_graph()`), a drawable `Graph`, or such a dict already."""
    if isinstance(graph, Mapping):
        drawn = graph
    else:
        g = graph.get_graph() if hasattr(graph, "get_graph") else graph
        drawn = {"nodes": list(g.nodes),
                 "edges": [{"source": e.source, "target": e.target, "conditional": bool(e.conditional)}
                           for e in g.edges]}
    nodes = [str(n) for n in drawn["nodes"]]
    edges = [{"source": str(e["source"]), "target": str(e["target"]), "conditional": bool(e.get("conditional"))}
             for e in drawn["edges"]]
    return {"nodes": nodes, "edges": edges}


def record_graph(graph: Any, name: str = "graph") -> None:
    """Write the graph's structure into the trace: a `graph <name>` span (the dashboard draws it)."""
    with tm.span(f"{tm.OPERATION_GRAPH} {name}", {tm.GRAPH_STRUCTURE: json.dumps(graph_structure(graph))}):
        pass


def load_graph(spec: str) -> dict[str, Any]:
    """`module:attr` -> the structure of that graph (a function of no arguments is called)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--graph takes module:attr, not {spec!r}")
    target: Any = import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    if not hasattr(target, "get_graph") and callable(target):
        target = target()
    if not hasattr(target, "get_graph"):
        raise ValueError(f"{spec} is not a LangGraph graph (no get_graph())")
    return graph_structure(target)


def observed_structure(routes: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    """A structure from the edges decisions took (when the graph itself was not recorded)."""
    nodes = list(dict.fromkeys(n for edge in routes for n in edge))
    return {"nodes": nodes, "edges": [{"source": s, "target": t, "conditional": True} for s, t in routes]}


# -- drawing ------------------------------------------------------------------------------

_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _PAD = 184, 96, 36, 64, 24


def _layers(nodes: list[str], edges: list[dict[str, Any]]) -> dict[str, int]:
    """Rows by breadth-first distance from `__start__` (cycles cannot stretch the drawing)."""
    out: dict[str, int] = {}
    roots = [START] if START in nodes else [n for n in nodes if not any(e["target"] == n for e in edges)][:1]
    queue = deque((r, 0) for r in roots or nodes[:1])
    while queue:
        node, depth = queue.popleft()
        if node in out:
            continue
        out[node] = depth
        queue.extend((e["target"], depth + 1) for e in edges if e["source"] == node and e["target"] not in out)
    bottom = max(out.values(), default=0)
    for n in nodes:
        out.setdefault(n, bottom + 1)
    if END in out:  # __end__ on a row of its own at the bottom
        out[END] = max((d for n, d in out.items() if n != END), default=0) + 1
    return out


def graph_svg(structure: Mapping[str, Any], figures: Mapping[str, Mapping[str, str]],
              traffic: Mapping[tuple[str, str], int], index: Mapping[str, int]) -> str:
    """The graph as inline SVG: per-node figure lines, per-edge traffic, nodes linking to filters.

    `figures[node]` holds up to four short lines; `index[node]` numbers the `#only-<n>` filter.
    """
    nodes, edges = list(structure["nodes"]), list(structure["edges"])
    layer = _layers(nodes, edges)
    rows: dict[int, list[str]] = {}
    for n in nodes:
        rows.setdefault(layer[n], []).append(n)
    widest = max((len(r) for r in rows.values()), default=1)
    width = max(2 * _PAD + widest * _BOX_W + (widest - 1) * _GAP_X, 480)
    height = 2 * _PAD + len(rows) * _BOX_H + (len(rows) - 1) * _GAP_Y
    pos: dict[str, tuple[float, float]] = {}
    for depth, (_, members) in enumerate(sorted(rows.items())):
        span = len(members) * _BOX_W + (len(members) - 1) * _GAP_X
        x0 = (width - span) / 2
        for i, n in enumerate(members):
            pos[n] = (x0 + i * (_BOX_W + _GAP_X), _PAD + depth * (_BOX_H + _GAP_Y))
    parts = [('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#64748b"/></marker></defs>')]
    for e in edges:
        if e["source"] not in pos or e["target"] not in pos:
            continue
        (sx, sy), (tx, ty) = pos[e["source"]], pos[e["target"]]
        x1, y1 = sx + _BOX_W / 2, sy + _BOX_H
        x2, y2 = tx + _BOX_W / 2, ty
        if ty <= sy:  # a back edge: from the side
            x1, y1, x2, y2 = sx + _BOX_W, sy + _BOX_H / 2, tx + _BOX_W, ty + _BOX_H / 2
        count = traffic.get((e["source"], e["target"]))
        cls = "gedge conditional" if e["conditional"] else "gedge"
        data = (f' data-source="{html.escape(e["source"])}" data-target="{html.escape(e["target"])}"'
                f' data-traffic="{count or 0}"')
        stroke = 1.2 + (min(count, 50) / 50 * 3 if count else 0)
        parts.append(f'<g class="{cls}"{data}><line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                     f'stroke-width="{stroke:.1f}" marker-end="url(#arrow)"/>')
        if count:
            mx, my = (x1 + x2) / 2, (y1 + y2) / 2
            parts.append(f'<rect class="elabel" x="{mx - 16:.1f}" y="{my - 9:.1f}" width="32" height="18" rx="9"/>'
                         f'<text class="etraffic" x="{mx:.1f}" y="{my + 4:.1f}" text-anchor="middle">{count}</text>')
        parts.append("</g>")
    for n in nodes:
        x, y = pos[n]
        lines = list(figures.get(n, {}).values())[:4]
        terminal = n in (START, END)
        label = {START: "start", END: "end"}.get(n, n)
        body = (f'<rect x="{x:.1f}" y="{y:.1f}" width="{_BOX_W}" height="{_BOX_H}" rx="10"/>'
                f'<text class="gname" x="{x + _BOX_W / 2:.1f}" y="{y + (48 if terminal else 22):.1f}" '
                f'text-anchor="middle">{html.escape(label)}</text>')
        for i, line in enumerate(lines):
            body += (f'<text class="gfig" x="{x + _BOX_W / 2:.1f}" y="{y + 40 + 14 * i:.1f}" '
                     f'text-anchor="middle">{html.escape(line)}</text>')
        kind = "terminal" if terminal else ("decision" if n in figures else "plain")
        node_attrs = f'class="gnode {kind}" data-node="{html.escape(n)}"'
        if n in index:
            node_attrs += f' data-nix="{index[n]}"'
            parts.append(f'<a href="#only-{index[n]}" {node_attrs}><title>show only {html.escape(n)}</title>'
                         f'{body}</a>')
        else:
            parts.append(f'<g {node_attrs}>{body}</g>')
    return (f'<svg class="graph" id="graph" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'role="img" aria-label="the graph, with per-edge traffic" xmlns="http://www.w3.org/2000/svg">'
            f'{"".join(parts)}</svg>')
