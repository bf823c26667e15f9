"""Trust in what an engine returns and what it is sent (issue #11, engine items).

- A row without every requested label id is an `EngineResponseError`, never an answer.
- The thought block opens the canvas only when the generation prompt lacks it.
- A server that refuses narrow canvases gets the full width, and is remembered.
- Every special token of the engine's own tokenizer, in state or question text, leaves
  the prompt's turn structure and every slot position unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import httpx
import pytest
from deadlines import patience
from langchain_core.decisions import Choice, Noul

from canvasroute.engine import (
    THOUGHT_SCAFFOLD,
    CanvasRead,
    Connection,
    EngineResponseError,
    FunctionEngine,
    Retries,
    VLLMServerEngine,
    check_rows,
    defuse,
)
from canvasroute.engine.testing import LoopbackVLLM
from canvasroute.router import CanvasDecisionModel, GatePolicy, OutcomePolicy
from canvasroute.router._read import slot_stats

QUESTIONS = {
    "team": Choice(instructions="Which team owns this ticket?", criteria={"billing": "charges", "tech": None}),
    "urgent": Noul(instructions="Does it need an answer today?"),
}


def loopback_engine(**server: object) -> tuple[VLLMServerEngine, LoopbackVLLM]:
    fake = LoopbackVLLM(**server)
    return VLLMServerEngine(Connection("http://vllm.test", retries=Retries(backoff=0.001),
                                       transport=fake.transport())), fake


# -- 1. rows must hold every requested label id --------------------------------------------


async def test_a_server_returning_only_its_argmax_is_a_response_error_not_an_answer():
    engine, fake = loopback_engine(answer="argmax")
    model = CanvasDecisionModel(engine=engine,
                                policy=GatePolicy(rereads=0),
                                outcomes=OutcomePolicy(engine_fault="raise"))
    with pytest.raises(EngineResponseError, match="lacks requested label ids"):
        await model.adecide("I was charged twice.", QUESTIONS)
    assert fake.reads == 1  # read once, not retried: a malformed row cannot pass by itself
    fallback = CanvasDecisionModel(engine=engine,
                                   policy=GatePolicy(rereads=0),
                                   outcomes=OutcomePolicy(engine_fault="fallback",
                                                          fallback={"team": "tech", "urgent": "yes"}))
    resp = await fallback.adecide("I was charged twice.", QUESTIONS)
    assert {r.path for r in resp.reads.values()} == {"fallback"}  # never "canvas"
    assert all(r.error.startswith("EngineResponseError") for r in resp.reads.values())


async def test_the_same_server_with_label_rows_answers():
    engine, _ = loopback_engine(answer="ranked")
    resp = await CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)).adecide("hi", QUESTIONS)
    assert {r.path for r in resp.reads.values()} == {"canvas"}


async def test_function_engine_rows_without_a_slots_label_fail_expensive():
    engine = FunctionEngine(lambda read: [{engine.token_id(t): -0.01 for t in ("A", "yes", "no")}] * len(read.slots))
    with pytest.raises(EngineResponseError, match="lacks label id"):  # team's "B" is missing
        await CanvasDecisionModel(engine=engine, outcomes=OutcomePolicy(engine_fault="raise")).adecide("hi", QUESTIONS)
    resp = await CanvasDecisionModel(
        engine=engine, outcomes=OutcomePolicy(engine_fault="fallback", fallback={"team": "tech", "urgent": "yes"}),
    ).adecide("hi", QUESTIONS)
    assert (resp.reads["team"].path, resp.reads["team"].answer) == ("fallback", "tech")
    assert resp.reads["team"].error.startswith("EngineResponseError")


def test_check_rows_holds_rows_to_the_wire_contract():
    read = CanvasRead(messages=({"role": "user", "content": "x"},), canvas=(1, 2, 3, 4), slots=(1, 2),
                      label_ids=(7, 8))
    with pytest.raises(EngineResponseError, match=r"position 1 lacks requested label ids \[8\]"):
        check_rows(read, [{7: -0.01}, {7: -0.01, 8: -3.0}])
    with pytest.raises(EngineResponseError, match="1 slot rows for 2 slots"):
        check_rows(read, [{7: -0.01, 8: -3.0}])
    check_rows(read, [{7: -0.01, 8: -5.0, 99: -0.5}] * 2)


def test_slot_stats_refuses_a_row_without_a_label_instead_of_filling_it_in():
    with pytest.raises(EngineResponseError, match="lacks label id 9"):
        slot_stats({8: -0.02}, [8, 9])
    stats = slot_stats({8: -0.02, 9: -math.inf}, [8, 9])
    assert stats.probs == (1.0, 0.0)


# -- 7. the thought scaffold is detected, not assumed ---------------------------------------


@pytest.mark.parametrize("thinking", [False, True])
async def test_the_scaffold_is_seeded_only_when_the_generation_prompt_lacks_it(thinking):
    fake = LoopbackVLLM()
    engine = VLLMServerEngine(Connection("http://vllm.test", transport=fake.transport()), enable_thinking=thinking)
    info = await engine.info()
    assert info.canvas_prefix == (THOUGHT_SCAFFOLD if thinking else "")
    await CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)).adecide("hi", QUESTIONS)
    [body] = list(fake.bodies)
    assert body["chat_template_kwargs"] == {"enable_thinking": thinking}
    prompt = await _server_prompt(engine, fake, body["messages"], thinking)
    scaffold = await engine.tokenize(THOUGHT_SCAFFOLD)
    canvas = body["vllm_xargs"]["diffusion_seed_canvas"]
    assert _count(prompt + canvas, scaffold) == 1  # exactly one thought block before the answer
    eot = (await engine.tokenize(info.end_of_turn))[0]
    answer_end = canvas.index(eot)
    newline = (await engine.tokenize("\n"))[0]
    assert canvas[answer_end - 1] != newline  # the last answer line sits right before the end of turn


async def _server_prompt(engine: VLLMServerEngine, fake: LoopbackVLLM, messages: list, thinking: bool) -> list[int]:
    async with httpx.AsyncClient(transport=fake.transport()) as client:
        resp = await client.post("http://vllm.test/tokenize", json={
            "model": fake.model, "messages": messages, "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": thinking}})
    return resp.json()["tokens"]


def _count(seq: Sequence[int], sub: Sequence[int]) -> int:
    n = len(sub)
    return sum(list(seq[i:i + n]) == list(sub) for i in range(len(seq) - n + 1))


@pytest.mark.vllm
@pytest.mark.parametrize("thinking", [False, True])
async def test_the_real_server_gets_exactly_one_thought_block(vllm_url, thinking):
    bodies: list[dict] = []

    class Recording(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/chat/completions":
                bodies.append(__import__("json").loads(request.content))
            return await super().handle_async_request(request)

    engine = VLLMServerEngine(Connection(vllm_url, timeout=patience(120), transport=Recording()),
                              enable_thinking=thinking)
    info = await engine.info()
    assert info.canvas_prefix == (THOUGHT_SCAFFOLD if thinking else "")
    resp = await CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)).adecide("hi", QUESTIONS)
    assert {r.path for r in resp.reads.values()} <= {"canvas", "unsure"}  # one read each, no escalation
    [body] = bodies
    async with httpx.AsyncClient() as client:
        prompt = (await client.post(f"{vllm_url}/tokenize", json={
            "model": info.model, "messages": body["messages"], "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": thinking}})).json()["tokens"]
    scaffold = await engine.tokenize(THOUGHT_SCAFFOLD)
    assert _count(prompt + body["vllm_xargs"]["diffusion_seed_canvas"], scaffold) == 1
    await engine.aclose()


# -- 8. narrow canvases a server refuses ---------------------------------------------------------


async def test_a_server_refusing_narrow_canvases_gets_the_full_width_once_and_for_all():
    engine, fake = loopback_engine(narrow=False, canvas_width=64)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    first = await model.adecide("first", QUESTIONS)
    second = await model.adecide("second", QUESTIONS)
    narrow, full, again = list(fake.bodies)
    assert narrow["vllm_xargs"]["diffusion_canvas_length"] < 64  # tried narrow, refused with a 400
    for body in (full, again):
        assert len(body["vllm_xargs"]["diffusion_seed_canvas"]) == body["max_tokens"] == 64
        assert "diffusion_canvas_length" not in body["vllm_xargs"]
    assert full["vllm_xargs"]["diffusion_seed_canvas"][:len(narrow["vllm_xargs"]["diffusion_seed_canvas"])] \
        == narrow["vllm_xargs"]["diffusion_seed_canvas"]  # same canvas, padded
    assert engine.narrow_canvases is False and engine.requests_sent == 3
    assert {r.path for resp in (first, second) for r in resp.reads.values()} == {"canvas"}


async def test_a_server_accepting_narrow_canvases_keeps_them():
    engine, fake = loopback_engine(canvas_width=64)
    await CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0)).adecide("x", QUESTIONS)
    [body] = list(fake.bodies)
    assert body["vllm_xargs"]["diffusion_canvas_length"] < 64 and engine.narrow_canvases


# -- 9. special tokens of the engine's own tokenizer --------------------------------------------


def test_defuse_breaks_every_listed_special_and_nothing_else():
    specials = ["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<turn|>"]
    text = "a<|im_end|>b<start_of_turn>c<turn|><turn|>d <not_special>"
    out = defuse(text, specials)
    assert not any(s in out for s in specials)
    assert out.replace("\u200b", "") == text and "<not_special>" in out
    assert defuse("<<|im_end|>|im_end|>", specials).count("<|im_end|>") == 0  # no break forms a new one


class Recorder:
    """Delegates to an engine and keeps every canvas read."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reads: list[CanvasRead] = []

    async def info(self):
        return await self.engine.info()

    async def tokenize(self, text):
        return await self.engine.tokenize(text)

    async def count_prompt(self, messages):
        return await self.engine.count_prompt(messages)

    async def read(self, batch):
        self.reads.extend(batch)
        return await self.engine.read(batch)

    async def aclose(self):
        await self.engine.aclose()


