"""The gate, re-reads, budgets and fallbacks over controlled distributions.

A `FunctionEngine` returns chosen log-probability rows, so every figure the gate sees
is known in advance and every expected value below is computed by hand from the
formulas (softmax over labels, floor = min(row) - 5, entropy in nats, ...), not by
calling the code under test.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence

import pytest
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda

from canvasroute.engine import (
    BudgetExhausted,
    DecisionError,
    EngineResponseError,
    EngineUnavailable,
    FunctionEngine,
    ReadResult,
)
from canvasroute.router import (
    CanvasDecisionModel,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    SlotStats,
    aggregate,
    slot_stats,
)

STATE = "I was charged twice this month. Please refund me."
TEAM = Choice(instructions="Which team owns this?", criteria={"billing": None, "tech": None})
URGENT = Noul(instructions="Is it urgent?")
SEVERITY = Score(instructions="How severe?", criteria=["minor", "major", "critical"])
LABELS = {"team": ("A", "B"), "urgent": ("yes", "no"), "severity": ("1", "2", "3")}
"""Canvas labels per question (FunctionEngine's tokenizer keeps the first alphabet)."""
OFF = dict(max_normalized_entropy=None, max_entropy=None, min_confidence=None, min_margin=None,
           min_label_mass=None)
"""Every threshold off: a policy built from this plus one threshold checks only that one."""


# -- a scripted engine ------------------------------------------------------------------


class Script:
    """A FunctionEngine whose row for question `qid` at read n is `dists[qid][n]` (the
    last entry repeats). A distribution is `(probs over labels, label mass)`.
    Single-chunk decision sets only: read n is the n-th canvas the engine sees."""

    def __init__(self, dists: dict[str, Sequence[tuple[Sequence[float], float]]], *,
                 prompt_tokens: int = 0, completion_tokens: int = 0, fail_from: int | None = None) -> None:
        self.dists = dists
        self.tokens = (prompt_tokens, completion_tokens)
        self.fail_from = fail_from
        self.engine = FunctionEngine(self._rows, model="scripted")

    def row(self, qid: str, probs: Sequence[float], mass: float) -> dict[int, float]:
        t = self.engine.token_id
        out = {t(label): math.log(p * mass) for label, p in zip(LABELS[qid], probs, strict=True)}
        if mass < 1.0:
            out[t("elsewhere")] = math.log(1.0 - mass)
        return out

    def _rows(self, read):
        n = len(self.engine.reads) - 1
        if self.fail_from is not None and n >= self.fail_from:
            raise EngineUnavailable("replica down")
        rows = []
        for qid in self.dists:
            probs, mass = self.dists[qid][min(n, len(self.dists[qid]) - 1)]
            rows.append(self.row(qid, probs, mass))
        assert len(rows) == len(read.slots)
        return ReadResult(rows=tuple(rows), prompt_tokens=self.tokens[0], completion_tokens=self.tokens[1])


def questions(*ids: str) -> dict:
    return {qid: {"team": TEAM, "urgent": URGENT, "severity": SEVERITY}[qid] for qid in ids}


class Recorder:
    """An escalation target (a Runnable) that answers from a table and records each call."""

    def __init__(self, answers: dict[str, str], usage: tuple[int, int] = (40, 6)) -> None:
        self.answers = answers
        self.usage = usage
        self.calls: list[list] = []
        self.runnable = RunnableLambda(self._reply, name="recorder")

    def _reply(self, messages):
        self.calls.append(messages)
        asked = re.findall(r'^Question "([^"]+)"', messages[-1].content, re.MULTILINE)
        i, o = self.usage
        return AIMessage(json.dumps({q: self.answers[q] for q in asked}),
                         usage_metadata={"input_tokens": i, "output_tokens": o, "total_tokens": i + o})

    def asked(self, call: int = -1) -> list[str]:
        return re.findall(r'^Question "([^"]+)"', self.calls[call][-1].content, re.MULTILINE)


# -- slot_stats and aggregate: hand-computed ------------------------------------------------


def test_slot_stats_softmax_over_labels():
    # labels A, B, C; an off-label id 99 holds -0.2 and does not count
    row = {1: -0.5, 2: -1.5, 3: -6.5, 99: -0.2}
    st = slot_stats(row, [1, 2, 3])
    e = [math.exp(-0.5), math.exp(-1.5), math.exp(-6.5)]
    p = [x / sum(e) for x in e]
    assert st.probs == pytest.approx(p, abs=1e-12)
    assert st.label_mass == pytest.approx(sum(e), abs=1e-12)  # exp of the raw label logprobs
    h = -sum(x * math.log(x) for x in p)
    assert st.entropy == pytest.approx(h, abs=1e-12)
    assert st.normalized_entropy == pytest.approx(h / math.log(3), abs=1e-12)
    assert st.margin == pytest.approx(p[0] - p[1], abs=1e-12)
    assert st.confidence == pytest.approx(p[0], abs=1e-12) and st.top == 0
    assert st.reads == 1 and st.agreement is None and st.stderr is None


def test_slot_stats_refuses_a_row_missing_a_label_id():
    with pytest.raises(EngineResponseError, match="lacks label id 2"):  # never filled in with a floor
        slot_stats({1: -0.1, 7: -9.0}, [1, 2])


def test_slot_stats_edge_cases():
    uniform = slot_stats({1: -math.inf, 2: -math.inf}, [1, 2])
    assert uniform.probs == (0.5, 0.5) and uniform.label_mass == 0.0
    assert uniform.normalized_entropy == pytest.approx(1.0) and uniform.margin == 0.0
    single = slot_stats({5: -0.3}, [5])
    assert single.probs == (1.0,) and single.normalized_entropy == 0.0 and single.margin == 1.0
    capped = slot_stats({1: -1e-9, 2: -1e-9}, [1, 2])  # sum of exp > 1 from rounding: capped
    assert capped.label_mass == 1.0


def test_aggregate_mean_agreement_and_stderr_by_hand():
    runs = [SlotStats((0.55, 0.45), 0.9), SlotStats((0.9, 0.1), 0.7),
            SlotStats((0.3, 0.7), 0.5), SlotStats((0.8, 0.2), 0.9)]
    agg = aggregate(runs)
    assert agg.probs == pytest.approx((0.6375, 0.3625))
    assert agg.top == 0 and agg.reads == 4
    assert agg.agreement == 0.75  # reads 1, 2, 4 chose label 0
    # p(label 0) per read: mean 0.6375, squared deviations sum to 0.216875
    assert agg.stderr == pytest.approx(math.sqrt(0.216875 / 3 / 4))
    assert agg.label_mass == pytest.approx(0.75)
    assert aggregate(runs[:1]) is runs[0]


# -- the threshold matrix ---------------------------------------------------------------------

# For each threshold: a policy that checks only it, a distribution on its confident side and
# one on its uncertain side (binary `team` question: probs of billing/tech, label mass).
# Figures by hand: H(0.95) = 0.1985 nats (0.286 of ln 2), H(0.7) = 0.6109 nats (0.881).
MATRIX = {
    "max_normalized_entropy": (dict(max_normalized_entropy=0.5), ((0.95, 0.05), 1.0), ((0.7, 0.3), 1.0)),
    "max_entropy": (dict(max_entropy=0.4), ((0.95, 0.05), 1.0), ((0.7, 0.3), 1.0)),
    "min_confidence": (dict(min_confidence=0.8), ((0.95, 0.05), 1.0), ((0.7, 0.3), 1.0)),
    "min_margin": (dict(min_margin=0.5), ((0.95, 0.05), 1.0), ((0.7, 0.3), 1.0)),
    "min_label_mass": (dict(min_label_mass=0.5), ((0.95, 0.05), 0.9), ((0.95, 0.05), 0.3)),
}


def test_matrix_figures_are_on_the_sides_claimed():
    h = lambda p: -(p * math.log(p) + (1 - p) * math.log(1 - p))  # noqa: E731
    assert h(0.95) == pytest.approx(0.19852, abs=1e-5) and h(0.7) == pytest.approx(0.61086, abs=1e-5)
    assert h(0.95) / math.log(2) < 0.5 < h(0.7) / math.log(2)
    assert h(0.95) < 0.4 < h(0.7)


@pytest.mark.parametrize("side", ["confident", "uncertain"])
@pytest.mark.parametrize("threshold", list(MATRIX))
@pytest.mark.parametrize("mode", ["answer", "reread", "escalate"])
async def test_path_per_threshold_side_and_mode(threshold, side, mode):
    limits, confident, uncertain = MATRIX[threshold]
    dist = confident if side == "confident" else uncertain
    script = Script({"team": [dist]})
    rereads = 2 if mode == "reread" else 0
    recorder = Recorder({"team": "tech"})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(**{**OFF, **limits}, rereads=rereads),
                                escalate_to=recorder.runnable if mode == "escalate" else None)
    resp = await model.adecide(STATE, questions("team"), seed=11)
    r = resp.reads["team"]
    assert r.normalized_entropy == pytest.approx(
        -sum(p * math.log(p) for p in dist[0]) / math.log(2))
    if side == "confident":  # the gate passes it at the first read, whatever the mode
        assert (r.path, r.confident, r.crossed, r.reads) == ("canvas", True, [], 1)
        assert resp.answers["team"].choice == "billing" and resp.canvas_reads == 1
        assert recorder.calls == []
        return
    if mode == "answer":  # no re-reads, nowhere to escalate: the canvas answer, path unsure
        assert (r.path, r.confident, r.crossed, r.reads) == ("unsure", False, [threshold], 1)
        assert resp.answers["team"].choice == "billing"
    elif mode == "reread":  # same rows each time: still uncertain after 2 re-reads
        assert (r.path, r.confident, r.crossed, r.reads) == ("unsure", False, [threshold], 3)
        assert r.agreement == 1.0 and r.stderr == pytest.approx(0.0, abs=1e-12)
        assert resp.canvas_reads == 3 and script.engine.calls == 2  # first read + one batch of 2
    else:
        assert (r.path, r.confident, r.crossed, r.reads) == ("escalated", False, [threshold], 1)
        assert r.escalation_model == "recorder" and resp.answers["team"].choice == "tech"
        assert r.canvas_probabilities == pytest.approx({"billing": dist[0][0], "tech": dist[0][1]})
        assert len(recorder.calls) == 1


