"""Calibration: ECE and temperature math on synthetic data with known answers, the policy
file, temperatures applied by the router, BIG-bench adapters, and `canvasroute calibrate`
against the real vLLM server (tiny random DiffusionGemma: near chance, so only the
plumbing and the no-worse guarantee are asserted, never accuracy)."""

from __future__ import annotations

import json
import math
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT, fresh_tracer_provider
from langchain_core.decisions import Choice, Noul
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage

from canvasroute.apps import calibration as cal_cli
from canvasroute.apps.cli import main
from canvasroute.apps.observability.traces import JsonlSpanExporter, read_spans
from canvasroute.engine import CalibrationError, FunctionEngine, VLLMServerEngine, run_sync
from canvasroute.router import (
    CanvasDecisionModel,
    GatePolicy,
    Labelled,
    calibrate,
    expected_calibration_error,
    fit_temperature,
    load_policy,
    save_policy,
    slot_stats,
)
from canvasroute.router import calibration as cm

BIGBENCH = ROOT / "data" / "bigbench"
PNG = b"\x89PNG\r\n\x1a\n"


def _softmax(z, t=1.0):
    top = max(x / t for x in z)
    w = [math.exp(x / t - top) for x in z]
    return tuple(v / sum(w) for v in w)


def _synthetic(n: int, sharpen: float, seed: int, k: int = 4) -> list[Labelled]:
    """Gold drawn from softmax(z); the 'model' reports softmax(sharpen * z): best T is `sharpen`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        z = [rng.gauss(0, 1.2) for _ in range(k)]
        true = _softmax(z)
        gold = rng.choices(range(k), weights=true)[0]
        out.append(Labelled(question_id="q", probabilities=_softmax([sharpen * x for x in z]), gold=gold))
    return out


# -- the math ------------------------------------------------------------------------------


def test_ece_known_answers():
    assert expected_calibration_error([1.0] * 5, [True] * 5) == 0.0
    assert math.isclose(expected_calibration_error([0.9] * 10, [True] * 5 + [False] * 5), 0.4)
    # two bins: 0.3 confidence never right, 0.8 always right -> 0.5*0.3 + 0.5*0.2
    conf, ok = [0.3] * 5 + [0.8] * 5, [False] * 5 + [True] * 5
    assert math.isclose(expected_calibration_error(conf, ok), 0.25)
    assert math.isclose(expected_calibration_error([0.8] * 10, [True] * 8 + [False] * 2), 0.0, abs_tol=1e-12)
    bins = cm.reliability([1 / 15, 1 / 15 + 1e-9, 1.0, 0.0], [True, True, False, False])
    assert len(bins) == 15 and (bins[0].count, bins[1].count, bins[14].count) == (2, 1, 1)
    with pytest.raises(CalibrationError):
        expected_calibration_error([], [])


def test_temperature_scaling_math():
    assert cm.tempered((0.7, 0.2, 0.1), 1.0) == pytest.approx((0.7, 0.2, 0.1))
    assert cm.tempered((0.8, 0.2), 2.0) == pytest.approx((2 / 3, 1 / 3))  # sqrt(0.8) : sqrt(0.2) = 2 : 1
    assert cm.tempered((0.8, 0.2), 1e6) == pytest.approx((0.5, 0.5), abs=1e-5)
    assert cm.tempered((0.0, 1.0), 3.0) == pytest.approx((0.0, 1.0))  # zeros stay (nearly) zero
    rows = [Labelled(question_id="q", probabilities=(0.8, 0.2), gold=0)]
    assert math.isclose(cm.nll(rows, 1.0), -math.log(0.8))
    assert math.isclose(cm.nll(rows, 2.0), -math.log(2 / 3))


def test_fit_recovers_a_known_temperature_and_lowers_held_out_ece():
    fit = fit_temperature(_synthetic(3000, 3.0, seed=1), _synthetic(3000, 3.0, seed=2))
    assert fit.accepted and fit.temperature == fit.fitted
    assert 2.7 < fit.fitted < 3.3
    assert fit.nll_check[1] < fit.nll_check[0] and fit.ece_check[1] < fit.ece_check[0]
    under = fit_temperature(_synthetic(3000, 0.4, seed=3), _synthetic(3000, 0.4, seed=4))
    assert under.accepted and 0.33 < under.fitted < 0.48  # underconfident: T < 1 sharpens


def test_fit_falls_back_to_one_when_held_out_gets_worse():
    # split A is overconfident (wants T > 1); split B is right with (0.6, 0.4) every time (wants T < 1)
    a = [Labelled(question_id="q", probabilities=(0.99, 0.01), gold=0 if i % 5 < 3 else 1) for i in range(50)]
    b = [Labelled(question_id="q", probabilities=(0.6, 0.4), gold=0) for _ in range(50)]
    fit = fit_temperature(a, b)
    assert fit.fitted > 1.5
    assert not fit.accepted and fit.temperature == 1.0 and "NLL" in fit.reason
    assert fit.nll_check[1] > fit.nll_check[0]
    # and calibrate() then keeps T = 1 in the policy
    rng = random.Random(0)
    rows = a + b
    rng.shuffle(rows)
    result = calibrate(rows, holdout=0.5, seed=0)
    q = result.questions["q"]
    assert q.ece_after <= q.ece_before + 1e-12
    assert result.policy.for_question("q").temperature == q.temperature.temperature


def test_thresholds_for_target_escalation_and_accuracy():
    # entropy rises with i; the four most certain rows are right, the rest wrong
    rows = [Labelled(question_id="q", probabilities=(1 - 0.05 * (i + 1), 0.05 * (i + 1)), gold=0 if i < 4 else 1)
            for i in range(8)]
    ents = [cm.normalized_entropy(r.probabilities) for r in rows]
    by_rate = cm.entropy_threshold(rows, target_escalation=0.25)
    assert by_rate.escalation_rate == 0.25 and math.isclose(by_rate.threshold, ents[5])
    by_acc = cm.entropy_threshold(rows, target_accuracy=1.0)
    assert math.isclose(by_acc.threshold, ents[3]) and by_acc.escalation_rate == 0.5
    assert by_acc.canvas_accuracy == 1.0 and by_acc.reachable
    wrong = [Labelled(question_id="q", probabilities=(0.9, 0.1), gold=1)] * 4
    assert not cm.entropy_threshold(wrong, target_accuracy=0.5).reachable
    curve = cm.escalation_curve(rows)
    assert curve[0].escalation_rate == 0.0 and curve[-1].escalation_rate == 1.0
    assert all(p.routed_accuracy >= (p.canvas_accuracy or 0) * (1 - p.escalation_rate) for p in curve)
    with pytest.raises(CalibrationError):
        cm.entropy_threshold(rows, target_accuracy=0.9, target_escalation=0.1)


def test_calibrate_builds_a_policy_that_round_trips(tmp_path):
    rows = [*_synthetic(400, 2.0, seed=5), Labelled(question_id="rare", probabilities=(0.5, 0.5), gold=0)]
    result = calibrate(rows, base=GatePolicy(rereads=1, min_margin=0.1), target_escalation=0.2)
    q = result.policy.for_question("q")
    assert q.temperature == result.questions["q"].temperature.temperature and 1.6 < q.temperature < 2.5
    assert q.min_margin == 0.1 and q.rereads == 1  # other base settings carry over
    assert q.max_normalized_entropy == result.questions["q"].threshold.threshold
    assert 0.1 < result.questions["q"].check_escalation_rate < 0.3
    assert "rare" not in result.policy.per_question and "not fitted" in result.questions["rare"].note
    path = save_policy(tmp_path / "policy.json", result.policy, {"questions": result.summary()})
    assert load_policy(path) == result.policy
    doc = json.loads(path.read_text())
    doc["policy"]["per_question"]["q"]["temprature"] = 2.0
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="unknown policy keys"):
        load_policy(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(CalibrationError, match="not a policy file"):
        load_policy(tmp_path / "other.json")
    doc["policy"]["per_question"]["q"] = {"temperature": -1}
    (tmp_path / "neg.json").write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="temperature"):
        load_policy(tmp_path / "neg.json")


# -- the router applies temperatures --------------------------------------------------------------


def test_slot_stats_divides_logprobs_by_temperature():
    row = {1: -0.2, 2: -1.9, 3: -3.0}
    for t in (0.5, 1.0, 2.5):
        assert slot_stats(row, [1, 2, 3], t).probs == pytest.approx(_softmax([-0.2, -1.9, -3.0], t))
    assert slot_stats(row, [1, 2, 3], 4.0).label_mass == slot_stats(row, [1, 2, 3]).label_mass
    with pytest.raises(ValueError):
        slot_stats(row, [1, 2], 0.0)
    with pytest.raises(ValueError):
        GatePolicy(temperature=0)


async def test_model_applies_per_question_temperature():
    def rows(read):
        return [{engine.token_id("A"): -0.1, engine.token_id("B"): -2.5},
                {engine.token_id("yes"): -0.3, engine.token_id("no"): -1.4}]

    engine = FunctionEngine(rows)
    questions = {"pick": Choice(instructions="Pick one", criteria={"left": None, "right": None}),
                 "ok": Noul(instructions="Is it ok?")}
    policy = GatePolicy(max_normalized_entropy=None, rereads=0,
                        per_question={"pick": GatePolicy(max_normalized_entropy=None, rereads=0, temperature=3.0)})
    resp = await CanvasDecisionModel(engine=engine, policy=policy).adecide("state", questions)
    assert list(resp.reads["pick"].canvas_probabilities.values()) == pytest.approx(_softmax([-0.1, -2.5], 3.0))
    assert list(resp.reads["ok"].canvas_probabilities.values()) == pytest.approx(_softmax([-0.3, -1.4]))


# -- data adapters ------------------------------------------------------------------------------


def test_bigbench_adapters_on_the_shared_tasks():
    if not BIGBENCH.is_dir():
        pytest.skip(f"no BIG-bench data at {BIGBENCH}")
    intent = cal_cli.load_rows(BIGBENCH / "intent_recognition", limit=5, seed=1)
    assert len(intent) == 5
    for row in intent:
        (q,) = row.questions.values()
        assert isinstance(q, Choice) and len(q.criteria) == 7 and row.gold["intent"] in q.criteria
    qa = cal_cli.load_rows(BIGBENCH / "strategyqa" / "task.json", limit=20)
    assert all(isinstance(r.questions["answer"], Noul) and r.gold["answer"] in ("yes", "no") for r in qa)
    assert {r.gold["answer"] for r in qa} == {"yes", "no"}
    emoji = cal_cli.load_rows(BIGBENCH / "emojis_emotion_prediction")
    assert len(emoji) == 131 and len(emoji[0].questions["emotion"].criteria) == 8
    assert emoji[0].gold["emotion"] == "joy"  # the top of its soft target_scores


def test_bad_data_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"state": "hi", "questions": {"x": {"type": "noul", "instructions": "?"}},
                                "gold": {"x": "maybe"}}) + "\n")
    code = main(["calibrate", str(data), "--engine-url", "http://127.0.0.1:9", "-o", str(tmp_path / "p.json")])
    assert code == 2 and "'maybe'" in capsys.readouterr().err
    assert main(["calibrate", "-o", str(tmp_path / "p.json")]) == 2


# -- end to end -------------------------------------------------------------------------------


@pytest.mark.vllm
def test_calibrate_cli_on_bigbench_against_vllm(vllm_url, tmp_path, capsys):
    if not BIGBENCH.is_dir():
        pytest.skip(f"no BIG-bench data at {BIGBENCH}")
    out = tmp_path / "policy.json"
    code = main(["calibrate", str(BIGBENCH / "intent_recognition"), "--limit", "24", "--engine-url", vllm_url,
                 "--target-escalation", "0.3", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "24/24" in captured.err  # the progress bar
    assert "near chance" in captured.out
    for png in (out.with_suffix(".reliability.png"), out.with_suffix(".escalation.png")):
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    doc = json.loads(out.read_text())
    q = doc["calibration"]["questions"]["intent"]
    assert doc["calibration"]["model"] == "tiny-dgemma" and doc["calibration"]["near_chance"]
    assert q["check_rows"] == 12 and q["fit_rows"] == 12
    assert q["ece_after"] <= q["ece_before"] + 1e-12  # held-out ECE never rises
    assert q["temperature"]["nll_check"][1] <= q["temperature"]["nll_check"][0] or not q["temperature"]["accepted"]

    policy = load_policy(out)
    intent = policy.for_question("intent")
    assert intent.temperature == q["temperature"]["temperature"] and intent.rereads == 0
    assert intent.max_normalized_entropy == q["threshold"]["threshold"]
    # the router loads it and reads with it: the same read, gate off at T = 1, then with the policy
    row = cal_cli.load_rows(BIGBENCH / "intent_recognition", limit=1, seed=7)[0]
    engine = VLLMServerEngine(vllm_url)
    plain = run_sync(CanvasDecisionModel(engine=engine, policy=cal_cli.GATE_OFF).adecide(row.state, row.questions))
    tuned = run_sync(CanvasDecisionModel(engine=engine, policy=policy).adecide(row.state, row.questions))
    raw, report = plain.reads["intent"], tuned.reads["intent"]
    expected = cm.tempered(list(raw.canvas_probabilities.values()), intent.temperature)
    assert list(report.canvas_probabilities.values()) == pytest.approx(expected, rel=1e-6)
    assert report.reads == 1  # rereads 0; no escalation target: over the gate it stays unsure
    assert report.confident == (report.normalized_entropy <= intent.max_normalized_entropy)
    assert report.path == ("canvas" if report.confident else "unsure")
    assert report.cause == (None if report.confident else "uncertain")


@pytest.mark.vllm
async def test_collect_reads_noul_rows_from_vllm(vllm_url):
    rows = cal_cli.load_rows(BIGBENCH / "strategyqa", limit=6, seed=3)
    engine = VLLMServerEngine(vllm_url)
    samples = await cal_cli.collect(engine, rows, concurrency=3)
    await engine.aclose()
    assert len(samples) == 6
    for s, row in zip(samples, rows, strict=True):
        assert len(s.probabilities) == 2 and math.isclose(sum(s.probabilities), 1.0)
        assert s.gold == ("yes", "no").index(row.gold["answer"])


# -- labels from traces -----------------------------------------------------------------------


@contextmanager
def _traced(path: Path):
    """A fresh global TracerProvider exporting to JSONL (restored afterwards)."""
    with fresh_tracer_provider(JsonlSpanExporter(path)):
        yield


async def test_calibrate_from_traces_uses_escalated_answers_as_labels(tmp_path, capsys):
    rng = random.Random(0)

    def rows(read):
        a, b = rng.uniform(-1.5, -0.2), rng.uniform(-1.5, -0.2)
        return [{engine.token_id("A"): a, engine.token_id("B"): b}]

    engine = FunctionEngine(rows)
    question = {"side": Choice(instructions="Which side?", criteria={"left": None, "right": None})}
    replies = iter([AIMessage('{"side": "left"}') for _ in range(40)])
    policy = GatePolicy(max_normalized_entropy=0.5, rereads=0, temperature=2.0)
    model = CanvasDecisionModel(engine=engine, policy=policy, escalate_to=GenericFakeChatModel(messages=replies))
    spans_file = tmp_path / "spans.jsonl"
    with _traced(spans_file):
        responses = [await model.adecide(f"case {i}", question) for i in range(30)]
    escalated = [r.reads["side"] for r in responses if r.reads["side"].path == "escalated"]
    assert len(escalated) >= 8

    labelled = cal_cli.labelled_from_spans(read_spans(spans_file))
    assert len(labelled) == len(escalated)
    assert all(s.gold == 0 for s in labelled)  # the escalation said "left"
    # the recorded distribution was at T = 2; the label row is back at T = 1
    first = escalated[0].canvas_probabilities
    assert labelled[0].probabilities == pytest.approx(cm.tempered(list(first.values()), 0.5))

    out = tmp_path / "from-traces.json"
    code = main(["calibrate", "--from-traces", str(spans_file), "--no-plots", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    meta = json.loads(out.read_text())["calibration"]
    assert meta["rows"] == len(escalated) and meta["source"] == str(spans_file)
    assert load_policy(out).for_question("side").temperature > 0


# -- what the command says when the rows cannot meet the target (issue #39, point 5) -----------------


def _p_engine() -> FunctionEngine:
    """Reads a Noul's yes-probability from the state's `p=` (so each row's canvas read is known)."""
    def rows(read):
        import re

        p = float(re.search(r"p=([0-9.]+)", read.messages[-1]["content"]).group(1))
        return [{engine.token_id("yes"): math.log(p), engine.token_id("no"): math.log1p(-p)}] * len(read.slots)

    engine = FunctionEngine(rows)
    return engine


def _p_rows(tmp_path: Path, rows: list[tuple[float, str]]) -> str:
    """JSONL of one Noul `q` per row: (the canvas's yes-probability, the gold answer)."""
    path = tmp_path / "rows.jsonl"
    question = Noul(instructions="Is it urgent?").model_dump(mode="json")
    path.write_text("".join(json.dumps({"state": f"ticket {i} p={p}", "questions": {"q": question},
                                        "gold": {"q": gold}}) + "\n" for i, (p, gold) in enumerate(rows)))
    return str(path)


@pytest.fixture
def p_engine(monkeypatch):
    from canvasroute import engine

    monkeypatch.setattr(engine, "embedded_engine", _p_engine)


def test_calibrate_explains_its_columns_under_the_table_and_in_help(tmp_path, p_engine, capsys):
    rows = _p_rows(tmp_path, [(0.9, "yes"), (0.8, "yes"), (0.3, "no"), (0.6, "no"), (0.95, "yes"), (0.2, "no")])
    assert main(["calibrate", rows, "--no-plots", "--target-escalation", "0.2", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    table, legend = out.split("\ncolumns:\n")
    header = table.splitlines()[1].split()
    assert header[:3] == ["question", "rows", "T"]
    shown = [line.split("  ")[1].strip() for line in legend.splitlines() if line.startswith("  ") and
             not line.startswith("   ")]
    assert shown == ["question", "rows", "T", "kept", "acc", "ECE before", "ECE after", "threshold", "escalate"]
    assert "  T           the temperature fitted on the fit rows: softmax(log p / T)" in legend
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    helped = capsys.readouterr().out
    assert "The summary table's columns:" in helped
    assert "errors/passed  wrong answers among the rows the certified gate passes" in helped
    assert "'target not met'" in helped


def test_calibrate_says_when_too_few_rows_cannot_meet_the_target(tmp_path, p_engine, capsys):
    """Three rows, a target accuracy: no fit, and the gate keeps the base threshold (on main,
    silently: the table showed threshold 0.500 and nothing said why)."""
    rows = _p_rows(tmp_path, [(0.9, "yes"), (0.2, "no"), (0.7, "yes")])
    out = tmp_path / "p.json"
    assert main(["calibrate", rows, "--no-plots", "--target-accuracy", "0.9", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert ("canvasroute calibrate: target not met: q: 3 labelled rows, fewer than the 4 a fit needs: no temperature "
            "is fitted, and its gate keeps the base threshold (H/lnK <= 0.5) rather than one for --target-accuracy "
            "0.9; give it at least 4 rows") in err.splitlines()
    assert out.is_file()


def test_calibrate_says_when_no_threshold_reaches_the_target_accuracy(tmp_path, p_engine, capsys):
    """The canvas is sure and wrong on every row: no threshold reaches 90 %, every answer
    escalates, and the command says what to do instead."""
    rows = _p_rows(tmp_path, [(0.9 - i / 100, "no") for i in range(8)])
    assert main(["calibrate", rows, "--no-plots", "--target-accuracy", "0.9", "-o", str(tmp_path / "p.json")]) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "target not met" in x]
    assert line == ("canvasroute calibrate: target not met: q: no threshold reaches accuracy 90% on its 4 fit rows "
                    "(the canvas's best is 0%, answering 4 of them): its gate escalates every answer; lower "
                    "--target-accuracy, or hold an escalation rate with --target-escalation")
    assert load_policy(tmp_path / "p.json").for_question("q").max_normalized_entropy == 0.0


def test_calibrate_says_how_many_rows_a_certificate_needs(tmp_path, p_engine, capsys):
    """Twenty right and sure rows cannot certify error <= 5 % at 90 % (45 passed rows, all right, are
    the least; the certificate tests every row): the command says so, and what the gate states until
    then (the looser bound twenty right rows prove: 1 - 0.1 ** (1 / 20) = 10.88 %)."""
    rows = _p_rows(tmp_path, [(0.97, "yes")] * 20)
    assert main(["calibrate", rows, "--no-plots", "--max-error", "0.05", "-o", str(tmp_path / "p.json")]) == 0
    printed = capsys.readouterr()
    assert ("canvasroute calibrate: target not met: q: not certified: error <= 5% at 90% needs at least 45 rows its "
            "gate passes, all right; it has 20 labelled rows; give it at least 45 (until then its gate states the "
            "looser bound its rows prove (10.88%))") in printed.err.splitlines()
    assert "more labelled rows would help: at least 45 (it has 20)." in printed.out
    assert cm.rows_needed(0.05, 0.9) == 45 and 1 - 0.95 ** 45 >= 0.9 > 1 - 0.95 ** 44  # 45 is the least
    rows = _p_rows(tmp_path, [(0.97, "yes")] * 100)
    assert main(["calibrate", rows, "--no-plots", "--max-error", "0.05", "-o", str(tmp_path / "p.json")]) == 0
    assert "target not met" not in capsys.readouterr().err  # 100 such rows do certify it


def test_calibrate_says_when_the_check_rows_miss_the_target_the_fit_rows_met(tmp_path, p_engine, capsys):
    """The fit rows are all right, the check rows all wrong: the threshold meets 90 % where it was
    fitted and not where it was checked, and the command says so (with the bound it could certify)."""
    fit, _ = cm.split(list(range(8)), 0.5, 0)  # the positions calibrate's seeded split fits on
    rows = _p_rows(tmp_path, [(0.9, "yes" if i in fit else "no") for i in range(8)])
    assert main(["calibrate", rows, "--no-plots", "--target-accuracy", "0.9", "-o", str(tmp_path / "p.json")]) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "target not met" in x]
    assert line == ("canvasroute calibrate: target not met: q: its threshold reaches accuracy 90% on its 4 fit rows, "
                    "but on its 4 check rows its 4 answers were 0% right: the target does not hold on rows it was not "
                    "fitted on (more rows would tell whether it holds at all); --max-error 0.1 could certify a bound "
                    "instead; it needs at least 22 labelled rows (--max-error tests every row)")
