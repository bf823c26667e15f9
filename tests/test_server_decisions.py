"""`canvasroute serve` speaks OpenAI Decisions at `POST /v1/decisions`: the `openai` SDK
(`client.decisions.create`, sync and async, strict validation) and langchain-openai's
`OpenAIDecisions` against it unchanged; agent traffic and images read as the canvas reads them;
refusals; OpenAI's error shape with the statuses the SDK maps; the admission, auth, limits,
rate limit, ids, metrics and tracing `/v1/systemone` has; a cascade of two servers.

Fast tests run on a FunctionEngine or the loopback vLLM (a MockTransport); `@pytest.mark.vllm`
ones on the real vLLM CPU server, through `canvasroute serve` in a thread or as processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from deadlines import Watch, patience, wait, wait_until
from decisions_server import PNG, REFUSE, DecisionsServer, Known
from langchain_core.decisions import BaseDecisionModel, Noul
from langchain_core.decisions import Choice as LCChoice
from langchain_core.decisions import Score as LCScore
from langchain_core.exceptions import ModelRefusalError
from langchain_core.messages import HumanMessage
from langchain_openai.decisions import Choice, OpenAIDecisions, Predicate, Score
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from services import child_env
from test_server import KEY, _args, _free_port, confident, function_model, uniform, vision_model

from canvasroute.apps.server import Limits, create_app, run_in_thread
from canvasroute.apps.server import cli as serve
from canvasroute.engine import Connection, EngineUnavailable, FunctionEngine, VLLMServerEngine
from canvasroute.router import (
    CanvasDecisionModel,
    Escalation,
    EscalationBudget,
    GatePolicy,
    OutcomePolicy,
    SystemOneDecisionModel,
    save_policy,
)

pytestmark = pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")

QUESTIONS: list[Any] = [
    {"type": "predicate", "name": "urgent", "instructions": "Is this urgent?"},
    {"type": "choice", "name": "team", "instructions": "Which team?",
     "choices": [{"value": "billing", "description": "Payments."}, {"value": "technical"}]},
    {"type": "score", "instructions": "How severe?",
     "levels": [{"label": "Cosmetic"}, {"label": "Workaround", "description": "Another way works."},
                {"label": "Blocked"}]},
    {"type": "choice", "name": "flag", "instructions": "Flag it?", "choices": [{"value": True}, {"value": "true"}]},
]
TICKET = "Stripe has failed to connect for three days. Help!"
TRAFFIC: list[Any] = [
    {"role": "developer", "content": "You route support tickets."},
    {"role": "system", "content": [{"type": "input_text", "text": "Be terse."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "My parcel arrived like this:"},
                                 {"type": "input_image", "image_url": PNG, "detail": "high"},
                                 {"type": "input_json", "data": {"order": 42}}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look up the order."}],
     "phase": "commentary"},
    {"type": "function_call", "call_id": "call_1", "name": "lookup_order", "arguments": '{"id": 42}'},
    {"type": "function_call_output", "call_id": "call_1",
     "output": [{"type": "input_text", "text": "shipped"}, {"type": "input_image", "image_url": PNG}]},
    {"type": "custom_tool_call", "call_id": "call_2", "name": "grep_logs", "input": "order 42"},
    {"type": "custom_tool_call_output", "call_id": "call_2", "output": "damaged in transit"},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No card data."}]},
]
TRANSCRIPT = """developer: You route support tickets.
system: Be terse.
human: My parcel arrived like this:
[image 1]
{"order":42}
ai: Let me look up the order.
ai: [call lookup_order id=call_1] {"id": 42}
tool: [lookup_order id=call_1] shipped
[image 2]
ai: [custom call grep_logs id=call_2] order 42
tool: [grep_logs id=call_2] damaged in transit
ai: [refusal] No card data."""


def sdk(url: str, key: str = KEY, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, _strict_response_validation=True,
                         **{"max_retries": 0, **kwargs})


def asdk(url: str, key: str = KEY, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, _strict_response_validation=True,
                              **{"max_retries": 0, **kwargs})


def decisions_target(url: str, model: str, **kwargs: Any) -> OpenAIDecisions:
    return OpenAIDecisions(model=model, api_key=SecretStr(KEY), base_url=url + "/v1", **{"max_retries": 0, **kwargs})


def metrics_of(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=patience(10)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- the openai SDK and langchain-openai, unchanged -----------------------------------------------


def test_the_openai_sdk_gets_answers_in_question_order_with_names_and_typed_values():
    model = function_model()
    with run_in_thread(create_app(model, api_key=KEY)) as url:
        decision = sdk(url).decisions.create(model="function", input=TICKET, questions=QUESTIONS,
                                             extra_headers={"x-request-id": "caller-1"})
        listed = sdk(url).models.list()
    urgent, team, severity, flag = decision.answers
    assert [(a.type, a.name) for a in decision.answers] == [
        ("predicate", "urgent"), ("choice", "team"), ("score", None), ("choice", "flag")]
    direct = model.decide(TICKET, {"urgent": {"type": "noul", "instructions": "Is this urgent?"}})
    assert urgent.probability == pytest.approx(direct.answers["urgent"].noul)  # the canvas answer, as in-process
    assert team.choice == "billing" and [p.value for p in team.probabilities] == ["billing", "technical"]
    assert team.confidence == max(p.probability for p in team.probabilities)
    assert severity.score == pytest.approx(sum(p.value * p.probability for p in severity.probabilities))
    assert [(p.label, p.value) for p in severity.probabilities] == [("Cosmetic", 0), ("Workaround", 1), ("Blocked", 2)]
    assert flag.choice is True  # typed: the boolean, not the string "true"
    assert [(type(p.value), p.value) for p in flag.probabilities] == [(bool, True), (str, "true")]
    assert decision.model == "function" and decision._request_id == "caller-1"
    usage = decision.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert (usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens) == (0, 0)
    extension = decision.answers[0].model_extra["canvasroute"]  # type: ignore[index]
    assert (extension["path"], extension["cause"], extension["confident"]) == ("canvas", None, True)
    assert decision.model_extra["canvasroute"]["ignored"] == []  # type: ignore[index]
    assert [m.id for m in listed.data] == ["function", "jev-latest"]  # /v1/models: one list for both wires


async def test_the_async_sdk_sends_agent_traffic_and_images_the_canvas_reads_as_a_transcript():
    """Messages of every role, function and custom tool calls with their outputs, image parts in the
    input, in a tool output and in a question: the canvas reads the transcript (calls and their
    arguments written out, `[image N]` in place) and every image, the question's last."""
    model, fake = vision_model()
    question = {"type": "predicate", "name": "damage", "instructions": [
        {"type": "input_text", "text": "Does the photo show damage?"}, {"type": "input_image", "image_url": PNG}]}
    with run_in_thread(create_app(model)) as url:
        decision = await asdk(url).decisions.create(model="fake-dgemma", input=TRAFFIC, questions=[question])
    (damage,) = decision.answers
    assert damage.type == "predicate" and damage.name == "damage" and 0.0 <= damage.probability <= 1.0
    (read,) = fake.read_bodies()
    system, (text, *images) = read["messages"][0]["content"], read["messages"][1]["content"]
    assert text == {"type": "text", "text": TRANSCRIPT}
    assert [i["image_url"]["url"] for i in images] == [PNG, PNG, PNG]
    assert "Does the photo show damage?\n[image 3]" in system


