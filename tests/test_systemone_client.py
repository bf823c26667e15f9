"""`SystemOneDecisionModel`: the Jev client, against our server, vLLM's gateway and faults."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from deadlines import patience
from langchain_core.decisions import Box, Choice, ClassifierResponse, Noul, Score
from langchain_core.messages import HumanMessage
from opentelemetry.trace import SpanKind

from canvasroute.apps.server import create_app, run_in_thread
from canvasroute.engine import (
    Connection,
    DecisionError,
    EngineOverloaded,
    EngineRequestError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    FunctionEngine,
    Retries,
    UnsupportedQuestion,
    VLLMServerEngine,
)
from canvasroute.engine.testing import LoopbackVLLM
from canvasroute.router import CanvasDecisionModel, GatePolicy, SystemOneDecisionModel

PNG_BASE64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

KEY = "sk-client-test"
QUESTIONS = {
    "urgent": Noul(instructions="Is this urgent?", criteria={"true": "money is lost", "false": "it can wait"}),
    "team": Choice(instructions="Which team?", criteria={"billing": "charges", "tech": None, "sales": "plans"}),
    "sev": Score(instructions="How severe?", criteria=["low", "medium", "high"]),
}
STATE = "I was charged twice and nobody answers."
ANSWER = {
    "model": "jev-test",
    "answers": {
        "urgent": {"type": "noul", "noul": 0.8},
        "team": {"type": "choice", "choice": "tech", "probabilities": {"billing": 0.1, "tech": 0.7, "sales": 0.2},
                 "confidence": 0.7},
        "sev": {"type": "score", "score": 1.2, "legend": {"0": "low", "1": "medium", "2": "high"},
                "probabilities": {"0": 0.2, "1": 0.4, "2": 0.4}, "confidence": 0.4},
    },
    "usage": {"input_tokens": 30, "output_tokens": 3},
}


def rows_for(engine: FunctionEngine, labels: tuple[str, ...], logprob: float):
    """Every requested label id at -9, then `labels` at `logprob` (rows must hold every label id)."""
    return lambda read: [dict.fromkeys(read.label_ids, -9.0) | {engine.token_id(t): logprob for t in labels}
                         ] * len(read.slots)


def confident_model() -> CanvasDecisionModel:
    """Answers yes / billing / level 0 with near certainty."""
    engine = FunctionEngine(lambda read: fn(read), model="upstream")
    fn = rows_for(engine, ("yes", "A", "1"), -0.01)
    return CanvasDecisionModel(engine=engine)


class Script:
    """A MockTransport handler answering from a list (the last answer repeats)."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def client(self, *, retries: int = 3, api_key: str | None = None) -> SystemOneDecisionModel:
        connection = Connection("http://jev.test", api_key=api_key, retries=Retries(max_retries=retries, backoff=0),
                                transport=httpx.MockTransport(self))
        return SystemOneDecisionModel(connection, model="jev-test")


