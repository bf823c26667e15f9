"""`VLLMServerEngine` unit tests over `httpx.MockTransport`: discovery, request bodies,
row parsing, retries, replicas, bounded concurrency and every error type."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
import pytest
from deadlines import bounded

from canvasroute.engine import (
    CanvasRead,
    Connection,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    Limits,
    Retries,
    Timeout,
    VLLMServerEngine,
    run_sync,
)
from canvasroute.engine.testing import LoopbackVLLM, read_response, tokenize

MODEL = "fake-dgemma"
VOCAB = 1024
WIDTH = 32
READS = ("/v1/chat/completions", "/v1/completions")


def _json(status: int, obj: object) -> httpx.Response:
    return httpx.Response(status, json=obj)


class FakeVLLM:
    """The loopback vLLM fake (`engine.testing.LoopbackVLLM`) as a MockTransport handler.

    `read` may replace its answers to structured reads; every request is kept in `requests`.
    """

    def __init__(self, read: Callable[[httpx.Request, dict], httpx.Response] | None = None, **server: object) -> None:
        self.requests: list[httpx.Request] = []
        self.read = read
        self.server = LoopbackVLLM(model=MODEL, canvas_width=WIDTH, vocab_size=VOCAB, max_model_len=1024, **server)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.read is not None and request.url.path in READS:
            body = json.loads(request.content)
            if len(body.get("vllm_xargs", {}).get("diffusion_seed_canvas") or ()) > 1:
                return self.read(request, body)
        _, (status, content) = self.server.reply(request.method, request.url.path, request.content)
        return httpx.Response(status, content=content)

    @staticmethod
    def ranked(request: httpx.Request, body: dict) -> httpx.Response:
        width = len(body["vllm_xargs"]["diffusion_seed_canvas"])
        chat = request.url.path == "/v1/chat/completions"
        return httpx.Response(200, content=read_response(chat, MODEL, width, body["logprob_token_ids"]))

    def paths(self) -> Counter[str]:
        return Counter(r.url.path for r in self.requests)

    def read_bodies(self) -> list[dict]:
        """Bodies of the structured reads (discovery probes carry a seed of 0 or 1 ids)."""
        bodies = [json.loads(r.content) for r in self.requests if r.url.path in READS]
        return [b for b in bodies if len(b["vllm_xargs"].get("diffusion_seed_canvas", [])) > 1]


def engine_for(handler: Callable[[httpx.Request], object], *, url: str | list[str] = "http://vllm.test",
               retries: int = 3, cooldown: float = 5.0, api_key: str | None = None, timeout: float | Timeout = 30.0,
               limits: Limits | None = None, **engine) -> VLLMServerEngine:
    connection = Connection(url, api_key=api_key, timeout=timeout, limits=limits or Limits(),
                            retries=Retries(max_retries=retries, backoff=0.001, replica_cooldown=cooldown),
                            transport=httpx.MockTransport(handler))
    return VLLMServerEngine(connection, **engine)


def canvas_read(width: int = WIDTH, slots: tuple[int, ...] = (3, 7), labels: tuple[int, ...] = (300, 301, 302),
                constrained: bool = False) -> CanvasRead:
    return CanvasRead(messages=({"role": "system", "content": "Question q1: ?"}, {"role": "user", "content": "hi"}),
                      canvas=tuple(range(10, 10 + width)), slots=slots, label_ids=labels, constrained=constrained)


async def test_info_discovers_model_vocab_and_canvas_without_counting_reads():
    fake = FakeVLLM()
    engine = engine_for(fake)
    info = await engine.info()
    assert (info.model, info.vocab_size, info.canvas_width, info.max_model_len) == (MODEL, VOCAB, WIDTH, 1024)
    assert info.provider == "vllm"
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    assert info.chat_overhead == await engine.count_prompt(empty) > 0
    # /tokenize: the empty chat, the thought block, the special-token probe (one request with token_strs)
    assert fake.paths() == Counter({"/v1/models": 1, "/v1/completions": 2, "/tokenize": 3})
    assert engine.requests_sent == 0
    await engine.info()
    assert sum(fake.paths().values()) == 6  # cached


async def test_given_vocab_and_width_skip_discovery_probes():
    fake = FakeVLLM()
    engine = engine_for(fake, vocab_size=500, canvas_width=16)
    info = await engine.info()
    assert (info.vocab_size, info.canvas_width) == (500, 16)
    assert fake.paths()["/v1/completions"] == 0


async def test_chat_read_body_follows_the_wire_format():
    fake = FakeVLLM()
    engine = engine_for(fake)
    await engine.read([canvas_read(width=16, labels=(302, 300, 301))])
    await engine.read([canvas_read(width=WIDTH, constrained=True)])
    narrow, full = fake.read_bodies()
    assert narrow["model"] == MODEL and narrow["max_tokens"] == 16
    assert narrow["logprob_token_ids"] == [300, 301, 302]
    assert narrow["return_tokens_as_token_ids"] is True
    assert narrow["logprobs"] is True and narrow["top_logprobs"] == 1
    assert narrow["chat_template_kwargs"] == {"enable_thinking": False}
    assert narrow["messages"][1] == {"role": "user", "content": "hi"}
    assert narrow["vllm_xargs"] == {"diffusion_seed_canvas": list(range(10, 26)), "diffusion_max_steps": 1,
                                    "diffusion_read_only": 1, "diffusion_canvas_length": 16}
    assert full["vllm_xargs"]["diffusion_constrained"] == 1 and "diffusion_canvas_length" not in full["vllm_xargs"]
    for body in (narrow, full):
        assert not {"seed", "temperature", "response_format", "structured_outputs", "prompt_logprobs"} & set(body)
    assert engine.requests_sent == 2


async def test_completions_read_sends_prompt_ids_tokenized_once():
    fake = FakeVLLM()
    engine = engine_for(fake, endpoint="completions")
    read = canvas_read()
    await engine.info()
    tokenized = fake.paths()["/tokenize"]
    await engine.read([read])
    await engine.read([read])
    bodies = fake.read_bodies()
    prompt = await engine.count_prompt(read.messages)
    assert [len(b["prompt"]) for b in bodies] == [prompt, prompt]
    assert all(isinstance(t, int) for t in bodies[0]["prompt"]) and bodies[0]["logprobs"] == 1
    assert "messages" not in bodies[0]
    assert fake.paths()["/tokenize"] == tokenized + 1  # the prompt's ids are cached


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_result_rows_are_the_slot_rows_in_slot_order(endpoint):
    def distinct(request: httpx.Request, body: dict) -> httpx.Response:
        width = len(body["vllm_xargs"]["diffusion_seed_canvas"])
        if endpoint == "chat":
            rows = [{"token": f"token_id:{p}", "logprob": -0.5, "top_logprobs": [
                {"token": "token_id:300", "logprob": -1.0 - p}, {"token": "token_id:301", "logprob": -2.0 - p}]}
                for p in range(width)]
            return _json(200, {"choices": [{"logprobs": {"content": rows}}],
                               "usage": {"prompt_tokens": 9, "completion_tokens": width}})
        rows = [{"token_id:300": -1.0 - p, "token_id:301": -2.0 - p} for p in range(width)]
        return _json(200, {"choices": [{"logprobs": {"top_logprobs": rows}}],
                           "usage": {"prompt_tokens": 9, "completion_tokens": width}})

    engine = engine_for(FakeVLLM(distinct), endpoint=endpoint)
    [result] = await engine.read([canvas_read(slots=(9, 2), labels=(300, 301))])
    assert [row[300] for row in result.rows] == [-10.0, -3.0]
    assert [row[301] for row in result.rows] == [-11.0, -4.0]
    if endpoint == "chat":  # the emitted token at the position is part of its row
        assert result.rows[0][9] == -0.5
    assert (result.prompt_tokens, result.completion_tokens) == (9, WIDTH)
    assert result.attrs["server.address"] == "http://vllm.test"


async def test_batch_reads_come_back_in_order():
    engine = engine_for(FakeVLLM())
    reads = [canvas_read(slots=(i,), labels=(300 + i, 400)) for i in range(5)]
    results = await engine.read(reads)
    # ranked rows: each read's lowest label id is its most likely one, so the order shows
    assert [max(r.rows[0], key=r.rows[0].get) for r in results] == [300 + i for i in range(5)]
    assert all(min(r.rows[0], key=r.rows[0].get) == 400 for r in results)


async def test_429_and_500_are_retried_then_answered():
    statuses = iter([429, 500, 503])

    def flaky(request: httpx.Request, body: dict) -> httpx.Response:
        status = next(statuses, 200)
        if status != 200:
            return _json(status, {"error": {"message": "busy"}})
        return FakeVLLM.ranked(request, body)

    engine = engine_for(FakeVLLM(flaky), retries=3)
    [result] = await engine.read([canvas_read()])
    assert len(result.rows) == 2
    assert engine.requests_sent == 4


@pytest.mark.parametrize(("status", "error"), [(429, EngineOverloaded), (503, EngineOverloaded),
                                               (500, EngineUnavailable), (502, EngineUnavailable)])
async def test_retries_exhausted_raise_a_typed_retryable_error(status, error):
    engine = engine_for(FakeVLLM(lambda r, b: _json(status, {"error": {"message": "nope"}})), retries=2)
    with pytest.raises(error, match=f"HTTP {status}") as info:
        await engine.read([canvas_read()])
    assert info.value.retryable and isinstance(info.value, ConnectionError)
    assert (status in (429, 503)) == isinstance(info.value, EngineOverloaded)
    assert engine.requests_sent == 3


async def test_400_is_refused_at_once_with_the_servers_message():
    message = "diffusion_seed_canvas must hold exactly 32 ids, got 5."
    fake = FakeVLLM(lambda r, b: _json(400, {"error": {"message": message, "type": "BadRequestError"}}))
    engine = engine_for(fake, retries=3)
    with pytest.raises(EngineRequestError) as info:
        await engine.read([canvas_read()])
    assert info.value.status == 400 and info.value.message == message
    assert isinstance(info.value, ValueError) and not info.value.retryable
    assert engine.requests_sent == 1


def _chat_body(rows: list) -> bytes:
    return json.dumps({"choices": [{"logprobs": {"content": rows}}], "usage": {}}).encode()


def _row(lp: object = -1.0, token: object = "token_id:300") -> dict:
    return {"token": token, "logprob": lp, "top_logprobs": [{"token": "token_id:301", "logprob": -2.0}]}


MALFORMED = {
    "not json": b"<html>oops</html>",
    "a json array": b"[1, 2]",
    "no choices": b'{"usage": {}}',
    "no logprobs": b'{"choices": [{"message": {"content": "A"}}]}',
    "missing rows": _chat_body([_row()] * (WIDTH - 1)),
    "extra rows": _chat_body([_row()] * (WIDTH + 1)),
    "token not an id": _chat_body([_row(token="A")] * WIDTH),
    "logprob NaN": _chat_body([_row(math.nan)] * WIDTH),
    "logprob +inf": _chat_body([_row(math.inf)] * WIDTH),
    "logprob positive": _chat_body([_row(0.5)] * WIDTH),
    "logprob a string": _chat_body([_row("abc")] * WIDTH),
    "logprob null": _chat_body([_row(None)] * WIDTH),
    "row not an object": _chat_body([3] * WIDTH),
    "usage garbage": json.dumps({"choices": [{"logprobs": {"content": [_row()] * WIDTH}}],
                                 "usage": {"prompt_tokens": "many"}}).encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_unreadable_responses_are_engine_response_errors(case):
    engine = engine_for(FakeVLLM(lambda r, b: httpx.Response(200, content=MALFORMED[case])), retries=3)
    with pytest.raises(EngineResponseError):
        await engine.read([canvas_read()])
    assert engine.requests_sent == 1  # a broken answer is not retried


async def test_minus_infinity_is_a_valid_impossible_label():
    engine = engine_for(FakeVLLM(lambda r, b: httpx.Response(200, content=_chat_body([_row(-math.inf)] * WIDTH))))
    [result] = await engine.read([canvas_read(labels=(300, 301))])
    assert result.rows[0][300] == -math.inf and result.rows[0][301] == -2.0


async def test_timeouts_are_retried_then_raise_engine_timeout():
    calls = Counter()

    def slow(request: httpx.Request) -> httpx.Response:
        calls[request.url.path] += 1
        raise httpx.ReadTimeout("timed out", request=request)

    engine = engine_for(slow, retries=2, vocab_size=VOCAB, canvas_width=WIDTH, model=MODEL)
    with pytest.raises(EngineTimeout) as info:
        await engine.tokenize("hello")
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, ConnectionError)
    assert info.value.retryable and calls["/tokenize"] == 3


async def test_an_answer_that_never_comes_is_bounded_by_the_attempt_deadline():
    """httpx's timeouts are per operation; a transport that never answers must still end."""
    calls = Counter()

    async def never(request: httpx.Request) -> httpx.Response:
        calls[request.url.path] += 1
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    engine = engine_for(never, retries=1, timeout=Timeout(read=0.05, connect=0.05), vocab_size=VOCAB,
                        canvas_width=WIDTH, model=MODEL)
    with pytest.raises(EngineTimeout):
        await bounded(engine.tokenize("hello"), 5, what="the attempt deadline")
    assert calls["/tokenize"] == 2


