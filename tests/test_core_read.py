"""The core read against the REAL vLLM server: one decision set, one canvas read."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from langchain_core.decisions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer

from canvasroute.engine import (
    Connection,
    EngineRequestError,
    EngineUnavailable,
    InputTooLong,
    Retries,
    VLLMServerEngine,
)
from canvasroute.router import CanvasDecisionModel, CanvasResponse, GatePolicy

pytestmark = pytest.mark.vllm

QUESTIONS = {
    "urgent": Noul(instructions="Does the customer need an answer today?",
                   criteria={"true": "service is down or money is lost", "false": "it can wait"}),
    "team": Choice(instructions="Which team owns this ticket?",
                   criteria={"billing": "charges, refunds, invoices", "technical": "bugs, errors, outages",
                             "sales": "pricing, plans", "legal": "contracts, privacy", "other": None}),
    "severity": Score(instructions="How severe is the problem?",
                      criteria=["cosmetic", "annoying", "blocking one user", "blocking everyone"]),
}
TICKET = "I was charged twice for my subscription this month and support has not replied."


class Recording(httpx.AsyncBaseTransport):
    """Forwards to the real network transport and keeps every request it sends."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return await self.inner.handle_async_request(request)

    def reads(self) -> list[dict]:
        """The structured reads sent (a seed canvas and label ids: no discovery probe, no thought block)."""
        return [json.loads(r.content) for r in self.requests
                if r.url.path in ("/v1/chat/completions", "/v1/completions") and
                "logprob_token_ids" in json.loads(r.content) and
                len(json.loads(r.content).get("vllm_xargs", {}).get("diffusion_seed_canvas", ())) > 1]