def error(status: int, message: str, **headers: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": "x", "message": message}}, headers=headers)


# -- real servers ----------------------------------------------------------------------------


async def test_against_our_server_matches_the_model_it_serves(spans):
    model = confident_model()
    with run_in_thread(create_app(model, api_key=KEY)) as url:
        jev = SystemOneDecisionModel(Connection(url, api_key=KEY), model="upstream")
        resp = await jev.ainvoke({"state": STATE, "questions": QUESTIONS})
        sync = jev.invoke({"state": STATE, "questions": QUESTIONS})  # the sync path
        keyless = SystemOneDecisionModel(Connection(url, retries=0), model="upstream")
        with pytest.raises(EngineRequestError) as denied:
            await keyless.ainvoke({"state": STATE, "questions": QUESTIONS})
        await jev.aclose()
    direct = await model.ainvoke({"state": STATE, "questions": QUESTIONS})
    assert isinstance(resp, ClassifierResponse) and resp.model == "upstream"
    assert resp.answers == direct.answers == sync.answers
    assert resp.choices["team"].choice == "billing" and resp.nouls["urgent"].noul > 0.99
    assert resp.request_id.startswith("decision-") and resp.request_id != sync.request_id
    assert denied.value.status == 401 and "API key" in denied.value.message
    # the server's span joins the client's trace
    finished = spans.get_finished_spans()
    client_span = next(s for s in finished if s.name == "systemone upstream")
    server_span = next(s for s in finished if s.kind == SpanKind.SERVER and
                       s.context.trace_id == client_span.context.trace_id)
    assert client_span.kind == SpanKind.CLIENT and server_span.parent.span_id == client_span.context.span_id


async def test_a_messages_images_reach_the_served_read_as_a_local_read_sends_them():
    """Defect: the client sent a message state's text and dropped its images (in a message
    list, or in messages inside a value); a hosted image is refused before any request."""
    vllm = LoopbackVLLM()
    served = CanvasDecisionModel(engine=VLLMServerEngine(Connection("http://vllm.test", transport=vllm.transport())),
                                 policy=GatePolicy(rereads=0))
    message = HumanMessage(content=[{"type": "text", "text": STATE},
                                    {"type": "image", "base64": PNG_BASE64, "mime_type": "image/png"}])
    team = {"team": QUESTIONS["team"]}
    with run_in_thread(create_app(served)) as url:
        jev = SystemOneDecisionModel(Connection(url, retries=0), model="loopback")
        for state in ([message], {"ticket": 7, "messages": [message]}):
            await jev.ainvoke({"state": state, "questions": team})
            remote = vllm.bodies[-1]["messages"][1]["content"]
            await served.ainvoke({"state": state, "questions": team})
            assert remote == vllm.bodies[-1]["messages"][1]["content"]  # the same text, the same image parts
            assert {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_BASE64}"}} in remote
        hosted = HumanMessage(content=[{"type": "text", "text": STATE},
                                       {"type": "image_url", "image_url": {"url": "https://example.test/a.png"}}])
        reads = vllm.reads
        with pytest.raises(DecisionError, match="data:image/ URLs"):
            await jev.ainvoke({"state": [hosted], "questions": team})
        assert vllm.reads == reads
        await jev.aclose()


def test_a_state_of_message_dicts_is_converted_to_messages_once(monkeypatch):
    """Defect: `wire_state` converted a state's message dicts to see that they are messages, then
    `read_state` converted them again, on every call."""
    from canvasroute.router import _state

    state = [{"role": "user", "content": STATE},
             {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": {"name": "refund", "arguments": '{"order" :7}'}}]}]
    expected = _state.read_state(state)
    converted, real = [], _state._from_dict
    monkeypatch.setattr(_state, "_from_dict", lambda value: converted.append(value) or real(value))
    assert _state.wire_state(state) == expected
    assert converted == state  # each dict once


@pytest.mark.vllm
async def test_against_our_server_on_real_vllm(vllm_url):
    model = CanvasDecisionModel(engine=VLLMServerEngine(vllm_url), policy=GatePolicy(rereads=0))
    with run_in_thread(create_app(model)) as url:
        resp = await SystemOneDecisionModel(url, model="tiny-dgemma").ainvoke({"state": STATE, "questions": QUESTIONS})
    direct = await model.ainvoke({"state": STATE, "questions": QUESTIONS})
    assert resp.model == "tiny-dgemma"
    assert resp.choices["team"].probabilities == pytest.approx(direct.choices["team"].probabilities, abs=1e-9)
    assert resp.scores["sev"].legend == {0: "low", 1: "medium", 2: "high"}
    assert resp.usage["input_tokens"] > 0


class Counting(httpx.AsyncBaseTransport):
    """The real network transport, counting what it sends."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return await self.inner.handle_async_request(request)


def _gateways() -> list[str]:
    extra = os.environ.get("CANVASROUTE_VLLM_GATEWAY_URL")
    return ["fixture", *([extra] if extra else [])]


@pytest.mark.vllm
@pytest.mark.parametrize("which", _gateways())
async def test_against_vllms_own_gateway(vllm_url, which):
    """vLLM's /v1/systemone. On the fixture's tiny tokenizer vLLM disables it (501: `yes`
    is not one token), which must surface as a typed refusal, sent once; a server whose
    tokenizer keeps the labels whole (CANVASROUTE_VLLM_GATEWAY_URL) must answer."""
    url = vllm_url if which == "fixture" else which
    name = (await VLLMServerEngine(url).info()).model
    transport = Counting()
    jev = SystemOneDecisionModel(Connection(url, retries=Retries(backoff=0), transport=transport), model=name)
    try:
        resp = await jev.ainvoke({"state": STATE, "questions": QUESTIONS})
    except EngineRequestError as exc:
        assert exc.status == 501 and exc.message == "The model does not support the structured decision API"
        assert transport.sent == 1  # 501 is permanent: no retries
        return
    assert transport.sent == 1 and resp.model == name
    assert resp.choices["team"].choice in {"billing", "tech", "sales"}
    assert sum(resp.choices["team"].probabilities.values()) == pytest.approx(1.0)
    assert resp.scores["sev"].legend == {0: "low", 1: "medium", 2: "high"}
    assert 0 <= resp.nouls["urgent"].noul <= 1


async def test_as_the_escalation_target_of_a_canvas_model():
    """Uncertain canvas reads escalate over HTTP to another decision server."""
    with run_in_thread(create_app(confident_model(), api_key=KEY)) as url:
        upstream = SystemOneDecisionModel(Connection(url, api_key=KEY), model="upstream")
        engine = FunctionEngine(lambda read: fn(read), model="fast")
        fn = rows_for(engine, ("yes", "no", "A", "B", "C", "1", "2", "3"), -2.0)  # uniform: uncertain
        model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=1),
                                    escalate_to=upstream)
        resp = await model.ainvoke({"state": STATE, "questions": QUESTIONS})
    for qid in QUESTIONS:
        report = resp.reads[qid]
        assert report.path == "escalated" and report.escalation_model == "upstream" and report.reads == 2
        assert report.canvas_probabilities is not None  # the canvas distribution is kept for review
    assert resp.choices["team"].choice == "billing" and resp.nouls["urgent"].noul > 0.99
    assert resp.reads["sev"].answer == "0"
    assert resp.usage["input_tokens"] >= 0 and resp.canvas_reads == 2


async def test_a_server_can_front_any_decision_model():
    """A canvasroute server proxying another /v1/systemone server: plain Jev answers."""
    with run_in_thread(create_app(confident_model(), api_key=KEY)) as upstream_url:
        proxy = create_app(SystemOneDecisionModel(Connection(upstream_url, api_key=KEY), model="upstream"))
        with run_in_thread(proxy) as url:
            async with httpx.AsyncClient(timeout=patience(30)) as http:
                r = await http.post(f"{url}/v1/systemone", json={"state": STATE, "questions": {
                    qid: q.model_dump(mode="json") for qid, q in QUESTIONS.items()}})
                models = (await http.get(f"{url}/v1/models")).json()
    assert r.status_code == 200, r.text
    answers = r.json()["answers"]
    assert answers["team"]["choice"] == "billing" and "x_canvasroute" not in answers["team"]
    assert r.json()["model"] == "upstream" and models["data"][0]["id"] == "upstream"


# -- retries and typed errors (MockTransport) ---------------------------------------------


async def test_retries_529_and_5xx_then_answers():
    script = Script(error(529, "queue full"), error(503, "warming up"), error(500, "oops"),
                    httpx.Response(200, json=ANSWER, headers={"x-request-id": "req-1"}))
    resp = await script.client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert len(script.requests) == 4
    assert resp.model == "jev-test" and resp.request_id == "req-1"
    assert resp.choices["team"].choice == "tech" and resp.scores["sev"].probabilities == {0: 0.2, 1: 0.4, 2: 0.4}
    assert resp.usage["total_tokens"] == 33
    body = json.loads(script.requests[0].content)
    assert body["model"] == "jev-test" and body["state"] == STATE
    assert body["questions"]["team"] == {"type": "choice", "instructions": "Which team?",
                                         "criteria": {"billing": "charges", "tech": None, "sales": "plans"}}
    assert "authorization" not in script.requests[0].headers


@pytest.mark.parametrize(("status", "kind"), [(529, EngineOverloaded), (429, EngineOverloaded),
                                              (503, EngineOverloaded), (502, EngineUnavailable)])
async def test_persistent_transient_statuses_raise_typed_errors_after_retries(status, kind):
    script = Script(error(status, "still busy"))
    with pytest.raises(kind, match="still busy") as info:
        await script.client(retries=2).ainvoke({"state": STATE, "questions": QUESTIONS})
    assert len(script.requests) == 3 and info.value.retryable
    assert not isinstance(info.value, EngineRequestError)


async def test_retry_after_is_honoured(monkeypatch):
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr("canvasroute.engine.transport._connection.asyncio.sleep", fake_sleep)
    script = Script(error(529, "later", **{"retry-after": "2"}), httpx.Response(200, json=ANSWER))
    await script.client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert slept == [2.0]


@pytest.mark.parametrize(("status", "message"), [
    (400, "question 'q': Box questions have no canvas form"),
    (401, "missing or invalid API key"),
    (404, "model 'jev-test' is not served here"),
    (422, "questions.team.criteria: must be an object"),
    (501, "The model does not support the structured decision API"),
])
async def test_refusals_raise_at_once_with_the_servers_message(status, message):
    script = Script(error(status, message))
    with pytest.raises(EngineRequestError) as info:
        await script.client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert len(script.requests) == 1
    assert info.value.status == status and info.value.message == message
    assert isinstance(info.value, ValueError) and not info.value.retryable


async def test_connection_faults_retry_then_raise_typed():
    refused = Script(httpx.ConnectError("connection refused"))
    with pytest.raises(EngineUnavailable, match="connection refused"):
        await refused.client(retries=1).ainvoke({"state": STATE, "questions": QUESTIONS})
    assert len(refused.requests) == 2
    slow = Script(httpx.ReadTimeout("read timed out"), httpx.Response(200, json=ANSWER))
    resp = await slow.client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert resp.nouls["urgent"].noul == 0.8 and len(slow.requests) == 2
    stuck = Script(httpx.ReadTimeout("read timed out"))
    with pytest.raises(EngineTimeout):
        await stuck.client(retries=0).ainvoke({"state": STATE, "questions": QUESTIONS})


@pytest.mark.parametrize("skip", ["null", "left out"])
async def test_a_question_the_server_skipped_has_no_answer(skip):
    """vLLM's gateway answers a question `ask_if` skipped with null; canvasroute leaves it out
    and names it in `diagnostics.skipped`: either way the client answers the rest."""
    answers = {**ANSWER["answers"], "sev": None} if skip == "null" else {
        k: v for k, v in ANSWER["answers"].items() if k != "sev"}
    body = {**ANSWER, "answers": answers, "diagnostics": {"skipped": {} if skip == "null" else {
        "sev": {"because": "team", "was": "tech", "wanted": ["billing"]}}}}
    resp = await Script(httpx.Response(200, json=body)).client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert set(resp.answers) == {"urgent", "team"} and resp.choices["team"].choice == "tech"


OLDER = {  # a canvasroute 0.1 server's reply: top-level id, object, created; a noul's probabilities and confidence
    "id": "decision-1", "object": "structured_decision", "created": 1, "model": "jev-test",
    "answers": {**ANSWER["answers"], "urgent": {"type": "noul", "noul": 0.8, "probabilities": {"yes": 0.8, "no": 0.2},
                                                "confidence": 0.8, "canvasroute": {"path": "escalated"}},
                "team": {**ANSWER["answers"]["team"], "canvasroute": {"path": "unsure", "refusal": "policy"}}},
    "usage": ANSWER["usage"], "diagnostics": {"skipped": {}},
}


X_PREFIXED = {  # a server naming its own fields as System One prefixes what its spec does not define (issue 39.5)
    **ANSWER, "answers": {**ANSWER["answers"], "team": {**ANSWER["answers"]["team"],
                                                        "x_canvasroute": {"path": "unsure", "refusal": "policy"}}},
    "x_canvasroute": {"decision_id": "decision-3"},
}


@pytest.mark.parametrize("reply", ["older canvasroute", "canvasroute 0.2", "canvasroute 0.2, no answer",
                                   "x_canvasroute"])
async def test_a_question_the_server_refused_is_a_refusal_not_an_answer(reply):
    """Issue 34.2: a canvasroute server answers a question its escalation target refused with its
    canvas's guess, the refusal in the answer's `canvasroute` object (and, since 0.2, in
    `diagnostics.refused`; a server fronting another decision model has no guess to give). The
    client read that guess as the server's answer; now it names the question in `refusals`."""
    body: dict = {"older canvasroute": OLDER, "x_canvasroute": X_PREFIXED,
                  "canvasroute 0.2": {**ANSWER, "diagnostics": {"refused": {"team": "policy"}},
                                      "canvasroute": {"decision_id": "decision-2"}},
                  "canvasroute 0.2, no answer": {**ANSWER, "answers": {
                      k: v for k, v in ANSWER["answers"].items() if k != "team"},
                      "diagnostics": {"refused": {"team": "policy"}}}}[reply]
    resp = await Script(httpx.Response(200, json=body)).client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert set(resp.answers) == {"urgent", "sev"} and resp.refusals == {"team": "policy"}
    assert resp.nouls["urgent"].noul == 0.8 and resp.scores["sev"].probabilities == {0: 0.2, 1: 0.4, 2: 0.4}
    assert resp.request_id == {"older canvasroute": "decision-1", "canvasroute 0.2": "decision-2",
                               "x_canvasroute": "decision-3"}.get(reply)


@pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")
async def test_a_refusal_behind_a_systemone_server_is_a_refusal_of_the_canvas_model_escalating_to_it():
    """Issue 34.2 at library level: the server's own target (a decisions server) refuses `team`; a
    canvas model escalating to the server reports `team` refused (path as for any refused
    escalation: its canvas answer, `unsure`), never the server's canvas guess as an escalated answer."""
    from decisions_server import REFUSE, DecisionsServer, Known
    from langchain_core.decisions import ChoiceAnswer
    from langchain_openai.decisions import OpenAIDecisions
    from pydantic import SecretStr

    labels = ("yes", "no", "A", "B", "C", "1", "2", "3")
    engine = FunctionEngine(lambda read: fn(read), model="downstream")
    fn = rows_for(engine, labels, -2.0)  # uniform: everything escalates
    upstream_engine = FunctionEngine(lambda read: up(read), model="upstream")
    up = rows_for(upstream_engine, labels, -2.0)
    with DecisionsServer({"urgent": Known(0.9), "team": REFUSE}) as big:
        target = OpenAIDecisions(model="big", api_key=SecretStr("k"), base_url=big.url + "/v1", max_retries=0)
        downstream = CanvasDecisionModel(engine=engine, policy=GatePolicy(rereads=0), escalate_to=target)
        with run_in_thread(create_app(downstream)) as url:
            jev = SystemOneDecisionModel(Connection(url, retries=0), model="downstream")
            asked = await jev.ainvoke({"state": STATE, "questions": {"team": QUESTIONS["team"]}})
            model = CanvasDecisionModel(engine=upstream_engine, policy=GatePolicy(rereads=0), escalate_to=jev)
            resp = await model.ainvoke({"state": STATE, "questions": {"team": QUESTIONS["team"],
                                                                      "urgent": QUESTIONS["urgent"]}})
            with run_in_thread(create_app(jev)) as proxy:  # a server fronting the client: no guess to give
                async with httpx.AsyncClient(timeout=patience(30)) as http:
                    fronted = (await http.post(f"{proxy}/v1/systemone", json={"state": STATE, "questions": {
                        "team": QUESTIONS["team"].model_dump(mode="json")}})).json()
                    decided = (await http.post(f"{proxy}/v1/decisions", json={"model": "downstream", "input": STATE,
                                                                               "questions": [{
                        "type": "choice", "name": "team", "instructions": "Which team?",
                        "choices": [{"value": "billing"}, {"value": "tech"}, {"value": "sales"}]}]})).json()
    assert asked.answers == {} and "refused" in asked.refusals["team"]
    team = resp.reads["team"]
    assert (team.path, team.cause, team.escalation_model) == ("unsure", "uncertain", "downstream")
    assert team.refusal is not None and "refused" in team.refusal
    assert team.probabilities == team.canvas_probabilities  # the upstream canvas's answer stands, flagged
    assert isinstance(resp.answers["team"], ChoiceAnswer)
    assert fronted["answers"] == {} and "refused" in fronted["diagnostics"]["refused"]["team"]
    assert [a["type"] for a in decided["answers"]] == ["refusal"]
    urgent = resp.reads["urgent"]  # the refused question alone is refused
    assert (urgent.path, urgent.refusal) == ("escalated", None) and urgent.probabilities["yes"] == pytest.approx(0.9)


@pytest.mark.parametrize("body", [
    b"not json",
    json.dumps({"model": "jev-test"}).encode(),
    json.dumps({**ANSWER, "answers": {"urgent": ANSWER["answers"]["urgent"]}}).encode(),  # answers missing
    json.dumps({**ANSWER, "answers": {**ANSWER["answers"], "team": ANSWER["answers"]["urgent"]}}).encode(),
    json.dumps({**ANSWER, "answers": {**ANSWER["answers"], "urgent": {"type": "noul", "noul": 1.5}}}).encode(),
])
async def test_unreadable_answers_raise_response_errors(body):
    script = Script(httpx.Response(200, content=body))
    with pytest.raises(EngineResponseError):
        await script.client().ainvoke({"state": STATE, "questions": QUESTIONS})
    assert len(script.requests) == 1


async def test_questions_are_checked_before_sending_and_the_key_is_sent():
    script = Script(httpx.Response(200, json={"model": "jev-test", "answers": {
        "logo": {"type": "box", "box": {"top": 0.1, "bottom": 0.5, "left": 0.2, "right": 0.6}}}}))
    jev = script.client(api_key=KEY)
    with pytest.raises(UnsupportedQuestion):
        await jev.ainvoke({"state": STATE, "questions": {"q": {"type": "choice", "instructions": "x"}}})
    with pytest.raises(DecisionError):
        await jev.ainvoke({"state": STATE, "questions": {}})
    assert script.requests == []
    resp = await jev.ainvoke({"state": {"ticket": STATE, "tags": ["billing"]},
                              "questions": {"logo": Box(instructions="the logo")}})  # the server decides
    assert resp.boxes["logo"].box.right == 0.6 and resp.usage is None
    sent = script.requests[0]
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert json.loads(sent.content)["state"] == {"ticket": STATE, "tags": ["billing"]}
    assert "api_key" not in repr(jev) and KEY not in repr(jev)


def test_a_base_url_must_be_http():
    with pytest.raises(ValueError, match="http"):
        SystemOneDecisionModel("127.0.0.1:8000", model="x")
