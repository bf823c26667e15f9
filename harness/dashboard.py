"""`canvasroute dashboard TRACES -o report.html`: exported decision spans as one HTML page.

The page is self-contained (inline CSS and SVG, no scripts) and shows, per graph node
(`canvasroute.graph.node`, else the decision set): normalized-entropy histograms by path,
path shares over time, escalation rate, canvas-vs-escalation agreement (escalated
questions whose canvas argmax equals the escalation's answer), latency percentiles, and
the most uncertain decisions. It names the model that produced the data and warns that
tiny and embedded models are near chance.

Example:
    ```bash
    canvasroute dashboard spans.jsonl -o report.html
    ```
"""

from __future__ import annotations

import argparse
import html
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router import telemetry as tm

from engine import TraceFileError

from .traces import SpanRecord, decision_figures, read_spans
from harness._stats import percentile

__all__ = ["Decision", "NodeStats", "Report", "build_report", "configure", "near_chance", "percentile",
           "render", "run"]

PATHS = ("canvas", "reread", "escalated", "fallback")
COLORS = {"canvas": "#15803d", "reread": "#d19a00", "escalated": "#dc2626", "fallback": "#64748b"}
ENTROPY_BINS = 20
NEAR_CHANCE_NOTE = ("Tiny and embedded models (the tiny random DiffusionGemma used in tests, the embedded "
                    "SmolLM2-135M) are near chance at decisions: figures from them show the pipeline at work, "
                    "not decision quality.")


# -- the data ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One question answered in one decision set, as its decide span recorded it."""

    time_ns: int
    node: str
    question: str
    kind: str
    path: str
    answer: str
    canvas_answer: str | None
    normalized_entropy: float | None
    confidence: float | None
    margin: float | None
    reads: int
    escalation_model: str | None
    trace_id: str

    @property
    def agrees(self) -> bool | None:
        """For escalated questions with a canvas read: whether the canvas argmax was the answer."""
        if self.path != "escalated" or self.canvas_answer is None:
            return None
        return self.canvas_answer == self.answer


@dataclass(slots=True)
class NodeStats:
    """Everything the page shows for one graph node."""

    name: str
    decisions: list[Decision] = field(default_factory=list)
    set_latencies: list[float] = field(default_factory=list)
    """Duration of each decision set (decide span) at this node, seconds."""
    errors: int = 0

    @property
    def paths(self) -> Counter[str]:
        return Counter(d.path for d in self.decisions)

    @property
    def escalation_rate(self) -> float:
        return self.paths["escalated"] / len(self.decisions) if self.decisions else 0.0

    @property
    def agreement(self) -> tuple[int, int]:
        """(agreeing, escalated with a canvas read)."""
        votes = [d.agrees for d in self.decisions if d.agrees is not None]
        return sum(votes), len(votes)


@dataclass(slots=True)
class Report:
    """Decision spans grouped by node, plus the engine and escalation calls under them."""

    nodes: dict[str, NodeStats]
    models: dict[str, str]
    """Canvas model name to provider."""
    escalation_models: dict[str, str]
    """Escalation model name to provider."""
    read_latencies: dict[str, list[float]]
    """Engine call durations by read kind (`first`, `reread`), seconds."""
    escalation_latencies: list[float]
    start_ns: int
    end_ns: int
    spans: int
    sources: list[str] = field(default_factory=list)

    @property
    def decisions(self) -> list[Decision]:
        return [d for n in self.nodes.values() for d in n.decisions]


def _is_decide(s: SpanRecord) -> bool:
    return s.name.startswith("decide ") and tm.DECISION_SET in s.attributes


