"""`canvasroute demo`, the whole loop: canvas reads on a vLLM-wire server, the gate, and
escalation to an OpenAI-compatible AR server (`--escalate-url`), or, without one, a report
of what would have escalated. The canvas server is the loopback vLLM (`answer="uniform"`:
every slot unsure, so every decision reaches the gate's escalation step); the AR server is
tests/ar_server.py on SmolLM2-135M (`smollm`): near chance, so its replies may be invalid,
which the demo reports instead of crashing."""

from __future__ import annotations

import html
import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import smollm2_ar_server
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from opentelemetry import trace
from opentelemetry.util._once import Once

from canvasroute.apps.cli import main
from canvasroute.apps.demo.model import make_model
from canvasroute.apps.demo.triage import SAMPLE_TICKETS, build_graph
from canvasroute.apps.observability.dashboard import build_report, render
from canvasroute.apps.observability.report import cause_shares
from canvasroute.apps.observability.traces import read_spans
from canvasroute.engine import FunctionEngine
from canvasroute.engine.testing import spawn
from canvasroute.harness import DECISION_EVENT
from canvasroute.router import CanvasDecisionModel, GatePolicy, Tally
from canvasroute.router import telemetry as tm


@contextmanager
def unset_tracer_provider() -> Iterator[None]:
    """The global tracer provider unset, as in a fresh `canvasroute demo` process (which installs
    its own); the previous one is put back afterwards."""
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    try:
        yield
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


TICKET = "I was charged twice for my subscription this month. Please refund one payment."


