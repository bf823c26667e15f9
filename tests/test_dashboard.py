"""Trace files and the dashboard: the JSONL exporter, the OTLP JSON reader, the page's
figures, and a page rendered from a real vLLM trace, opened in headless Chromium."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import struct
import subprocess
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Annotated

import deadlines
import pytest
from conftest import ROOT, fresh_tracer_provider, label_rows
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from typing_extensions import TypedDict

from canvasroute.apps.cli import main
from canvasroute.apps.observability.dashboard import build_report, near_chance, percentile, render
from canvasroute.apps.observability.traces import (
    JsonlSpanExporter,
    SpanEvent,
    SpanRecord,
    decision_figures,
    read_spans,
    span_record,
)
from canvasroute.engine import FunctionEngine, TraceFileError, VLLMServerEngine, run_sync
from canvasroute.harness import merge_decisions
from canvasroute.router import CanvasDecisionModel, GatePolicy
from canvasroute.router import telemetry as tm

BIGBENCH = ROOT / "data" / "bigbench"


@contextmanager
def traced(path: Path):
    """A fresh global TracerProvider exporting to JSONL and to memory (restored afterwards)."""
    memory = InMemorySpanExporter()
    with fresh_tracer_provider(JsonlSpanExporter(path), memory):
        yield memory


# -- trace files --------------------------------------------------------------------------------


async def test_jsonl_exporter_round_trips_sdk_spans(tmp_path):
    def rows(read):
        return [{engine.token_id("A"): -0.7, engine.token_id("B"): -0.75}]

    engine = FunctionEngine(rows, model="fn")
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=1),
                                escalate_to=GenericFakeChatModel(messages=iter([AIMessage('{"side": "right"}')])))
    path = tmp_path / "spans.jsonl"
    with traced(path) as memory:
        await model.adecide("x", {"side": Choice(instructions="Side?", criteria={"left": None, "right": None})},
                           attributes={tm.GRAPH_NODE: "pick"})
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["trace_id"] for line in lines)  # decide, 2 reads, escalate, chat
    expected = sorted((span_record(s) for s in memory.get_finished_spans()), key=lambda s: s.span_id)
    got = sorted(read_spans(path), key=lambda s: s.span_id)
    assert got == expected
    decide = next(s for s in got if s.name == "decide fn")
    (event,) = decide.events  # one per question, the id as a value
    assert event.name == tm.QUESTION_EVENT and event.attributes[tm.QUESTION_ID] == "side"
    assert event.attributes[tm.FIGURE_KEYS["options"]] == ["left", "right"]
    escalate = next(s for s in got if s.name.startswith("escalate "))
    assert {s.parent_id for s in got if s is not decide and not s.name.startswith("chat ")} == {decide.span_id}
    assert next(s for s in got if s.name.startswith("chat ")).parent_id == escalate.span_id
    exporter = JsonlSpanExporter(tmp_path / "closed.jsonl")
    exporter.shutdown()
    assert exporter.export(memory.get_finished_spans()).name == "FAILURE"


def _otlp_span(name, span_id, parent, start, end, attrs, code=0, kind=1, events=()):
    def value(v):
        if isinstance(v, bool):
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        if isinstance(v, float):
            return {"doubleValue": v}
        if isinstance(v, list):
            return {"arrayValue": {"values": [value(x) for x in v]}}
        return {"stringValue": v}

    span = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": span_id, "name": name, "kind": kind,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
            "attributes": [{"key": k, "value": value(v)} for k, v in attrs.items()], "status": {"code": code},
            "events": [{"name": e.name, "timeUnixNano": str(e.time_ns),
                        "attributes": [{"key": k, "value": value(v)} for k, v in e.attributes.items()]}
                       for e in events]}
    if parent:
        span["parentSpanId"] = parent
    return span


def _decide_attrs(node, questions):
    return {tm.DECISION_SET: ",".join(questions), tm.QUESTIONS: len(questions), tm.GRAPH_NODE: node}


def _question_events(questions, time_ns=0):
    """The `canvasroute.question` events of a decide span: figures under fixed keys, the id a value."""
    return tuple(SpanEvent(name=tm.QUESTION_EVENT, time_ns=time_ns, attributes={
        tm.QUESTION_ID: qid, **({tm.QUESTION_KIND: f["kind"]} if "kind" in f else {}),
        **{tm.FIGURE_KEYS[k]: v for k, v in f.items() if k != "kind"}}) for qid, f in questions.items())


def test_reads_otlp_json_from_the_collector_file_exporter(tmp_path):
    t0 = 1_700_000_000_000_000_000
    questions = {"team.v2": {"path": "escalated", "answer": "billing", "canvas_answer": "billing",
                             "normalized_entropy": 0.81, "confidence": 0.4, "reads": 4, "kind": "choice",
                             "options": ["billing", "tech"], "canvas_probabilities": [0.6, 0.4]}}
    decide = _otlp_span("decide big-dgemma", "eee19b7ec3c1b174", None, t0, t0 + 250_000_000,
                        _decide_attrs("triage", questions), events=_question_events(questions, t0 + 200))
    read = _otlp_span("canvas_read big-dgemma", "aaa19b7ec3c1b174", "eee19b7ec3c1b174", t0 + 1000,
                      t0 + 100_000_000, {tm.GEN_AI_OPERATION: "canvas_read", tm.GEN_AI_PROVIDER: "vllm",
                                         tm.GEN_AI_MODEL: "big-dgemma", tm.READ_KIND: "first"}, code=2, kind=3)
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "bot"}}]},
                              "scopeSpans": [{"scope": {"name": "canvasroute"}, "spans": [decide, read]}]}]}
    lines = tmp_path / "otlp.jsonl"
    lines.write_text(json.dumps(doc) + "\n")
    pretty = tmp_path / "otlp.json"
    pretty.write_text(json.dumps(doc, indent=2))
    for path in (lines, pretty):
        spans = read_spans(path)
        assert [s.name for s in spans] == ["decide big-dgemma", "canvas_read big-dgemma"]
        d, r = spans
        assert decision_figures(d)["team.v2"]["reads"] == 4 and d.events[0].time_ns == t0 + 200
        assert decision_figures(d)["team.v2"]["canvas_probabilities"] == [0.6, 0.4]
        assert r.parent_id == d.span_id and r.status == "ERROR" and r.kind == "CLIENT"
        assert d.resource["service.name"] == "bot" and d.duration_s == 0.25
    report = build_report(read_spans(lines, pretty))
    (node,) = report.nodes.values()
    assert node.name == "triage" and [x.question for x in node.decisions] == ["team.v2", "team.v2"]
    assert node.agreement == (2, 2) and report.models == {"big-dgemma": "vllm"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(TraceFileError, match="not a span"):
        read_spans(bad)
    with pytest.raises(TraceFileError, match="no trace file"):
        read_spans(tmp_path / "missing.jsonl")


def _record(span_id, node, start_s, dur_s, questions, node_attr=True):
    attrs = _decide_attrs(node, questions)
    if not node_attr:
        del attrs[tm.GRAPH_NODE]
    return SpanRecord(name="decide real-model", trace_id=f"{span_id:032x}", span_id=f"{span_id:016x}", parent_id=None,
                      start_time_ns=int(start_s * 1e9), end_time_ns=int((start_s + dur_s) * 1e9), attributes=attrs,
                      events=_question_events(questions))


def test_trace_files_written_before_question_events_still_read():
    """Before 0.2 the figures were span attributes named by question id; such files still read."""
    legacy = {**_decide_attrs("triage", {"team.v2": {}}), "canvasroute.decision.team.v2.path": "canvas",
              "canvasroute.decision.team.v2.answer": "tech", "canvasroute.decision.team.v2.kind": "choice"}
    span = SpanRecord(name="decide old-model", trace_id="1" * 32, span_id="2" * 16, parent_id=None,
                      start_time_ns=0, end_time_ns=1, attributes=legacy)
    assert decision_figures(span) == {"team.v2": {"path": "canvas", "answer": "tech", "kind": "choice"}}
    (decision,) = build_report([span]).decisions
    assert (decision.question, decision.path, decision.answer, decision.kind) == ("team.v2", "canvas", "tech", "choice")


def test_report_figures_and_page_from_known_spans():
    def q(path, answer, canvas, h):
        return {"path": path, "answer": answer, "canvas_answer": canvas, "normalized_entropy": h, "kind": "noul",
                "confidence": 1 - h / 2, "reads": 1}

    spans = [
        _record(1, "triage", 0, 0.1, {"urgent": q("canvas", "yes", "yes", 0.1)}),
        _record(2, "triage", 1, 0.2, {"urgent": q("escalated", "no", "yes", 0.9)}),
        _record(3, "triage", 2, 0.3, {"urgent": q("escalated", "no", "no", 0.8)}),
        _record(4, "triage", 3, 0.4, {"urgent": q("reread", "yes", "yes", 0.5)}),
        _record(5, "spam", 4, 1.0, {"spam": q("escalated", "yes", "no", 0.95)}, node_attr=False),
    ]
    report = build_report(spans, ["known.jsonl"])
    triage, spam = report.nodes["triage"], report.nodes["spam"]  # no graph node: grouped by decision set
    assert triage.escalation_rate == 0.5 and triage.agreement == (1, 2)
    assert spam.agreement == (0, 1) and spam.escalation_rate == 1.0
    assert triage.set_latencies == pytest.approx([0.1, 0.2, 0.3, 0.4])
    page = render(report, top=3)
    assert 'id="model-banner" class="banner"' in page and "real-model" in page  # not flagged near chance
    assert "near chance" in page  # the note is always on the page
    assert re.search(r'id="kpi-escalation".*?<div class="v">60%</div>', page)
    assert re.search(r'id="kpi-agreement".*?<div class="v">33%</div>', page)
    assert page.count("<tr><td class=\"time\">") == 3  # top 3 uncertain
    first = re.search(r'<table id="uncertain">.*?<tbody><tr>(.*?)</tr>', page, re.DOTALL).group(1)
    assert "spam" in first and "0.950" in first
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_percentiles_and_near_chance_names():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 95) == 95
    assert near_chance("tiny-dgemma", "vllm") and near_chance("SmolLM2-135M-Instruct", "transformers")
    assert near_chance("anything", "function")
    assert near_chance("google/diffusiongemma-26B-A4B-it", "vllm") is None


def test_dashboard_cli_refuses_traces_without_decisions(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["dashboard", str(empty), "-o", str(tmp_path / "r.html")]) == 2
    assert "no spans" in capsys.readouterr().err


# -- a real trace, a real browser -----------------------------------------------------------------


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def find(self, tag=None, cls=None, ident=None):
        return [a for t, a in self.elements if (tag is None or t == tag) and (ident is None or a.get("id") == ident)
                and (cls is None or cls in a.get("class", "").split())]


def _browse(exe: str, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage"]
    return deadlines.run([exe, *flags, *args], cpu_s=120)


@pytest.mark.vllm
@pytest.mark.services
def test_dashboard_from_a_real_vllm_trace_in_chromium(vllm_url, chromium, tmp_path):
    exe = chromium
    intents = json.loads((BIGBENCH / "intent_recognition" / "task.json").read_text())["examples"]
    facts = json.loads((BIGBENCH / "strategyqa" / "task.json").read_text())["examples"]
    triage = {"intent": Choice(instructions="Which intent?", criteria=dict.fromkeys(intents[0]["target_scores"])),
              "urgent": Noul(instructions="Is it urgent?")}
    check = {"answer": Noul(instructions="Is the answer yes?")}
    reply = AIMessage('{"intent": "play_music", "urgent": "no", "answer": "yes"}',
                      usage_metadata={"input_tokens": 80, "output_tokens": 12, "total_tokens": 92})
    engine = VLLMServerEngine(vllm_url)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.993, rereads=2),
                                escalate_to=GenericFakeChatModel(messages=itertools.repeat(reply)))
    spans_file = tmp_path / "spans.jsonl"
    with traced(spans_file):
        for i in range(10):
            run_sync(model.adecide(intents[i * 37]["input"], triage, attributes={tm.GRAPH_NODE: "triage"}))
            run_sync(model.adecide(facts[i]["input"], check, attributes={tm.GRAPH_NODE: "fact_check"}))
    html_file = tmp_path / "report.html"
    assert main(["dashboard", str(spans_file), "-o", str(html_file), "--top", "12"]) == 0
    report = build_report(read_spans(spans_file))
    assert report.models == {"tiny-dgemma": "vllm"} and set(report.nodes) == {"triage", "fact_check"}

    shot = tmp_path / "report.png"
    done = _browse(exe, f"--screenshot={shot}", "--window-size=1280,2200", html_file.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1280, 2200)
    assert len(png) > 50_000  # a rendered page, not a blank one
    if artefacts := os.environ.get("CANVASROUTE_ARTEFACTS"):
        shutil.copy(shot, Path(artefacts) / "dashboard.png")

    dumped = _browse(exe, "--dump-dom", html_file.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom_text = dumped.stdout
    dom = _Dom()
    dom.feed(dom_text)
    (banner,) = dom.find(ident="model-banner")
    assert banner["data-near-chance"] == "true"
    banner_text = re.search(r'id="model-banner".*?</div>', dom_text, re.DOTALL).group(0)
    assert "tiny-dgemma" in banner_text and "near chance" in banner_text
    assert sorted(a["data-node"] for a in dom.find("section", cls="node")) == ["fact_check", "triage"]
    sections = re.split(r'<section class="node"', dom_text)[1:]
    for section in sections:
        assert section.count('class="chart entropy-histogram"') == 1
        assert section.count('class="chart path-shares"') == 1
        assert re.search(r'<rect class="seg (canvas|reread|escalated|fallback)"', section)
    assert len(dom.find("svg", cls="latency-bars")) == 1
    assert len(dom.find("table", ident="latency")) == 1
    uncertain = re.search(r'<table id="uncertain">.*?</table>', dom_text, re.DOTALL).group(0)
    assert uncertain.count("<tr>") - 1 == 12
    escalated = sum(d.path == "escalated" for d in report.decisions)
    rate = f"{escalated / len(report.decisions):.0%}"
    assert re.search(rf'id="kpi-escalation".*?<div class="v">{rate}</div>', dom_text, re.DOTALL)
    assert not dom.find("script")


# -- the graph, shadow mode and edge traffic, from a real LangGraph run --------------------------


class _GraphState(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict, merge_decisions]
    lane: str


def _graph_run(spans_file: Path):
    """A real graph: `triage` shadows a rules router, `check` routes on the canvas (and escalates
    to a scripted chat model when unsure); both decision nodes' traffic goes to the trace."""
    from langgraph.graph import END, START, StateGraph

    from canvasroute.apps.observability.graph import record_graph
    from canvasroute.harness import decision_node

    def rows(read):  # tickets with "refund" read sure billing/yes; the others unsure
        sure = "refund" in read.messages[-1]["content"]
        lp = {"A": -0.01, "B": -6.0, "yes": -0.01, "no": -6.0} if sure else \
             {"A": -0.69, "B": -0.70, "yes": -0.69, "no": -0.70}
        return label_rows(engine, lp, read)

    engine = FunctionEngine(rows)
    reply = AIMessage('{"urgent": "yes"}', usage_metadata={"input_tokens": 50, "output_tokens": 5, "total_tokens": 55})
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                                escalate_to=GenericFakeChatModel(messages=itertools.repeat(reply)))
    team = {"team": Choice(instructions="Which team?", criteria={"billing": "payments", "tech": "bugs"})}
    urgent = {"urgent": Noul(instructions="Is it urgent?")}
    builder = StateGraph(_GraphState)
    builder.add_node("triage", decision_node(model, team, inputs="ticket", route=("team", {"billing": "billing",
                                                                                           "tech": "check"}),
                                             shadow=lambda s: "billing" if "charge" in s["ticket"] else "check"))
    builder.add_node("check", decision_node(model, urgent, inputs="ticket",
                                            route=("urgent", {"yes": "on_call", "no": "tech"})))
    for lane in ("billing", "tech", "on_call"):
        builder.add_node(lane, lambda state, lane=lane: {"lane": lane})
        builder.add_edge(lane, END)
    builder.add_edge(START, "triage")
    graph = builder.compile()
    tickets = ["charged twice, refund please", "refund my charge", "the app crashes", "charge looks wrong",
               "500 errors everywhere"]
    with traced(spans_file):
        record_graph(graph, "support")
        lanes = [graph.invoke({"ticket": t})["lane"] for t in tickets]
    return graph, lanes


