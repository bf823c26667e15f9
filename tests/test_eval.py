"""`canvasroute eval`: the arms, the cascade mix, AUROC, the sweep, the CLI (FunctionEngine + fake target)."""

from __future__ import annotations

import contextlib
import itertools
import json
import random

import pytest
from langchain_core.decisions import Choice
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda

from canvasroute.apps.calibration.rows import Row
from canvasroute.apps.cli import main
from canvasroute.apps.eval import auroc, evaluate, figures, mix_accuracy, risk_coverage
from canvasroute.apps.eval.metrics import Item
from canvasroute.engine import FunctionEngine
from canvasroute.router import GatePolicy

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
#            state                         gold       canvas rows (A=billing, B=tech)
CASES = [("refund please, sure", "billing", (-0.01, -5.0)),      # confident and right
         ("it crashes, sure", "tech", (-0.01, -5.0)),            # confident and wrong
         ("refund please, unsure", "billing", (-0.70, -0.69)),   # uncertain
         ("it crashes, unsure", "tech", (-0.70, -0.69)),
         ("something odd, unsure", "billing", (-0.70, -0.69))]   # the target gets this one wrong


def _engine() -> FunctionEngine:
    def rows(read):
        text = read.messages[-1]["content"]
        a, b = next(lp for state, _, lp in CASES if state in text)
        return [{fake.token_id("A"): a, fake.token_id("B"): b} for _ in read.slots]
    fake = FunctionEngine(rows)
    return fake


def _target(seen: list[str]):
    def answer(messages) -> AIMessage:
        text = messages[-1].content
        seen.append(text)
        team = "billing" if "refund" in text else "tech"
        return AIMessage(json.dumps({"team": team}), usage_metadata={"input_tokens": 10, "output_tokens": 3,
                                                                      "total_tokens": 13})
    return RunnableLambda(answer)


def _rows() -> list[Row]:
    return [Row(state, {"team": TEAM}, {"team": gold}) for state, gold, _ in CASES]


def test_auroc_on_constructed_cases():
    assert auroc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert auroc([0.1, 0.2, 0.8, 0.9], [True, True, False, False]) == 0.0
    assert auroc([0.5, 0.5, 0.5], [True, False, False]) == 0.5
    assert auroc([0.3, 0.5, 0.8, 0.1], [True, False, True, False]) == 0.75
    assert auroc([0.3, 0.4], [True, True]) is None
    rng = random.Random(3)
    scores = [rng.choice([0.1, 0.2, 0.3, 0.4]) for _ in range(40)]
    labels = [rng.random() < 0.4 for _ in range(40)]
    pos = [s for s, p in zip(scores, labels) if p]
    neg = [s for s, p in zip(scores, labels) if not p]
    pairs = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    assert auroc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)))


def test_risk_coverage_answers_least_uncertain_first():
    items = [Item(row=i, question_id="q", gold="a", canvas_answer=ans, normalized_entropy=ne)
             for i, (ans, ne) in enumerate([("a", 0.1), ("b", 0.2), ("a", 0.2), ("b", 0.9)])]
    assert risk_coverage(items) == [(0.25, 0.0), (0.75, 1 / 3), (1.0, 0.5)]


