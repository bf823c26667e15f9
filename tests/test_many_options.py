"""Up to 255 options per question: scanned one-token labels, and two reads past one read.

`ForcedWinner` keeps a real engine's tokenizer and makes every read put probability 0.9
on the label that the read's own system prompt gives to one option name (or to the group
holding it), so an answer comes back as that name only if label -> option maps right end
to end. A question with more options than one read can label (the tokenizer's one-token
labels, or 128 label ids per request) is read twice: its group, then the option in it;
its probability is the product of both reads.
"""

from __future__ import annotations

import math
import re

import pytest
from langchain_core.decisions import Choice, Score

from canvasroute.engine import FunctionEngine, LabelError, ReadResult, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy
from canvasroute.router._plan import MAX_LABEL_IDS, plan, template_text
from canvasroute.router._questions import parse_questions

P = 0.9
NO_GATE = GatePolicy(max_normalized_entropy=None, rereads=0)


class ForcedWinner:
    """A real engine's tokenizer; reads put `P` on the label of `winner` (or of its group)."""

    def __init__(self, inner, winner: str, options: list[str] | None = None) -> None:
        self.inner, self.winner = inner, winner
        self.index = {name: i for i, name in enumerate(options or [])}
        self.batches: list[int] = []

    async def info(self):
        return await self.inner.info()

    async def tokenize(self, text: str) -> list[int]:
        return await self.inner.tokenize(text)

    async def count_prompt(self, messages) -> int:
        return await self.inner.count_prompt(messages)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def label(self, system: str) -> str:
        """The label the prompt gives to the winner, or to the group listing it."""
        for label, text in re.findall(r"^(\S+): (.*)$", system, re.MULTILINE):
            if text == self.winner or text.startswith(self.winner + " ("):
                return label
            if "(one of: " in text and self.winner in text.split("(one of: ", 1)[1].rstrip(")").split(", "):
                return label
            ends = re.search(r"\(one of \d+ options, from (.+) to (.+)\)$", text)
            if ends and self.index[ends[1]] <= self.index[self.winner] <= self.index[ends[2]]:
                return label
        raise AssertionError(f"{self.winner!r} is not in the prompt")

    async def read(self, batch):
        self.batches.append(len(batch))
        out = []
        for read in batch:
            assert len(read.slots) == 1 and len(read.label_ids) <= MAX_LABEL_IDS
            ids = await self.tokenize(template_text(await self.info(), [self.label(read.messages[0]["content"])]))
            win = ids[read.slots[0]]
            assert win in read.label_ids
            rest = math.log((1 - P) / (len(read.label_ids) - 1))
            out.append(ReadResult(rows=({i: math.log(P) if i == win else rest for i in read.label_ids},)))
        return out


def many(k: int) -> Choice:
    return Choice(instructions="Which product line?", criteria={f"line {i}": None for i in range(k)})


async def check(inner, k: int, winner_index: int) -> None:
    winner = f"line {winner_index}"
    engine = ForcedWinner(inner, winner, list(many(k).criteria))
    resp = await CanvasDecisionModel(engine=engine, policy=NO_GATE).adecide("an order", {"q": many(k)})
    r = resp.reads["q"]
    assert resp.answers["q"].choice == winner == r.answer
    assert len(r.labels) == len(set(r.labels)) == k
    assert sum(r.probabilities.values()) == pytest.approx(1.0)
    if r.reads == 1:  # one read: every option had its own one-token label
        assert k <= MAX_LABEL_IDS and engine.batches == [1]
        assert r.confidence == pytest.approx(P)
    else:  # two reads: honest probability = p(group) * p(option | group)
        assert r.reads == 2 and engine.batches == [1, 1] and resp.canvas_reads == 2
        assert r.confidence == pytest.approx(P * P)
        assert resp.answers["q"].confidence == pytest.approx((P * P - 1 / k) / (1 - 1 / k))  # System One's
        group_size = sum(1 for label in r.labels if label.split("/")[0] == r.labels[0].split("/")[0])
        assert r.probabilities["line 0" if winner_index >= group_size else f"line {k - 1}"] == pytest.approx(
            (1 - P) / (len({label.split("/")[0] for label in r.labels}) - 1) / group_size, rel=0.05)
    if k > MAX_LABEL_IDS:
        assert r.reads == 2