def test_one_conversation_is_read_as_the_same_canvas_in_the_library_and_over_decisions():
    """Issue 34.4: the conversation as Decisions input items through `serve`, and as LangChain
    messages decided in the library, reach the engine as the same text and the same images."""
    from test_decisions_wire import CONVERSATION_ITEMS, conversation_messages

    model, fake = vision_model()
    with run_in_thread(create_app(model)) as url:
        sdk(url).decisions.create(model="fake-dgemma", input=CONVERSATION_ITEMS, questions=[QUESTIONS[0]])
    model.decide(conversation_messages(), {"urgent": Noul(instructions="Is this urgent?")})
    remote, local = (body["messages"][1]["content"] for body in fake.read_bodies())
    assert remote == local and remote[0]["text"].startswith("developer: Route support tickets.\nsystem: Be terse.")
    assert 'ai: [call order_status id=c1] {"order":7 , "days" :7}' in remote[0]["text"].splitlines()


def test_langchain_openais_decisions_model_invokes_and_ainvokes_serve():
    import asyncio

    model, fake = vision_model()
    questions = {"urgent": Predicate(instructions="Is this urgent?"),
                 "team": Choice(instructions="Which team?", choices={"billing": "Payments.", True: None}),
                 "severity": Score(instructions="How severe?", levels=["Cosmetic", "Workaround", "Blocked"])}
    photo = HumanMessage(content=[{"type": "text", "text": "My parcel:"},
                                  {"type": "image", "base64": PNG.split(",", 1)[1], "mime_type": "image/png"}])
    with run_in_thread(create_app(model, api_key=KEY)) as url:
        target = decisions_target(url, "fake-dgemma")
        response = target.invoke({"input": TICKET, "questions": questions})
        pictured = asyncio.run(target.ainvoke({"input": [photo], "questions": {"urgent": questions["urgent"]}}))
    assert set(response.predicates) == {"urgent"} and set(response.scores) == {"severity"}
    team = response.choices["team"]
    assert team.choice in ("billing", True) and set(team.probabilities) == {"billing", True}
    assert response.scores["severity"].legend == {0: "Cosmetic", 1: "Workaround", 2: "Blocked"}
    assert response.model == "fake-dgemma" and response.request_id and response.usage.input_tokens
    assert 0.0 <= pictured.predicates["urgent"].probability <= 1.0
    image_read = fake.read_bodies()[-1]["messages"][1]["content"]
    assert image_read[0]["text"] == "human: My parcel:\n[image 1]" and image_read[1]["image_url"]["url"] == PNG