async def test_cascade_is_the_mix_the_gate_decided():
    seen: list[str] = []
    policy = GatePolicy(max_normalized_entropy=0.5, rereads=0)
    ev = await evaluate(_engine(), _rows(), policy=policy, target=_target(seen))
    items = {it.row: it for it in ev.items}
    assert [items[i].canvas_answer for i in range(5)] == ["billing", "billing", "tech", "tech", "tech"]
    assert [items[i].target_answer for i in range(5)] == ["billing", "tech", "billing", "tech", "tech"]
    for it in ev.items:
        escalated = it.normalized_entropy > 0.5
        assert it.cascade_path == ("escalated" if escalated else "canvas")
        assert it.cascade_answer == (it.target_answer if escalated else it.canvas_answer)
    out = figures(ev, policy, model="function", provider="function", near_chance="a FunctionEngine test double")
    arms = out["arms"]
    assert arms["canvas"]["accuracy"] == pytest.approx(2 / 5)   # rows 0 and 3
    assert arms["target"]["accuracy"] == pytest.approx(4 / 5)   # all but row 4
    assert arms["cascade"]["accuracy"] == pytest.approx(3 / 5)  # rows 0, 2, 3
    assert mix_accuracy(ev.items, 0.5) == (pytest.approx(3 / 5), 3)
    assert (arms["canvas"]["reads"], arms["canvas"]["escalations"], arms["canvas"]["target_calls"]) == (5, 0, 0)
    assert (arms["target"]["reads"], arms["target"]["target_calls"], arms["target"]["escalations"]) == (0, 5, 5)
    assert (arms["cascade"]["reads"], arms["cascade"]["escalations"], arms["cascade"]["target_calls"]) == (5, 3, 3)
    assert (arms["target"]["input_tokens"], arms["target"]["output_tokens"]) == (50, 15)
    assert arms["cascade"]["output_tokens"] >= 9
    # the target alone gets no canvas hint; the cascade's escalations do
    assert not any("Fast model" in t for t in seen[:5]) and all("Fast model" in t for t in seen[5:])
    # errors: rows 1 (confident), 2, 4 (uncertain); right: rows 0 (confident), 3 (uncertain).
    # pairs (error, right): (1,0) tie, (1,3) below, (2,0) above, (2,3) tie, (4,0) above, (4,3) tie
    errors = [not it.canvas_ok for it in ev.items]
    assert out["auroc_normalized_entropy"] == pytest.approx(auroc([it.normalized_entropy for it in ev.items], errors))
    assert out["auroc_normalized_entropy"] == pytest.approx((0.5 + 0 + 1 + 0.5 + 1 + 0.5) / 6)
    point = next(p for p in out["sweep"] if p["threshold"] is not None and 0.0 < p["threshold"] < 0.9)
    assert point["accuracy"] == pytest.approx(3 / 5) and point["escalations"] == 3
    assert out["sweep"][-1]["threshold"] is None and out["sweep"][-1]["accuracy"] == pytest.approx(4 / 5)
    assert out["sweep"][0]["escalation_rate"] == 0 and out["sweep"][0]["accuracy"] == pytest.approx(2 / 5)


async def test_a_failing_target_scores_wrong_never_as_an_answer():
    """Alone, a failing target's answers score wrong (none). In the cascade, as served by default
    (`OutcomePolicy.target_fault="answer"`), a question it failed keeps the canvas's answer, path
    `unsure` and cause `target_fault`, and the decision counts as a failure of the cascade."""
    def broken(messages):
        raise RuntimeError("target down")

    ev = await evaluate(_engine(), _rows(), policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                        target=RunnableLambda(broken))
    assert ev.target.failures == 5 and ev.cascade.failures == 3
    assert all(it.target_answer is None for it in ev.items)
    escalating_rows = {it.row for it in ev.items if it.normalized_entropy > 0.5}
    assert len(escalating_rows) == 3 and ev.cascade.tally.causes["target_fault"] == 3
    for it in ev.items:
        if it.row in escalating_rows:
            assert (it.cascade_answer, it.cascade_path) == (it.canvas_answer, "unsure")


