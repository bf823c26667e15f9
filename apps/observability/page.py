"""The dashboard page: one self-contained HTML string (inline CSS and SVG, no scripts).

Clicking a node of the graph drawing filters the decision tables to it: each node links to
`#only-<n>`, and CSS rules keyed on that `:target` hide the other nodes' rows.
"""

from __future__ import annotations

import html
import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Sequence

from canvasroute.router import Tally

from .charts import COLORS, duration, entropy_histogram, latency_bars, path_shares, seconds
from .graph import graph_svg, observed_structure
from .report import (
    CAUSE_WORDS,
    GUARD_WORDS,
    NEAR_CHANCE_NOTE,
    PATHS,
    Decision,
    NodeStats,
    Report,
    RunTotals,
    cause_shares,
    escalation_rate,
    near_chance,
)
from .stats import percentile

__all__ = ["plural", "render"]


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
td.num,th.num{text-align:right}
td.num,.badge{white-space:nowrap}
td.time{white-space:nowrap}
section.card>p:first-child{margin-top:0}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;color:#334155}
.badge{display:inline-block;padding:1px 8px;border-radius:999px;font-size:11.5px;font-weight:600;color:#fff}
.meter{display:inline-block;width:64px;height:7px;background:#e2e8f0;border-radius:4px;margin-right:6px;
 vertical-align:middle;overflow:hidden}
.meter i{display:block;height:100%;background:#7c3aed}
.muted{color:var(--muted)}
#runs-section .plumbing{color:#991b1b}
footer{color:var(--muted);font-size:12px;text-align:center;padding:10px 0 30px}
.graph-wrap{overflow-x:auto}
svg.graph{max-width:100%;height:auto;display:block;margin:0 auto}
svg.graph .gnode rect{fill:#fff;stroke:#94a3b8;stroke-width:1.2}
svg.graph .gnode.decision rect{fill:#f5f3ff;stroke:#7c3aed;stroke-width:1.6}
svg.graph .gnode.terminal rect{fill:#f1f5f9;stroke:#cbd5e1}
svg.graph a.gnode{cursor:pointer}
svg.graph a.gnode:hover rect{stroke-width:3}
svg.graph .gname{font-size:13px;font-weight:650;fill:#0f172a}
svg.graph .gfig{font-size:11px;fill:#475569}
svg.graph .gedge line{stroke:#94a3b8}
svg.graph .gedge.conditional line{stroke-dasharray:5 4}
svg.graph .elabel{fill:#0f172a}
svg.graph .etraffic{font-size:11px;font-weight:600;fill:#fff}
.target{position:relative;top:-40px}
.filter-note{display:none;margin-left:8px}
"""


def _cell(text: str) -> str:
    """Escaped text for a table cell, breakable after `_ - / :`: a long node name, question id,
    label or trace file name wraps inside its column instead of widening the table past its card."""
    return re.sub(r"([_\-/:])", r"\1<wbr>", html.escape(text))


def _pct(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0%}"


def _badge(path: str) -> str:
    return (f'<span class="badge path-{html.escape(path)}" style="background:{COLORS.get(path, "#334155")}">'
            f'{html.escape(path)}</span>')


def _kpi(key: str, value: str, sub: str = "", kpi_id: str = "") -> str:
    ident = f' id="{kpi_id}"' if kpi_id else ""
    return (f'<div class="kpi"{ident}><div class="k">{html.escape(key)}</div><div class="v">{value}</div>'
            f'<div class="s">{sub}</div></div>')


def _gate_kpi(tally: Tally, kpi_id: str = "") -> str:
    """Over the gate, with the paths taken and the gate in words (as the demo's console says them)."""
    n = tally.decisions
    gates = "; ".join(tally.gates) or "no read gated"
    return _kpi("over the gate", _pct(tally.over_gate / n if n else None),
                f"{tally.over_gate} of {n} · passes {html.escape(gates)}<br>{html.escape(tally.shares())}", kpi_id)


def _escalation_kpi(tally: Tally, escalated: Tally, kpi_id: str = "") -> str:
    """Escalated questions (path `escalated`, whatever the cause), and why they went."""
    n, k = tally.decisions, tally.paths["escalated"]
    why = ", ".join(f"{CAUSE_WORDS.get(c, c)} {m}" for c, m in escalated.causes.items() if m)
    return _kpi("escalation rate", _pct(escalation_rate(tally) if n else None),
                f"{k} of {n} questions" + (f" · {html.escape(why)}" if why else ""), kpi_id)


def _hedge_kpi(decisions: Sequence[Decision], kpi_id: str = "") -> str:
    """Questions hedged (`Escalation.hedge`), and which side settled them first ("" when none was)."""
    hedged = [d for d in decisions if d.hedged]
    if not hedged:
        return ""
    target = sum(d.path == "escalated" for d in hedged)
    return _kpi("hedged", _pct(len(hedged) / len(decisions)),
                f"{len(hedged)} of {len(decisions)} questions · target first {target}, re-reads first "
                f"{sum(d.path == 'reread' for d in hedged)}", kpi_id)


def _guards_kpi(report: Report, kpi_id: str = "") -> str:
    """What the escalation guards did: degraded answers, short circuits, engine faults past the cap
    ("" when no guard acted and no escalation failed)."""
    degraded = [d for d in report.decisions if d.cause == "target_fault"]
    if not report.guards and not degraded:
        return ""
    count = Counter((g.guard, g.what) for g in report.guards)
    opened = count["breaker", "open"]
    return _kpi("escalation guards", f"{len(degraded)}",
                f"answers without the target (target fault) · breaker opened {opened}, kept "
                f"{count['breaker', 'short_circuit']} decisions from the target · engine-fault cap refused "
                f"{count['fault_cap', 'refused']}", kpi_id)


def _causes_kpi(tally: Tally, kpi_id: str = "") -> str:
    """Questions the gate did not pass, by cause (escalated, fallback or unsure alike)."""
    n, k = tally.decisions, sum(tally.causes.values())
    return _kpi("gate not passed", _pct(k / n if n else None), f"{k} of {n} · {html.escape(cause_shares(tally))}",
                kpi_id)


def _causes(decisions: Sequence[Decision]) -> str:
    """`uncertain 2, abstained 1` for a table cell (– when every one passed)."""
    counts = Counter(CAUSE_WORDS.get(d.cause, d.cause) for d in decisions if d.cause)
    return html.escape(", ".join(f"{c} {k}" for c, k in counts.most_common())) or "–"


def plural(count: int, noun: str) -> str:
    """`1 node`, `2 nodes`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def replayed_note(n: int, sep: str = " · ") -> str:
    """`· + 2 replayed`: decision sets a cache replayed, shown beside the decided ones (none: empty)."""
    return f"{sep}+ {n} replayed" if n else ""


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


def _nix(index: dict[str, int], node: str) -> str:
    """The attribute that lets the graph's filter hide a row (`data-nix`, on the node's cell)."""
    return f' data-nix="{index[node]}"' if node in index else ""


def _filter_css(index: dict[str, int]) -> str:
    """Per node: while `#only-<n>` is the target, hide the other nodes' rows and mark the node."""
    rules = []
    for i in index.values():
        on = f"main:has(#only-{i}:target)"
        rules.append(f'{on} tr:has(>td[data-nix]:not([data-nix="{i}"])),{on} section[data-nix]:not([data-nix="{i}"])'
                     f'{{display:none}}{on} .gnode[data-nix="{i}"] rect{{stroke:#0f172a;stroke-width:3.5}}'
                     f'{on} .filter-note[data-nix="{i}"]{{display:inline}}')
    return "".join(rules)


def _figures(report: Report) -> dict[str, dict[str, str]]:
    """Up to three short lines per decision node for the graph drawing."""
    out: dict[str, dict[str, str]] = {}
    for name, node in report.nodes.items():
        ents = [x.normalized_entropy for x in node.decisions if x.normalized_entropy is not None]
        out[name] = {"entropy": f"H/lnK {sum(ents) / len(ents):.2f}" if ents else "H/lnK –",
                     "escalated": f"escalated {_pct(node.escalation_rate if node.decisions else None)}"}
    for name, sh in report.shadow.items():
        out.setdefault(name, {})["shadow"] = (f"shadow agree {_pct(sh.agreement)} · "
                                              f"alone {_pct(sh.canvas_alone_share)}")
    for name, hits in report.cache_hits.items():
        if name in out:
            out[name]["cache"] = f"cache hits {hits}"
    return out


def _graph_section(report: Report, index: dict[str, int]) -> str:
    structure = report.graph or observed_structure(report.routes)
    source = ("the graph's own description (graph.get_graph())" if report.graph
              else "the routes decisions were seen taking (no graph recorded; pass --graph module:attr)")
    anchors = "".join(f'<span class="target" id="only-{i}"></span>' for i in index.values())
    notes = "".join(f'<span class="filter-note badge" style="background:#0f172a" data-nix="{i}">showing only '
                    f'{html.escape(n)}</span>' for n, i in index.items())
    svg = graph_svg(structure, _figures(report), report.routes, index)
    return (f'<section class="card" id="graph-section">{anchors}<p class="muted">Drawn from {source}. Edge labels: '
            'decision sets that took the edge. Per decision node: mean canvas H/ln K, escalation share, shadow '
            'agreement and the share the canvas would have taken alone at the current gate, cache hits. Click a '
            f'node to filter the tables below; <a href="#all">show all</a>.{notes}</p>'
            f'<div class="graph-wrap">{svg}</div></section>')


def _shadow_section(report: Report, index: dict[str, int]) -> str:
    if not report.shadow:
        return ('<section class="card" id="shadow-section"><p class="muted">No shadow-mode decisions in these traces '
                '(<code>decision_node(..., shadow=existing_router)</code> records them).</p></section>')
    rows = []
    for name, sh in report.shadow.items():
        rows.append(f'<tr><td{_nix(index, name)}>{_cell(name)}</td><td class="num">{sh.sets}</td>'
                    f'<td class="num"><span class="meter"><i style="width:{(sh.agreement or 0) * 100:.0f}%"></i>'
                    f'</span>{_pct(sh.agreement)}</td><td class="num">{_pct(sh.canvas_alone_share)}</td>'
                    f'<td class="num">{sh.canvas_errors}</td>'
                    f'<td class="num">{seconds(percentile(sh.router_latencies, 50))}</td>'
                    f'<td class="num">{seconds(percentile(sh.canvas_latencies, 50))}</td></tr>')
    return ('<section class="card" id="shadow-section"><p class="muted">The graph followed the existing router; '
            'the canvas read beside it without escalating. Agreement: the canvas would have routed the same way. '
            'Alone: no question would have escalated at the current gate.</p><table id="shadow"><thead><tr>'
            '<th>node</th><th class="num">sets</th><th class="num">agreement</th><th class="num">canvas alone</th>'
            '<th class="num">canvas errors</th><th class="num">router p50</th><th class="num">canvas p50</th>'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def _node_section(node: NodeStats, report: Report, buckets: int, index: dict[str, int]) -> str:
    d = node.decisions
    tally = node.tally
    paths = tally.paths
    agree, escalated = node.agreement
    ents = [x.normalized_entropy for x in d if x.normalized_entropy is not None]
    kpis = "".join([
        _kpi("decision sets", f"{len(node.set_latencies)}", f"{len(d)} questions{replayed_note(node.replayed)}"),
        _escalation_kpi(tally, node.escalated),
        _causes_kpi(tally),
        _gate_kpi(tally),
        _kpi("agreement", _pct(agree / escalated if escalated else None),
             f"canvas = escalation in {agree}/{escalated}"),
        _kpi("re-read", _pct(paths["reread"] / len(d) if d else None), f"{paths['reread']} answered after re-reads"),
        _kpi("mean H/ln K", f"{sum(ents) / len(ents):.3f}" if ents else "–", "canvas normalized entropy"),
        _kpi("p50 / p95", f"{seconds(percentile(node.set_latencies, 50))}",
             f"p95 {seconds(percentile(node.set_latencies, 95))} · "
             f"p99 {seconds(percentile(node.set_latencies, 99))}"),
    ])
    rows = []
    by_q: dict[str, list[Decision]] = defaultdict(list)
    for x in d:
        by_q[x.question].append(x)
    for q, xs in sorted(by_q.items()):
        pc = Counter(x.path for x in xs)
        votes = [x.agrees for x in xs if x.agrees is not None]
        es = [x.normalized_entropy for x in xs if x.normalized_entropy is not None]
        answers = ", ".join(f"{_cell(a)} ({c})" for a, c in Counter(x.answer for x in xs).most_common(3))
        mean_h = f"{sum(es) / len(es):.3f}" if es else "–"
        rows.append(f'<tr><td><code>{_cell(q)}</code></td><td>{html.escape(xs[0].kind)}</td>'
                    f'<td class="num">{len(xs)}</td><td class="num">{_pct(pc["escalated"] / len(xs))}</td>'
                    f'<td class="num">{_pct(sum(votes) / len(votes) if votes else None)}</td>'
                    f'<td class="num">{mean_h}</td><td>{_causes(xs)}</td><td>{answers}</td></tr>')
    table = ('<table class="questions"><thead><tr><th>question</th><th>kind</th><th class="num">n</th>'
             '<th class="num">escalated</th><th class="num">agreement</th><th class="num">mean H/ln K</th>'
             f'<th>gate not passed</th><th>top answers</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')
    errors = f" · {node.errors} failed" if node.errors else ""
    return (f'<section class="node" data-node="{html.escape(node.name)}"{_nix(index, node.name)}>'
            f'<h3>{html.escape(node.name)}</h3>'
            f'<div class="sub">graph node · questions {html.escape(", ".join(sorted(by_q)))}{errors}</div>'
            f'<div class="kpis">{kpis}</div><div class="charts">'
            f'<figure><figcaption>Canvas normalized entropy, by path</figcaption>{entropy_histogram(d)}</figure>'
            f'<figure><figcaption>Path shares over time</figcaption>'
            f'{path_shares(d, report.start_ns, report.end_ns, buckets)}</figure></div>{table}</section>')


def _guarantees_section(report: Report, index: dict[str, int]) -> str:
    """Each certified (or uncertified) gate in words, beside what its question did in these traces;
    then each live-certified question (`Escalation.audit`) as it stood last."""
    groups: dict[tuple[str, str, str], list[Decision]] = defaultdict(list)
    live: dict[tuple[str, str], list[Decision]] = defaultdict(list)
    for d in report.decisions:
        if d.gate and _LIVE in d.gate:
            live[(d.node, d.question)].append(d)
        elif d.gate and _CERTIFIED in d.gate:
            groups[(d.node, d.question, d.gate)].append(d)
    if not groups and not live:
        return ('<section class="card" id="guarantees-section"><p class="muted">No certified gate in these traces '
                '(<code>canvasroute calibrate --max-error 0.05 --confidence 0.9</code> writes one; '
                '<code>Escalation(audit=Audit(rate=0.02))</code> certifies live).</p></section>')
    out = ['<section class="card" id="guarantees-section">']
    if groups:
        rows = []
        for (node, question, gate), xs in sorted(groups.items()):
            passed = sum(x.path in ("canvas", "reread") for x in xs)
            rows.append(f'<tr><td{_nix(index, node)}>{_cell(node)}</td><td><code>{_cell(question)}</code>'
                        f'</td><td>{html.escape(gate)}</td><td class="num">{len(xs)}</td>'
                        f'<td class="num">{_pct(passed / len(xs))}</td>'
                        f'<td class="num">{_pct(sum(x.path == "escalated" for x in xs) / len(xs))}</td>'
                        f'<td>{_causes(xs)}</td></tr>')
        out.append('<p class="muted">A certified gate (<code>canvasroute calibrate --max-error</code>) bounds the '
                   'error rate of the answers it passes, with the stated probability over its calibration rows, '
                   'while live reads are drawn like those rows; an uncertified one passes nothing, or keeps its own '
                   'threshold and says so. Its words say the bound and the share of calibration rows it escalated: a '
                   'live share far from that one is a sign the traffic has drifted, and the bound then says nothing. '
                   'Traces carry no gold answers: the live error rate is not measured here.</p>'
                   '<table id="guarantees"><thead><tr><th>node</th><th>question</th><th>gate</th>'
                   '<th class="num">n</th><th class="num">passed</th><th class="num">escalated</th>'
                   f'<th>gate not passed</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')
    if live:
        rows = []
        for (node, question), xs in sorted(live.items()):
            last = max(xs, key=lambda x: x.time_ns)
            passed = sum(x.path in ("canvas", "reread") for x in xs)
            threshold = f"{last.live_threshold:g}" if last.live_threshold is not None else "nothing"
            rows.append(f'<tr><td{_nix(index, node)}>{_cell(node)}</td><td><code>{_cell(question)}</code>'
                        f'</td><td class="num">{html.escape(threshold)}</td>'
                        f'<td class="num">{"–" if last.live_bound is None else f"{last.live_bound:.1%}"}</td>'
                        f'<td class="num">{last.live_rows if last.live_rows is not None else "–"}</td>'
                        f'<td class="num">{last.live_audits if last.live_audits is not None else "–"}</td>'
                        f'<td class="num">{len(xs)}</td><td class="num">{_pct(passed / len(xs))}</td>'
                        f'<td>{html.escape(last.gate or "")}</td></tr>')
        out.append('<p class="muted">Live certification (<code>Escalation(audit=Audit(...))</code>) labels a share '
                   'of the passed answers in the background and passes at the loosest threshold whose anytime-valid '
                   'bound certifies the target: with the stated probability, at every moment, the answers it passes '
                   'disagree with the labeller (the escalation target, or reviewers) at most that often, while the '
                   'traffic is stationary. It certifies disagreement with the labeller, not truth. As it stood at '
                   'the last decision in these traces:</p>'
                   '<table id="live-guarantees"><thead><tr><th>node</th><th>question</th>'
                   '<th class="num">certified threshold</th><th class="num">bound</th><th class="num">rows</th>'
                   '<th class="num">audits</th><th class="num">n</th><th class="num">passed</th><th>gate</th></tr>'
                   f'</thead><tbody>{"".join(rows)}</tbody></table>')
    out.append("</section>")
    return "".join(out)


_LIVE = "certified live: "
"""In a gate's words (`GatePolicy.gate_text`) when live certification gates it (`uncertified live: `, too)."""
_CERTIFIED = "certified: "
"""In a gate's words (`GatePolicy.gate_text`) when it holds a certificate, certified or not."""


def _runs_section(report: Report) -> str:
    """Per run (trace file): what its decisions cost, beside every decision set sent to the target."""
    runs = list(report.runs)
    if len(runs) > 1:
        total = runs[0]
        for run in runs[1:]:
            total += run
        runs.append(total)

    def count(value: float | None, *, estimate: bool = False) -> str:
        return "–" if value is None else ("≈ " if estimate else "") + f"{value:,.0f}"

    def secs(value: float | None, *, estimate: bool = False) -> str:
        return "–" if value is None else ("≈ " if estimate else "") + seconds(value)

    def hedges(r: RunTotals) -> str:
        parts = [f"{r.hedges} hedged, {r.hedges_cancelled} cancelled"] if r.hedges else []
        parts += [f"{r.audits} audits"] if r.audits else []
        return f" ({'; '.join(parts)})" if parts else ""

    def replayed(n: int) -> str:
        return f' <span class="muted">+ {n} replayed</span>' if n else ""

    rows = "".join(
        f'<tr data-run="{html.escape(r.source or "spans")}"><td>{_cell(r.source or "spans")}</td>'
        f'<td>{_cell(", ".join(r.models))}</td><td class="num">{r.sets}{replayed(r.replayed)}</td>'
        f'<td class="num">{r.questions}</td>'
        f'<td class="num">{r.reads}</td><td class="num">{count(r.canvas_tokens or None)}</td>'
        f'<td class="num">{secs(r.decide_s)}</td><td class="num">{r.escalated} of {r.questions}</td>'
        f'<td class="num">{r.target_calls} of {r.sets}{hedges(r)}</td><td class="num">{r.calls_saved}</td>'
        f'<td class="num">{count(r.target_tokens if r.calls_with_usage else None)}</td>'
        f'<td class="num">{count(r.if_all_to_target_tokens, estimate=True)}</td>'
        f'<td class="num">{secs(r.target_s if r.target_calls else None)}</td>'
        f'<td class="num">{secs(r.if_all_to_target_s, estimate=True)}</td></tr>'
        for r in runs)
    chance = sorted({m for r in report.runs for m, p in r.models.items() if near_chance(m, p)})
    plumbing = (f'<p class="plumbing">Plumbing, not quality, for runs on {html.escape(", ".join(chance))} (near '
                "chance: the banner above says why): that they answered questions without the target says nothing "
                "about whether those answers were right.</p>" if chance else "")
    return ('<section class="card" id="runs-section"><p class="muted">A run is one trace file. Had every decision '
            "set gone to the escalation target, each would have been one target call: measured here are the "
            "decision sets, the questions escalated (path escalated, any cause), the target calls made and "
            "saved, their tokens and time (decision time: the decision sets end to end); ≈ marks an estimate, "
            "the mean measured target call times the decision sets (– when no target call reported it; a "
            "cancelled hedge is a target call, but its time is left out of the mean). Canvas reads and their "
            "tokens are routing's own cost. "
            "Decision sets a cache replayed (+ N replayed) read nothing and are not counted as saved by routing."
            f"</p>{plumbing}<table id=\"runs\"><thead><tr><th>run</th><th>canvas model</th>"
            '<th class="num">decision sets</th><th class="num">questions</th><th class="num">canvas reads</th>'
            '<th class="num">canvas tokens</th><th class="num">decision time</th><th class="num">escalated</th>'
            '<th class="num">target calls</th><th class="num">calls saved</th><th class="num">target tokens</th>'
            '<th class="num">tokens if all to target</th><th class="num">target time</th>'
            '<th class="num">time if all to target</th>'
            '</tr></thead>'
            f"<tbody>{rows}</tbody></table></section>")


def _agreement_section(report: Report, index: dict[str, int]) -> str:
    rows = []
    for node in report.nodes.values():
        by_q: dict[str, list[bool]] = defaultdict(list)
        for x in node.decisions:
            if x.agrees is not None:
                by_q[x.question].append(x.agrees)
        for q, votes in sorted(by_q.items()):
            share = sum(votes) / len(votes)
            rows.append(f'<tr><td{_nix(index, node.name)}>{_cell(node.name)}</td>'
                        f'<td><code>{_cell(q)}</code></td>'
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


def _guards_section(report: Report, index: dict[str, int]) -> str:
    """The escalation guards: what each did, counted, and every change of state, in time order."""
    degraded = [d for d in report.decisions if d.cause == "target_fault"]
    if not report.guards and not degraded:
        return ('<section class="card" id="guards-section"><p class="muted">No escalation guard acted in these traces '
                "and no escalation failed (<code>Escalation(breaker=Breaker(...))</code>: the target's circuit "
                "breaker and the cap on what engine faults escalate, on by default).</p></section>")
    count = Counter((g.guard, g.what) for g in report.guards)
    kept: Counter[tuple[str, str]] = Counter()
    for g in report.guards:
        kept[g.guard, g.what] += len(g.questions)
    rows = [f'<tr><td>{html.escape(GUARD_WORDS.get(key, " ".join(key)))}</td><td class="num">{n}</td>'
            f'<td class="num">{kept[key] or "–"}</td></tr>' for key, n in sorted(count.items())]
    why = Counter(str(d.escalation_error).split(":", 1)[0] for d in degraded)
    rows += [f'<tr><td>answered without the target: {html.escape(kind)}</td><td class="num">{n}</td>'
             f'<td class="num">{n}</td></tr>' for kind, n in why.most_common()]
    changes = "".join(
        f'<tr><td class="time">{_when(g.time_ns, date=False)}</td><td{_nix(index, g.node)}>{html.escape(g.node)}</td>'
        f'<td>{html.escape(GUARD_WORDS.get((g.guard, g.what), g.what))}</td><td>{html.escape(g.message)}</td>'
        f'<td><code>{g.trace_id[:12]}</code></td></tr>'
        for g in report.guards if g.change)
    return ('<section class="card" id="guards-section"><p class="muted">The escalation target\'s circuit breaker '
            "(after repeated failures it is not called until a probe answers; the questions that wanted it take "
            "<code>OutcomePolicy.target_fault</code>, by default the canvas answer, path unsure, cause target fault) "
            "and the cap on what engine faults escalate (past it an engine fault is over budget, never a cheap "
            "answer). Each counts in its own process. Events: how often each happened; questions: how many it "
            'kept from the target.</p><table id="guard-counts"><thead><tr><th>event</th><th class="num">events</th>'
            f'<th class="num">questions</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
            '<table id="guard-changes"><thead><tr><th>time (UTC)</th><th>node</th><th>change</th><th>what happened'
            f'</th><th>trace</th></tr></thead><tbody>{changes}</tbody></table></section>')


def _latency_section(report: Report) -> str:
    rows: list[tuple[str, Sequence[float]]] = [(f"decide · {n.name}", n.set_latencies) for n in report.nodes.values()]
    rows += [(f"canvas read · {k}", v) for k, v in sorted(report.read_latencies.items())]
    rows.append(("escalation", report.escalation_latencies))
    trs = "".join(
        f'<tr><td>{_cell(name)}</td><td class="num">{len(xs)}</td>'
        + "".join(f'<td class="num">{seconds(percentile(xs, q))}</td>' for q in (50, 95, 99))
        + f'<td class="num">{seconds(max(xs))}</td></tr>'
        for name, xs in rows if xs)
    table = ('<table id="latency"><thead><tr><th>span</th><th class="num">n</th><th class="num">p50</th>'
             '<th class="num">p95</th><th class="num">p99</th><th class="num">max</th></tr></thead>'
             f'<tbody>{trs}</tbody></table>')
    return (f'<section class="card" id="latency-section"><div class="charts"><figure>{latency_bars(rows)}</figure>'
            f'<div>{table}</div></div></section>')


def _uncertain_section(report: Report, top: int, index: dict[str, int]) -> str:
    ranked = sorted((d for d in report.decisions if d.normalized_entropy is not None),
                    key=lambda d: d.normalized_entropy or 0.0, reverse=True)[:top]
    rows = "".join(
        f'<tr><td class="time">{_when(d.time_ns, date=False)}</td><td{_nix(index, d.node)}>{_cell(d.node)}</td>'
        f'<td><code>{_cell(d.question)}</code></td>'
        f'<td>{_badge(d.path)}</td><td>{html.escape(CAUSE_WORDS.get(d.cause or "", d.cause or "–"))}</td>'
        f'<td>{_cell(d.canvas_answer or "–")}</td><td>{_cell(d.answer)}</td>'
        f'<td class="num"><span class="meter"><i style="width:{(d.normalized_entropy or 0) * 100:.0f}%"></i></span>'
        f'{d.normalized_entropy:.3f}</td><td class="num">{_pct(d.confidence)}</td>'
        f'<td class="num">{d.reads}</td><td><code>{d.trace_id[:12]}</code></td></tr>'
        for d in ranked)
    return ('<section class="card"><table id="uncertain"><thead><tr><th>time (UTC)</th><th>node</th><th>question</th>'
            '<th>path</th><th>cause</th><th>canvas</th><th>answer</th><th class="num">H/ln K</th>'
            '<th class="num">confidence</th>'
            f'<th class="num">reads</th><th>trace</th></tr></thead><tbody>{rows}</tbody></table></section>')


def render(report: Report, *, title: str = "canvasroute decisions", top: int = 20, buckets: int = 24) -> str:
    """The whole page as one HTML string."""
    ds = report.decisions
    tally = report.tally
    paths = tally.paths
    votes = [d.agrees for d in ds if d.agrees is not None]
    sets = report.set_latencies
    errors = sum(n.errors for n in report.nodes.values())
    kpis = "".join([
        _kpi("decision sets", str(len(sets)), f"{plural(len(ds), 'question')} · {plural(len(report.nodes), 'node')}"
             f"{replayed_note(report.replayed)}", "kpi-sets"),
        _escalation_kpi(tally, report.escalated, "kpi-escalation"),
        _hedge_kpi(ds, "kpi-hedged"),
        _guards_kpi(report, "kpi-guards"),
        _causes_kpi(tally, "kpi-causes"),
        _gate_kpi(tally, "kpi-gate"),
        _kpi("canvas vs escalation", _pct(sum(votes) / len(votes) if votes else None),
             f"agreed on {sum(votes)} of {len(votes)} escalated", "kpi-agreement"),
        _kpi("re-read", _pct(paths["reread"] / len(ds) if ds else None), f"{paths['reread']} answered after re-reads",
             "kpi-reread"),
        _kpi("decide p50", seconds(percentile(sets, 50)),
             f"p95 {seconds(percentile(sets, 95))} · p99 {seconds(percentile(sets, 99))}", "kpi-latency"),
        _kpi("failed sets", str(errors), "decide spans with error status", "kpi-errors"),
    ])
    legend = "".join(f'<span style="--c:{COLORS[p]}">{p}</span>' for p in PATHS)
    buckets = max(1, min(buckets, len(sets) // 2 or 1))
    index = {n: i for i, n in enumerate(dict.fromkeys([*report.nodes, *report.shadow, *(s for s, _ in report.routes)]))}
    nodes = "".join(_node_section(n, report, buckets, index) for n in report.nodes.values())
    sources = ", ".join(report.sources) or "spans"
    span_s = (report.end_ns - report.start_ns) / 1e9
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>{_CSS}{_filter_css(index)}</style></head>
<body><header><h1>{html.escape(title)}</h1><div class="meta">{report.spans} spans from {html.escape(sources)} ·
{_when(report.start_ns)} → {_when(report.end_ns)} ({duration(span_s)}) ·
generated {_when(time.time_ns())}</div></header>
<main>{_banner(report)}
<div class="kpis" id="summary">{kpis}</div>
<h2>Saved by routing</h2>{_runs_section(report)}
<h2>The graph</h2>{_graph_section(report, index)}
<h2>Graph nodes</h2><div class="legend">{legend}</div>{nodes}
<h2>Guarantees</h2>{_guarantees_section(report, index)}
<h2>Shadow mode</h2>{_shadow_section(report, index)}
<h2>Escalation guards</h2>{_guards_section(report, index)}
<h2>Canvas vs escalation agreement</h2>{_agreement_section(report, index)}
<h2>Latency</h2>{_latency_section(report)}
<h2>Most uncertain decisions</h2>{_uncertain_section(report, top, index)}
</main><footer>canvasroute dashboard · self-contained page (inline CSS and SVG, no scripts)</footer></body></html>
"""
