"""Answers that do not depend on their neighbours (issue 29.4), on the embedded engine.

A causal LM read at each slot sees every question before its slot, so on one joint canvas
adding a question or reordering them moves the others' answers (through `serve` on the
embedded engine: 0.155 on average for a yes/no answer, 0.278 for a score's probabilities,
far above the engine's own read-to-read noise). `ReadOptions.isolate="auto"` (the default)
reads each question of a causal engine without the others in view, the state first so the
reads share its prefix: then no neighbour moves an answer beyond that noise.
"""

from __future__ import annotations

import pytest
from langchain_core.decisions import Choice, Noul, Score

from canvasroute import CanvasDecisionModel, GatePolicy

pytestmark = pytest.mark.smollm

TICKET = "I was charged twice for my subscription this month and the app now crashes on start. Refund me!"
URGENT = Noul(instructions="Does the customer need an answer today?")
TEAM = Choice(instructions="Which team owns this ticket?", criteria={"billing": None, "technical": None,
                                                                     "account": None})
REFUND = Noul(instructions="Does the customer ask for money back?")
SEVERITY = Score(instructions="How severe is the problem?", criteria=["minor", "major", "blocking"])
OTHERS = {"refund": REFUND, "severity": SEVERITY, "team": TEAM}
ONE_READ = GatePolicy(max_normalized_entropy=None, rereads=0)


@pytest.fixture(scope="module")
def model(smol) -> CanvasDecisionModel:
    return CanvasDecisionModel(engine=smol, policy=ONE_READ)


def urgent_yes(model: CanvasDecisionModel, questions: dict, **read) -> tuple[float, int]:
    """P(yes) of `urgent` read among `questions`, and the canvas reads the decision took."""
    resp = model.decide(TICKET, questions, read=read or None, seed=7)
    return resp.reads["urgent"].probabilities["yes"], resp.canvas_reads


def test_neighbours_and_their_order_move_no_answer_beyond_the_engines_noise(model):
    alone, _ = urgent_yes(model, {"urgent": URGENT})
    noise = max(abs(model.decide(TICKET, {"urgent": URGENT}, seed=s).reads["urgent"].probabilities["yes"] - alone)
                for s in (1, 2, 3))  # the engine's own read-to-read noise for this answer
    sets = [{"urgent": URGENT, "refund": REFUND},
            {"urgent": URGENT, **OTHERS},
            {**dict(reversed(OTHERS.items())), "urgent": URGENT}]  # added, and in another order
    moved, reads = [], []
    for questions in sets:
        p, n = urgent_yes(model, questions)
        moved.append(abs(p - alone))
        reads.append(n)
    assert max(moved) <= noise + 1e-4, (moved, noise)  # (float32 batches of other sizes differ by ~1e-6)
    assert reads == [len(q) for q in sets]  # one read per question, its prefix shared (the cost: BENCHMARKS.md)
    # the same sets on one joint canvas: the neighbours do move the answer (what isolation prevents)
    joint = [abs(urgent_yes(model, questions, isolate="none")[0] - alone) for questions in sets]
    assert max(joint) > noise + 1e-3, (joint, noise)


def test_isolated_reads_share_the_states_prefix(model):
    engine = model.engine
    before = engine.prefix_tokens_reused
    model.decide(TICKET + " (prefix)", {"urgent": URGENT, **OTHERS}, seed=3)
    assert engine.prefix_tokens_reused - before >= 3 * len(TICKET.split())  # three reads reuse the first's state