def test_the_cli_prints_json_and_writes_the_plot(tmp_path, monkeypatch, capsys):
    from canvasroute.apps.eval import command

    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"state": s, "questions": {"team": TEAM.model_dump(mode="json")},
                                          "gold": {"team": g}}) for s, g, _ in CASES))
    monkeypatch.setattr(command, "open_engine", lambda args: _engine())

    @contextlib.contextmanager
    def fake_target(args):
        yield _target([])

    monkeypatch.setattr(command, "open_target", fake_target)
    plot = tmp_path / "eval.png"
    assert main(["eval", str(data), "--threshold", "0.5", "--rereads", "0", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["arms"]["cascade"]["accuracy"] == pytest.approx(3 / 5)
    assert out["near_chance"] and "not the product" in out["note"]
    assert plot.stat().st_size > 1000


def test_measured_escalation_curve_uses_the_targets_answers():
    from canvasroute.apps.calibration.plots import measured_curve
    from canvasroute.router import Labelled

    rows = [Labelled(question_id="q", probabilities=p, gold=g)
            for p, g in [((0.99, 0.01), 0), ((0.98, 0.02), 1), ((0.5, 0.5), 0), ((0.55, 0.45), 1)]]
    target_ok = {id(rows[0]): True, id(rows[1]): True, id(rows[2]): True, id(rows[3]): False}
    curve = measured_curve(rows, 1.0, target_ok)
    # escalate all: 3/4; keep the two confident (right, wrong), escalate the rest (right, wrong): 2/4; none: canvas 2/4
    assert curve[0] == (1.0, 0.75)
    assert (0.5, 0.5) in curve and curve[-1] == (0.0, 0.5)


def test_calibrate_with_a_target_draws_the_measured_curve(tmp_path, monkeypatch, capsys):
    import canvasroute.apps.eval.target as target_mod
    from canvasroute.apps.calibration import command, plots

    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"state": s, "questions": {"team": TEAM.model_dump(mode="json")},
                                          "gold": {"team": g}}) for s, g, _ in CASES * 2))
    monkeypatch.setattr(command, "open_engine", lambda args: _engine())
    seen: list[str] = []

    @contextlib.contextmanager
    def fake_target(args):
        yield _target(seen)

    monkeypatch.setattr(target_mod, "open_target", fake_target)
    drawn = {}
    real = plots.measured_curve

    def spy(rows, temperature, target_ok):
        drawn["curve"] = real(rows, temperature, target_ok)
        drawn["ok"] = sorted(target_ok.values())
        return drawn["curve"]

    monkeypatch.setattr(plots, "measured_curve", spy)
    out = tmp_path / "policy.json"
    assert main(["calibrate", str(data), "--escalate-embedded", "-o", str(out)]) == 0
    assert len(seen) == 10 and drawn["ok"] == [False, False] + [True] * 8  # the target misses row 4 twice
    assert out.with_suffix(".escalation.png").stat().st_size > 1000


def test_eval_flags_reach_the_questions_calibrate_fitted(tmp_path, monkeypatch, capsys):
    """Defect 7: the gate is the policy file (per-question fits included), then the flags, which
    apply to every question; a fitted question keeps what the flags do not name (its temperature)."""
    import argparse

    from canvasroute.apps.eval import command
    from canvasroute.router import save_policy

    fitted = GatePolicy(max_normalized_entropy=0.0, rereads=0, temperature=1.5)  # alone: every row escalates
    policy_file = save_policy(tmp_path / "policy.json", GatePolicy(rereads=2, per_question={"team": fitted}))
    gate = command.gate_of(argparse.Namespace(policy=str(policy_file), threshold=0.5, rereads=None))
    assert gate.for_question("team") == GatePolicy(max_normalized_entropy=0.5, rereads=0, temperature=1.5)
    assert (gate.max_normalized_entropy, gate.rereads, gate.temperature) == (0.5, 2, 1.0)  # every other question

    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"state": s, "questions": {"team": TEAM.model_dump(mode="json")},
                                          "gold": {"team": g}}) for s, g, _ in CASES))
    monkeypatch.setattr(command, "open_engine", lambda args: _engine())

    @contextlib.contextmanager
    def fake_target(args):
        yield _target([])

    monkeypatch.setattr(command, "open_target", fake_target)
    assert main(["eval", str(data), "--policy", str(policy_file), "--threshold", "0.5", "--json", "--no-plots"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"]["per_question"]["team"] == {"max_normalized_entropy": 0.5, "rereads": 0, "temperature": 1.5}
    cascade = out["arms"]["cascade"]
    assert cascade["escalations"] == 3 and cascade["paths"] == {"canvas": 2, "escalated": 3}  # not all 5
    assert cascade["causes"] == {"uncertain": 3}
    assert main(["eval", str(data), "--policy", str(policy_file), "--json", "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out)["arms"]["cascade"]["escalations"] == 5  # the fit alone
