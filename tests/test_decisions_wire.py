"""`/v1/decisions` parse and render (apps/server/decisions/), checked against the `openai` SDK's own types."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from decisions_server import PNG
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage, convert_to_openai_messages
from openai.types import Decision

from canvasroute.apps.server import Limits
from canvasroute.apps.server.decisions import (
    DecisionsWireError,
    QuestionResult,
    Usage,
    error_body,
    from_refusal,
    parse,
    render,
)
from canvasroute.apps.server.wire import Refusal
from canvasroute.router._state import read_state, state_images

URL = "https://example.com/cat.png"
PREDICATE = {"type": "predicate", "name": "urgent", "instructions": "Is this urgent?"}
CHOICE = {"type": "choice", "name": "team", "instructions": "Which team?",
          "choices": [{"value": "billing", "description": "Payments."}, {"value": "tech"}]}
SCORE = {"type": "score", "name": "severity", "instructions": "How severe?",
         "levels": [{"label": "Cosmetic"}, {"label": "Workaround", "description": "Another way works."},
                    {"label": "Blocked"}]}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt-6-luna", "input": "Stripe fails to connect. Help!",
            "questions": [PREDICATE, CHOICE, SCORE], **fields}


def wire_error(data: Any, **kwargs: Any) -> DecisionsWireError:
    with pytest.raises(DecisionsWireError) as info:
        parse(data, **kwargs)
    return info.value


# -- input -----------------------------------------------------------------------------------


def test_text_input_and_the_three_question_types() -> None:
    req = parse(body())
    assert req.model == "gpt-6-luna"
    assert req.state == req.text == "Stripe fails to connect. Help!"
    assert req.images == ()
    assert req.questions_by_id() == {
        "urgent": Noul(instructions="Is this urgent?"),
        "team": Choice(instructions="Which team?", criteria={"billing": "Payments.", "tech": None}),
        "severity": Score(instructions="How severe?", criteria=["Cosmetic", "Workaround: Another way works.",
                                                                "Blocked"]),
    }
    assert [q.options for q in req.questions] == [("yes", "no"), ("billing", "tech"), ("0", "1", "2")]
    assert req.questions[2].labels == ("Cosmetic", "Workaround", "Blocked")
    assert [(q.index, q.name, q.kind) for q in req.questions] == [
        (0, "urgent", "predicate"), (1, "team", "choice"), (2, "severity", "score")]


def test_messages_of_every_role_with_text_image_and_json_parts() -> None:
    req = parse(body(input=[
        {"role": "developer", "content": "Route support tickets."},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "My card:"},
                                     {"type": "input_image", "image_url": PNG, "detail": "low"},
                                     {"type": "input_json", "data": {"order": 42, "paid": True}},
                                     {"type": "input_image", "image_url": URL}]},
        {"role": "assistant", "phase": "commentary",
         "content": [{"type": "output_text", "text": "Looking."}, {"type": "refusal", "refusal": "No card data."}]},
    ]))
    assert isinstance(req.state, tuple)
    developer, system, user, assistant = req.state
    assert isinstance(developer, SystemMessage) and developer.additional_kwargs == {"__openai_role__": "developer"}
    assert isinstance(system, SystemMessage) and system.additional_kwargs == {}
    assert isinstance(user, HumanMessage) and isinstance(assistant, AIMessage)
    assert user.content == [
        {"type": "text", "text": "My card:"},
        {"type": "image", "base64": PNG.split(",", 1)[1], "mime_type": "image/png"},
        {"type": "text", "text": '{"order":42,"paid":true}'},
        {"type": "image", "url": URL},
    ]
    assert assistant.additional_kwargs == {"phase": "commentary"}
    assert req.images == (PNG, URL)
    assert state_images(req.state) == req.images  # the router finds the same images in the messages
    assert req.text == ("developer: Route support tickets.\nsystem: Be terse.\n"
                        'human: My card:\n[image 1]\n{"order":42,"paid":true}\n[image 2]\n'
                        "ai: Looking.\n[refusal] No card data.")
    openai_roles = [m["role"] for m in convert_to_openai_messages(list(req.state))]
    assert openai_roles == ["developer", "system", "user", "assistant"]  # langchain-core reads them back
    assert read_state(req.state) == (req.text, req.images)  # and the library writes the same transcript


def test_agent_traffic_function_and_custom_tool_calls_with_their_outputs() -> None:
    req = parse(body(input=[
        {"role": "user", "content": "What is the weather in Paris, and how many orders?"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "status": "completed"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "run_sql", "namespace": "db",
         "input": "SELECT count(*) FROM orders"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "18C"}, {"type": "input_image", "image_url": PNG}]},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "7"},
        {"type": "function_call", "call_id": "call_3", "name": "broken", "arguments": "{not json"},
        {"type": "function_call_output", "call_id": "call_3", "output": "error"},
    ]))
    assert isinstance(req.state, tuple)
    user, turn, weather, orders, broken, broken_out = req.state
    assert isinstance(user, HumanMessage)
    assert isinstance(turn, AIMessage)  # the assistant's text and the calls right after it: one AI turn
    assert turn.tool_calls == [
        {"type": "tool_call", "name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"},
        {"type": "tool_call", "name": "db.run_sql", "args": {"__arg1": "SELECT count(*) FROM orders"}, "id": "call_2"},
    ]
    assert turn.content == [{"type": "text", "text": "Checking."},  # each call as sent, in order
                            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                             "arguments": '{"city": "Paris"}'},
                            {"type": "custom_tool_call", "call_id": "call_2", "name": "run_sql",
                             "input": "SELECT count(*) FROM orders"}]
    assert isinstance(weather, ToolMessage) and (weather.tool_call_id, weather.name) == ("call_1", "get_weather")
    assert weather.content == [{"type": "text", "text": "18C"},
                               {"type": "image", "base64": PNG.split(",", 1)[1], "mime_type": "image/png"}]
    assert isinstance(orders, ToolMessage) and orders.additional_kwargs == {"type": "custom_tool_call_output"}
    assert isinstance(broken, AIMessage) and broken.tool_calls == []
    assert [(c["name"], c["args"]) for c in broken.invalid_tool_calls] == [("broken", "{not json")]
    assert isinstance(broken_out, ToolMessage)
    assert req.images == (PNG,)
    assert req.text.splitlines() == [
        "human: What is the weather in Paris, and how many orders?",
        "ai: Checking.",
        'ai: [call get_weather id=call_1] {"city": "Paris"}',
        "ai: [custom call db.run_sql id=call_2] SELECT count(*) FROM orders",
        "tool: [get_weather id=call_1] 18C",
        "[image 1]",
        "tool: [db.run_sql id=call_2] 7",
        "ai: [call broken id=call_3] {not json",
        "tool: [broken id=call_3] error",
    ]
    assert read_state(req.state) == (req.text, req.images)  # the library reads the wire's messages as the same text


def test_a_conversation_reads_as_the_same_text_on_the_wire_and_in_the_library() -> None:
    """Defect: the library's transcript of messages dropped tool calls, so a canvas asked whether a
    call needs a human never saw the call; it now writes them as the wire's transcript does."""
    req = parse(body(input=[
        {"role": "user", "content": "Refund order 7 and tell me the weather."},
        {"role": "assistant", "content": "On it."},
        {"type": "function_call", "call_id": "c1", "name": "refund", "arguments": '{"order": 7, "amount": 120.5}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "refunded"},
        {"type": "function_call_output", "call_id": "c2", "output": "error"},
        {"role": "assistant", "content": "Refunded; the weather tool failed."},
    ]))
    assert 'ai: [call refund id=c1] {"order": 7, "amount": 120.5}' in req.text.splitlines()
    assert read_state(req.state)[0] == req.text
    nested = json.loads(read_state({"messages": list(req.state)})[0])["messages"]
    assert nested[1]["tool_calls"] == [{"name": "refund", "id": "c1", "args": {"order": 7, "amount": 120.5}},
                                       {"name": "weather", "id": "c2", "args": "{not json"}]  # unparsed: as sent
    assert (nested[2]["name"], nested[2]["tool_call_id"]) == ("refund", "c1")


# -- one conversation, two representations (issue #34.4) ------------------------------------------

ARGUMENTS = '{"order":7 , "days" :7}'
"""Tool-call arguments as a model sent them (json.dumps would re-space them)."""
CONVERSATION_ITEMS = [
    {"role": "developer", "content": "Route support tickets."},
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": [{"type": "input_text", "text": "My order 7 is late:"},
                                 {"type": "input_image", "image_url": PNG}]},
    {"role": "assistant", "content": "Checking."},
    {"type": "function_call", "call_id": "c1", "name": "order_status", "arguments": ARGUMENTS},
    {"type": "function_call", "call_id": "c2", "name": "refund", "arguments": "{not json"},
    {"type": "function_call_output", "call_id": "c1", "output": "late by 2 days"},
    {"type": "function_call_output", "call_id": "c2", "output": "error"},
    {"role": "assistant", "content": "It is late by 2 days."},
]
"""The conversation as OpenAI Decisions input items (what `/v1/decisions` reads)."""