def test_without_a_target_the_demo_says_what_would_escalate_and_how_to_add_one(tmp_path, capsys):
    trace = tmp_path / "demo.jsonl"
    with spawn(answer="uniform") as server, unset_tracer_provider():
        assert main(["demo", "--engine-url", server.url, "--ticket", TICKET, "--ticket", "My app crashes",
                     "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "escalate (no target set: reported, not sent)" in out
    assert out.count("would escalate") == 6  # 2 tickets x 3 questions, all unsure
    assert "answered: canvas 0/6 (0%), re-read 0/6 (0%), escalated 0/6 (0%), unsure 6/6 (100%)" in out
    assert "over the gate: 6/6 (the gate passes H/lnK <= 0.5)" in out
    assert "6 of them would have escalated" in out
    assert "--escalate-url http://HOST:8001/v1 --escalate-model MODEL" in out
    report = build_report(read_spans(trace))
    assert report.graph is not None and "triage" in report.graph["nodes"]  # the demo records its graph
    assert sum(report.routes.values()) == 2


def test_escalate_url_and_model_go_together(capsys):
    assert main(["demo", "--engine-url", "http://127.0.0.1:9", "--escalate-url", "http://127.0.0.1:9/v1"]) == 2
    assert "go together" in capsys.readouterr().err


@pytest.fixture(scope="module")
def ar_server(smol):
    with smollm2_ar_server(smol, max_new_tokens=40) as server:
        yield server


@pytest.mark.slow
@pytest.mark.smollm
def test_the_demo_escalates_to_an_openai_compatible_ar_server(ar_server, tmp_path, capsys):
    trace = tmp_path / "demo.jsonl"
    before = len(ar_server.requests)
    with spawn(answer="uniform") as server, unset_tracer_provider():
        assert main(["demo", "--engine-url", server.url, "--ticket", TICKET, "--trace", str(trace),
                     "--escalate-url", ar_server.url, "--escalate-model", "smollm2"]) == 0
    out = capsys.readouterr().out
    print(out)
    sent = ar_server.requests[before:]
    # one call, one more on an invalid reply; a slow CPU may time a call out, and the node retries that
    assert sent and all(r["model"] == "smollm2" for r in sent)
    assert TICKET in sent[0]["messages"][-1]["content"]
    assert f"escalate to smollm2 at {ar_server.url}" in out and "would escalate" not in out
    summary = re.search(r"answered: (.*?); model load", out).group(1)
    if "escalation failed" in out:  # SmolLM2 answered outside the options twice: reported, not hidden
        assert "1 decision set(s) failed to escalate" in out
    elif "kept (target fault)" in out:  # a starved CPU ran the call past its timeout: answered degraded, said so
        assert out.count("kept (target fault)") == 3 and "unsure 3/3 (100%)" in summary
        return
    else:
        assert out.count("escalated to smollm2") == 3 and "escalated 3/3 (100%)" in summary
    spans = read_spans(trace)
    (chat,) = [s for s in spans if s.name == "chat smollm2"][:1]
    assert chat.attributes[tm.GEN_AI_PROVIDER] == "openai"
    report = build_report(spans)
    assert report.escalation_models == {"smollm2": "openai"}  # the provider, read from the chat span


def test_console_stream_and_dashboard_count_the_same(tmp_path, capsys):
    """One run's counts, three ways: the demo's console summary, the graph stream's decision
    events and the dashboard built from the demo's trace (`Tally` behind each). The loopback's
    rows are confident, not certain (H/lnK 0.01-0.02): a 0.015 gate passes some questions and
    not others, a mix of canvas and unsure, with the gate in words everywhere."""
    trace = tmp_path / "demo.jsonl"
    with spawn() as server:
        with unset_tracer_provider():
            assert main(["demo", "--engine-url", server.url, "--threshold", "0.015", "--trace", str(trace)]) == 0
        out = capsys.readouterr().out
        model = make_model(server.url, policy=GatePolicy(max_normalized_entropy=0.015))
        graph = build_graph(model)
        streamed = Tally.of(())
        events = 0
        for ticket in SAMPLE_TICKETS:
            for chunk in graph.stream({"ticket": ticket}, stream_mode="custom"):
                if chunk["type"] == DECISION_EVENT:
                    streamed += Tally.from_dict(chunk["tally"])
                    events += 1
    assert events == len(SAMPLE_TICKETS)
    assert streamed.paths["canvas"] > 0 and streamed.paths["unsure"] > 0  # both kinds of answer occur
    assert streamed.over_gate == streamed.paths["unsure"] and streamed.gates == ("H/lnK <= 0.015",)
    summary = next(line for line in out.splitlines() if line.startswith("summary:"))
    assert f"{streamed.decisions} decisions" in summary
    assert f"answered: {streamed.shares()}; {streamed.gate_line()}; gate not passed: {cause_shares(streamed)}" \
        in summary
    assert streamed.causes["uncertain"] == streamed.paths["unsure"]
    assert out.count("would escalate") == streamed.over_gate
    report = build_report(read_spans(trace))
    assert report.tally == streamed
    page = render(report)
    kpi = page[page.index('id="kpi-gate"'):]
    assert f"{streamed.over_gate} of {streamed.decisions} · passes H/lnK &lt;= 0.015" in kpi
    assert html.escape(streamed.shares()) in kpi
    assert re.search(rf'id="kpi-causes".*?{streamed.paths["unsure"]} of {streamed.decisions} · '
                     rf'{re.escape(cause_shares(streamed))}', page, re.DOTALL)
    assert "1 node</div>" in page or "· 1 node<" in page  # one node, in the singular
    assert main(["dashboard", str(trace), "-o", str(tmp_path / "report.html")]) == 0
    assert f"({streamed.decisions} questions in {events} decision sets, 1 node, model loopback)" in \
        capsys.readouterr().out  # the command's own line, in the singular too


def test_tally_counts_paths_and_the_gate_from_reports():
    """`Tally` over real `ReadReport`s: every path counted, over-the-gate counted whatever path
    followed (an escalation included), the gate in words; a path it does not know is refused."""
    engine = FunctionEngine(lambda read: [dict.fromkeys(read.label_ids, 0.0)] * len(read.slots))  # uniform: unsure
    target = GenericFakeChatModel(messages=itertools.cycle([AIMessage('{"team": "b"}')]))
    model = CanvasDecisionModel(engine=engine, escalate_to=target, policy=GatePolicy(
        rereads=0, per_question={"urgent": GatePolicy(max_normalized_entropy=None, rereads=0)}))
    resp = model.decide("My app crashes", {"urgent": Noul(instructions="Urgent?"),
                                           "team": Choice(instructions="Team?", criteria={"a": None, "b": None})})
    tally = Tally.of(resp.reads.values())
    assert tally.paths["canvas"] == 1 and tally.paths["escalated"] == 1 and tally.decisions == 2
    assert tally.over_gate == 1 and set(tally.gates) == {"none", "H/lnK <= 0.5"}
    assert resp.reads["team"].gate == "H/lnK <= 0.5" and resp.reads["urgent"].gate == "none"
    assert Tally.of(r.model_dump(mode="json") for r in resp.reads.values()) == tally  # the dumps count alike
    assert Tally.from_dict(tally.as_dict()) == tally
    with pytest.raises(ValueError, match="unknown decision path 'abstained'"):  # gone: a cause now
        Tally.of([{"path": "abstained", "crossed": [], "gate": None}])