# -- refusals ---------------------------------------------------------------------------------------


def test_a_question_the_escalation_target_refused_is_a_refusal_the_others_keep_its_distribution():
    """A cascade into a decisions server (known answers): every question is over A's gate; the target's
    distribution and confidence come back as A's answer (path escalated); what it refused is refused."""
    script = {"urgent": Known(0.8), "team": Known({"billing": 0.3, "technical": 0.7}, confidence=0.6),
              "How severe?": Known({0: 0.2, 1: 0.5, 2: 0.3}), "flag": REFUSE}
    with DecisionsServer(script, model="big-decider") as big:
        cascade = function_model(uniform, escalate_to=decisions_target(big.url, "big-decider"))
        with run_in_thread(create_app(cascade)) as url:
            decision = sdk(url).decisions.create(model="function", input=TICKET, questions=QUESTIONS)
            systemone = httpx.post(f"{url}/v1/systemone", timeout=patience(30), json={"state": TICKET, "questions": {
                "flag": {"type": "choice", "instructions": "Flag it?", "criteria": {"yes": None, "no": None}}}})
            seen = metrics_of(url)
        sent = big.bodies[0]
    urgent, team, severity, flag = decision.answers
    assert urgent.probability == pytest.approx(0.8)
    assert (team.choice, team.confidence) == ("technical", 0.6)
    assert [p.probability for p in team.probabilities] == pytest.approx([0.3, 0.7])
    assert [p.probability for p in severity.probabilities] == pytest.approx([0.2, 0.5, 0.3])
    assert (flag.type, flag.name) == ("refusal", "flag")
    figures = [a.model_extra["canvasroute"] for a in decision.answers]  # type: ignore[index]
    assert [(f["path"], f["escalation_model"]) for f in figures[:3]] == [("escalated", "big-decider")] * 3
    assert (figures[3]["path"], figures[3]["refusal"]) == ("unsure", "the target refused to answer")
    assert [q["name"] for q in sent["questions"]] == ["urgent", "team", "questions[2]", "flag"]
    assert sent["input"] == TICKET
    # /v1/systemone has no refusal: the same refused question gets the canvas answer there (path unsure)
    assert systemone.json()["answers"]["flag"]["x_canvasroute"]["refusal"] == "the target refused to answer"
    assert seen[("canvasroute_server_refusals_total", (("reason", "escalation_refused"),))] == 1


def test_a_refusal_downstream_of_a_systemone_target_stays_a_refusal_upstream():
    """Issue 34.2: A escalates over /v1/systemone to B (`serve --escalate-systemone`, here its target
    in a thread), whose own target (a decisions server) refuses `flag`. B answers `flag` with its
    canvas's guess, the refusal named; A read that guess as B's answer (path escalated). Now A's
    `flag` is a refusal, as over /v1/decisions: path unsure, the refusal kept, `{"type": "refusal"}`
    on A's /v1/decisions; the other questions are B's answers."""
    script = {"urgent": Known(0.8), "team": Known({"billing": 0.3, "technical": 0.7}, confidence=0.6),
              "How severe?": Known({0: 0.2, 1: 0.5, 2: 0.3}), "flag": REFUSE}
    with DecisionsServer(script, model="big-decider") as big, \
            run_in_thread(create_app(function_model(uniform, escalate_to=decisions_target(big.url, "big-decider")))
                          ) as b:
        jev = SystemOneDecisionModel(Connection(b, retries=0), model="jev-latest")
        with run_in_thread(create_app(function_model(uniform, escalate_to=jev))) as a:
            decision = sdk(a).decisions.create(model="function", input=TICKET, questions=QUESTIONS)
            systemone = httpx.post(f"{a}/v1/systemone", timeout=patience(30), json={"state": TICKET, "questions": {
                "flag": {"type": "choice", "instructions": "Flag it?", "criteria": {"yes": None, "no": None}}}})
            seen = metrics_of(a)
    urgent, team, severity, flag = decision.answers
    figures = [x.model_extra["canvasroute"] for x in decision.answers]  # type: ignore[index]
    assert [(f["path"], f["escalation_model"]) for f in figures[:3]] == [("escalated", "function")] * 3
    assert urgent.probability == pytest.approx(0.8)  # type: ignore[union-attr]
    assert [p.probability for p in team.probabilities] == pytest.approx([0.3, 0.7])  # type: ignore[union-attr]
    assert [p.probability for p in severity.probabilities] == pytest.approx([0.2, 0.5, 0.3])  # type: ignore[union-attr]
    assert (flag.type, flag.name) == ("refusal", "flag")
    assert (figures[3]["path"], figures[3]["cause"], figures[3]["escalation_model"]) == (
        "unsure", "uncertain", "function")  # B refused it
    assert "the target refused to answer" in figures[3]["refusal"]
    body = systemone.json()  # A's /v1/systemone: its own canvas answer, the refusal named
    assert body["answers"]["flag"]["x_canvasroute"]["path"] == "unsure"
    assert "the target refused to answer" in body["diagnostics"]["refused"]["flag"]
    assert seen[("canvasroute_server_refusals_total", (("reason", "escalation_refused"),))] == 1