def _openai(kind: str) -> Any:
    """A `ChatOpenAI` whose server (an httpx `MockTransport`) replies "Checking." with the two calls
    (`responses`: the Responses API; `stream`: chat completions, streamed)."""
    import httpx
    from langchain_openai import ChatOpenAI

    calls = [("c1", "order_status", ARGUMENTS), ("c2", "refund", "{not json")]

    def reply(request: httpx.Request) -> httpx.Response:
        if kind == "responses":
            return httpx.Response(200, json={
                "id": "resp_1", "object": "response", "created_at": 1, "model": "gpt-x", "status": "completed",
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                           *({"type": "function_call", "id": f"fc_{i}", "call_id": i, "name": n, "arguments": a,
                              "status": "completed"} for i, n, a in calls)]})
        deltas = [{"role": "assistant", "content": "Checking."}, *(
            {"tool_calls": [{"index": k, "id": i, "type": "function", "function": {"name": n, "arguments": a}}]}
            for k, (i, n, a) in enumerate(calls))]
        chunks = [{"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "gpt-x",
                   "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    return ChatOpenAI(model="gpt-x", api_key="test", base_url="http://openai.test/v1",
                      use_responses_api=kind == "responses",
                      http_client=httpx.Client(transport=httpx.MockTransport(reply)))


def _assistant_turn(kind: str) -> Any:
    """The assistant's "Checking." and its two calls, as a LangChain user holds them."""
    if kind == "responses":  # langchain-openai keeps a Responses API call as sent, in a content block
        return _openai(kind).invoke("Is order 7 late?")
    if kind == "stream":  # a streamed turn's chunks keep the arguments as sent
        chunks = list(_openai(kind).stream("Is order 7 late?"))
        return sum(chunks[1:], chunks[0])
    return {"role": "assistant", "content": "Checking.",  # an OpenAI chat message, as an app stores it
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "order_status",
                                                                          "arguments": ARGUMENTS}},
                           {"id": "c2", "type": "function", "function": {"name": "refund", "arguments": "{not json"}}]}