def build_report(spans: Sequence[SpanRecord], sources: Sequence[str] = ()) -> Report:
    """Group decide spans by node and collect their child calls."""
    decides = [s for s in spans if _is_decide(s)]
    if not decides:
        raise TraceFileError("no canvasroute decision spans (`decide <model>`) in the trace files"
                             if spans else "the trace files hold no spans")
    decide_ids = {s.span_id for s in decides}
    nodes: dict[str, NodeStats] = {}
    models: dict[str, str] = {}
    for s in decides:
        node = str(s.attributes.get(tm.GRAPH_NODE) or s.attributes.get(tm.DECISION_SET))
        stats = nodes.setdefault(node, NodeStats(node))
        stats.set_latencies.append(s.duration_s)
        stats.errors += s.status == "ERROR"
        models.setdefault(s.name[len("decide "):], "")
        for qid, f in sorted(decision_figures(s.attributes).items()):
            if "path" not in f:
                continue
            stats.decisions.append(Decision(
                time_ns=s.start_time_ns, node=node, question=qid, kind=str(f.get("kind", "")), path=str(f["path"]),
                answer=str(f.get("answer", "")), canvas_answer=_str_or_none(f.get("canvas_answer")),
                normalized_entropy=_float_or_none(f.get("normalized_entropy")),
                confidence=_float_or_none(f.get("confidence")), margin=_float_or_none(f.get("margin")),
                reads=int(f.get("reads") or 0), escalation_model=_str_or_none(f.get("escalation_model")),
                trace_id=s.trace_id))
    reads: dict[str, list[float]] = defaultdict(list)
    escalations: list[float] = []
    escalation_models: dict[str, str] = {}
    for s in spans:
        if s.parent_id not in decide_ids:
            continue
        op = s.attributes.get(tm.GEN_AI_OPERATION)
        model = str(s.attributes.get(tm.GEN_AI_MODEL, ""))
        provider = str(s.attributes.get(tm.GEN_AI_PROVIDER) or s.attributes.get(tm.GEN_AI_SYSTEM) or "")
        if op == tm.OPERATION_CANVAS_READ:
            reads[str(s.attributes.get(tm.READ_KIND, "first"))].append(s.duration_s)
            if model:
                models[model] = provider
        elif s.name.startswith("escalate "):
            escalations.append(s.duration_s)
            escalation_models[model or s.name[len("escalate "):]] = provider
    return Report(nodes=dict(sorted(nodes.items())), models=models, escalation_models=escalation_models,
                  read_latencies=dict(reads), escalation_latencies=escalations,
                  start_ns=min(s.start_time_ns for s in decides), end_ns=max(s.end_time_ns for s in decides),
                  spans=len(spans), sources=list(sources))


def _float_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _str_or_none(v: Any) -> str | None:
    return str(v) if v is not None else None


def near_chance(model: str, provider: str = "") -> str | None:
    """Why figures from this model say nothing about decision quality (None: a real model)."""
    name = model.casefold()
    if provider == "function":
        return "a FunctionEngine test double (synthetic rows)"
    if "smollm" in name:
        return "the embedded SmolLM2-135M (near chance at decisions)"
    if "tiny" in name or "random" in name:
        return "a tiny random DiffusionGemma (near chance at decisions)"
    return None


# -- SVG charts ---------------------------------------------------------------------------

_W, _H = 560, 220
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 44, 12, 14, 34


def _svg(css_class: str, label: str, body: str) -> str:
    return (f'<svg class="chart {css_class}" viewBox="0 0 {_W} {_H}" role="img" aria-label="{html.escape(label)}" '
            f'xmlns="http://www.w3.org/2000/svg">{body}</svg>')


def _y_axis(y_max: float, fmt: str, ticks: int) -> str:
    parts = []
    for i in range(ticks + 1):
        v = y_max * i / ticks
        y = _H - _PAD_B - (_H - _PAD_B - _PAD_T) * i / ticks
        parts.append(f'<line class="grid" x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="tick" x="{_PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt.format(v)}</text>')
    return "".join(parts)


def _step(top: float, mantissas: Sequence[float]) -> float:
    """The smallest round step (mantissa x 10^e) that covers `top` in at most 5 steps."""
    e = math.floor(math.log10(top / 5)) if top > 0 else 0
    while True:
        for m in mantissas:
            if top / (m * 10.0**e) <= 5 + 1e-9:
                return m * 10.0**e
        e += 1


def _count_axis(top: float) -> tuple[float, int]:
    """An integer axis for counts: (maximum, number of steps), at most 5 steps."""
    step = max(1.0, _step(top, (1, 2, 5)))
    ticks = max(1, math.ceil(top / step))
    return step * ticks, ticks