@pytest.mark.parametrize("k, winner", [(60, 57), (128, 127), (255, 3), (255, 254)])
async def test_many_options_on_the_function_tokenizer(k, winner):
    await check(FunctionEngine(lambda read: []), k, winner)


@pytest.mark.smollm
@pytest.mark.parametrize("k, winner", [(60, 57), (128, 127), (255, 3), (255, 200)])
async def test_many_options_on_the_smollm2_tokenizer(smollm2_tokenizer_engine, k, winner):
    await check(smollm2_tokenizer_engine, k, winner)


@pytest.mark.vllm
@pytest.mark.parametrize("k, winner", [(60, 57), (128, 127), (255, 3), (255, 200)])
async def test_many_options_on_the_tiny_vllm_tokenizer(vllm_url, k, winner):
    await check(VLLMServerEngine(vllm_url), k, winner)


@pytest.mark.vllm
async def test_255_options_read_for_real_on_vllm(vllm_url):
    """No forcing: the served model reads both steps; the answer is an option, its
    probability the product of the two reads' probabilities."""
    resp = await CanvasDecisionModel(engine=VLLMServerEngine(vllm_url), policy=NO_GATE).adecide(
        "an order", {"q": many(255)})
    r = resp.reads["q"]
    assert r.answer in many(255).criteria and r.reads == 2 and resp.canvas_reads == 2
    assert 0 < r.confidence <= 1 and sum(r.probabilities.values()) == pytest.approx(1.0)


async def test_scores_route_too_and_too_few_labels_is_a_label_error():
    score = Score(instructions="How many stars?", criteria=[f"{i} stars" for i in range(200)])
    engine = ForcedWinner(FunctionEngine(lambda read: []), "137", [str(i) for i in range(200)])
    resp = await CanvasDecisionModel(engine=engine, policy=NO_GATE).adecide("a review", {"s": score})
    assert resp.reads["s"].answer == "137" and resp.reads["s"].reads == 2

    with pytest.raises(LabelError, match="one-token labels"):
        await plan(FewLabels("ABC", lambda read: []), parse_questions({"q": many(60)}))


async def test_a_tokenizer_with_few_one_token_labels_routes_in_two_reads():
    # 10 one-token labels: 60 options become 6 groups of 10, read in two steps
    engine = ForcedWinner(FewLabels("ABCDEFGHIJ", lambda read: []), "line 42", list(many(60).criteria))
    the_plan = await plan(engine, parse_questions({"q": many(60)}))
    assert [len(g) for g in the_plan.routes["q"].groups] == [10] * 6
    await check(engine.inner, 60, 42)


class FewLabels(FunctionEngine):
    """A tokenizer that keeps only some labels whole at a slot (others split in two)."""

    def __init__(self, whole: str, fn) -> None:
        super().__init__(fn)
        self.whole = set(whole)

    async def tokenize(self, text):
        split = re.sub(r"(?<=: )(\w+)(?=\n|<)", lambda m: m[1] if m[1] in self.whole else f"{m[1]} {m[1]}", text)
        return await super().tokenize(split)


@pytest.fixture(scope="module")
def smollm2_tokenizer_engine(smol):
    """SmolLM2's real tokenizer (the shared embedded engine's) behind the engine protocol."""
    from canvasroute.engine import EngineInfo

    tok = smol.tokenizer
    info = EngineInfo(model="smollm2", provider="test", canvas_width=64, max_model_len=8192,
                      vocab_size=len(tok), canvas_prefix="", end_of_turn="<|im_end|>")

    class Tokenizer(FunctionEngine):
        async def info(self):
            return info

        async def tokenize(self, text):
            return tok(text, add_special_tokens=False).input_ids

    return Tokenizer(lambda read: [])


@pytest.mark.smollm
async def test_255_options_read_for_real_on_the_embedded_engine(smol):
    """No forcing: SmolLM2 reads both steps (near-chance answers; plumbing, not accuracy)."""
    resp = await CanvasDecisionModel(engine=smol, policy=NO_GATE).adecide("an order", {"q": many(255)})
    r = resp.reads["q"]
    assert r.answer in many(255).criteria and r.reads == 2 and resp.canvas_reads == 2
    group, option = r.labels[list(many(255).criteria).index(r.answer)].split("/")
    assert group in "AB" and option  # 255 > 128 label ids: two groups
    assert 0 < r.confidence <= 1 and sum(r.probabilities.values()) == pytest.approx(1.0)