def conversation_messages(developer: str = "SystemMessage", assistant: str = "responses") -> list[Any]:
    """`CONVERSATION_ITEMS` as a LangChain user holds the conversation: the developer message as
    langchain-openai reads one (`SystemMessage`), as a `ChatMessage` or as a dict; the assistant's
    turn from `ChatOpenAI` (the Responses API, or streamed chat completions) or as a dict."""
    from langchain_core.messages import ChatMessage

    instructions = "Route support tickets."
    lead = {"SystemMessage": SystemMessage(instructions, additional_kwargs={"__openai_role__": "developer"}),
            "ChatMessage": ChatMessage(role="developer", content=instructions),
            "dict": {"role": "developer", "content": instructions}}[developer]
    return [
        lead,
        SystemMessage("Be terse."),
        HumanMessage(content=[{"type": "text", "text": "My order 7 is late:"},
                              {"type": "image", "base64": PNG.split(",", 1)[1], "mime_type": "image/png"}]),
        _assistant_turn(assistant),
        ToolMessage("late by 2 days", tool_call_id="c1", name="order_status"),
        ToolMessage("error", tool_call_id="c2", name="refund"),
        AIMessage("It is late by 2 days."),
    ]


@pytest.mark.parametrize("developer", ["SystemMessage", "ChatMessage", "dict"])
@pytest.mark.parametrize("assistant", ["responses", "stream", "dict"])
def test_one_conversation_reads_as_the_same_text_from_langchain_messages_and_from_decisions_items(
        developer: str, assistant: str) -> None:
    """The library's transcript of a messages state (`read_state`) is the `/v1/decisions`
    transcript of the same conversation: developer and system messages, a user's text and image,
    the assistant's text and calls with their arguments exactly as sent (an unparsed one
    included), the tool outputs naming their calls."""
    messages = conversation_messages(developer, assistant)
    wire = parse(body(input=CONVERSATION_ITEMS))
    assert wire.text.splitlines()[:4] == ["developer: Route support tickets.", "system: Be terse.",
                                         "human: My order 7 is late:", "[image 1]"]
    assert f"ai: [call order_status id=c1] {ARGUMENTS}" in wire.text.splitlines()
    assert read_state(messages) == (wire.text, wire.images)
    assert read_state(wire.state) == (wire.text, wire.images)  # the wire's own messages read back the same