async def test_a_refused_replica_cools_down_and_reads_move_on():
    fake = FakeVLLM()
    seen = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.host] += 1
        if request.url.host == "down.test":
            raise httpx.ConnectError("connection refused", request=request)
        return fake(request)

    engine = engine_for(handler, url=["http://down.test", "http://up.test"], cooldown=60)
    await engine.info()
    results = await engine.read([canvas_read() for _ in range(10)])
    assert len(results) == 10 and {r.attrs["server.address"] for r in results} == {"http://up.test"}
    assert seen["down.test"] == 1  # tried once, then cooling down


async def test_healthy_replicas_share_reads_round_robin_without_affinity():
    engine = engine_for(FakeVLLM(), url=["http://a.test", "http://b.test/"], affinity=False)
    await engine.info()
    results = [await engine.read([canvas_read()]) for _ in range(10)]
    spread = Counter(r[0].attrs["server.address"] for r in results)
    assert spread == Counter({"http://a.test": 5, "http://b.test": 5})


async def test_every_replica_down_is_engine_unavailable_naming_the_url():
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    engine = engine_for(refused, url=["http://a.test", "http://b.test"], retries=3)
    with pytest.raises(EngineUnavailable, match=r"http://[ab]\.test") as info:
        await engine.info()
    assert not isinstance(info.value, EngineTimeout) and info.value.hint