@pytest.mark.parametrize("threshold, value", [
    ("max_normalized_entropy", "normalized_entropy"), ("max_entropy", "entropy"),
    ("min_confidence", "confidence"), ("min_margin", "margin"), ("min_label_mass", "label_mass"),
])
def test_a_figure_exactly_at_its_threshold_is_not_crossed(threshold, value):
    st = SlotStats((0.75, 0.25), 0.6)
    assert GatePolicy(**{**OFF, threshold: getattr(st, value)}).crossed(st) == []
    nudged = getattr(st, value) + (-1e-9 if threshold.startswith("max") else 1e-9)
    assert GatePolicy(**{**OFF, threshold: nudged}).crossed(st) == [threshold]


def test_every_crossed_threshold_is_named():
    st = SlotStats((0.6, 0.4), 0.2)
    policy = GatePolicy(max_normalized_entropy=0.5, max_entropy=0.5, min_confidence=0.7, min_margin=0.5,
                        min_label_mass=0.5)
    assert policy.crossed(st) == ["max_normalized_entropy", "max_entropy", "min_confidence", "min_margin",
                                  "min_label_mass"]
    assert GatePolicy(**OFF).crossed(st) == []


@pytest.mark.parametrize("kwargs, error", [
    (dict(rereads=32), ValueError), (dict(rereads=-1), ValueError), (dict(samples=0), ValueError),
    (dict(samples=33), ValueError), (dict(min_confidence=1.5), ValueError),
    (dict(max_normalized_entropy=-0.1), ValueError), (dict(max_entropy=-1.0), ValueError),
    (dict(per_question={"team": {"min_margin": 0.3}}), TypeError),
])
def test_policy_validation(kwargs, error):
    with pytest.raises(error):
        GatePolicy(**kwargs)