def hostile_questions(tok: str) -> dict:
    return {"team": Choice(instructions=f"Which team {tok} owns this?", criteria={"billing": f"charges {tok}",
                                                                                      "tech": None}),
            "urgent": Noul(instructions=f"Today{tok}?")}


async def assert_specials_are_inert(engine, prompt_ids) -> int:
    """For each special token of `engine`: in the state and in every question text, the
    prompt's special ids (its turn structure) and the canvas slots equal a plain decision's."""
    info = await engine.info()
    ids = {tok: await engine.tokenize(tok) for tok in info.special_tokens}
    special_ids = {i[0] for i in ids.values() if len(i) == 1}
    assert special_ids, "the engine reports no special token that tokenizes to one id"
    rec = Recorder(engine)
    model = CanvasDecisionModel(engine=rec, policy=GatePolicy(rereads=0))
    await model.adecide("plain ticket", hostile_questions("x"))
    base = rec.reads[-1]
    base_structure = [t for t in await prompt_ids(base.messages) if t in special_ids]
    checked = 0
    for tok, tok_ids in ids.items():
        if len(tok_ids) != 1:
            continue
        await model.adecide(f"ticket {tok} with{tok}tokens", hostile_questions(tok))
        read = rec.reads[-1]
        assert [t for t in await prompt_ids(read.messages) if t in special_ids] == base_structure, tok
        assert read.slots == base.slots and read.label_ids == base.label_ids, tok
        assert [c for p, c in enumerate(read.canvas) if p not in read.slots] == \
            [c for p, c in enumerate(base.canvas) if p not in base.slots], tok
        checked += 1
    return checked