def _stacked(columns: Sequence[Mapping[str, float]], x_labels: Sequence[str], *, y_max: float, ticks: int,
             fmt: str, css_class: str, label: str, x_title: str, tips: Sequence[str] | None = None) -> str:
    """Stacked bars, one column per entry, segments in `PATHS` order."""
    plot_w, plot_h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    n = max(1, len(columns))
    step = plot_w / n
    bar = max(1.0, step * 0.82)
    out = [_y_axis(y_max, fmt, ticks)]
    for i, col in enumerate(columns):
        x = _PAD_L + i * step + (step - bar) / 2
        y = _H - _PAD_B
        for path in PATHS:
            v = col.get(path, 0.0)
            if v <= 0 or y_max <= 0:
                continue
            h = plot_h * v / y_max
            y -= h
            tip = html.escape(f"{tips[i] if tips else x_labels[i]}: {path} {fmt.format(v)}")
            out.append(f'<rect class="seg {path}" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                       f'fill="{COLORS[path]}"><title>{tip}</title></rect>')
    every = max(1, math.ceil(len(x_labels) / 8))
    for i, text in enumerate(x_labels):
        if i % every == 0:
            x = _PAD_L + i * step + step / 2
            out.append(f'<text class="tick" x="{x:.1f}" y="{_H - _PAD_B + 14}" text-anchor="middle">'
                       f'{html.escape(text)}</text>')
    out.append(f'<line class="axis" x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{_H - _PAD_B}" y2="{_H - _PAD_B}"/>')
    out.append(f'<text class="axis-title" x="{_PAD_L + plot_w / 2:.1f}" y="{_H - 4}" text-anchor="middle">'
               f'{html.escape(x_title)}</text>')
    return _svg(css_class, label, "".join(out))


def entropy_histogram(decisions: Sequence[Decision]) -> str:
    """Normalized entropy in 20 bins, stacked by path.

    The range is [0, 1], narrowed to [lo, 1] (lo on a 0.05 grid) when every value is
    above lo, so near-uniform reads still show their spread.
    """
    values = [d.normalized_entropy for d in decisions if d.normalized_entropy is not None]
    lo = min(0.95, math.floor(min(values, default=0.0) * 20) / 20)
    width = (1.0 - lo) / ENTROPY_BINS
    cols: list[dict[str, float]] = [defaultdict(float) for _ in range(ENTROPY_BINS)]
    for d in decisions:
        if d.normalized_entropy is not None:
            b = min(ENTROPY_BINS - 1, max(0, int((d.normalized_entropy - lo) / width)))
            cols[b][d.path] += 1
    top = max([sum(c.values()) for c in cols] + [1])
    digits = 2 if lo == 0 else 3
    labels = [f"{lo + i * width:.{digits}f}" for i in range(ENTROPY_BINS)]
    tips = [f"H/ln K {lo + i * width:.{digits + 1}f}-{lo + (i + 1) * width:.{digits + 1}f}"
            for i in range(ENTROPY_BINS)]
    title = "normalized entropy (H / ln K)" + (f", range {lo:.2f}-1" if lo > 0 else "")
    y_max, ticks = _count_axis(top)
    return _stacked(cols, labels, y_max=y_max, ticks=ticks, fmt="{:.0f}", css_class="entropy-histogram",
                    label="normalized entropy histogram by path", x_title=title, tips=tips)


def path_shares(decisions: Sequence[Decision], start_ns: int, end_ns: int, buckets: int) -> str:
    """Share of each path per time bucket (empty buckets stay empty)."""
    span = max(1, end_ns - start_ns)
    n = max(1, buckets)
    counts: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
    for d in decisions:
        counts[min(n - 1, int((d.time_ns - start_ns) / span * n))][d.path] += 1
    shares = [{p: v / sum(c.values()) for p, v in c.items()} if c else {} for c in counts]
    secs = span / 1e9
    labels = [_duration(secs * i / n) for i in range(n)]
    tips = [f"+{_duration(secs * i / n)} ({int(sum(c.values()))} questions)" for i, c in enumerate(counts)]
    return _stacked(shares, labels, y_max=1.0, ticks=4, fmt="{:.0%}", css_class="path-shares",
                    label="path shares over time", x_title="time since the first decision", tips=tips)


def latency_bars(rows: Sequence[tuple[str, Sequence[float]]]) -> str:
    """Horizontal p50/p95/p99 bars per row (seconds)."""
    rows = [(name, xs) for name, xs in rows if xs]
    row_h, top_pad = 34, 22
    height = top_pad + row_h * max(1, len(rows)) + 26
    label_w = 150
    plot_w = _W - label_w - 20
    step = _step(max([percentile(xs, 99) for _, xs in rows] + [1e-3]), (1, 2, 2.5, 5))
    ticks = max(1, math.ceil(max([percentile(xs, 99) for _, xs in rows] + [1e-3]) / step))
    x_max = step * ticks
    shades = {"p50": "#1d4ed8", "p95": "#60a5fa", "p99": "#bfdbfe"}
    out = []
    for i in range(ticks + 1):
        x = label_w + plot_w * i / ticks
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top_pad - 6}" y2="{height - 22}"/>'
                   f'<text class="tick" x="{x:.1f}" y="{height - 8}" text-anchor="middle">'
                   f'{_seconds(step * i)}</text>')
    for r, (name, xs) in enumerate(rows):
        y = top_pad + r * row_h
        out.append(f'<text class="row-label" x="{label_w - 8}" y="{y + 17}" text-anchor="end">'
                   f'{html.escape(name)}</text>')
        for j, (q, shade) in enumerate(reversed(list(shades.items()))):
            v = percentile(xs, float(q[1:]))
            w = plot_w * v / x_max
            tip = html.escape(f"{name} {q} {_seconds(v)} (n={len(xs)})")
            out.append(f'<rect class="lat {q}" x="{label_w}" y="{y + 4 + j * 3}" width="{w:.1f}" '
                       f'height="{22 - j * 6}" fill="{shade}"><title>{tip}</title></rect>')
    legend = "".join(f'<rect x="{label_w + i * 70}" y="2" width="10" height="10" fill="{c}"/>'
                     f'<text class="tick" x="{label_w + i * 70 + 14}" y="11">{q}</text>'
                     for i, (q, c) in enumerate(shades.items()))
    return (f'<svg class="chart latency-bars" viewBox="0 0 {_W} {height}" role="img" '
            f'aria-label="latency percentiles" xmlns="http://www.w3.org/2000/svg">{legend}{"".join(out)}</svg>')


