"""Inline SVG charts for the dashboard: entropy histograms, path shares, latency bars."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from .report import PATHS, Decision
from .stats import percentile

COLORS = {"canvas": "#15803d", "reread": "#d19a00", "escalated": "#dc2626", "fallback": "#64748b",
          "abstained": "#7c3aed", "unsure": "#ea580c", "skipped": "#cbd5e1"}
ENTROPY_BINS = 20


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
        y = float(_H - _PAD_B)
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
    labels = [duration(secs * i / n) for i in range(n)]
    tips = [f"+{duration(secs * i / n)} ({int(sum(c.values()))} questions)" for i, c in enumerate(counts)]
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
                   f'{seconds(step * i)}</text>')
    for r, (name, xs) in enumerate(rows):
        y = top_pad + r * row_h
        out.append(f'<text class="row-label" x="{label_w - 8}" y="{y + 17}" text-anchor="end">'
                   f'{html.escape(name)}</text>')
        for j, (q, shade) in enumerate(reversed(list(shades.items()))):
            v = percentile(xs, float(q[1:]))
            w = plot_w * v / x_max
            tip = html.escape(f"{name} {q} {seconds(v)} (n={len(xs)})")
            out.append(f'<rect class="lat {q}" x="{label_w}" y="{y + 4 + j * 3}" width="{w:.1f}" '
                       f'height="{22 - j * 6}" fill="{shade}"><title>{tip}</title></rect>')
    legend = "".join(f'<rect x="{label_w + i * 70}" y="2" width="10" height="10" fill="{c}"/>'
                     f'<text class="tick" x="{label_w + i * 70 + 14}" y="11">{q}</text>'
                     for i, (q, c) in enumerate(shades.items()))
    return (f'<svg class="chart latency-bars" viewBox="0 0 {_W} {height}" role="img" '
            f'aria-label="latency percentiles" xmlns="http://www.w3.org/2000/svg">{legend}{"".join(out)}</svg>')


def seconds(v: float) -> str:
    if math.isnan(v):
        return "–"
    if v < 0.01:
        return f"{v * 1000:.1f} ms" if v else "0 ms"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def duration(secs: float) -> str:
    if secs < 60:
        return f"{secs:.0f}s" if secs >= 1 or secs == 0 else f"{secs * 1000:.0f}ms"
    if secs < 3600:
        return f"{secs / 60:.0f}m"
    return f"{secs / 3600:.1f}h"