def test_policy_is_frozen_and_keyword_only():
    policy = GatePolicy()
    assert policy.rereads == 3 and policy.max_normalized_entropy == 0.5
    with pytest.raises(AttributeError):
        policy.rereads = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        GatePolicy(0.5)  # type: ignore[misc]
    assert policy.with_overrides(rereads=1).rereads == 1 and policy.rereads == 3


# -- per-question overrides -------------------------------------------------------------------


async def test_per_question_override_replaces_the_whole_policy():
    # both at 0.9: the base policy (min_confidence 0.99) calls both uncertain; the override
    # for `team` has no thresholds at all, so only `urgent` is re-read.
    script = Script({"team": [((0.9, 0.1), 1.0)], "urgent": [((0.9, 0.1), 1.0)]})
    policy = GatePolicy(**{**OFF, "min_confidence": 0.99}, rereads=1, per_question={"team": GatePolicy(**OFF)})
    resp = await CanvasDecisionModel(engine=script.engine, policy=policy).adecide(STATE, questions("team", "urgent"))
    assert (resp.reads["team"].path, resp.reads["team"].confident, resp.reads["team"].reads) == ("canvas", True, 1)
    assert (resp.reads["urgent"].path, resp.reads["urgent"].confident) == ("unsure", False)
    assert resp.reads["urgent"].crossed == ["min_confidence"] and resp.reads["urgent"].reads == 2