def _seconds(v: float) -> str:
    if math.isnan(v):
        return "–"
    if v < 0.01:
        return f"{v * 1000:.1f} ms" if v else "0 ms"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _duration(secs: float) -> str:
    if secs < 60:
        return f"{secs:.0f}s" if secs >= 1 or secs == 0 else f"{secs * 1000:.0f}ms"
    if secs < 3600:
        return f"{secs / 60:.0f}m"
    return f"{secs / 3600:.1f}h"


# -- the page -----------------------------------------------------------------------------

_CSS = """
:root{--ink:#0f172a;--muted:#64748b;--line:#e2e8f0;--card:#fff;--bg:#f1f5f9}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
 color:var(--ink);background:var(--bg)}
header{background:#0f172a;color:#f8fafc;padding:22px 32px 18px}
header h1{margin:0 0 4px;font-size:22px;font-weight:650;letter-spacing:-.01em}
header .meta{color:#94a3b8;font-size:12.5px}
main{max-width:1240px;margin:0 auto;padding:20px 32px 40px}
.banner{border-radius:10px;padding:14px 18px;margin:0 0 18px;border:1px solid #bfdbfe;background:#eff6ff}
.banner.warn{border-color:#fca5a5;background:#fef2f2}
.banner strong.model{font-size:16px}
.banner p{margin:4px 0 0}
.banner.warn .chance{color:#991b1b;font-weight:600}
.kpis{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:12px;margin:0 0 18px}
.kpi{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px}
.kpi .v{font-size:22px;font-weight:650;font-variant-numeric:tabular-nums}
.kpi .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.kpi .s{color:var(--muted);font-size:12px}
h2{font-size:17px;margin:26px 0 10px}
section.card,.node{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:16px 18px;
 margin:0 0 16px}
.node h3{margin:0 0 2px;font-size:16px}
.node .sub{color:var(--muted);font-size:12.5px;margin-bottom:10px}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px}
figure{margin:0}
figcaption{font-size:12.5px;color:var(--muted);margin:0 0 4px}
svg.chart{width:100%;height:auto;display:block}
svg .grid{stroke:#eef2f7;stroke-width:1}
svg .axis{stroke:#94a3b8;stroke-width:1}
svg text{font-family:inherit;fill:#475569}
svg .tick{font-size:10.5px}
svg .axis-title{font-size:11px;fill:#64748b}
svg .row-label{font-size:12px;fill:#0f172a}
.legend{display:flex;gap:14px;flex-wrap:wrap;font-size:12.5px;color:#334155;margin:0 0 10px}
.legend span:before{content:"";display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;
 vertical-align:-1px;background:var(--c)}
table{border-collapse:collapse;width:100%;font-size:13px;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:6px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-size:11.5px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted);font-weight:600}
td.num,th.num{text-align:right;white-space:nowrap}
td.time{white-space:nowrap}
section.card>p:first-child{margin-top:0}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;color:#334155}
.badge{display:inline-block;padding:1px 8px;border-radius:999px;font-size:11.5px;font-weight:600;color:#fff}
.meter{display:inline-block;width:64px;height:7px;background:#e2e8f0;border-radius:4px;margin-right:6px;
 vertical-align:middle;overflow:hidden}
.meter i{display:block;height:100%;background:#7c3aed}
.muted{color:var(--muted)}
footer{color:var(--muted);font-size:12px;text-align:center;padding:10px 0 30px}
"""