def test_an_assistant_turn_of_calls_only_reads_the_same_with_or_without_an_empty_message() -> None:
    calls = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    bare, empty = (parse(body(input=[{"role": "user", "content": "Go."}, *lead, *calls]))
                   for lead in ([], [{"role": "assistant", "content": ""}]))
    assert bare.text == empty.text == "human: Go.\nai: [call f id=c1] {}"
    assert read_state(empty.state)[0] == empty.text


def _chat_call(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    """One call as OpenAI's chat API sends it (arguments as text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("ids", [(None, None), ("c", "c")])
def test_every_call_of_a_turn_is_read_without_ids_or_with_a_repeated_id(ids: tuple[Any, Any]) -> None:
    """Defect: the library kept a turn's calls by call id, so calls without an id (or sharing one)
    overwrote each other: two calls read as the last one, or with another call's arguments."""
    first, second = ids
    parsed = [{"name": "a", "args": {"x": 1}, "id": first}, {"name": "b", "args": {"y": 2}, "id": second}]
    sent = [_chat_call(first, "a", '{"x" :1}'), _chat_call(second, "b", '{"y" :2}')]
    assert read_state([AIMessage("", tool_calls=parsed)])[0].splitlines() == [
        f'ai: [call a id={first}] {{"x": 1}}', f'ai: [call b id={second}] {{"y": 2}}']
    as_sent = [f'ai: [call a id={first}] {{"x" :1}}', f'ai: [call b id={second}] {{"y" :2}}']
    kept = AIMessage("", tool_calls=parsed, additional_kwargs={"tool_calls": sent})
    assert read_state([kept])[0].splitlines() == as_sent
    assert read_state([{"role": "assistant", "content": "", "tool_calls": sent}])[0].splitlines() == as_sent
    only_b = AIMessage("", tool_calls=parsed, additional_kwargs={"tool_calls": sent[1:]})  # a's arguments not kept
    assert sorted(read_state([only_b])[0].splitlines()) == [f'ai: [call a id={first}] {{"x": 1}}', as_sent[1]]


def test_a_turn_whose_first_call_did_not_parse_reads_in_the_order_sent_on_the_wire_and_in_the_library() -> None:
    """Defect: the library wrote a turn's unparsed calls after the others, the wire in the order sent."""
    wire = parse(body(input=[
        {"role": "user", "content": "Go."},
        {"type": "function_call", "call_id": "c1", "name": "broken", "arguments": "{not json"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a" :1}'},
    ]))
    assert wire.text.splitlines() == ["human: Go.", "ai: [call broken id=c1] {not json", 'ai: [call f id=c2] {"a" :1}']
    assert read_state(wire.state) == (wire.text, wire.images)
    chat = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "", "tool_calls": [
        _chat_call("c1", "broken", "{not json"), _chat_call("c2", "f", '{"a" :1}')]}]
    assert read_state(chat) == (wire.text, wire.images)