async def test_per_question_rereads_bound_each_question():
    # both stay uncertain; `team` asked for 1 re-read, `urgent` for 3: one batch of 3 re-reads
    # of the shared chunk, and each question aggregates only the reads it asked for.
    script = Script({"team": [((0.6, 0.4), 1.0), ((0.5, 0.5), 1.0), ((0.9, 0.1), 1.0)],
                     "urgent": [((0.6, 0.4), 1.0)]})
    policy = GatePolicy(rereads=3, per_question={"team": GatePolicy(rereads=1)})
    resp = await CanvasDecisionModel(engine=script.engine, policy=policy).adecide(STATE, questions("team", "urgent"))
    assert resp.canvas_reads == 4 and script.engine.calls == 2
    assert resp.reads["team"].reads == 2 and resp.reads["urgent"].reads == 4
    # team: mean of reads 0 and 1 only (read 2's 0.9 is not its to use)
    assert resp.reads["team"].canvas_probabilities == pytest.approx({"billing": 0.55, "tech": 0.45})


async def test_a_confident_question_keeps_its_first_read_when_its_chunk_is_reread():
    script = Script({"team": [((0.99, 0.01), 1.0), ((0.5, 0.5), 1.0)], "urgent": [((0.6, 0.4), 1.0)]})
    resp = await CanvasDecisionModel(engine=script.engine).adecide(STATE, questions("team", "urgent"))
    assert resp.canvas_reads == 4  # the chunk was re-read for `urgent`
    team = resp.reads["team"]
    assert (team.path, team.confident, team.reads) == ("canvas", True, 1)
    assert team.canvas_probabilities == pytest.approx({"billing": 0.99, "tech": 0.01})
    assert resp.reads["urgent"].path == "unsure"


async def test_per_call_policy_overrides_the_model_policy():
    script = Script({"team": [((0.7, 0.3), 1.0)]})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=0))
    assert (await model.adecide(STATE, questions("team"))).reads["team"].confident is False
    strict = GatePolicy(**OFF, rereads=0)
    assert (await model.adecide(STATE, questions("team"), gate=strict)).reads["team"].confident is True
    resp = await model.ainvoke({"state": STATE, "questions": questions("team"), "gate": strict})
    assert resp.reads["team"].confident is True