async def test_function_engine_specials_in_state_and_questions_are_inert():
    engine = FunctionEngine(lambda read: [dict.fromkeys(read.label_ids, -1.0)] * len(read.slots))

    async def prompt_ids(messages):
        return [t for m in messages for t in await engine.tokenize(m["content"])]

    assert await assert_specials_are_inert(engine, prompt_ids) == len((await engine.info()).special_tokens)


async def test_loopback_server_specials_are_discovered_and_inert():
    engine, fake = loopback_engine()
    info = await engine.info()
    assert {"<|turn>", "<turn|>", "<|channel>", "<channel|>", "<bos>", "<|think|>"} <= set(info.special_tokens)
    assert "<start_of_turn>" not in info.special_tokens and "<|im_end|>" not in info.special_tokens

    async def prompt_ids(messages):
        return await _server_prompt(engine, fake, list(messages), False)

    assert await assert_specials_are_inert(engine, prompt_ids) >= 6


@pytest.mark.vllm
async def test_real_server_specials_are_discovered_and_inert(vllm_url):
    engine = VLLMServerEngine(Connection(vllm_url, timeout=patience(120)))
    info = await engine.info()
    assert {"<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<pad>"} <= set(info.special_tokens)

    async def prompt_ids(messages):
        async with httpx.AsyncClient() as client:
            resp = await client.post(f"{vllm_url}/tokenize", json={
                "model": info.model, "messages": list(messages), "add_generation_prompt": True,
                "chat_template_kwargs": {"enable_thinking": False}})
        return resp.json()["tokens"]

    assert await assert_specials_are_inert(engine, prompt_ids) == len(info.special_tokens)
    await engine.aclose()


@pytest.mark.slow
@pytest.mark.smollm
async def test_embedded_smollm_added_tokens_are_inert(smol):
    info = await smol.info()
    added = {str(t.content) for t in smol.tokenizer.added_tokens_decoder.values()}
    assert added <= set(info.special_tokens) and len(added) >= 17

    async def prompt_ids(messages):
        return list(smol.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    assert await assert_specials_are_inert(smol, prompt_ids) >= 17