def test_deeply_nested_call_arguments_read_as_sent_on_the_wire_and_in_the_library() -> None:
    """Defect: the wire read arguments nested deeper than the library's `MAX_DEPTH` as sent, while
    the library refused the same conversation (it walked the parsed arguments it never writes)."""
    arguments = '{"a": ' + "[" * 70 + "]" * 70 + "}"
    wire = parse(body(input=[{"role": "user", "content": "Go."},
                             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}]))
    assert wire.text == f"human: Go.\nai: [call f id=c1] {arguments}"
    assert read_state(wire.state) == (wire.text, wire.images)
    chat = [{"role": "user", "content": "Go."},
            {"role": "assistant", "content": "", "tool_calls": [_chat_call("c1", "f", arguments)]}]
    assert read_state(chat) == (wire.text, wire.images)


def test_the_wire_writes_the_librarys_transcript_a_lone_surrogate_included() -> None:
    """The wire's transcript is the library's (`read_state` of the wire's messages), so a lone
    surrogate (valid JSON, no UTF-8 text) becomes U+FFFD on both."""
    wire = parse(body(input=[{"role": "user", "content": "a\ud800b"}]))
    assert wire.text == "human: a\ufffdb"
    assert read_state(wire.state) == (wire.text, wire.images)


@pytest.mark.parametrize(("items", "param", "code"), [
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id", "unknown_call_id"),
    ([{"type": "custom_tool_call", "call_id": "c", "name": "t", "input": "x"},
      {"type": "function_call_output", "call_id": "c", "output": "x"}], "input[1].call_id", "unknown_call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "t", "arguments": "{}"},
      {"type": "function_call", "call_id": "c", "name": "u", "arguments": "{}"}],
     "input[1].call_id", "duplicate_value"),
    ([{"type": "function_call", "call_id": "c", "name": "t"}], "input[0].arguments", "missing_required_parameter"),
    ([{"role": "tool", "content": "x"}], "input[0].role", "invalid_value"),
    ([{"content": "x"}], "input[0].type", "missing_required_parameter"),
    ([{"type": "reasoning", "summary": []}], "input[0].type", "invalid_value"),
    ([{"role": "developer", "content": [{"type": "input_image", "image_url": PNG}]}], "input[0].content[0].type",
     "invalid_value"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "file-abc123"}]}],
     "input[0].content[0].image_url", "invalid_value"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:text/plain;base64,aGk="}]}],
     "input[0].content[0].image_url", "invalid_value"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": PNG, "detail": "max"}]}],
     "input[0].content[0].detail", "invalid_value"),
    ([{"role": "user", "content": [{"type": "input_json", "data": [1, 2]}]}], "input[0].content[0].data",
     "invalid_type"),
    ([{"role": "assistant", "phase": "draft", "content": "x"}], "input[0].phase", "invalid_value"),
    ([], "input", "empty_array"),
])
def test_input_errors_name_the_field(items: list[Any], param: str, code: str) -> None:
    error = wire_error(body(input=items))
    assert (error.status, error.param, error.code) == (400, param, code)
    assert param in error.message