def test_refuse_unsure_refuses_what_the_gate_did_not_pass_and_nothing_answered():
    body = {"model": "function", "input": TICKET, "questions": QUESTIONS[:2]}
    model = function_model(uniform)  # no target: every question stays unsure
    with run_in_thread(create_app(model, refuse_unsure=True)) as strict, run_in_thread(create_app(model)) as lenient:
        refused = httpx.post(f"{strict}/v1/decisions", json=body, timeout=patience(30)).json()
        answered = httpx.post(f"{lenient}/v1/decisions", json=body, timeout=patience(30)).json()
        seen = metrics_of(strict)
    assert [a["type"] for a in refused["answers"]] == ["refusal", "refusal"]
    assert [a["canvasroute"]["path"] for a in refused["answers"]] == ["unsure", "unsure"]
    assert [a["type"] for a in answered["answers"]] == ["predicate", "choice"]  # the default answers, as systemone
    assert [a["canvasroute"]["cause"] for a in answered["answers"]] == ["uncertain", "uncertain"]
    assert seen[("canvasroute_server_refusals_total", (("reason", "unsure"),))] == 2
    confident_model = function_model(confident)
    with run_in_thread(create_app(confident_model, refuse_unsure=True)) as url:
        passed = httpx.post(f"{url}/v1/decisions", json=body, timeout=patience(30)).json()
    assert [a["type"] for a in passed["answers"]] == ["predicate", "choice"]  # the gate passed them: answered


def test_the_escalation_budget_holds_on_this_wire_too():
    """One escalated question per window: the first request's question escalates; past the budget a
    question is answered from the canvas (path unsure, cause over_budget), a refusal with
    refuse_unsure, or 429 (the SDK's RateLimitError) with over_budget='raise'."""
    def cascade(**outcomes: Any) -> CanvasDecisionModel:
        return function_model(uniform, outcomes=OutcomePolicy(**outcomes), escalate_to=Escalation(
            function_model(confident), budget=EscalationBudget(max_per_window=1, window_s=3600)))

    body = {"model": "function", "input": TICKET, "questions": QUESTIONS[:1]}
    with run_in_thread(create_app(cascade())) as answers, \
            run_in_thread(create_app(cascade(), refuse_unsure=True)) as refuses, \
            run_in_thread(create_app(cascade(over_budget="raise"))) as raises:
        first = [httpx.post(f"{u}/v1/decisions", json=body, timeout=patience(30)).json()["answers"][0]
                 for u in (answers, refuses, raises)]
        spent = httpx.post(f"{answers}/v1/decisions", json=body, timeout=patience(30)).json()["answers"][0]
        refused = httpx.post(f"{refuses}/v1/decisions", json=body, timeout=patience(30)).json()["answers"][0]
        limited = _status_error(lambda: sdk(raises).decisions.create(**body))
    assert {a["canvasroute"]["path"] for a in first} == {"escalated"}
    assert (spent["type"], spent["canvasroute"]["path"], spent["canvasroute"]["cause"]) == (
        "predicate", "unsure", "over_budget")
    assert (refused["type"], refused["canvasroute"]["cause"]) == ("refusal", "over_budget")
    assert (type(limited), limited.code) == (openai.RateLimitError, "escalation_budget_exhausted")


class Refuser(BaseDecisionModel):
    """A decision model that refuses every request (as a provider's `ModelRefusalError`)."""

    @property
    def _provider(self) -> str:
        return "refuser"

    def _classify(self, state: Any, questions: dict[str, Any]) -> Any:
        raise ModelRefusalError("policy")


def test_a_decision_model_that_refuses_refuses_every_question():
    with run_in_thread(create_app(Refuser(model="refuser"))) as url:
        decision = sdk(url).decisions.create(model="refuser", input="x", questions=QUESTIONS[:2])
    assert [(a.type, a.name) for a in decision.answers] == [("refusal", "urgent"), ("refusal", "team")]
    assert decision.model == "refuser"


# -- errors: OpenAI's shape, the statuses the SDK maps ----------------------------------------------


