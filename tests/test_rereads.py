"""Re-reads that can change something: what a re-read varies depends on the engine's readout.

Noise sits at the answer slots. DiffusionGemma sees the whole canvas, so every re-read (fresh
noise) can move every slot. A causal LM read at each slot (the embedded SmolLM2) sees only the
canvas before a slot: its first slot sees no noise, reads the same distribution every time, and
is not re-read (`rereadable=False`, one read, no agreement or stderr to report). These tests
read one joint canvas (`isolate="none"`): by default a causal engine reads each question alone.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from langchain_core.decisions import Choice, Noul

from canvasroute import CanvasDecisionModel, FunctionEngine, GatePolicy, VLLMServerEngine
from canvasroute.engine import run_sync

QUESTIONS = {
    "team": Choice(instructions="Which team owns this?", criteria={"billing": None, "technical": None}),
    "urgent": Noul(instructions="Does it need an answer today?"),
}
TICKET = "I was charged twice this month and need a refund today."
ALWAYS_REREAD = GatePolicy(max_normalized_entropy=0.0, rereads=2)
"""Every read is over the gate, so every question that can be re-read is."""
JOINT = {"isolate": "none"}
"""One canvas for both questions (a causal engine would read them apart by default)."""


def causal_rows(engine: FunctionEngine):
    """Rows that, like a causal readout, depend only on the canvas before each slot."""

    def rows(read):
        out = []
        for pos in read.slots:
            seen = hashlib.sha256(json.dumps(read.canvas[:pos]).encode()).digest()
            p = 0.2 + 0.6 * seen[0] / 255
            out.append({i: (-0.1 if (n + seen[1]) % 2 else -1.0) * p for n, i in enumerate(read.label_ids)})
        return out

    return rows


@pytest.mark.parametrize("causal", [True, False])
def test_a_causal_readouts_first_slot_is_not_reread(causal):
    engine = FunctionEngine(lambda read: rows(read), causal_readout=causal)
    rows = causal_rows(engine)
    model = CanvasDecisionModel(engine=engine, policy=ALWAYS_REREAD, read=JOINT)
    resp = model.decide(TICKET, QUESTIONS)
    team, urgent = resp.reads["team"], resp.reads["urgent"]
    assert urgent.reads == 3 and urgent.rereadable and urgent.agreement is not None and urgent.stderr is not None
    if causal:  # the first slot: one read, said so, nothing to agree about
        assert (team.reads, team.rereadable, team.agreement, team.stderr) == (1, False, None, None)
    else:
        assert team.reads == 3 and team.rereadable and team.agreement is not None
    assert resp.canvas_reads == 3  # one canvas holds both questions: first read + 2 re-reads either way


def test_a_canvas_whose_only_uncertain_question_cannot_change_is_not_read_again():
    engine = FunctionEngine(lambda read: rows(read), causal_readout=True)
    rows = causal_rows(engine)
    policy = GatePolicy(max_normalized_entropy=0.0, rereads=3, per_question={"urgent": GatePolicy(rereads=0)})
    resp = CanvasDecisionModel(engine=engine, policy=policy, read=JOINT).decide(TICKET, QUESTIONS)
    assert resp.canvas_reads == 1 and engine.calls == 1
    assert resp.reads["team"].rereadable is False and resp.reads["team"].reads == 1


@pytest.mark.smollm
def test_on_the_embedded_engine_fresh_noise_cannot_reach_the_first_slot(smol):
    assert run_sync(smol.info()).causal_readout
    model = CanvasDecisionModel(engine=smol, policy=GatePolicy(max_normalized_entropy=None, rereads=0), read=JOINT)
    a, b = (model.decide(TICKET, QUESTIONS, seed=s) for s in (1, 2))
    # the fact the rule rests on, on the real model: other noise, the same first slot, another second
    assert a.reads["team"].canvas_probabilities == pytest.approx(b.reads["team"].canvas_probabilities, abs=1e-6)
    assert a.reads["urgent"].canvas_probabilities != pytest.approx(b.reads["urgent"].canvas_probabilities, abs=1e-6)
    gated = CanvasDecisionModel(engine=smol, policy=ALWAYS_REREAD, read=JOINT).decide(TICKET, QUESTIONS, seed=1)
    team = gated.reads["team"]
    assert (team.reads, team.rereadable, team.agreement) == (1, False, None)
    assert gated.reads["urgent"].reads == 3 and gated.reads["urgent"].stderr is not None


@pytest.mark.vllm
def test_on_diffusiongemma_every_slot_is_reread_and_reads_differ(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    try:
        plain = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=None, rereads=0))
        a, b = (plain.decide(TICKET, QUESTIONS, seed=s) for s in (1, 2))
        # DiffusionGemma sees the whole canvas: fresh noise moves the first slot too
        assert a.reads["team"].canvas_probabilities != pytest.approx(b.reads["team"].canvas_probabilities, abs=1e-6)
        resp = CanvasDecisionModel(engine=engine, policy=ALWAYS_REREAD).decide(TICKET, QUESTIONS, seed=1)
        for report in resp.reads.values():
            assert report.rereadable and report.reads == 3
            assert report.agreement is not None and report.stderr is not None
    finally:
        run_sync(engine.aclose())