def test_input_json_bounds() -> None:
    deep: Any = {}
    for _ in range(32):
        deep = {"a": deep}
    error = wire_error(body(input=[{"role": "user", "content": [{"type": "input_json", "data": deep}]}]))
    assert error.param == "input[0].content[0].data" and "32 container levels" in error.message
    wide = {"v": list(range(10_000))}
    assert "10000 values" in wire_error(body(input=[{"role": "user", "content": [
        {"type": "input_json", "data": wide}]}])).message


# -- questions -------------------------------------------------------------------------------


def test_choice_values_are_typed_true_and_the_string_true_are_two_options() -> None:
    req = parse(body(questions=[{"type": "choice", "name": "flag", "instructions": "Which?",
                                 "choices": [{"value": True}, {"value": "true", "description": "the word"},
                                             {"value": False}, {"value": "no"}]}]))
    q = req.questions[0]
    assert q.values == (True, "true", False, "no")
    assert [type(v) for v in q.values] == [bool, str, bool, str]
    assert q.options == ("true (boolean)", "true", "false", "no")
    assert q.question == Choice(instructions="Which?", criteria={"true (boolean)": None, "true": "the word",
                                                                 "false": None, "no": None})


def test_unnamed_questions_get_ids_that_no_name_takes() -> None:
    req = parse(body(questions=[{"type": "predicate", "instructions": "A?"},
                                {"type": "predicate", "name": "questions[0]", "instructions": "B?"}]))
    assert [(q.id, q.name) for q in req.questions] == [("questions[0]'", None), ("questions[0]", "questions[0]")]


def test_instructions_as_parts_text_json_and_images() -> None:
    req = parse(body(questions=[{"type": "predicate", "name": "match", "instructions": [
        {"type": "input_text", "text": "Does the photo match the listing?"},
        {"type": "input_json", "data": {"listing": "red bike"}},
        {"type": "input_image", "image_url": PNG}]}]))
    q = req.questions[0]
    assert q.instructions == 'Does the photo match the listing?\n{"listing":"red bike"}'
    assert q.question == Noul(instructions=q.instructions)
    assert q.images == (PNG,)


def four(bad: dict[str, Any]) -> dict[str, Any]:
    return body(questions=[PREDICATE, CHOICE, SCORE, bad])