# -- re-reads ---------------------------------------------------------------------------------


async def test_reread_aggregation_agreement_and_stderr_by_hand():
    # p(billing) per read: 0.55 (uncertain under min_confidence 0.6), then 0.9, 0.3, 0.8
    reads = [((0.55, 0.45), 1.0), ((0.9, 0.1), 1.0), ((0.3, 0.7), 1.0), ((0.8, 0.2), 0.8)]
    script = Script({"team": reads})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(**{**OFF, "min_confidence": 0.6}),
                                read={"constrained": False})  # label mass is measured only on unconstrained reads
    resp = await model.adecide(STATE, questions("team"), seed=5)
    r = resp.reads["team"]
    assert (r.path, r.reads, r.confident, r.crossed) == ("reread", 4, True, [])  # 0.6375 >= 0.6
    assert r.canvas_probabilities == pytest.approx({"billing": 0.6375, "tech": 0.3625})
    assert r.probabilities == r.canvas_probabilities and r.answer == "billing"
    assert r.confidence == pytest.approx(0.6375)
    assert r.agreement == 0.75
    assert r.stderr == pytest.approx(math.sqrt(0.216875 / 3 / 4))
    assert r.label_mass == pytest.approx((1 + 1 + 1 + 0.8) / 4)
    h = -(0.6375 * math.log(0.6375) + 0.3625 * math.log(0.3625))
    assert r.entropy == pytest.approx(h) and r.normalized_entropy == pytest.approx(h / math.log(2))
    assert r.margin == pytest.approx(0.275)
    assert resp.answers["team"].probabilities == pytest.approx({"billing": 0.6375, "tech": 0.3625})


async def test_rereads_use_fresh_seeds_seed_plus_7919_k():
    script = Script({"team": [((0.6, 0.4), 1.0)]})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=3))
    await model.adecide(STATE, questions("team"), seed=1234)
    assert len(script.engine.reads) == 4
    info = await script.engine.info()
    label_ids = {script.engine.token_id("A"), script.engine.token_id("B"), info.pad_id}
    for k, read in enumerate(script.engine.reads):
        rng = random.Random(1234 + 7919 * k)
        noise = rng.randrange(info.vocab_size)
        while noise in label_ids:
            noise = rng.randrange(info.vocab_size)
        (slot,) = read.slots
        assert read.canvas[slot] == noise
    assert len({r.canvas for r in script.engine.reads}) == 4  # four different canvases


async def test_the_default_seed_is_deterministic_and_rereads_of_it_differ():
    script = Script({"team": [((0.6, 0.4), 1.0)]})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=1))
    await model.adecide(STATE, questions("team"))
    await model.adecide(STATE, questions("team"))
    a, b, c, d = (r.canvas for r in script.engine.reads)
    assert (a, b) == (c, d) and a != b


async def test_rereads_zero_turns_rereading_off():
    script = Script({"team": [((0.6, 0.4), 1.0)]})
    resp = await CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=0)).adecide(
        STATE, questions("team"))
    assert resp.canvas_reads == 1 and resp.reads["team"].path == "unsure" and not resp.reads["team"].confident


# -- escalation: only the uncertain questions, in one call ----------------------------------------


async def test_only_uncertain_questions_escalate_together_in_one_call():
    script = Script({"team": [((0.55, 0.45), 1.0)], "urgent": [((0.99, 0.01), 1.0)],
                     "severity": [((0.4, 0.3, 0.3), 1.0)]})
    recorder = Recorder({"team": "tech", "severity": "2"})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=1), escalate_to=recorder.runnable)
    resp = await model.adecide(STATE, questions("team", "urgent", "severity"))
    assert len(recorder.calls) == 1 and recorder.asked() == ["team", "severity"]
    assert {q: r.path for q, r in resp.reads.items()} == {"team": "escalated", "urgent": "canvas",
                                                          "severity": "escalated"}
    assert resp.answers["team"].choice == "tech" and resp.answers["severity"].score == 2
    assert resp.answers["urgent"].noul == pytest.approx(0.99)
    assert resp.reads["team"].reads == 2 and resp.reads["urgent"].reads == 1  # re-read, then escalated
    # the prompt carries the state, the options and the canvas probabilities (mean over reads)
    prompt = recorder.calls[0][-1].content
    assert STATE in prompt and 'Options: "billing", "tech".' in prompt
    assert 'Fast model\'s probabilities: {"billing": 0.55, "tech": 0.45}' in prompt


