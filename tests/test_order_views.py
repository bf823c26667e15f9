"""Order-bias views (`GatePolicy.order_views`): the same Choice listed again in shifted
label order, as extra slots of the same canvas, its aligned distributions averaged.

Every expected figure below is worked out by hand from the rows the engine returns.
"""

from __future__ import annotations

import pytest
from langchain_core.decisions import Choice, Noul
from promptrows import PromptRows, blocks, pick

from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy
from canvasroute.router._questions import parse_questions, rotated, unrotate, view_shifts

THREE = Choice(instructions="Which team owns this?", criteria={"billing": None, "tech": None, "sales": None})
FOUR = Choice(instructions="Which team owns this?",
              criteria={"billing": None, "tech": None, "sales": None, "legal": None})
OFF = GatePolicy(max_normalized_entropy=None, rereads=0)


def first_label(p: float = 0.7):
    """A position-biased engine: label A gets `p` whatever option it names."""
    return PromptRows(pick(0, p))


async def test_an_engine_that_always_prefers_label_a_reads_flat_with_every_shift():
    rows = first_label()
    model = CanvasDecisionModel(engine=rows.engine, policy=OFF.with_overrides(order_views=2))
    resp = await model.adecide("x", {"team": THREE})
    assert rows.engine.calls == 1 and resp.canvas_reads == 1 and len(rows.engine.reads[0].slots) == 3
    listed = [b.texts for b in blocks(rows.systems[0])]
    assert listed == [("billing", "tech", "sales"), ("tech", "sales", "billing"), ("sales", "billing", "tech")]
    # option j is under label A in exactly one listing: (0.7 + 0.15 + 0.15) / 3 for each
    assert resp.reads["team"].canvas_probabilities == pytest.approx({"billing": 1 / 3, "tech": 1 / 3, "sales": 1 / 3})
    assert resp.reads["team"].normalized_entropy == pytest.approx(1.0)


async def test_without_views_the_same_engine_reads_its_bias():
    rows = first_label()
    resp = await CanvasDecisionModel(engine=rows.engine, policy=OFF).adecide("x", {"team": THREE})
    assert resp.reads["team"].canvas_probabilities == pytest.approx({"billing": 0.7, "tech": 0.15, "sales": 0.15})
    assert len(rows.engine.reads[0].slots) == 1


async def test_two_views_of_four_options_leave_the_unshifted_option_low():
    """Shifts 1 and 2 of 4: label A names billing, tech and sales once each, legal never."""
    rows = first_label(0.7)
    model = CanvasDecisionModel(engine=rows.engine, policy=OFF.with_overrides(order_views=2))
    probs = (await model.adecide("x", {"team": FOUR})).reads["team"].canvas_probabilities
    assert probs == pytest.approx({"billing": 0.3, "tech": 0.3, "sales": 0.3, "legal": 0.1})


async def test_an_engine_that_reads_the_content_keeps_its_answer_under_views():
    """Alignment, not flattening: a preference for the option named `tech` survives the shifts."""
    rows = PromptRows(pick("tech", 0.8))
    model = CanvasDecisionModel(engine=rows.engine, policy=OFF.with_overrides(order_views=2))
    report = (await model.adecide("x", {"team": THREE})).reads["team"]
    assert report.answer == "tech"
    assert report.canvas_probabilities == pytest.approx({"billing": 0.1, "tech": 0.8, "sales": 0.1})


async def test_views_apply_to_choices_only_and_per_question():
    rows = PromptRows(pick(0, 0.6))
    policy = OFF.with_overrides(per_question={"team": OFF.with_overrides(order_views=1)})
    resp = await CanvasDecisionModel(engine=rows.engine, policy=policy).adecide(
        "x", {"team": THREE, "urgent": Noul(instructions="Urgent?"), "owner": THREE})
    assert [b.instructions for b in blocks(rows.systems[0])] == [
        "Which team owns this?", "Which team owns this? (the same question again, options in another order)",
        "Urgent?", "Which team owns this?"]
    assert resp.reads["owner"].canvas_probabilities["billing"] == pytest.approx(0.6)  # no views
    # one view of 3 at shift 1: billing (0.6 + 0.2) / 2, tech (0.2 + 0.6) / 2, sales (0.2 + 0.2) / 2
    assert resp.reads["team"].canvas_probabilities == pytest.approx({"billing": 0.4, "tech": 0.4, "sales": 0.2})


async def test_rereads_average_view_folded_reads():
    rows = first_label(0.9)
    policy = GatePolicy(max_normalized_entropy=0.5, rereads=2, order_views=1)
    resp = await CanvasDecisionModel(engine=rows.engine, policy=policy, outcomes=OutcomePolicy(
        engine_fault="fallback", fallback={"team": "billing"})).adecide("x", {"team": Choice(
                                         instructions="Team?", criteria={"billing": None, "tech": None})})
    report = resp.reads["team"]
    assert report.reads == 3 and resp.canvas_reads == 3
    assert report.canvas_probabilities == pytest.approx({"billing": 0.5, "tech": 0.5})


def test_rotation_and_unrotation_are_inverse():
    spec = parse_questions({"team": FOUR})["team"]
    for shift in range(1, 4):
        view = rotated(spec, shift)
        assert view.options == spec.options[shift:] + spec.options[:shift]
        one_hot = tuple(float(i == 0) for i in range(4))  # the view's label A
        assert unrotate(one_hot, shift)[shift] == 1.0  # ... names option `shift`
    assert view_shifts(2, 2) == (1,) and view_shifts(3, 2) == (1, 2) and view_shifts(26, 1) == (13,)
    with pytest.raises(ValueError, match="order_views"):
        GatePolicy(order_views=3)