@pytest.mark.parametrize(("data", "param", "code"), [
    ({"input": "x", "questions": [PREDICATE]}, "model", "missing_required_parameter"),
    (body(model=""), "model", "empty_string"),
    (body(model=7), "model", "invalid_type"),
    ({"model": "m", "questions": [PREDICATE]}, "input", "missing_required_parameter"),
    (body(input=3), "input", "invalid_type"),
    (body(questions=[]), "questions", "empty_array"),
    (body(questions=[PREDICATE | {"name": f"q{i}"} for i in range(401)]), "questions", "array_above_max_length"),
    (four({"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}), "questions[3].choices",
     "array_below_min_length"),
    (four({"type": "choice", "instructions": "x", "choices": [{"value": str(i)} for i in range(256)]}),
     "questions[3].choices", "array_above_max_length"),
    (four({"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}),
     "questions[3].choices[1].value", "duplicate_value"),
    (four({"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": 1}]}),
     "questions[3].choices[1].value", "invalid_type"),
    (four({"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"description": "b"}]}),
     "questions[3].choices[1].value", "missing_required_parameter"),
    (four({"type": "score", "instructions": "x", "levels": [{"label": "only"}]}), "questions[3].levels",
     "array_below_min_length"),
    (four({"type": "score", "instructions": "x", "levels": [{"label": "a"}, {"label": ""}]}),
     "questions[3].levels[1].label", "empty_string"),
    (four({"type": "box", "instructions": "x"}), "questions[3].type", "invalid_value"),
    (four({"type": "predicate", "instructions": ""}), "questions[3].instructions", "empty_string"),
    (four({"type": "predicate"}), "questions[3].instructions", "missing_required_parameter"),
    (four({"type": "predicate", "instructions": [{"type": "input_image", "image_url": PNG}]}),
     "questions[3].instructions", "empty_string"),
    (four({"type": "predicate", "name": "urgent", "instructions": "x"}), "questions[3].name", "duplicate_value"),
    (four({"type": "predicate", "name": 3, "instructions": "x"}), "questions[3].name", "invalid_type"),
    (body(prompt_cache_options={"mode": "sometimes"}), "prompt_cache_options.mode", "invalid_value"),
    (body(safety_identifier=5), "safety_identifier", "invalid_type"),
])
def test_question_and_request_errors_name_the_field(data: dict[str, Any], param: str, code: str) -> None:
    error = wire_error(data)
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": param,
                                      "code": code}}


def test_a_body_that_is_not_an_object() -> None:
    error = wire_error([1, 2])
    assert (error.status, error.param, error.code) == (400, None, "invalid_type")


def test_limits_tighten_the_wire() -> None:
    limits = Limits(max_questions=2, max_options=2, max_text_chars=20, max_state_chars=10)
    assert wire_error(body(input="x"), limits=limits).param == "questions"
    assert wire_error(body(questions=[PREDICATE]), limits=limits).param == "input"
    small = body(input="x", questions=[{"type": "choice", "instructions": "x",
                                        "choices": [{"value": "a"}, {"value": "b"}, {"value": "c"}]}])
    assert wire_error(small, limits=limits).param == "questions[0].choices"
    long = body(input="x", questions=[{"type": "predicate", "instructions": "y" * 21}])
    assert wire_error(long, limits=limits).code == "string_above_max_length"


def test_unknown_fields_are_listed_not_refused() -> None:
    data = body(temperature=0, questions=[PREDICATE | {"criteria": {}}],
                input=[{"role": "user", "content": "x", "id": "msg_1"}], prompt_cache_key="k",
                prompt_cache_options={"mode": "explicit", "ttl": "30m"}, safety_identifier="user-1")
    req = parse(data)
    assert req.ignored == ("temperature", "input[0].id", "questions[0].criteria")
    assert (req.prompt_cache_key, req.safety_identifier) == ("k", "user-1")


def test_parse_does_not_change_the_body() -> None:
    data = body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}])
    before = copy.deepcopy(data)
    parse(data)
    assert data == before


# -- render ----------------------------------------------------------------------------------


def test_render_validates_as_the_sdks_decision() -> None:
    req = parse(body(questions=[PREDICATE, CHOICE, SCORE, {"type": "predicate", "instructions": "Unnamed?"},
                                {"type": "choice", "name": "flag", "instructions": "Flag?",
                                 "choices": [{"value": True}, {"value": "true"}]}]))
    results = {
        "urgent": QuestionResult(answer="yes", probabilities={"yes": 0.8, "no": 0.2}),
        "team": QuestionResult(answer="tech", probabilities={"billing": 0.25, "tech": 0.75}, confidence=0.4),
        "severity": QuestionResult(refusal="the canvas abstained"),
        "questions[3]": QuestionResult(answer="no", probabilities={"yes": 0.1, "no": 0.9}),
        "flag": QuestionResult(answer="true (boolean)", probabilities={"true (boolean)": 0.6, "true": 0.4}),
    }
    out = render(req, results, usage=Usage(input_tokens=40, output_tokens=5, cached_tokens=8, reasoning_tokens=2))
    decision = Decision.model_validate(out)
    assert [(a.type, a.name) for a in decision.answers] == [
        ("predicate", "urgent"), ("choice", "team"), ("refusal", "severity"), ("predicate", None), ("choice", "flag")]
    urgent, team, _, unnamed, flag = decision.answers
    assert urgent.probability == pytest.approx(0.8) and unnamed.probability == pytest.approx(0.1)  # type: ignore[union-attr]
    assert team.choice == "tech" and team.confidence == 0.4  # type: ignore[union-attr]
    assert [(p.value, p.probability) for p in team.probabilities] == [("billing", 0.25), ("tech", 0.75)]  # type: ignore[union-attr]
    assert flag.choice is True and flag.confidence == pytest.approx(0.6)  # type: ignore[union-attr]
    assert [type(p.value) for p in flag.probabilities] == [bool, str]  # type: ignore[union-attr]
    assert out["answers"][3]["name"] is None and "name" in out["answers"][3]
    assert decision.model == "gpt-6-luna"
    assert decision.usage.model_dump() == {"input_tokens": 40, "output_tokens": 5, "total_tokens": 45,
                                           "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
                                           "output_tokens_details": {"reasoning_tokens": 2}}
    assert set(out) == {"answers", "model", "usage"}  # the SDK's Decision has no id, object or created