def _pct(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0%}"


def _badge(path: str) -> str:
    return f'<span class="badge path-{html.escape(path)}" style="background:{COLORS.get(path, "#334155")}">' \
           f'{html.escape(path)}</span>'


def _kpi(key: str, value: str, sub: str = "", kpi_id: str = "") -> str:
    ident = f' id="{kpi_id}"' if kpi_id else ""
    return f'<div class="kpi"{ident}><div class="k">{html.escape(key)}</div><div class="v">{value}</div>' \
           f'<div class="s">{sub}</div></div>'


def _when(ns: int, *, date: bool = True) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S", time.gmtime(ns / 1e9))
    return stamp + f".{(ns // 1_000_000) % 1000:03d}" + (" UTC" if date else "")


def _banner(report: Report) -> str:
    models = report.models or {"unknown": ""}
    names = ", ".join(f"{m} ({p})" if p else m for m, p in models.items())
    reasons = [r for m, p in models.items() if (r := near_chance(m, p))]
    esc = ", ".join(f"{m} ({p})" if p else m for m, p in report.escalation_models.items()) or "none called"
    cls = "banner warn" if reasons else "banner"
    lead = (f'<p class="chance">This data comes from {html.escape("; ".join(reasons))}. Its accuracy, entropies '
            "and escalation rates are not the product's.</p>") if reasons else ""
    return (f'<div id="model-banner" class="{cls}" data-near-chance="{str(bool(reasons)).lower()}">'
            f'Canvas model: <strong class="model">{html.escape(names)}</strong> · escalation: '
            f'<strong>{html.escape(esc)}</strong>{lead}<p>{html.escape(NEAR_CHANCE_NOTE)}</p></div>')


def _node_section(node: NodeStats, report: Report, buckets: int) -> str:
    d = node.decisions
    paths = node.paths
    agree, escalated = node.agreement
    ents = [x.normalized_entropy for x in d if x.normalized_entropy is not None]
    kpis = "".join([
        _kpi("decision sets", f"{len(node.set_latencies)}", f"{len(d)} questions"),
        _kpi("escalation rate", _pct(node.escalation_rate), f"{paths['escalated']} escalated"),
        _kpi("agreement", _pct(agree / escalated if escalated else None),
             f"canvas = escalation in {agree}/{escalated}"),
        _kpi("re-read", _pct(paths["reread"] / len(d) if d else None), f"{paths['reread']} answered after re-reads"),
        _kpi("mean H/ln K", f"{sum(ents) / len(ents):.3f}" if ents else "–", "canvas normalized entropy"),
        _kpi("p50 / p95", f"{_seconds(percentile(node.set_latencies, 50))}",
             f"p95 {_seconds(percentile(node.set_latencies, 95))} · "
             f"p99 {_seconds(percentile(node.set_latencies, 99))}"),
    ])
    rows = []
    by_q: dict[str, list[Decision]] = defaultdict(list)
    for x in d:
        by_q[x.question].append(x)
    for q, xs in sorted(by_q.items()):
        pc = Counter(x.path for x in xs)
        votes = [x.agrees for x in xs if x.agrees is not None]
        es = [x.normalized_entropy for x in xs if x.normalized_entropy is not None]
        answers = ", ".join(f"{html.escape(a)} ({c})" for a, c in Counter(x.answer for x in xs).most_common(3))
        mean_h = f"{sum(es) / len(es):.3f}" if es else "–"
        rows.append(f'<tr><td><code>{html.escape(q)}</code></td><td>{html.escape(xs[0].kind)}</td>'
                    f'<td class="num">{len(xs)}</td><td class="num">{_pct(pc["escalated"] / len(xs))}</td>'
                    f'<td class="num">{_pct(sum(votes) / len(votes) if votes else None)}</td>'
                    f'<td class="num">{mean_h}</td><td>{answers}</td></tr>')
    table = ('<table class="questions"><thead><tr><th>question</th><th>kind</th><th class="num">n</th>'
             '<th class="num">escalated</th><th class="num">agreement</th><th class="num">mean H/ln K</th>'
             f'<th>top answers</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')
    errors = f" · {node.errors} failed" if node.errors else ""
    return (f'<section class="node" data-node="{html.escape(node.name)}"><h3>{html.escape(node.name)}</h3>'
            f'<div class="sub">graph node · questions {html.escape(", ".join(sorted(by_q)))}{errors}</div>'
            f'<div class="kpis">{kpis}</div><div class="charts">'
            f'<figure><figcaption>Canvas normalized entropy, by path</figcaption>{entropy_histogram(d)}</figure>'
            f'<figure><figcaption>Path shares over time</figcaption>'
            f'{path_shares(d, report.start_ns, report.end_ns, buckets)}</figure></div>{table}</section>')