async def test_max_concurrency_bounds_requests_in_flight():
    fake = FakeVLLM()
    in_flight = peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.002)
        in_flight -= 1
        return fake(request)

    engine = engine_for(handler, limits=Limits(max_concurrency=4))
    await engine.info()
    results = await asyncio.gather(*(engine.read([canvas_read()]) for _ in range(40)))
    assert len(results) == 40 and peak == 4


async def test_reads_refused_before_any_request():
    fake = FakeVLLM()
    engine = engine_for(fake)
    await engine.info()
    with pytest.raises(EngineRequestError, match="at most 32"):
        await engine.read([canvas_read(width=WIDTH + 16)])
    with pytest.raises(EngineRequestError, match="at most 128"):
        await engine.read([canvas_read(labels=tuple(range(300, 430)))])
    assert engine.requests_sent == 0 and not fake.read_bodies()


async def test_unserved_model_and_vocab_probe_failures_are_clear():
    with pytest.raises(EngineRequestError, match="not served here"):
        await engine_for(FakeVLLM(), model="other").info()

    def accepts_anything(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return _json(200, {"data": [{"id": MODEL, "max_model_len": 1024}]})
        return _json(200, {"choices": [], "usage": {"completion_tokens": WIDTH}})

    with pytest.raises(EngineResponseError, match="not DiffusionGemma's structured read") as plain:
        await engine_for(accepts_anything).info()  # a server that ignores vllm_xargs serves a plain model
    assert "CausalServerEngine" in str(plain.value)

    def no_range(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return _json(200, {"data": [{"id": MODEL, "max_model_len": 1024}]})
        return _json(400, {"error": {"message": "unknown field vllm_xargs"}})

    with pytest.raises(EngineRequestError, match="vocabulary size") as info:
        await engine_for(no_range).info()
    assert "DiffusionGemma" in info.value.hint


async def test_api_key_is_sent_as_a_bearer_token():
    fake = FakeVLLM()
    engine = engine_for(fake, api_key="sk-test-123")
    await engine.info()
    assert {r.headers.get("authorization") for r in fake.requests} == {"Bearer sk-test-123"}
    assert "sk-test-123" not in repr(engine)


def test_the_sync_path_and_a_second_event_loop_each_get_a_working_client():
    fake = FakeVLLM()
    engine = engine_for(fake)
    [a] = run_sync(engine.read([canvas_read()]))
    [b] = asyncio.run(engine.read([canvas_read()]))
    assert a.rows == b.rows and engine.requests_sent == 2
    run_sync(engine.aclose())


class Held:
    """A MockTransport handler holding every request before `inner` until all callers of `run` started."""

    def __init__(self, inner: Callable[[httpx.Request], httpx.Response]) -> None:
        self.inner = inner
        self.arrived, self.released = asyncio.Event(), asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.arrived.set()
        await self.released.wait()
        return self.inner(request)

    async def run(self, calls: Callable[[], Awaitable[object]], n: int) -> list[object]:
        """`n` concurrent `calls()`, their outcomes: the first request is held until every caller waits."""
        self.arrived.clear()
        self.released.clear()
        tasks = [asyncio.ensure_future(calls()) for _ in range(n)]
        await self.arrived.wait()  # tasks start in order: by now every caller has made its call
        self.released.set()
        return await asyncio.gather(*tasks, return_exceptions=True)


async def test_concurrent_cold_callers_share_one_discovery_and_one_tokenize():
    fake = FakeVLLM()
    held = Held(fake)
    engine = engine_for(held)
    infos = await held.run(engine.info, 20)
    assert all(i is infos[0] for i in infos)
    assert fake.paths() == Counter({"/v1/models": 1, "/v1/completions": 2, "/tokenize": 3})
    ids = await held.run(lambda: engine.tokenize("hello world"), 20)
    assert ids == [tokenize("hello world", VOCAB)] * 20 and fake.paths()["/tokenize"] == 4


async def test_a_shared_failure_reaches_every_caller_and_is_not_cached():
    fake = FakeVLLM()
    fail = True

    def flaky(request: httpx.Request) -> httpx.Response:
        if fail and request.url.path == "/v1/models":
            return _json(401, {"error": {"message": "bad key"}})
        return fake(request)

    held = Held(flaky)
    engine = engine_for(held)
    results = await held.run(engine.info, 5)
    assert all(isinstance(r, EngineRequestError) and r.status == 401 for r in results)
    assert fake.paths()["/v1/models"] == 0 and len(fake.requests) == 0
    fail = False
    assert (await engine.info()).model == MODEL


@pytest.mark.parametrize("decoder", ["fast", "json module"])
async def test_responses_decode_the_same_with_or_without_orjson(decoder, monkeypatch):
    from canvasroute.engine.transport import _connection

    if decoder == "json module":
        monkeypatch.setattr(_connection, "_fast_loads", None)
    assert _connection.loads(b'{"a": [1, -2.5, "x"]}') == {"a": [1, -2.5, "x"]}
    special = _connection.loads(b'{"lp": -Infinity, "bad": NaN}')  # literals only the json module accepts
    assert special["lp"] == -math.inf and math.isnan(special["bad"])
    engine = engine_for(FakeVLLM())
    [result] = await engine.read([canvas_read(slots=(1, 4), labels=(300, 301, 302))])
    assert result.rows[0] == {300: -0.1, 301: -3.1, 302: -6.1} and result.rows[1] == result.rows[0]
    with pytest.raises(EngineResponseError, match="non-JSON"):
        await engine_for(FakeVLLM(lambda r, b: httpx.Response(200, content=b"{oops"))).read([canvas_read()])