def test_the_graph_shadow_and_edge_traffic_from_a_real_run(tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    graph, lanes = _graph_run(spans_file)
    assert lanes == ["billing", "billing", "on_call", "billing", "on_call"]
    report = build_report(read_spans(spans_file))
    assert report.graph["nodes"] == list(graph.get_graph().nodes)
    assert report.routes == {("triage", "billing"): 3, ("triage", "check"): 2, ("check", "on_call"): 2}
    sh = report.shadow["triage"]
    # the canvas reads "refund" tickets as sure billing and leans billing, unsure, on the rest:
    # it agrees with the rules on the three "charge" tickets, and would take the two sure ones alone
    assert (sh.sets, sh.agreed, sh.canvas_alone) == (5, 3, 2)
    assert sh.agreement == 0.6 and sh.canvas_alone_share == 0.4
    assert report.nodes["check"].paths == {"escalated": 2}  # the canvas-routed node escalates for real
    assert report.nodes["triage"].paths["escalated"] == 0  # the shadow never escalates
    (provider,) = report.escalation_models.values()  # read from the chat span under escalate
    chat = next(s for s in read_spans(spans_file) if s.attributes.get(tm.GEN_AI_OPERATION) == "chat")
    assert provider and provider == chat.attributes[tm.GEN_AI_PROVIDER]
    page = render(report)
    assert "<script" not in page
    assert re.search(r'<g class="gedge conditional" data-source="triage" data-target="billing" data-traffic="3">',
                     page)
    assert 'data-source="check" data-target="tech" data-traffic="0"' in page  # drawn, never taken
    assert re.search(r'<table id="shadow">.*?<td data-nix="\d">triage</td><td class="num">5</td>.*?60%.*?40%',
                     page, re.DOTALL)


def test_cache_hits_and_a_graph_passed_on_the_command_line(tmp_path, capsys, monkeypatch):
    spans_file = tmp_path / "spans.jsonl"
    spans = [_record(1, "triage", 0, 0.1, {"urgent": {"path": "canvas", "answer": "yes", "kind": "noul"}}),
             _record(2, "triage", 1, 0.1, {"urgent": {"path": "canvas", "answer": "yes", "kind": "noul"}})]
    lines = [s.to_json() for s in spans]
    lines[1]["attributes"][tm.CACHE_HIT] = True
    spans_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    module = tmp_path / "my_graph.py"
    module.write_text("from langgraph.graph import StateGraph, START, END\nfrom typing_extensions import TypedDict\n"
                      "class S(TypedDict):\n    x: int\n"
                      "def build():\n    b = StateGraph(S)\n    b.add_node('triage', lambda s: s)\n"
                      "    b.add_edge(START, 'triage')\n    b.add_edge('triage', END)\n    return b.compile()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.html"
    assert main(["dashboard", str(spans_file), "-o", str(out), "--graph", "my_graph:build"]) == 0
    page = out.read_text()
    assert "graph.get_graph()" in page and "cache hits 1" in page
    assert re.search(r'<a href="#only-0" class="gnode decision" data-node="triage" data-nix="0">', page)
    assert main(["dashboard", str(spans_file), "-o", str(out), "--graph", "my_graph"]) == 2
    assert "module:attr" in capsys.readouterr().err


@pytest.mark.services
def test_the_graph_page_in_chromium_filters_on_a_click(chromium, tmp_path):
    exe = chromium
    spans_file = tmp_path / "spans.jsonl"
    _graph_run(spans_file)
    html_file = tmp_path / "report.html"
    assert main(["dashboard", str(spans_file), "-o", str(html_file)]) == 0
    shot = tmp_path / "graph.png"
    done = _browse(exe, f"--screenshot={shot}", "--window-size=1280,1400", html_file.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 30_000
    if artefacts := os.environ.get("CANVASROUTE_ARTEFACTS"):
        shutil.copy(shot, Path(artefacts) / "dashboard-graph.png")

    page = html_file.read_text()
    nix = re.search(r'class="gnode decision" data-node="check" data-nix="(\d)"', page).group(1)
    # a test-only probe on a copy of the page: click the node, then report what the CSS shows
    probe = ("<script>document.querySelector('a.gnode[data-node=\"check\"]').dispatchEvent("
             "new MouseEvent('click', {bubbles: true, cancelable: true}));"
             "setTimeout(() => { const shown = s => [...document.querySelectorAll(s)].filter("
             "e => getComputedStyle(e.closest('tr')).display !== 'none').map(e => e.textContent.trim());"
             "const out = document.createElement('pre'); out.id = 'probe'; out.textContent = JSON.stringify({"
             "hash: location.hash, sections: [...document.querySelectorAll('section.node')].filter("
             "e => getComputedStyle(e).display !== 'none').map(e => e.dataset.node),"
             "uncertain: shown('#uncertain tbody td[data-nix]'), shadow: shown('#shadow tbody td[data-nix]')});"
             "document.body.append(out); }, 100);</script>")
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", probe + "</body>"))
    dumped = _browse(exe, "--dump-dom", "--virtual-time-budget=3000", probed.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    probe = re.search(r'<pre id="probe">(.*?)</pre>', dumped.stdout, re.DOTALL)
    seen = json.loads(html_module_unescape(probe.group(1)))
    assert seen["hash"] == f"#only-{nix}"
    assert seen["sections"] == ["check"]
    assert seen["uncertain"] and set(seen["uncertain"]) == {"check"}
    assert seen["shadow"] == []  # triage's shadow row is filtered out
    # the unfiltered page shows both nodes
    dom = _Dom()
    dom.feed(_browse(exe, "--dump-dom", html_file.as_uri()).stdout)
    assert sorted(a["data-node"] for a in dom.find("section", cls="node")) == ["check", "triage"]
    assert {a["data-node"] for a in dom.find("a", cls="gnode")} == {"check", "triage"}
    assert len(dom.find("svg", ident="graph")) == 1 and not dom.find("script")


def html_module_unescape(text: str) -> str:
    import html

    return html.unescape(text)


# -- outcomes: paths, causes, and what routing saved ---------------------------------------------


def _legacy(path, answer, **more):
    """One question's figures as a trace written before the one outcome vocabulary holds them."""
    return {"path": path, "answer": answer, "kind": "choice", "options": ["billing", "tech", "(abstain)"],
            "canvas_probabilities": [0.15, 0.05, 0.8], "normalized_entropy": 0.6, "reads": 1, **more}


def test_abstained_questions_answered_by_the_target_are_escalations_on_the_dashboard(tmp_path):
    """Defect 12: a question that abstained and was answered by the target is escalated (path
    `escalated`, cause `abstained`), in a trace written now and in one written before."""
    from promptrows import PromptRows, pick

    from canvasroute.harness import decision_node
    from canvasroute.router import Tally

    old = [_record(1, "triage", 0, 0.1, {"team": _legacy("abstained", "tech", escalation_model="big")}),
           _record(2, "triage", 1, 0.1, {"team": _legacy("abstained", "billing", escalation_model="big")})]
    report = build_report(old)
    assert [(d.path, d.cause) for d in report.decisions] == [("escalated", "abstained")] * 2
    page = render(report)
    assert re.search(r'id="kpi-escalation".*?<div class="v">100%</div>.*?2 of 2 questions · abstained 2', page,
                     re.DOTALL)
    assert re.search(r'id="kpi-causes".*?<div class="v">100%</div>.*?uncertain 0, abstained 2, engine fault 0, '
                     r'over budget 0', page, re.DOTALL)

    # written now: a real graph whose `team` abstains, answered by the escalation target
    rows = PromptRows(pick("none of these", 0.8))
    target = GenericFakeChatModel(messages=itertools.repeat(AIMessage('{"team": "tech"}')))
    model = CanvasDecisionModel(engine=rows.engine, escalate_to=target,
                                policy=GatePolicy(max_normalized_entropy=None, rereads=0, abstain=True))
    team = {"team": Choice(instructions="Which team?", criteria={"billing": "payments", "tech": "bugs"})}
    from langgraph.graph import END, START, StateGraph

    builder = StateGraph(_GraphState)
    builder.add_node("triage", decision_node(model, team, inputs="ticket"))
    builder.add_edge(START, "triage")
    builder.add_edge("triage", END)
    graph = builder.compile()
    spans_file = tmp_path / "spans.jsonl"
    with traced(spans_file):
        events = [e for t in ("refund", "crash", "login") for e in graph.stream({"ticket": t}, stream_mode="custom")]
    told = sum((Tally.from_dict(e["tally"]) for e in events), Tally.of(()))
    report = build_report(read_spans(spans_file))
    assert report.tally == told  # the dashboard counts as the decision events do
    assert told.paths["escalated"] == 3 and told.causes["abstained"] == 3
    assert report.nodes["triage"].escalation_rate == 1.0
    page = render(report)
    assert re.search(r'id="kpi-escalation".*?<div class="v">100%</div>', page, re.DOTALL)
    assert "3 of 3 questions · abstained 3" in page


def test_older_trace_outcomes_map_onto_paths_and_causes():
    """Traces written before the one outcome vocabulary (path `abstained`, figure `over_budget`,
    no `cause`) read in it, by the documented rules of `legacy_outcome`."""
    keys = {**tm.FIGURE_KEYS, "kind": tm.QUESTION_KIND, "over_budget": tm.DECISION_PREFIX + ".over_budget"}
    cases = {
        "escalated": (_legacy("abstained", "tech", escalation_model="big"), ("escalated", "abstained")),
        "kept": (_legacy("abstained", "billing"), ("unsure", "abstained")),  # the best real option
        "fallback": (_legacy("abstained", "tech"), ("fallback", "abstained")),  # not the best: a fallback
        "spent": (_legacy("abstained", "billing", over_budget=True), ("unsure", "over_budget")),
        "unsure": (_legacy("unsure", "billing", over_budget=True), ("unsure", "over_budget")),
        "gated": (_legacy("escalated", "tech", escalation_model="big"), ("escalated", "uncertain")),
        "fault": ({"path": "escalated", "answer": "tech", "escalation_model": "big"}, ("escalated", "engine_fault")),
        "passed": ({"path": "canvas", "answer": "tech"}, ("canvas", None)),
        "now": (_legacy("fallback", "tech", cause="engine_fault"), ("fallback", "engine_fault")),
    }
    events = tuple(SpanEvent(name=tm.QUESTION_EVENT, attributes={
        tm.QUESTION_ID: qid, **{keys[k]: v for k, v in f.items()}})
        for qid, (f, _) in cases.items())
    span = SpanRecord(name="decide old-model", trace_id="1" * 32, span_id="2" * 16, parent_id=None, start_time_ns=0,
                      end_time_ns=1, attributes=_decide_attrs("triage", cases), events=events)
    figures = decision_figures(span)
    assert {q: (f["path"], f.get("cause")) for q, f in figures.items()} == {q: want for q, (_, want) in cases.items()}
    assert not any("over_budget" in f for f in figures.values())
    assert build_report([span]).tally.causes == {"uncertain": 1, "abstained": 3, "engine_fault": 2, "over_budget": 2,
                                                 "target_fault": 0}


def test_the_runs_panel_counts_cache_hits_apart_as_the_totals_do(tmp_path):
    """Issue 34.3: a `DecisionCache` hit of an escalated decision read nothing and escalated
    nothing; the dashboard's runs (and its "calls saved") agree with the responses' `Totals`."""
    from canvasroute.router import DecisionCache, Totals

    engine = FunctionEngine(lambda read: label_rows(engine, {"A": -0.69, "B": -0.70}, read))  # a toss-up
    reply = AIMessage('{"team": "tech"}', usage_metadata={"input_tokens": 50, "output_tokens": 5, "total_tokens": 55})
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                                escalate_to=GenericFakeChatModel(messages=itertools.repeat(reply)),
                                cache=DecisionCache())
    team = {"team": Choice(instructions="Which team?", criteria={"billing": None, "tech": None})}
    with traced(tmp_path / "hits.jsonl"):
        responses = [run_sync(model.adecide(t, team, attributes={tm.GRAPH_NODE: "triage"}))
                     for t in ("crash a", "crash a", "crash b", "crash a")]
    assert [r.replayed for r in responses] == [None, "decision_cache", None, "decision_cache"]
    totals = sum((r.totals for r in responses), Totals())
    (run,) = build_report(read_spans(tmp_path / "hits.jsonl")).runs
    assert (run.sets, run.questions, run.reads, run.escalated, run.target_calls) == (
        totals.decisions, totals.questions, totals.reads, totals.escalations, 2)
    assert (run.sets, run.replayed, run.calls_saved) == (2, 2, 0)  # the hits were saved by the cache, not routing
    row = re.search(r'<tr data-run="hits.jsonl">(.*?)</tr>', render(build_report(read_spans(tmp_path / "hits.jsonl"))))
    assert "+ 2 replayed" in row.group(1)


def test_every_decision_set_figure_counts_cache_hits_apart(tmp_path, capsys):
    """The page's decision sets (summary, node, latency table, CLI line) and its decide latencies
    leave `DecisionCache` hits out, as the runs panel does; the hits show as replayed beside them."""
    canvas = {"urgent": {"path": "canvas", "answer": "yes", "kind": "noul"}}
    spans = [_record(1, "triage", 0, 1.0, canvas), _record(2, "triage", 2, 3.0, canvas)]
    lines = [s.to_json() for s in [*spans, _record(3, "triage", 6, 0.001, {}), _record(4, "triage", 7, 0.001, {})]]
    for line in lines[2:]:
        line["attributes"][tm.CACHE_HIT] = True
    path = tmp_path / "hits.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = build_report(read_spans(path))
    node, (run,) = report.nodes["triage"], report.runs
    assert node.set_latencies == pytest.approx([1.0, 3.0]) and node.replayed == 2
    assert (run.sets, run.replayed) == (len(node.set_latencies), node.replayed)
    assert report.cache_hits == {"triage": 2}
    page = render(report)
    assert re.search(r'id="kpi-sets"><div class="k">decision sets</div><div class="v">2</div>'
                     r'<div class="s">[^<]*\+ 2 replayed', page)
    assert re.search(r'id="kpi-latency">.*?<div class="v">2.00 s</div>', page)  # p50 of 1 s and 3 s
    assert re.search(r'<div class="k">decision sets</div><div class="v">2</div><div class="s">2 questions · '
                     r'\+ 2 replayed', page)
    assert re.search(r'<td>decide · triage</td><td class="num">2</td>', page)
    assert main(["dashboard", str(path), "-o", str(tmp_path / "r.html")]) == 0
    assert "2 questions in 2 decision sets (+ 2 replayed)" in capsys.readouterr().out


def test_the_mean_target_call_leaves_cancelled_hedges_out():
    """A hedge cancelled because the re-reads settled its question first still counts as a target
    call (as `Totals.target_calls` does), but its short time is no target call's time: the mean
    call and the estimate "if all to target" are taken over completed calls."""
    canvas = {"urgent": {"path": "reread", "answer": "yes", "kind": "noul"}}
    escalated = {"urgent": {"path": "escalated", "answer": "no", "kind": "noul"}}
    decides = [_record(1, "triage", 0, 2.5, escalated), _record(2, "triage", 3, 0.5, canvas),
               _record(3, "triage", 4, 0.2, canvas)]

    def escalate(span_id, parent, start_s, dur_s, hedge=None):
        return SpanRecord(name="escalate big", trace_id=f"{parent:032x}", span_id=f"{span_id:016x}",
                          parent_id=f"{parent:016x}", start_time_ns=int(start_s * 1e9),
                          end_time_ns=int((start_s + dur_s) * 1e9), attributes={tm.HEDGE: hedge} if hedge else {})

    calls = [escalate(11, 1, 0.1, 2.0), escalate(12, 2, 3.1, 0.1, "cancelled")]
    (run,) = build_report([*decides, *calls]).runs
    assert (run.sets, run.target_calls, run.hedges, run.hedges_cancelled) == (3, 2, 1, 1)
    assert run.target_s == pytest.approx(2.1)  # seconds spent, the cancelled hedge's included
    assert run.if_all_to_target_s == pytest.approx(2.0 * 3)  # the completed call's 2 s, per set
    (only,) = build_report([decides[1], calls[1]]).runs
    assert (only.target_calls, only.if_all_to_target_s) == (1, None)  # no call completed: no estimate
    both = run + only
    assert (both.target_calls, both.if_all_to_target_s) == (3, pytest.approx(2.0 * 4))


def test_the_runs_panel_counts_each_runs_cost_beside_every_decision_sent_to_the_target(tmp_path, capsys):
    """Issue 30.3: per run (trace file), the decision sets, canvas reads, escalations and target
    tokens, beside what sending every decision set to the target would have cost."""
    from canvasroute.router import Totals

    def rows(read):  # tickets with "refund" read sure; the others a toss-up (escalated)
        sure = "refund" in read.messages[-1]["content"]
        return label_rows(engine, {"A": -0.01, "B": -6.0} if sure else {"A": -0.69, "B": -0.70}, read)

    engine = FunctionEngine(rows)
    reply = AIMessage('{"team": "tech"}', usage_metadata={"input_tokens": 50, "output_tokens": 5, "total_tokens": 55})
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=1),
                                escalate_to=GenericFakeChatModel(messages=itertools.repeat(reply)))
    team = {"team": Choice(instructions="Which team?", criteria={"billing": None, "tech": None})}
    totals = {}
    for name, tickets in (("monday.jsonl", ["refund a", "refund b", "crash c", "refund d"]),
                          ("tuesday.jsonl", ["crash e", "crash f"])):
        with traced(tmp_path / name):
            responses = [run_sync(model.adecide(t, team, attributes={tm.GRAPH_NODE: "triage"})) for t in tickets]
        totals[name] = sum((Totals.of(r) for r in responses), Totals())
    report = build_report(read_spans(tmp_path / "monday.jsonl", tmp_path / "tuesday.jsonl"))
    runs = {r.source: r for r in report.runs}
    assert list(runs) == ["monday.jsonl", "tuesday.jsonl"]
    for name, run in runs.items():  # the traces say what the responses' totals say
        t = totals[name]
        assert (run.sets, run.questions, run.reads, run.escalated) == (t.decisions, t.questions, t.reads,
                                                                       t.escalations)
    monday, tuesday = runs["monday.jsonl"], runs["tuesday.jsonl"]
    assert (monday.target_calls, monday.calls_saved, monday.target_tokens) == (1, 3, 55)
    assert monday.if_all_to_target_tokens == 4 * 55 and tuesday.if_all_to_target_tokens == 2 * 55
    assert (tuesday.target_calls, tuesday.calls_saved) == (2, 0)
    out = tmp_path / "report.html"
    assert main(["dashboard", str(tmp_path / "monday.jsonl"), str(tmp_path / "tuesday.jsonl"), "-o", str(out)]) == 0
    page = out.read_text()
    table = re.search(r'<table id="runs">.*?</table>', page, re.DOTALL).group(0)
    heads = re.findall(r"<th[^>]*>(.*?)</th>", table)  # one name per column, and the estimates say so
    assert len(heads) == len(set(heads)) and heads[-4:] == ["target tokens", "tokens if all to target",
                                                           "target time", "time if all to target"]
    monday_row = re.search(r'<tr data-run="monday.jsonl">(.*?)</tr>', table).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", monday_row)
    assert cells[2:5] == ["4", "4", str(monday.reads)]
    assert cells[7:12] == ["1 of 4", "1 of 4", "3", "55", "≈ 220"]
    total = re.findall(r"<td[^>]*>(.*?)</td>", re.search(r'<tr data-run="all runs">(.*?)</tr>', table).group(1))
    assert total[2:5] == ["6", "6", str(monday.reads + tuesday.reads)] and total[7:12] == [
        "3 of 6", "3 of 6", "3", "165", "≈ 330"]
    # a FunctionEngine's figures are plumbing: the panel says so
    assert re.search(r'id="runs-section".*?Plumbing, not quality, for runs on function \(near chance: the banner above',
                     page, re.DOTALL)


# -- the page as a user sees it (issue #39, point 5) -----------------------------------------------

FIT_PROBE = """<script>
(() => {
  const px = v => parseFloat(v) || 0;
  const over = [];
  for (const card of document.querySelectorAll("section.card, section.node, .banner, .kpi")) {
    const style = getComputedStyle(card), box = card.getBoundingClientRect();
    const inner = box.right - px(style.borderRightWidth) - px(style.paddingRight) + 0.5;
    const name = card.id || card.dataset.node || card.className;
    if (card.scrollWidth > card.clientWidth + 1) {
      over.push(`${name} scrolls: ${card.scrollWidth} > ${card.clientWidth}`);
    }
    for (const part of card.querySelectorAll("table, svg, figure, .kpis")) {
      const right = part.getBoundingClientRect().right;
      if (right > inner) {
        over.push(`${name}: ${part.tagName}#${part.id} ends at ${Math.round(right)} > ${Math.round(inner)}`);
      }
    }
  }
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({over, text: document.body.innerText,
    page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
    banners: document.querySelectorAll(".banner").length});
  document.body.append(out);
})();
</script>"""
"""Appended to a copy of the page: per card, whether it scrolls sideways and where each table, chart and
KPI grid ends against the card's content box; the page's text; how many banners it shows."""


def _wide_traces(folder: Path) -> list[Path]:
    """Three runs whose tables are as wide as real ones get: long node, question, label and file names, a
    graph with shadow mode, escalations (a scripted target) and answers left unsure."""
    long_run = folder / "a-long-trace-file-name-for-the-monday-support-run.jsonl"
    labels = ["search_screening_event", "add_to_playlist", "book_restaurant_table"]

    def rows(read):
        text = read.messages[-1]["content"]
        sure = {"A": -0.1, "B": -2.5, "C": -3.0, "yes": -0.05, "no": -3.0}
        unsure = {"A": -1.1, "B": -1.1, "C": -1.1, "yes": -0.69, "no": -0.7}
        return label_rows(engine, sure if "refund" in text else unsure, read)

    engine = FunctionEngine(rows)
    reply = AIMessage('{"intent": "add_to_playlist", "urgent_customer_escalation_needed": "yes"}',
                      usage_metadata={"input_tokens": 60, "output_tokens": 9, "total_tokens": 69})
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=1),
                                escalate_to=GenericFakeChatModel(messages=itertools.repeat(reply)))
    questions = {"intent": Choice(instructions="Which intent?", criteria=dict.fromkeys(labels)),
                 "urgent_customer_escalation_needed": Noul(instructions="Is it urgent?")}
    with traced(long_run):
        for i in range(12):
            model.decide(f"ticket {i}: {'refund me' if i % 3 == 0 else 'it is broken'}", questions,
                         attributes={tm.GRAPH_NODE: "triage_the_incoming_support_ticket_for_routing"})
    graph_run = folder / "graph.jsonl"
    _graph_run(graph_run)
    return [long_run, graph_run]