async def test_nothing_escalates_when_everything_is_confident():
    script = Script({"team": [((0.99, 0.01), 1.0)], "urgent": [((0.02, 0.98), 1.0)]})
    recorder = Recorder({})
    resp = await CanvasDecisionModel(engine=script.engine, escalate_to=recorder.runnable).adecide(
        STATE, questions("team", "urgent"))
    assert recorder.calls == [] and {r.path for r in resp.reads.values()} == {"canvas"}
    assert resp.answers["urgent"].noul == pytest.approx(0.02)


async def test_usage_sums_reads_and_escalation():
    script = Script({"team": [((0.6, 0.4), 1.0)]}, prompt_tokens=100, completion_tokens=16)
    recorder = Recorder({"team": "tech"}, usage=(250, 7))
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=2), escalate_to=recorder.runnable)
    resp = await model.adecide(STATE, questions("team"))
    assert resp.canvas_reads == 3
    assert resp.usage["input_tokens"] == 3 * 100 + 250
    assert resp.usage["output_tokens"] == 3 * 16 + 7
    assert resp.usage["total_tokens"] == 3 * 116 + 257


def test_sync_invoke_takes_the_same_path():
    script = Script({"team": [((0.6, 0.4), 1.0)]})
    recorder = Recorder({"team": "tech"})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=0), escalate_to=recorder.runnable)
    resp = model.invoke({"state": STATE, "questions": questions("team"), "seed": 3})
    assert resp.reads["team"].path == "escalated" and resp.answers["team"].choice == "tech"


# -- budgets ------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    import canvasroute.router._budget as policy_module

    c = Clock()
    monkeypatch.setattr(policy_module.time, "monotonic", c)
    return c


def _budgeted(over_budget: str, recorder: Recorder, **budget) -> tuple[CanvasDecisionModel, Script]:
    script = Script({"team": [((0.6, 0.4), 1.0)]})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=0),
                                escalate_to=Escalation(recorder.runnable, budget=EscalationBudget(**budget)),
                                outcomes=OutcomePolicy(over_budget=over_budget, fallback={"team": "tech"}))
    return model, script


@pytest.mark.parametrize("over_budget", ["answer", "fallback", "raise"])
async def test_the_n_plus_first_escalation_in_a_window_behaves_as_declared(over_budget, clock):
    recorder = Recorder({"team": "billing"})
    model, _ = _budgeted(over_budget, recorder, max_per_window=2, window_s=60)
    for _ in range(2):
        resp = await model.adecide(STATE, questions("team"))
        assert (resp.reads["team"].path, resp.reads["team"].cause) == ("escalated", "uncertain")
    clock.now += 59.0
    if over_budget == "raise":
        with pytest.raises(BudgetExhausted):
            await model.adecide(STATE, questions("team"))
    else:
        r = (await model.adecide(STATE, questions("team"))).reads["team"]
        assert r.cause == "over_budget" and not r.confident and r.crossed == ["max_normalized_entropy"]
        assert r.escalation_model is None
        if over_budget == "answer":
            assert (r.path, r.answer) == ("unsure", "billing")  # the canvas argmax (0.6), acted on unsure
        else:
            assert (r.path, r.answer) == ("fallback", "tech")
            assert r.probabilities == {"billing": 0.0, "tech": 1.0}
    assert len(recorder.calls) == 2
    assert model.budget_counters == {"granted": 2, "refused": 1, "refunded": 0, "in_window": 2}
    clock.now += 1.0  # the first two leave the 60 s window
    assert (await model.adecide(STATE, questions("team"))).reads["team"].path == "escalated"
    assert model.budget_counters == {"granted": 3, "refused": 1, "refunded": 0, "in_window": 1}