def test_render_score_is_the_expected_level() -> None:
    req = parse(body(questions=[SCORE]))
    out = render(req, {"severity": QuestionResult(answer="2", probabilities={"0": 0.2, "1": 0.2, "2": 0.6})},
                 model="canvas")
    score = Decision.model_validate(out).answers[0]
    assert score.type == "score" and score.score == pytest.approx(1.4) and score.confidence == pytest.approx(0.6)
    assert [(p.label, p.value) for p in score.probabilities] == [("Cosmetic", 0), ("Workaround", 1), ("Blocked", 2)]
    assert out["model"] == "canvas"


def test_render_renormalizes_over_the_options_and_puts_all_on_an_answer_without_a_distribution() -> None:
    req = parse(body())
    out = render(req, {"urgent": QuestionResult(answer="yes", probabilities={"yes": 0.3, "no": 0.1}),
                       "team": QuestionResult(answer="billing"),
                       "severity": QuestionResult(answer="1", probabilities={"1": 2.0})})
    urgent, team, severity = out["answers"]
    assert urgent["probability"] == pytest.approx(0.75)
    assert team["probabilities"] == [{"value": "billing", "probability": 1.0}, {"value": "tech", "probability": 0.0}]
    assert team["confidence"] == 1.0
    assert severity["score"] == pytest.approx(1.0)


@pytest.mark.parametrize(("results", "message"), [
    ({"urgent": QuestionResult(answer="yes")}, "no result for question 'team'"),
    ({"urgent": QuestionResult(answer="maybe")}, "'maybe' is not one of"),
    ({"urgent": QuestionResult(answer="yes", probabilities={"yes": 0.5, "(abstain)": 0.5})}, "not options"),
    ({"urgent": QuestionResult(answer="yes", probabilities={"yes": -1.0, "no": 2.0})}, "non-negative"),
    ({"urgent": QuestionResult(answer="yes", probabilities={"yes": 0.0, "no": 0.0})}, "not all 0"),
])
def test_render_refuses_results_that_are_not_answers(results: dict[str, QuestionResult], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render(parse(body()), results)


# -- errors ----------------------------------------------------------------------------------


def test_error_body_is_openais_shape() -> None:
    assert error_body("Bad.", param="questions[0].type", code="invalid_value") == {
        "error": {"message": "Bad.", "type": "invalid_request_error", "param": "questions[0].type",
                  "code": "invalid_value"}}
    assert error_body("Down.", status=503) == {"error": {"message": "Down.", "type": "server_error", "param": None,
                                                         "code": None}}


def test_from_refusal_keeps_status_kind_and_headers() -> None:
    error = from_refusal(Refusal(529, "engine_overloaded", "the engine is overloaded; retry later",
                                 headers={"retry-after": "1"}))
    assert (error.status, error.code, error.headers) == (529, "engine_overloaded", {"retry-after": "1"})
    assert error.body()["error"]["type"] == "server_error"