def _agreement_section(report: Report) -> str:
    rows = []
    for node in report.nodes.values():
        by_q: dict[str, list[bool]] = defaultdict(list)
        for x in node.decisions:
            if x.agrees is not None:
                by_q[x.question].append(x.agrees)
        for q, votes in sorted(by_q.items()):
            share = sum(votes) / len(votes)
            rows.append(f'<tr><td>{html.escape(node.name)}</td><td><code>{html.escape(q)}</code></td>'
                        f'<td class="num">{len(votes)}</td><td class="num">{sum(votes)}</td>'
                        f'<td class="num"><span class="meter"><i style="width:{share * 100:.0f}%"></i></span>'
                        f'{_pct(share)}</td></tr>')
    if not rows:
        body = '<p class="muted">No escalated question had a canvas read in these traces.</p>'
    else:
        body = ('<table id="agreement"><thead><tr><th>node</th><th>question</th><th class="num">escalated</th>'
                '<th class="num">canvas agreed</th><th class="num">agreement</th></tr></thead>'
                f'<tbody>{"".join(rows)}</tbody></table>')
    return ('<section class="card" id="agreement-section"><p class="muted">Escalated questions whose canvas argmax '
            f'equals the escalation model\'s answer.</p>{body}</section>')


def _latency_section(report: Report) -> str:
    rows: list[tuple[str, Sequence[float]]] = [(f"decide · {n.name}", n.set_latencies) for n in report.nodes.values()]
    rows += [(f"canvas read · {k}", v) for k, v in sorted(report.read_latencies.items())]
    rows.append(("escalation", report.escalation_latencies))
    trs = "".join(
        f'<tr><td>{html.escape(name)}</td><td class="num">{len(xs)}</td>'
        + "".join(f'<td class="num">{_seconds(percentile(xs, q))}</td>' for q in (50, 95, 99))
        + f'<td class="num">{_seconds(max(xs))}</td></tr>'
        for name, xs in rows if xs)
    table = ('<table id="latency"><thead><tr><th>span</th><th class="num">n</th><th class="num">p50</th>'
             '<th class="num">p95</th><th class="num">p99</th><th class="num">max</th></tr></thead>'
             f'<tbody>{trs}</tbody></table>')
    return f'<section class="card" id="latency-section"><div class="charts"><figure>{latency_bars(rows)}</figure>' \
           f'<div>{table}</div></div></section>'