def _status_error(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_errors_are_openais_shape_with_the_sdks_exception_classes():
    model = function_model()
    app = create_app(model, api_key=KEY, limits=Limits(max_questions=3, max_body_bytes=20_000))
    with run_in_thread(app) as url:
        client = sdk(url)

        def create(**fields: Any) -> Any:
            return client.decisions.create(**{"model": "function", "input": TICKET, "questions": QUESTIONS[:1],
                                              **fields})

        bad_field = _status_error(lambda: create(questions=[{"type": "choice", "name": "one", "instructions": "x",
                                                              "choices": [{"value": "a"}]}]))
        too_many = _status_error(lambda: create(questions=QUESTIONS))
        unknown_call = _status_error(lambda: create(input=[{"type": "function_call_output", "call_id": "c9",
                                                            "output": "x"}]))
        not_served = _status_error(lambda: create(model="gpt-6-luna"))
        wrong_key = _status_error(lambda: sdk(url, key="wrong").decisions.create(
            model="function", input="x", questions=QUESTIONS[:1]))
        too_large = _status_error(lambda: create(input="x" * 30_000))
        not_json = httpx.post(f"{url}/v1/decisions", content=b"{", timeout=patience(10),
                              headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
        multipart = httpx.post(f"{url}/v1/decisions", files={"request": b"{}"}, timeout=patience(10),
                               headers={"authorization": f"Bearer {KEY}"})
    assert type(bad_field) is openai.BadRequestError
    assert (bad_field.param, bad_field.code, bad_field.type) == ("questions[0].choices", "array_below_min_length",
                                                                 "invalid_request_error")
    assert (type(too_many), too_many.param, too_many.code) == (openai.BadRequestError, "questions",
                                                              "array_above_max_length")
    assert (unknown_call.param, unknown_call.code) == ("input[0].call_id", "unknown_call_id")
    assert (type(not_served), not_served.status_code, not_served.param, not_served.code) == (
        openai.NotFoundError, 404, "model", "model_not_found")
    assert (type(wrong_key), wrong_key.code) == (openai.AuthenticationError, "invalid_api_key")
    assert (type(too_large), too_large.code) == (openai.BadRequestError, "payload_too_large")  # 413 elsewhere
    assert (not_json.status_code, not_json.json()["error"]["code"]) == (400, "invalid_json")
    assert set(not_json.json()["error"]) == {"message", "type", "param", "code"}
    assert (multipart.status_code, multipart.json()["error"]["code"]) == (400, "unsupported_media_type")
    assert model.engine.reads == []  # nothing refused reached the engine


def test_engine_faults_and_the_rate_limit_keep_their_status_and_retry_after():
    def down(engine: FunctionEngine) -> Any:
        def read(_: Any) -> Any:
            raise EngineUnavailable("vLLM at http://10.0.0.9:8000 is down")
        return read

    with run_in_thread(create_app(function_model(down))) as url:
        fault = _status_error(lambda: sdk(url).decisions.create(model="function", input="x", questions=QUESTIONS[:1]))
    with run_in_thread(create_app(function_model(), rate_limit=0.01, rate_burst=1)) as url:
        sdk(url).decisions.create(model="function", input="x", questions=QUESTIONS[:1])
        limited = _status_error(lambda: sdk(url).decisions.create(model="function", input="x",
                                                                  questions=QUESTIONS[:1]))
    assert (type(fault), fault.status_code, fault.code, fault.type) == (openai.InternalServerError, 503,
                                                                      "engine_unavailable", "server_error")
    assert "10.0.0.9" not in fault.message and fault.response.headers["retry-after"] == "1"
    assert (type(limited), limited.code) == (openai.RateLimitError, "rate_limit_exceeded")
    assert int(limited.response.headers["retry-after"]) >= 1


def test_400_questions_are_answered_in_order_and_the_401st_is_refused():
    with run_in_thread(create_app(function_model())) as url:
        many = [{"type": "predicate", "name": f"q{i}", "instructions": f"Is statement {i} true?"} for i in range(400)]
        decision = sdk(url).decisions.create(model="function", input=TICKET, questions=many)
        over = _status_error(lambda: sdk(url).decisions.create(model="function", input=TICKET, questions=[
            *many, {"type": "predicate", "instructions": "One more?"}]))
    assert [a.name for a in decision.answers] == [f"q{i}" for i in range(400)]
    assert (over.param, over.code) == ("questions", "array_above_max_length")


# -- what both wires share --------------------------------------------------------------------------


def test_both_wires_share_admission_metrics_ids_and_the_access_log(spans, caplog):
    app = create_app(function_model(), api_key=KEY)
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "function", "input": TICKET, "questions": QUESTIONS[:2]}
    with caplog.at_level("INFO", logger="canvasroute.server.access"), run_in_thread(app) as url:
        limit_s = patience(30)
        ok = httpx.post(f"{url}/v1/decisions", json=body, headers={**auth, "x-request-id": "req-42"}, timeout=limit_s)
        denied = httpx.post(f"{url}/v1/decisions", json=body, timeout=limit_s)
        jev = httpx.post(f"{url}/v1/systemone", headers=auth, timeout=limit_s, json={"state": TICKET, "questions": {
            "urgent": {"type": "noul", "instructions": "Is this urgent?"}}})
        seen = metrics_of(url)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "req-42"
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert jev.status_code == 200
    route = ("route", "/v1/decisions")
    assert seen[("canvasroute_server_requests_total", (("method", "POST"), route, ("status", "200")))] == 1
    assert seen[("canvasroute_server_requests_total", (("method", "POST"), route, ("status", "401")))] == 1
    assert seen[("canvasroute_server_decisions_total", (("cause", "none"), ("path", "canvas")))] == 3  # both wires
    assert seen[("canvasroute_server_rejections_total", (("reason", "invalid_api_key"),))] == 1
    assert seen[("canvasroute_server_queue_wait_seconds_count", ())] == 2  # one gate for both
    assert any("POST /v1/decisions 200" in r.getMessage() and "req-42" in r.getMessage() for r in caplog.records)
    servers = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    decided = next(s for s in servers if s.name == "POST /v1/decisions" and s.attributes["http.response.status_code"]
                   == 200)
    assert decided.attributes["http.route"] == "/v1/decisions"
    assert decided.attributes["canvasroute.questions"] == 2
    assert decided.attributes["canvasroute.decision_set"] == "urgent,team"
    assert any(s.parent is not None and s.parent.span_id == decided.context.span_id
               for s in spans.get_finished_spans() if s.name.startswith("decide"))  # the decision under the route


def test_the_openapi_document_describes_the_decisions_route():
    with run_in_thread(create_app(function_model())) as url:
        doc = httpx.get(f"{url}/openapi.json", timeout=patience(10)).json()
    post = doc["paths"]["/v1/decisions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/DecisionsRequest")
    assert {"200", "400", "401", "404", "429", "503", "529"} <= set(post["responses"])
    assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/DecisionsErrorResponse")
    schemas = doc["components"]["schemas"]
    assert schemas["DecisionsRequest"]["properties"]["questions"]["maxItems"] == Limits().max_questions == 400
    assert {"predicate", "choice", "score", "refusal"} == {
        s.removeprefix("#/components/schemas/").removesuffix("Answer").lower()
        for s in schemas["DecisionsResponse"]["properties"]["answers"]["items"]["discriminator"]["mapping"].values()}


# -- canvasroute serve's flags ---------------------------------------------------------------------


def test_serve_flags_choose_an_escalation_target_of_each_wire(monkeypatch, capsys):
    url = ["--engine-url", "http://127.0.0.1:9"]
    decisions = serve.build_model(_args([*url, "--escalate-decisions", "http://127.0.0.1:11/v1",
                                         "--escalate-model", "b-model"])).escalate_to.target
    assert isinstance(decisions, OpenAIDecisions)
    assert (decisions.base_url, decisions.model, decisions.max_retries) == ("http://127.0.0.1:11/v1", "b-model", 2)
    jev = serve.build_model(_args([*url, "--escalate-systemone", "http://127.0.0.1:12"])).escalate_to.target
    assert isinstance(jev, SystemOneDecisionModel)
    assert (jev.connection.urls, jev.model, jev.connection.retries.max_retries) == (("http://127.0.0.1:12",),
                                                                                   "jev-latest", 2)
    assert serve.run(_args([*url, "--escalate-decisions", "http://127.0.0.1:11/v1"])) == 2
    assert "--escalate-decisions needs --escalate-model" in capsys.readouterr().err
    assert serve.run(_args([*url, "--escalate-url", "http://127.0.0.1:11/v1", "--escalate-systemone",
                            "http://127.0.0.1:12", "--escalate-model", "m"])) == 2
    assert "one escalation target at a time" in capsys.readouterr().err
    assert serve.build_app(_args(url)).state.refuse_unsure is False
    assert serve.build_app(_args([*url, "--refuse-unsure"])).state.refuse_unsure is True
    monkeypatch.setenv("CANVASROUTE_REFUSE_UNSURE", "1")
    monkeypatch.setenv("CANVASROUTE_ESCALATE_DECISIONS", "http://127.0.0.1:13/v1")
    args = _args([*url, "--escalate-model", "b"])
    assert args.refuse_unsure is True and args.escalate_decisions == "http://127.0.0.1:13/v1"


# -- the real vLLM server ------------------------------------------------------------------------


@pytest.mark.vllm
async def test_the_sdks_against_serve_on_real_vllm_answer_what_the_model_decides_in_process(vllm_url):
    """The `openai` SDK (sync with agent traffic, async with text) and `OpenAIDecisions` through
    `canvasroute serve` on the real vLLM CPU server: the answers are what the same model decides
    in-process on the same transcript (reads are seeded); images are refused (400) by a server
    whose vLLM reads none. Prints a /v1/decisions request's latency beside /v1/systemone's."""
    model = CanvasDecisionModel(engine=VLLMServerEngine(vllm_url), policy=GatePolicy(rereads=0))
    text_only: list[Any] = [
        {"role": "developer", "content": "You route support tickets."},
        {"role": "user", "content": [{"type": "input_text", "text": "Where is my order?"},
                                     {"type": "input_json", "data": {"order": 42}}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup_order", "arguments": '{"id": 42}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "shipped"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "grep_logs", "input": "order 42"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "lost in transit"}]
    jev_questions = {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                     "team": {"type": "choice", "instructions": "Which team?",
                              "criteria": {"billing": "Payments.", "technical": None}}}
    with run_in_thread(create_app(model, api_key=KEY)) as url:
        traffic = sdk(url).decisions.create(model="tiny-dgemma", input=text_only, questions=QUESTIONS)
        text = await asdk(url).decisions.create(model="tiny-dgemma", input=TICKET, questions=QUESTIONS[:2])
        lc = decisions_target(url, "tiny-dgemma").invoke({"input": TICKET, "questions": {
            "urgent": Predicate(instructions="Is this urgent?")}})
        images = _status_error(lambda: sdk(url).decisions.create(model="tiny-dgemma", input=TRAFFIC,
                                                                 questions=QUESTIONS[:1]))
        timings: dict[str, list[float]] = {"/v1/decisions": [], "/v1/systemone": []}
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                                     timeout=patience(120)) as http:
            for _ in range(3):
                for route, body in (("/v1/decisions", {"model": "tiny-dgemma", "input": TICKET,
                                                       "questions": QUESTIONS[:2]}),
                                    ("/v1/systemone", {"state": TICKET, "questions": jev_questions})):
                    started = time.perf_counter()
                    r = await http.post(route, json=body)
                    timings[route].append(time.perf_counter() - started)
                    assert r.status_code == 200, r.text
    direct = await model.adecide(TICKET, {q["name"]: _jev(q) for q in QUESTIONS[:2]})
    assert text.answers[0].probability == pytest.approx(direct.answers["urgent"].noul, abs=1e-9)
    assert [p.probability for p in text.answers[1].probabilities] == pytest.approx(
        [direct.answers["team"].probabilities[k] for k in ("billing", "technical")], abs=1e-9)
    alone = await model.adecide(TICKET, {"urgent": Noul(instructions="Is this urgent?")})
    assert lc.predicates["urgent"].probability == pytest.approx(alone.answers["urgent"].noul, abs=1e-9)
    assert [(a.type, a.name) for a in traffic.answers] == [
        ("predicate", "urgent"), ("choice", "team"), ("score", None), ("choice", "flag")]
    assert traffic.answers[3].choice in (True, "true") and traffic.model == "tiny-dgemma"  # type: ignore[union-attr]
    transcript = ('developer: You route support tickets.\nhuman: Where is my order?\n{"order":42}\n'
                  'ai: [call lookup_order id=call_1] {"id": 42}\ntool: [lookup_order id=call_1] shipped\n'
                  'ai: [custom call grep_logs id=call_2] order 42\ntool: [grep_logs id=call_2] lost in transit')
    in_process = await model.adecide(transcript, {q.get("name") or "questions[2]": _jev(q) for q in QUESTIONS})
    assert traffic.answers[0].probability == pytest.approx(in_process.answers["urgent"].noul, abs=1e-9)
    assert (type(images), images.code) == (openai.BadRequestError, "images_unsupported")
    print("latency on the vLLM CPU server, same text and questions (s): " + "; ".join(
        f"{route} median {sorted(t)[1]:.3f} (runs {', '.join(f'{x:.3f}' for x in t)})" for route, t in timings.items()))


def _jev(q: dict[str, Any]) -> Any:
    """A wire question as the langchain-core question the server asks the model."""
    if q["type"] == "predicate":
        return Noul(instructions=q["instructions"])
    if q["type"] == "score":
        return LCScore(instructions=q["instructions"], criteria=[
            f"{lv['label']}: {lv['description']}" if lv.get("description") else lv["label"] for lv in q["levels"]])
    strings = {c["value"] for c in q["choices"] if isinstance(c["value"], str)}
    names = [c["value"] if isinstance(c["value"], str) else str(c["value"]).lower() + (
        " (boolean)" if str(c["value"]).lower() in strings else "") for c in q["choices"]]
    return LCChoice(instructions=q["instructions"],
                    criteria=dict(zip(names, (c.get("description") for c in q["choices"]), strict=True)))


@contextmanager
def serving(argv: list[str], tmp_path: Any, name: str) -> Iterator[str]:
    """`canvasroute serve` as a process on a free loopback port; stopped (SIGINT) after."""
    port = _free_port()
    log = (tmp_path / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "canvasroute.apps.cli", "serve", *argv, "--port", str(port),
                             "--log-level", "warning"], cwd=tmp_path, env=child_env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=patience(2)).status_code == 200,
                   Watch(proc.pid, cpu_s=90, idle_s=60, what=name), what=f"{name} starting", proc=proc,
                   log=tmp_path / f"{name}.log")
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        if wait(proc, Watch(proc.pid, cpu_s=60, idle_s=60, what=f"{name} stopping")) is None:
            proc.kill()
            proc.wait()
        log.close()
        assert proc.returncode == 0, (tmp_path / f"{name}.log").read_text()


@pytest.mark.vllm
def test_a_cascade_of_two_serve_processes_on_real_vllm(vllm_url, tmp_path):
    """Serve A (a gate nothing passes) escalates to serve B's /v1/decisions through
    `--escalate-decisions`, both real processes on the real vLLM server. B passes every question
    but `secret`, which its policy file holds to a gate nothing passes, and B refuses what stays
    unsure (`--refuse-unsure`). A's answers are B's (path escalated, B's distribution, not one-hot);
    B's refusal is A's refusal."""
    policy = save_policy(tmp_path / "b-policy.json", GatePolicy(max_normalized_entropy=1.0, per_question={
        "secret": GatePolicy(max_normalized_entropy=0.0)}))
    questions = [*QUESTIONS[:2], {"type": "score", "name": "severity", "instructions": "How severe?",
                                  "levels": [{"label": "Cosmetic"}, {"label": "Blocked"}]},
                 {"type": "predicate", "name": "secret", "instructions": "Is a card number shown?"}]
    body = {"model": "tiny-dgemma", "input": TICKET, "questions": questions}
    with serving(["--engine-url", vllm_url, "--policy", str(policy), "--refuse-unsure"], tmp_path, "b") as b, \
            serving(["--engine-url", vllm_url, "--max-normalized-entropy", "0", "--rereads", "0",
                     "--escalate-decisions", f"{b}/v1", "--escalate-model", "tiny-dgemma"], tmp_path, "a") as a:
        cascaded = sdk(a).decisions.create(**body)
        asked_b = sdk(b).decisions.create(**body)
        seen = metrics_of(a)
    answers = {x.name: x for x in cascaded.answers}
    from_b = {x.name: x for x in asked_b.answers}
    figures = {x.name: x.model_extra["canvasroute"] for x in cascaded.answers}  # type: ignore[index]
    for name in ("urgent", "team", "severity"):
        assert (figures[name]["path"], figures[name]["cause"]) == ("escalated", "uncertain"), name
        assert figures[name]["escalation_model"] == asked_b.model == "tiny-dgemma"
    assert answers["urgent"].probability == pytest.approx(from_b["urgent"].probability, abs=1e-9)  # type: ignore[union-attr]
    for name in ("team", "severity"):
        mine = [p.probability for p in answers[name].probabilities]  # type: ignore[union-attr]
        assert mine == pytest.approx([p.probability for p in from_b[name].probabilities], abs=1e-9)  # type: ignore[union-attr]
        assert 0.0 < max(mine) < 1.0  # B's canvas distribution, not a one-hot escalation answer
    assert (answers["secret"].type, from_b["secret"].type) == ("refusal", "refusal")
    assert (figures["secret"]["path"], figures["secret"]["escalation_model"]) == ("unsure", "tiny-dgemma")
    assert seen[("canvasroute_server_decisions_total", (("cause", "uncertain"), ("path", "escalated")))] == 3
    assert seen[("canvasroute_server_refusals_total", (("reason", "escalation_refused"),))] == 1
    assert json.loads((tmp_path / "b-policy.json").read_text())["policy"]["per_question"]["secret"]


@pytest.mark.vllm
def test_a_refusal_stays_a_refusal_through_serve_escalate_systemone_on_real_vllm(vllm_url, tmp_path):
    """Issue 34.2, as processes on the real vLLM server: A (a gate nothing passes) escalates to B
    through `--escalate-systemone`; B passes every question but `secret`, which it escalates to C (a
    decisions server) that refuses it. A's answers are B's (path escalated); B's refusal, which B's
    /v1/systemone answers with its canvas's guess, is A's refusal: `{"type": "refusal"}`."""
    policy = save_policy(tmp_path / "b-policy.json", GatePolicy(max_normalized_entropy=1.0, per_question={
        "secret": GatePolicy(max_normalized_entropy=0.0)}))
    questions = [*QUESTIONS[:2], {"type": "predicate", "name": "secret", "instructions": "Is a card number shown?"}]
    body = {"model": "tiny-dgemma", "input": TICKET, "questions": questions}
    with DecisionsServer({"secret": REFUSE}, model="big-decider") as c, \
            serving(["--engine-url", vllm_url, "--policy", str(policy), "--escalate-decisions", f"{c.url}/v1",
                     "--escalate-model", "big-decider"], tmp_path, "b") as b, \
            serving(["--engine-url", vllm_url, "--max-normalized-entropy", "0", "--rereads", "0",
                     "--escalate-systemone", b], tmp_path, "a") as a:
        cascaded = sdk(a).decisions.create(**body)
        from_b = httpx.post(f"{b}/v1/systemone", timeout=patience(60), json={"state": TICKET, "questions": {
            "secret": {"type": "noul", "instructions": "Is a card number shown?"}}}).json()
        seen = metrics_of(a)
    answers = {x.name: x for x in cascaded.answers}
    figures = {x.name: x.model_extra["canvasroute"] for x in cascaded.answers}  # type: ignore[index]
    for name in ("urgent", "team"):
        assert (figures[name]["path"], figures[name]["escalation_model"]) == ("escalated", "tiny-dgemma"), name
    assert answers["secret"].type == "refusal"
    assert from_b["answers"]["secret"]["type"] == "noul"  # B's canvas guess, for plain Jev clients ...
    assert from_b["diagnostics"]["refused"]["secret"]  # ... and the refusal, named
    assert (figures["secret"]["path"], figures["secret"]["escalation_model"]) == ("unsure", "tiny-dgemma")
    assert seen[("canvasroute_server_refusals_total", (("reason", "escalation_refused"),))] == 1