@pytest.mark.parametrize("over_budget", ["answer", "fallback", "raise"])
async def test_per_thread_budget(over_budget):
    recorder = Recorder({"team": "billing"})
    model, _ = _budgeted(over_budget, recorder, max_per_thread=1)
    assert (await model.adecide(STATE, questions("team"), thread_id="t1")).reads["team"].path == "escalated"
    if over_budget == "raise":
        with pytest.raises(BudgetExhausted):
            await model.adecide(STATE, questions("team"), thread_id="t1")
    else:
        r = (await model.adecide(STATE, questions("team"), thread_id="t1")).reads["team"]
        assert r.cause == "over_budget" and r.path == {"answer": "unsure", "fallback": "fallback"}[over_budget]
    # another thread has its own allowance; no thread id means no per-thread cap
    assert (await model.adecide(STATE, questions("team"), thread_id="t2")).reads["team"].path == "escalated"
    for _ in range(2):
        assert (await model.adecide(STATE, questions("team"))).reads["team"].path == "escalated"
    assert model.budget_counters["granted"] == 4 and model.budget_counters["refused"] == 1
    assert len(recorder.calls) == 4


async def test_a_partial_budget_escalates_what_it_can_in_one_call(clock):
    script = Script({"team": [((0.6, 0.4), 1.0)], "urgent": [((0.5, 0.5), 1.0)], "severity": [((0.4, 0.3, 0.3), 1.0)]})
    recorder = Recorder({"team": "tech", "urgent": "yes", "severity": "1"})
    model = CanvasDecisionModel(engine=script.engine, policy=GatePolicy(rereads=0),
                                escalate_to=Escalation(recorder.runnable, budget=EscalationBudget(max_per_window=2)))
    resp = await model.adecide(STATE, questions("team", "urgent", "severity"))
    assert len(recorder.calls) == 1 and recorder.asked() == ["team", "urgent"]
    assert [resp.reads[q].path for q in ("team", "urgent", "severity")] == ["escalated", "escalated", "unsure"]
    assert resp.reads["severity"].cause == "over_budget" and resp.reads["team"].cause == "uncertain"
    assert model.budget_counters == {"granted": 2, "refused": 1, "refunded": 0, "in_window": 2}


async def test_budget_validation_and_no_counters_without_budget():
    with pytest.raises(ValueError):
        EscalationBudget(max_per_window=-1)
    with pytest.raises(ValueError):
        EscalationBudget(window_s=0)
    with pytest.raises(ValueError):
        OutcomePolicy(over_budget="ignore")  # type: ignore[arg-type]
    script = Script({"team": [((0.6, 0.4), 1.0)]})
    assert CanvasDecisionModel(engine=script.engine).budget_counters == {}


# -- engine faults and fallbacks ------------------------------------------------------------------


async def test_a_fault_with_a_spent_keep_budget_raises_not_a_cheap_answer(clock):
    script = Script({"team": [((0.9, 0.1), 1.0)]}, fail_from=0)
    recorder = Recorder({"team": "tech"})
    model = CanvasDecisionModel(engine=script.engine,
                                escalate_to=Escalation(recorder.runnable, budget=EscalationBudget(max_per_window=1)))
    assert (await model.adecide(STATE, questions("team"))).reads["team"].path == "escalated"
    with pytest.raises(BudgetExhausted, match="engine failed"):
        await model.adecide(STATE, questions("team"))