@pytest.mark.services
@pytest.mark.parametrize("width", [1280, 1440])
def test_the_page_fits_its_cards_at_1280_and_1440_px_and_shows_each_banner_once(chromium, tmp_path, width):
    """In headless Chromium at a laptop's and a desktop's width: no table, chart or KPI grid runs past its
    card and nothing scrolls sideways, and the near-chance banner is shown once (on main, the runs and
    uncertain tables ran past their cards at both widths, and the runs panel said the banner's warning
    again in the banner's red)."""
    traces = _wide_traces(tmp_path)
    page_file = tmp_path / "report.html"
    assert main(["dashboard", *map(str, traces), "-o", str(page_file)]) == 0
    probed = tmp_path / "probed.html"
    probed.write_text(page_file.read_text().replace("</body>", FIT_PROBE + "</body>"))
    dumped = _browse(chromium, f"--window-size={width},2000", "--virtual-time-budget=3000", "--dump-dom",
                     probed.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    probe = re.search(r'<pre id="probe">(.*?)</pre>', dumped.stdout, re.DOTALL)
    seen = json.loads(html_module_unescape(probe.group(1)))
    assert seen["over"] == [], seen["over"]
    assert seen["page"] == [width, width]  # nothing wider than the window
    assert seen["banners"] == 1
    reason = near_chance("function", "function")
    assert reason and seen["text"].count(reason) == 1, reason  # the banner says it; nothing says it again
    assert "Plumbing, not quality, for runs on function" in seen["text"]  # the runs panel points at it
