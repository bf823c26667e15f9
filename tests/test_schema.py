"""Labels, prompts, templates, slots and chunking — with two real tokenizers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from langchain_core.decisions import Box, Choice, Noul, Score

from canvasroute.engine import DecisionError, EngineInfo, FunctionEngine, InputTooLong, LabelError, UnsupportedQuestion
from canvasroute.router import CanvasDecisionModel, GatePolicy
from canvasroute.router._plan import canvas_width, plan, template_text
from canvasroute.router._questions import MAX_OPTIONS, parse_questions

TRIAGE = {
    "urgent": Noul(instructions="Urgent?"),
    "team": Choice(instructions="Which team?", criteria={"billing": "money", "tech": None, "sales": None,
                                                           "legal": None, "other": None}),
    "severity": Score(instructions="How bad?", criteria=["low", "medium", "high", "critical"]),
}


class TokenizerEngine:
    """Only the tokenizer half of an engine, around a real Hugging Face tokenizer."""

    def __init__(self, tokenizer, info: EngineInfo) -> None:
        self.tokenizer, self._info = tokenizer, info

    async def info(self) -> EngineInfo:
        return self._info

    async def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def count_prompt(self, messages) -> int:
        return len(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))

    async def read(self, batch):
        raise AssertionError("tokenizer-only engine cannot read")

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def tiny_bpe(tiny_dgemma_dir: Path) -> TokenizerEngine:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dgemma_dir)
    return TokenizerEngine(tok, EngineInfo(model="tiny", provider="test", canvas_width=32,
                                           max_model_len=1024, vocab_size=len(tok)))


@pytest.fixture(scope="module")
def smollm2_bpe(smol) -> TokenizerEngine:
    """SmolLM2's tokenizer, the shared embedded engine's (parsing the GGUF file again costs ~15 s)."""
    tok = smol.tokenizer
    return TokenizerEngine(tok, EngineInfo(model="smollm2", provider="test", canvas_width=64, max_model_len=2048,
                                           vocab_size=len(tok), canvas_prefix="", end_of_turn="<|im_end|>"))


async def _check_plan(engine: TokenizerEngine) -> None:
    """Each slot's label ids are exactly what the tokenizer produces at that position."""
    info = await engine.info()
    the_plan = await plan(engine, parse_questions(TRIAGE))
    (chunk,) = the_plan.chunks
    assert chunk.width % 16 == 0 or chunk.width == info.canvas_width
    assert len(chunk.template) < chunk.width <= info.canvas_width
    for slot in chunk.slots:
        for j, label in enumerate(slot.labels):
            labels = [s.labels[0] if s is not slot else label for s in chunk.slots]
            ids = await engine.tokenize(template_text(info, labels))
            assert len(ids) == len(chunk.template)
            assert ids[slot.position] == slot.label_ids[j]
            changed = [i for i, (a, b) in enumerate(zip(ids, chunk.template)) if a != b]
            assert changed == ([] if j == 0 else [slot.position])


async def test_tiny_bpe_needs_another_noul_alphabet(tiny_bpe):
    the_plan = await plan(tiny_bpe, parse_questions(TRIAGE))
    labels = {s.question_id: s.labels for s in the_plan.chunks[0].slots}
    assert len(await tiny_bpe.tokenize(" yes")) > 1
    assert labels["urgent"] != ("yes", "no")
    await _check_plan(tiny_bpe)


@pytest.mark.smollm
async def test_smollm2_keeps_yes_no_and_letters(smollm2_bpe):
    the_plan = await plan(smollm2_bpe, parse_questions(TRIAGE))
    labels = {s.question_id: s.labels for s in the_plan.chunks[0].slots}
    assert labels["urgent"] == ("yes", "no")
    assert labels["team"] == ("A", "B", "C", "D", "E")
    await _check_plan(smollm2_bpe)


@pytest.mark.smollm
async def test_the_two_tokenizers_split_labels_differently(tiny_bpe, smollm2_bpe):
    tiny = await plan(tiny_bpe, parse_questions(TRIAGE))
    smol = await plan(smollm2_bpe, parse_questions(TRIAGE))
    assert [s.labels for s in tiny.chunks[0].slots] != [s.labels for s in smol.chunks[0].slots]


def test_label_alphabets():
    specs = parse_questions({
        "n": Noul(instructions="?"),
        "c30": Choice(instructions="?", criteria={f"opt{i}": None for i in range(30)}),
        "s": Score(instructions="?", criteria=["a", "b", "c"]),
    })
    assert specs["n"].alphabets[0] == ("yes", "no")
    assert specs["c30"].alphabets[0][:3] == ("A", "B", "C") and specs["c30"].alphabets[0][26] == "a"
    assert specs["s"].alphabets[0] == ("1", "2", "3") and ("0", "1", "2") in specs["s"].alphabets
    assert specs["s"].options == ("0", "1", "2")


@pytest.mark.parametrize("questions, error, match", [
    ({}, DecisionError, "non-empty"),
    ({"x": Box(instructions="find the cat")}, UnsupportedQuestion, "Box"),
    ({"x": {"type": "box", "instructions": "find"}}, UnsupportedQuestion, "Box"),
    ({"x": {"type": "poll", "instructions": "?"}}, UnsupportedQuestion, "not a Noul"),
    ({"x": Choice(instructions="?", criteria={f"o{i}": None for i in range(MAX_OPTIONS + 1)})}, LabelError,
     "at most 255"),
    ({"": Noul(instructions="?")}, UnsupportedQuestion, "non-empty strings"),
])
def test_bad_questions_are_refused_clearly(questions, error, match):
    with pytest.raises(error, match=match):
        parse_questions(questions)


def test_any_distinct_option_names_are_options():
    """As on vLLM's gateway: an empty name and names differing only in case or space are options."""
    specs = parse_questions({"x": Choice(instructions="?", criteria={"": None, "Billing": None, " billing": None})})
    assert specs["x"].options == ("", "Billing", " billing")


def test_plain_dict_questions_validate():
    specs = parse_questions({"t": {"type": "choice", "instructions": "?", "criteria": {"a": None, "b": None}}})
    assert specs["t"].options == ("a", "b")


def test_canvas_width_rounding():
    assert canvas_width(15, 64) == 16 and canvas_width(16, 64) == 32 and canvas_width(40, 32) == 32


async def test_questions_that_do_not_fit_split_into_chunks_read_together():
    engine = FunctionEngine(lambda read: [dict.fromkeys(read.label_ids, math.log(1 / len(read.label_ids)))]
                            * len(read.slots), canvas_width=32)
    questions = {f"q{i}": Noul(instructions=f"question {i}?") for i in range(12)}
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    resp = await model.ainvoke({"state": "x", "questions": questions})
    the_plan = next(iter(model._memo.planner.plans.values()))
    assert len(the_plan.chunks) > 1
    assert engine.calls == 1 and len(engine.reads) == len(the_plan.chunks)  # one engine call for all chunks
    assert resp.canvas_reads == len(the_plan.chunks)
    assert set(resp.answers) == set(questions)
    for chunk, read in zip(the_plan.chunks, engine.reads):
        assert len(read.canvas) == chunk.width <= 32
        # each chunk's prompt lists only its own questions
        assert read.messages[0]["content"].count("Question q") == len(chunk.slots)


async def test_a_question_too_big_for_any_canvas():
    engine = FunctionEngine(lambda read: [], canvas_width=8)
    with pytest.raises(InputTooLong, match="does not fit"):
        await plan(engine, parse_questions({"x": Noul(instructions="?")}))