@pytest.fixture
def recorded(vllm_url):
    transport = Recording()
    return VLLMServerEngine(Connection(vllm_url, transport=transport)), transport


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_one_invoke_is_one_read_on_the_served_canvas(vllm_url, endpoint):
    transport = Recording()
    engine = VLLMServerEngine(Connection(vllm_url, transport=transport), endpoint=endpoint)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    info = await engine.info()
    before = engine.requests_sent

    resp = await model.ainvoke({"state": TICKET, "questions": QUESTIONS})

    assert isinstance(resp, CanvasResponse)
    assert engine.requests_sent - before == 1
    bodies = transport.reads()
    assert len(bodies) == 1
    body = bodies[0]
    canvas = body["vllm_xargs"]["diffusion_seed_canvas"]
    assert body["vllm_xargs"]["diffusion_max_steps"] == 1 and body["vllm_xargs"]["diffusion_read_only"] == 1
    assert body["vllm_xargs"]["diffusion_constrained"] == 1  # the default: nothing here gates on label mass
    assert body["return_tokens_as_token_ids"] is True
    # every non-slot position holds the template, padded; slots hold non-label noise
    plan = next(iter(model._memo.planner.plans.values()))
    (chunk,) = plan.chunks
    slots = {s.position: s for s in chunk.slots}
    # the canvas: template + 1 rounded up to 16, within the served width (narrower is cheaper)
    assert len(canvas) == body["max_tokens"] == min(info.canvas_width, -(-(len(chunk.template) + 1) // 16) * 16)
    if len(canvas) < info.canvas_width:
        assert body["vllm_xargs"]["diffusion_canvas_length"] == len(canvas)
    template = list(chunk.template) + [info.pad_id] * (len(canvas) - len(chunk.template))
    for pos, token in enumerate(canvas):
        if pos in slots:
            assert token not in slots[pos].label_ids
        else:
            assert token == template[pos], pos
    assert body["logprob_token_ids"] == sorted({i for s in chunk.slots for i in s.label_ids})
    # answers are langchain-core types whose probabilities sum to 1
    assert isinstance(resp.answers["urgent"], NoulAnswer)
    assert isinstance(resp.answers["team"], ChoiceAnswer)
    assert isinstance(resp.answers["severity"], ScoreAnswer)
    assert set(resp.answers["team"].probabilities) == set(QUESTIONS["team"].criteria)
    assert math.isclose(sum(resp.answers["team"].probabilities.values()), 1.0, abs_tol=1e-9)
    assert math.isclose(sum(resp.answers["severity"].probabilities.values()), 1.0, abs_tol=1e-9)
    assert resp.answers["severity"].legend == dict(enumerate(QUESTIONS["severity"].criteria))
    for qid, report in resp.reads.items():
        assert report.path == ("canvas" if report.confident else "unsure") and report.reads == 1
        k = len(report.labels)
        assert 0 <= report.entropy <= math.log(k) + 1e-9
        assert math.isclose(report.normalized_entropy, report.entropy / math.log(k))
        assert report.label_mass is None and report.argmax_is_label is None and 0 <= report.margin <= 1
        assert math.isclose(report.confidence, max(report.canvas_probabilities.values()))
        assert report.slot in slots and slots[report.slot].question_id == qid
        assert report.read_entropies == [pytest.approx(report.entropy)]
    assert resp.usage["output_tokens"] == len(canvas) and resp.usage["input_tokens"] > 0
    await engine.aclose()


async def test_identical_requests_read_identically_and_seed_moves_noise(recorded):
    engine, transport = recorded
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    a = await model.ainvoke({"state": TICKET, "questions": QUESTIONS})
    b = await model.ainvoke({"state": TICKET, "questions": QUESTIONS})
    c = await model.ainvoke({"state": TICKET, "questions": QUESTIONS, "seed": 12345})
    bodies = transport.reads()
    assert bodies[0]["vllm_xargs"] == bodies[1]["vllm_xargs"]
    assert bodies[2]["vllm_xargs"]["diffusion_seed_canvas"] != bodies[0]["vllm_xargs"]["diffusion_seed_canvas"]
    assert a.reads == {k: v.model_copy(update={"latency_s": a.reads[k].latency_s}) for k, v in b.reads.items()}
    assert c.reads["team"].canvas_probabilities != a.reads["team"].canvas_probabilities


def test_sync_invoke_and_batch(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    one = model.invoke({"state": TICKET, "questions": {"urgent": QUESTIONS["urgent"]}})
    many = model.batch([{"state": f"ticket {i}", "questions": QUESTIONS} for i in range(3)])
    assert 0.0 <= one.answers["urgent"].noul <= 1.0
    assert [len(r.answers) for r in many] == [3, 3, 3]
    assert model.model == "tiny-dgemma" or model.model  # the served model name replaces the default


async def test_slot_resolution_falls_back_on_the_real_tokenizer(vllm_url):
    """The tiny BPE splits ' yes' in two: the Noul must move to another alphabet."""
    engine = VLLMServerEngine(vllm_url)
    assert len(await engine.tokenize(" yes")) > 1  # the premise of this test
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    resp = await model.ainvoke({"state": TICKET, "questions": {"urgent": QUESTIONS["urgent"]}})
    assert resp.reads["urgent"].labels != ["yes", "no"]
    assert set(resp.reads["urgent"].canvas_probabilities) == {"yes", "no"}


async def test_constrained_reads_are_the_default_and_read_the_same_distribution(vllm_url):
    """A constrained read normalizes over the request's label ids: the same distribution
    over each question's labels as a full-vocabulary read of the same canvas (the softmax
    normalizer cancels), but no label mass. Reads are constrained unless the policy gates
    on label mass or the model says `constrained=False`."""
    engine = VLLMServerEngine(vllm_url)
    default = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0))
    full = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0), read={"constrained": False})
    massed = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0, min_label_mass=0.0))
    a, b, c = [await m.adecide(TICKET, QUESTIONS, seed=4) for m in (default, full, massed)]
    for qid in QUESTIONS:
        assert a.reads[qid].canvas_probabilities == pytest.approx(b.reads[qid].canvas_probabilities, abs=1e-5)
        assert a.reads[qid].label_mass is None and a.reads[qid].argmax_is_label is None
        assert 0 < b.reads[qid].label_mass < 1 and isinstance(b.reads[qid].argmax_is_label, bool)
        assert c.reads[qid].label_mass == pytest.approx(b.reads[qid].label_mass)
    assert a.diagnostics.constrained and not b.diagnostics.constrained and not c.diagnostics.constrained
    await engine.aclose()


async def test_too_long_state_is_refused_before_any_read(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    model = CanvasDecisionModel(engine=engine)
    await engine.info()
    before = engine.requests_sent
    with pytest.raises(InputTooLong, match="context"):
        await model.ainvoke({"state": "word " * 3000, "questions": QUESTIONS})
    assert engine.requests_sent == before


async def test_server_400_is_a_value_error_with_the_servers_message(vllm_url):
    engine = VLLMServerEngine(vllm_url, model="no-such-model")
    with pytest.raises(EngineRequestError, match="no-such-model") as info:
        await engine.info()
    assert isinstance(info.value, ValueError) and not info.value.retryable


async def test_unreachable_server_is_a_retryable_connection_error():
    engine = VLLMServerEngine(Connection("http://127.0.0.1:9", retries=Retries(max_retries=2, backoff=0.01)))
    with pytest.raises(EngineUnavailable) as info:
        await engine.info()
    assert isinstance(info.value, ConnectionError) and info.value.retryable
