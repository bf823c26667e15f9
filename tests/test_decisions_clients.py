"""Real clients of `/v1/decisions` against the known-answers server, unchanged: the `openai` SDK's
`client.decisions.create` (sync and async, strict response validation) and langchain-openai's
`OpenAIDecisions` (`invoke` / `ainvoke`). The server parses with canvasroute's parser and answers
with its renderer, so these are the wire's end-to-end checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from decisions_server import PNG, REFUSE, DecisionsServer, Known
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai.decisions import Choice, Level, OpenAIDecisions, Predicate, Score
from pydantic import SecretStr

pytestmark = pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")

SCRIPT = {
    "urgent": Known(0.9),
    "team": Known({"billing": 0.7, "technical": 0.3}, confidence=0.55),
    "severity": Known({0: 0.1, 1: 0.2, 2: 0.7}),
    "secret": REFUSE,
    "flag": Known({True: 0.8, "true": 0.2}),
    "Does the photo show damage?": Known(0.35),
}
QUESTIONS: list[Any] = [
    {"type": "predicate", "name": "urgent", "instructions": "Is this urgent?"},
    {"type": "choice", "name": "team", "instructions": "Which team?",
     "choices": [{"value": "billing", "description": "Payments."}, {"value": "technical"}]},
    {"type": "score", "name": "severity", "instructions": "How severe?",
     "levels": [{"label": "Cosmetic"}, {"label": "Workaround"}, {"label": "Blocked"}]},
    {"type": "predicate", "name": "secret", "instructions": "What is the card number?"},
]


@pytest.fixture(scope="module")
def server() -> Iterator[DecisionsServer]:
    with DecisionsServer(SCRIPT) as running:
        yield running


@pytest.fixture
def fresh(server: DecisionsServer) -> Iterator[DecisionsServer]:
    server.failures.clear()
    yield server
    server.failures.clear()


def client(server: DecisionsServer, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test-key", _strict_response_validation=True, **kwargs)


def aclient(server: DecisionsServer, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test-key", _strict_response_validation=True,
                              **kwargs)


# -- the openai SDK ----------------------------------------------------------------------------


def test_sdk_create_predicate_choice_score_and_a_refusal(fresh: DecisionsServer) -> None:
    before = fresh.count
    decision = client(fresh).decisions.create(model="gpt-6-luna", input="Stripe fails. Help!", questions=QUESTIONS)
    urgent, team, severity, secret = decision.answers
    assert urgent.type == "predicate" and urgent.name == "urgent" and urgent.probability == pytest.approx(0.9)
    assert team.type == "choice" and team.choice == "billing" and team.confidence == 0.55
    assert [(p.value, p.probability) for p in team.probabilities] == [("billing", 0.7), ("technical", 0.3)]
    assert severity.type == "score" and severity.score == pytest.approx(1.6)
    assert [p.label for p in severity.probabilities] == ["Cosmetic", "Workaround", "Blocked"]
    assert secret.type == "refusal" and secret.name == "secret"
    assert decision.model == "known-answers"
    assert decision.usage.total_tokens == 13 and decision.usage.input_tokens_details.cached_tokens == 3
    assert fresh.count == before + 1
    assert fresh.bodies[-1] == {"model": "gpt-6-luna", "input": "Stripe fails. Help!", "questions": QUESTIONS}
    assert fresh.headers[-1]["authorization"] == "Bearer test-key"


async def test_sdk_async_agent_traffic_and_images(fresh: DecisionsServer) -> None:
    traffic: list[Any] = [
        {"role": "developer", "content": "You route support tickets."},
        {"role": "user", "content": [{"type": "input_text", "text": "My parcel arrived like this:"},
                                     {"type": "input_image", "image_url": PNG, "detail": "high"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look up the order."}],
         "phase": "commentary"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup_order", "arguments": '{"id": 42}'},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "shipped"}, {"type": "input_image", "image_url": PNG}]},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "grep_logs", "input": "order 42"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "damaged in transit"},
    ]
    questions: list[Any] = [
        {"type": "predicate", "name": "urgent", "instructions": "Is this urgent?"},
        {"type": "predicate", "instructions": [{"type": "input_text", "text": "Does the photo show damage?"},
                                               {"type": "input_image", "image_url": PNG}]},
    ]
    decision = await aclient(fresh).decisions.create(model="gpt-6-luna", input=traffic, questions=questions)
    assert [(a.type, a.name) for a in decision.answers] == [("predicate", "urgent"), ("predicate", None)]
    assert decision.answers[1].probability == pytest.approx(0.35)  # type: ignore[union-attr]
    assert fresh.bodies[-1]["input"] == traffic  # as the caller built it, images and all


def test_sdk_typed_choice_values_come_back_as_they_were_sent(fresh: DecisionsServer) -> None:
    decision = client(fresh).decisions.create(model="m", input="x", questions=[
        {"type": "choice", "name": "flag", "instructions": "Flag?", "choices": [{"value": True}, {"value": "true"}]}])
    flag = decision.answers[0]
    assert flag.type == "choice" and flag.choice is True
    assert [(type(p.value), p.value, p.probability) for p in flag.probabilities] == [(bool, True, 0.8),
                                                                                     (str, "true", 0.2)]
    assert fresh.bodies[-1]["questions"][0]["choices"] == [{"value": True}, {"value": "true"}]


def test_sdk_a_request_the_wire_refuses_is_a_bad_request_naming_the_field(fresh: DecisionsServer) -> None:
    bad = [*QUESTIONS[:3], {"type": "choice", "name": "one", "instructions": "x", "choices": [{"value": "a"}]}]
    with pytest.raises(openai.BadRequestError) as info:
        client(fresh, max_retries=0).decisions.create(model="m", input="x", questions=bad)
    error = info.value
    assert (error.status_code, error.param, error.code, error.type) == (400, "questions[3].choices",
                                                                      "array_below_min_length",
                                                                      "invalid_request_error")
    assert "questions[3].choices" in error.message


@pytest.mark.parametrize(("status", "exception"), [
    (400, openai.BadRequestError), (401, openai.AuthenticationError), (403, openai.PermissionDeniedError),
    (404, openai.NotFoundError), (409, openai.ConflictError), (422, openai.UnprocessableEntityError),
    (429, openai.RateLimitError), (500, openai.InternalServerError), (503, openai.InternalServerError),
    (418, openai.APIStatusError),
])
def test_sdk_maps_each_status_to_its_exception(fresh: DecisionsServer, status: int,
                                               exception: type[openai.APIStatusError]) -> None:
    fresh.fail(status)
    with pytest.raises(exception) as info:
        client(fresh, max_retries=0).decisions.create(model="m", input="x", questions=QUESTIONS[:1])
    assert type(info.value) is exception
    assert info.value.status_code == status and info.value.code == "scripted"
    assert str(info.value) == f"Error code: {status} - scripted failure {status}"


def test_sdk_retries_what_may_pass(fresh: DecisionsServer) -> None:
    fresh.fail(503, times=2, headers={"retry-after-ms": "1"})
    before = fresh.count
    decision = client(fresh, max_retries=2).decisions.create(model="m", input="x", questions=QUESTIONS[:1])
    assert decision.answers[0].type == "predicate"
    assert fresh.count == before + 3


# -- langchain-openai's OpenAIDecisions -----------------------------------------------------------


def decisions(server: DecisionsServer, **kwargs: Any) -> OpenAIDecisions:
    return OpenAIDecisions(model="gpt-6-luna", api_key=SecretStr("test-key"), base_url=server.url + "/v1", **kwargs)


LC_QUESTIONS: dict[str, Any] = {
    "urgent": Predicate(instructions="Is this urgent?"),
    "team": Choice(instructions="Which team?", choices={"billing": "Payments.", "technical": None}),
    "severity": Score(instructions="How severe?", levels=["Cosmetic", Level(label="Workaround",
                                                                            description="Another way works."),
                                                          "Blocked"]),
    "secret": Predicate(instructions="What is the card number?"),
}


def test_openai_decisions_invoke(fresh: DecisionsServer) -> None:
    response = decisions(fresh).invoke({"input": "Stripe fails. Help!", "questions": LC_QUESTIONS})
    assert response.predicates["urgent"].probability == pytest.approx(0.9)
    assert response.choices["team"].choice == "billing"
    assert response.choices["team"].probabilities == {"billing": 0.7, "technical": 0.3}
    assert response.scores["severity"].legend == {0: "Cosmetic", 1: "Workaround", 2: "Blocked"}
    assert response.scores["severity"].probabilities == {0: 0.1, 1: 0.2, 2: 0.7}
    assert set(response.refusals) == {"secret"}
    assert (response.usage.input_tokens, response.usage.output_tokens) == (11, 2)
    assert response.request_id == f"req_{fresh.count}"
    sent = fresh.bodies[-1]["questions"]
    assert sent[2]["levels"] == [{"label": "Cosmetic"}, {"label": "Workaround", "description": "Another way works."},
                                 {"label": "Blocked"}]


async def test_openai_decisions_ainvoke_with_images(fresh: DecisionsServer) -> None:
    state = HumanMessage(content=[{"type": "text", "text": "My parcel:"},
                                  {"type": "image", "base64": PNG.split(",", 1)[1], "mime_type": "image/png"}])
    response = await decisions(fresh).ainvoke({"input": [state], "questions": {
        "damage": Predicate(instructions="Does the photo show damage?")}})
    assert response.predicates["damage"].probability == pytest.approx(0.35)
    assert fresh.bodies[-1]["input"] == [{"role": "user", "content": [
        {"type": "input_text", "text": "My parcel:"}, {"type": "input_image", "image_url": PNG}]}]


def test_openai_decisions_sends_a_conversation_as_json_in_one_user_message(fresh: DecisionsServer) -> None:
    """langchain-openai 1.7's `to_decision_input`: only text and `HumanMessage`s go natively; any other
    conversation (system, AI, tool messages) becomes JSON text in one user message."""
    conversation = [SystemMessage("Route tickets."), HumanMessage("Help!"), AIMessage("On it.")]
    decisions(fresh).invoke({"input": conversation, "questions": {"urgent": LC_QUESTIONS["urgent"]}})
    (message,) = fresh.bodies[-1]["input"]
    assert message["role"] == "user" and [p["type"] for p in message["content"]] == ["input_text"]
    assert '"role": "system"' in message["content"][0]["text"]


def test_openai_decisions_errors_are_langchains_openai_errors(fresh: DecisionsServer) -> None:
    fresh.fail(401)
    with pytest.raises(openai.AuthenticationError) as info:
        decisions(fresh, max_retries=0).invoke({"input": "x", "questions": {"urgent": LC_QUESTIONS["urgent"]}})
    assert type(info.value).__name__ == "OpenAIAuthenticationError"
    fresh.fail(200, body={"answers": "not a list"})
    with pytest.raises(openai.APIResponseValidationError):
        decisions(fresh, max_retries=0).invoke({"input": "x", "questions": {"urgent": LC_QUESTIONS["urgent"]}})
