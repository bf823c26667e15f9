"""CLI output: rich progress bars and tables on a terminal, plain text (and pure --json) off one."""

from __future__ import annotations

import io
import json
import re

import pytest
from conftest import fresh_tracer_provider

from canvasroute.apps._console import print_table, progress
from canvasroute.apps.cli import main
from canvasroute.engine import FunctionEngine
from canvasroute.router import CanvasDecisionModel


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def text(self) -> str:
        """What a reader sees: the output without colour codes."""
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.getvalue())


def test_off_a_terminal_progress_is_one_closing_line_and_tables_are_plain():
    err, out = io.StringIO(), io.StringIO()
    with progress(3, "calibrate tiny", stream=err) as advance:
        for _ in range(3):
            advance(1)
        assert err.getvalue() == ""  # nothing while it runs
    assert err.getvalue().startswith("calibrate tiny: 3/3 rows in ") and err.getvalue().count("\n") == 1
    print_table("t", ["a", "b"], [["1", "2"]], plain="a  b\n1  2", stream=out)
    assert out.getvalue() == "a  b\n1  2\n"


def test_on_a_terminal_progress_is_a_rich_bar_and_tables_are_rich():
    err, out = Terminal(), Terminal()
    with progress(4, "calibrate tiny", stream=err) as advance:
        advance(4)
    assert "calibrate tiny" in err.text() and "4/4" in err.text() and "━" in err.text()
    print_table("figures", ["question", "acc"], [["intent", "61%"]], notes=["near chance"], plain="PLAIN", stream=out)
    text = out.text()
    assert "PLAIN" not in text and "figures" in text and "┃ question" in text and "│ intent" in text
    assert "near chance" in text


def instant_model(engine_url=None, *, progress=None, engine_kind="auto", **kwargs):  # make_model's signature
    def rows(read):
        return [{engine.token_id(t): (-0.01 if t in ("A", "no", "1") else -6.0)
                 for t in ("A", "B", "C", "yes", "no", "1", "2", "3", "4")}] * len(read.slots)

    engine = FunctionEngine(rows)
    return CanvasDecisionModel(engine=engine, **kwargs)


@pytest.mark.parametrize("terminal", [False, True])
def test_the_demo_prints_plain_lines_off_a_terminal_and_rich_tables_on_one(terminal, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("canvasroute.apps.demo.model.make_model", instant_model)
    if terminal:
        monkeypatch.setattr("sys.stdout", Terminal())
        monkeypatch.setattr("sys.stderr", Terminal())
    import sys

    with fresh_tracer_provider():
        assert main(["demo", "--engine-url", "http://127.0.0.1:9", "--trace", str(tmp_path / "t.jsonl"),
                     "--ticket", "Refund my double charge", "--ticket", "Crash on start"]) == 0
    out, err = (sys.stdout.text(), sys.stderr.text()) if terminal else capsys.readouterr()
    assert out.count("routed to billing") == 2  # team A = billing, not urgent: the team's lane
    if terminal:
        assert "┃ question" in out and "│ team" in out and "2/2" in err
    else:
        assert "    team      billing    path=canvas" in out and "┃" not in out
        assert err.startswith("triage: 2/2 tickets in ")


def test_bench_json_stays_pure_json_on_stdout(capsys):
    assert main(["bench", "--quick", "--json", "--only", "packing", "--vllm-url", ""]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["sections"]["packing"]["rows"]
    assert captured.err.startswith("canvasroute bench: 1/1 sections in ")