def _uncertain_section(report: Report, top: int) -> str:
    ranked = sorted((d for d in report.decisions if d.normalized_entropy is not None),
                    key=lambda d: d.normalized_entropy or 0.0, reverse=True)[:top]
    rows = "".join(
        f'<tr><td class="time">{_when(d.time_ns, date=False)}</td><td>{html.escape(d.node)}</td>'
        f'<td><code>{html.escape(d.question)}</code></td>'
        f'<td>{_badge(d.path)}</td><td>{html.escape(d.canvas_answer or "–")}</td><td>{html.escape(d.answer)}</td>'
        f'<td class="num"><span class="meter"><i style="width:{(d.normalized_entropy or 0) * 100:.0f}%"></i></span>'
        f'{d.normalized_entropy:.3f}</td><td class="num">{_pct(d.confidence)}</td>'
        f'<td class="num">{d.reads}</td><td><code>{d.trace_id[:12]}</code></td></tr>'
        for d in ranked)
    return ('<section class="card"><table id="uncertain"><thead><tr><th>time (UTC)</th><th>node</th><th>question</th>'
            '<th>path</th><th>canvas</th><th>answer</th><th class="num">H/ln K</th><th class="num">confidence</th>'
            f'<th class="num">reads</th><th>trace</th></tr></thead><tbody>{rows}</tbody></table></section>')


def render(report: Report, *, title: str = "canvasroute decisions", top: int = 20, buckets: int = 24) -> str:
    """The whole page as one HTML string."""
    ds = report.decisions
    paths = Counter(d.path for d in ds)
    votes = [d.agrees for d in ds if d.agrees is not None]
    sets = [x for n in report.nodes.values() for x in n.set_latencies]
    errors = sum(n.errors for n in report.nodes.values())
    kpis = "".join([
        _kpi("decision sets", str(len(sets)), f"{len(ds)} questions · {len(report.nodes)} nodes", "kpi-sets"),
        _kpi("escalation rate", _pct(paths["escalated"] / len(ds) if ds else None),
             f"{paths['escalated']} of {len(ds)} questions", "kpi-escalation"),
        _kpi("canvas vs escalation", _pct(sum(votes) / len(votes) if votes else None),
             f"agreed on {sum(votes)} of {len(votes)} escalated", "kpi-agreement"),
        _kpi("re-read", _pct(paths["reread"] / len(ds) if ds else None), f"{paths['reread']} answered after re-reads",
             "kpi-reread"),
        _kpi("decide p50", _seconds(percentile(sets, 50)),
             f"p95 {_seconds(percentile(sets, 95))} · p99 {_seconds(percentile(sets, 99))}", "kpi-latency"),
        _kpi("failed sets", str(errors), "decide spans with error status", "kpi-errors"),
    ])
    legend = "".join(f'<span style="--c:{COLORS[p]}">{p}</span>' for p in PATHS)
    buckets = max(1, min(buckets, len(sets) // 2 or 1))
    nodes = "".join(_node_section(n, report, buckets) for n in report.nodes.values())
    sources = ", ".join(report.sources) or "spans"
    span_s = (report.end_ns - report.start_ns) / 1e9
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body><header><h1>{html.escape(title)}</h1><div class="meta">{report.spans} spans from {html.escape(sources)} ·
{_when(report.start_ns)} → {_when(report.end_ns)} ({_duration(span_s)}) ·
generated {_when(time.time_ns())}</div></header>
<main>{_banner(report)}
<div class="kpis" id="summary">{kpis}</div>
<h2>Graph nodes</h2><div class="legend">{legend}</div>{nodes}
<h2>Canvas vs escalation agreement</h2>{_agreement_section(report)}
<h2>Latency</h2>{_latency_section(report)}
<h2>Most uncertain decisions</h2>{_uncertain_section(report, top)}
</main><footer>canvasroute dashboard · self-contained page (inline CSS and SVG, no scripts)</footer></body></html>
"""


# -- CLI ---------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACES",
                        help="span JSONL files (JsonlSpanExporter) or OTLP JSON files, or folders of them")
    parser.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    parser.add_argument("--title", default="canvasroute decisions", help="page title")
    parser.add_argument("--top", type=int, default=20, help="rows in the most-uncertain table (default 20)")
    parser.add_argument("--buckets", type=int, default=24, help="time buckets for path shares (default 24)")


def run(args: argparse.Namespace) -> int:
    try:
        spans = read_spans(*args.traces)
        report = build_report(spans, [Path(p).name for p in args.traces])
    except TraceFileError as exc:
        print(f"canvasroute dashboard: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.write_text(render(report, title=args.title, top=args.top, buckets=args.buckets), encoding="utf-8")
    ds = report.decisions
    print(f"wrote {out} ({len(ds)} questions in {sum(len(n.set_latencies) for n in report.nodes.values())} "
          f"decision sets, {len(report.nodes)} nodes, model {', '.join(report.models) or 'unknown'})")
    return 0