async def test_a_fault_with_a_spent_fallback_budget_takes_the_fallback_label(clock):
    script = Script({"team": [((0.9, 0.1), 1.0)]}, fail_from=0)
    model = CanvasDecisionModel(engine=script.engine,
                                escalate_to=Escalation(Recorder({"team": "tech"}).runnable,
                                                       budget=EscalationBudget(max_per_window=0)),
                                outcomes=OutcomePolicy(over_budget="fallback", fallback={"team": "billing"}))
    r = (await model.adecide(STATE, questions("team"))).reads["team"]
    assert (r.path, r.answer, r.cause) == ("fallback", "billing", "over_budget")
    assert r.error is not None and "EngineUnavailable" in r.error and r.canvas_probabilities is None


async def test_on_engine_error_fallback_answers_the_declared_label():
    script = Script({"team": [((0.9, 0.1), 1.0)], "urgent": [((0.9, 0.1), 1.0)]}, fail_from=0)
    model = CanvasDecisionModel(engine=script.engine, outcomes=OutcomePolicy(
        engine_fault="fallback", fallback={"team": "tech", "urgent": "no"}))
    resp = await model.adecide(STATE, questions("team", "urgent"))
    for qid, label in (("team", "tech"), ("urgent", "no")):
        r = resp.reads[qid]
        assert (r.path, r.cause, r.answer, r.confident, r.reads) == ("fallback", "engine_fault", label, False, 0)
        assert r.error is not None and "replica down" in r.error
    assert resp.answers["urgent"].noul == 0.0 and resp.answers["team"].choice == "tech"


async def test_a_reread_fault_under_fallback_takes_the_label_not_the_uncertain_read():
    script = Script({"team": [((0.6, 0.4), 1.0)], "urgent": [((0.99, 0.01), 1.0)]}, fail_from=1)
    model = CanvasDecisionModel(engine=script.engine,
                                outcomes=OutcomePolicy(engine_fault="fallback", fallback={"team": "tech"}))
    resp = await model.adecide(STATE, questions("team", "urgent"))
    team = resp.reads["team"]
    assert (team.path, team.answer, team.reads) == ("fallback", "tech", 1)
    assert team.canvas_probabilities == pytest.approx({"billing": 0.6, "tech": 0.4}) and team.error
    assert resp.reads["urgent"].path == "canvas" and resp.reads["urgent"].error is None  # its read was fine


async def test_a_fault_for_a_question_without_a_fallback_label_raises_the_engine_error():
    script = Script({"team": [((0.9, 0.1), 1.0)], "urgent": [((0.9, 0.1), 1.0)]}, fail_from=0)
    model = CanvasDecisionModel(engine=script.engine,
                                outcomes=OutcomePolicy(engine_fault="fallback", fallback={"team": "tech"}))
    with pytest.raises(EngineUnavailable, match="replica down"):
        await model.adecide(STATE, questions("team", "urgent"))


async def test_a_reread_fault_escalates_the_uncertain_questions():
    script = Script({"team": [((0.6, 0.4), 1.0)], "urgent": [((0.99, 0.01), 1.0)]}, fail_from=1)
    recorder = Recorder({"team": "tech"})
    model = CanvasDecisionModel(engine=script.engine, escalate_to=recorder.runnable)
    resp = await model.adecide(STATE, questions("team", "urgent"))
    assert recorder.asked() == ["team"] and resp.reads["team"].path == "escalated"
    assert "EngineUnavailable" in resp.reads["team"].error
    assert resp.reads["urgent"].path == "canvas"


async def test_a_reread_fault_without_escalation_raises():
    script = Script({"team": [((0.6, 0.4), 1.0)]}, fail_from=1)
    with pytest.raises(EngineUnavailable):
        await CanvasDecisionModel(engine=script.engine).adecide(STATE, questions("team"))


async def test_fallback_configuration_is_validated():
    script = Script({"team": [((0.9, 0.1), 1.0)]})
    with pytest.raises(ValueError, match="fallback"):
        OutcomePolicy(engine_fault="fallback")
    model = CanvasDecisionModel(engine=script.engine,
                                outcomes=OutcomePolicy(engine_fault="fallback", fallback={"team": "sales"}))
    with pytest.raises(DecisionError, match="not an option"):
        await model.adecide(STATE, questions("team"))
