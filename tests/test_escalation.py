"""Escalation: targets, faults, retries, logprob distributions, and a REAL AR model.

Faults use `GenericFakeChatModel` (langchain-core's own fake chat model). The last
section escalates through `langchain_openai.ChatOpenAI` to a real OpenAI-compatible HTTP
server (tests/ar_server.py) running SmolLM2-135M-Instruct on this CPU: a model far too
small to be good at the questions, used for plumbing only (no accuracy is claimed).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import deadlines
import pytest
from conftest import smollm2_ar_server
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.decisions import Choice, Noul, Score
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableLambda
from pydantic import BaseModel

from canvasroute.engine import CanvasRouteError, EngineUnavailable, EscalationError, FunctionEngine
from canvasroute.router import CanvasDecisionModel, Escalation, GatePolicy, OutcomePolicy, ReadOptions

STATE = "I was charged twice for my subscription, please refund me now!"
TEAM = Choice(instructions="Which team should handle this ticket?",
              criteria={"billing": "payments, refunds, invoices", "tech": "bugs, errors, outages"})
URGENT = Noul(instructions="Is the customer asking for urgent help?")
SEVERITY = Score(instructions="How severe is the problem?", criteria=["minor", "major", "critical"])
ALL = {"team": TEAM, "urgent": URGENT, "severity": SEVERITY}
OPTIONS = {"team": ("billing", "tech"), "urgent": ("yes", "no"), "severity": ("0", "1", "2")}


def uncertain_engine() -> FunctionEngine:
    """Every slot: the first two labels at 0.5 / 0.5 (normalized entropy >= 0.63: uncertain)."""

    def rows(read):
        return [{engine.token_id(x): math.log(0.5) for x in ("A", "B", "yes", "no", "1", "2")}] * len(read.slots)

    engine = FunctionEngine(rows, model="canvas-fn")
    return engine


def canvas_model(target: Any, **escalation: Any) -> CanvasDecisionModel:
    """A model that escalates every question to `target` (`escalation`: `Escalation`'s other fields);
    a failed escalation raises (`target_fault="raise"`), so these tests read the target's error itself."""
    return CanvasDecisionModel(engine=uncertain_engine(), policy=GatePolicy(rereads=0),
                               escalate_to=Escalation(target, **escalation),
                               outcomes=OutcomePolicy(target_fault="raise"))


class Prompts(BaseCallbackHandler):
    """Records the messages of every chat-model call (GenericFakeChatModel keeps none)."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def on_chat_model_start(self, serialized, messages, **kwargs):
        self.calls.append(messages[0])


class Replies(Iterator):
    """GenericFakeChatModel's reply source: messages, or exceptions to raise, in order."""

    def __init__(self, *items: Any) -> None:
        self.items = list(items)

    def __next__(self) -> Any:
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def fake(*items: Any) -> tuple[GenericFakeChatModel, Prompts]:
    prompts = Prompts()
    return GenericFakeChatModel(messages=Replies(*items), callbacks=[prompts]), prompts


def reply(answer: dict, usage: tuple[int, int] = (100, 10), **kwargs: Any) -> AIMessage:
    i, o = usage
    return AIMessage(json.dumps(answer), usage_metadata={"input_tokens": i, "output_tokens": o,
                                                         "total_tokens": i + o}, **kwargs)


def bounded(coro, seconds: float = 30):
    """The test's bound on a decision: `seconds` of a quiet machine, stretched to this one's pace."""
    return deadlines.bounded(coro, seconds, what="the decision")


@pytest.mark.parametrize(("said", "answer"), [("Billing", "Billing"), ("billing ", "billing "), ("", ""),
                                              (" BILLING", None)])
async def test_options_differing_in_case_or_empty_are_asked_and_matched_exactly(said, answer):
    """Any distinct option names are options (vLLM's gateway takes them too): an escalation's
    reply names one exactly, else stripped, else case-folded only when that is unambiguous."""
    names = Choice(instructions="Which team?", criteria={"Billing": None, "billing ": None, "": "none of them"})
    target, _ = fake(reply({"team": said}), reply({"team": said}))
    model = canvas_model(target)
    if answer is None:
        with pytest.raises(EscalationError, match="not one of"):
            await model.adecide(STATE, {"team": names})
        return
    resp = await model.adecide(STATE, {"team": names})
    assert resp.reads["team"].labels == ["A", "B", "C"] and resp.answers["team"].choice == answer


# -- faults and retries (GenericFakeChatModel) ------------------------------------------------------


class AuthenticationError(Exception):
    """What an API client raises for a refused key (it carries the status, as openai's errors do)."""

    status_code = 401


@pytest.mark.parametrize("error, failure, retryable", [
    (ConnectionError("AR down"), "network", True),
    (TimeoutError("slow"), "network", True),
    (AuthenticationError("401: invalid API key"), "target", False),
])
async def test_a_failed_call_is_sent_once_and_says_what_failed(error, failure, retryable):
    """The target's own client owns transport retries: one call, then a typed error naming the failure."""
    chat, prompts = fake(error, reply({"team": "tech"}))
    with pytest.raises(EscalationError) as info:
        await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))
    assert len(prompts.calls) == 1
    assert isinstance(info.value, CanvasRouteError) and info.value.failure == failure
    assert info.value.retryable is retryable and info.value.attempts == 1
    assert f"failed ({failure}: the target" in str(info.value) and type(info.value.__cause__) is type(error)
    assert ("URL" if failure == "network" else "API key") in info.value.hint


async def test_an_exception_inside_the_target_points_at_the_target_code_not_its_key():
    """A target whose own code raises (a bug in a chain, not an API's answer) is told so, not sent
    to check its API key and quota."""
    chat, _ = fake(KeyError("missing field"), reply({"team": "tech"}))
    with pytest.raises(EscalationError) as info:
        await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))
    assert info.value.failure == "target" and "raised KeyError" in str(info.value)
    assert "own code raised" in info.value.hint and "API key" not in info.value.hint


async def test_a_target_that_retries_itself_owns_its_retries():
    """`max_retries` on the target (ChatOpenAI's default is 2): its error says so, and `retry_on` leaves it."""
    from canvasroute.harness import retry_on

    class Retrying(GenericFakeChatModel):
        max_retries: int = 2

    chat = Retrying(messages=Replies(ConnectionError("AR down")))
    with pytest.raises(EscalationError) as info:
        await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))
    assert info.value.attempts == 3 and info.value.retryable and not retry_on(info.value)


async def test_malformed_twice_is_an_escalation_error():
    chat, prompts = fake(AIMessage("I think it is billing."), AIMessage('{"team": "marketing"}'))
    with pytest.raises(EscalationError, match="outside the allowed options twice") as info:
        await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))
    assert "'marketing' is not one of ['billing', 'tech']" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.failure == "format" and not info.value.retryable and "structured output" in info.value.hint
    assert len(prompts.calls) == 2


async def test_malformed_once_then_success_on_retry_and_usage_counts_both():
    bad = AIMessage("Sure! The team is billing.", usage_metadata={"input_tokens": 300, "output_tokens": 8,
                                                                  "total_tokens": 308})
    chat, prompts = fake(bad, reply({"team": "billing"}, usage=(340, 6)))
    model = canvas_model(chat)
    resp = await bounded(model.adecide(STATE, {"team": TEAM}))
    r = resp.reads["team"]
    assert (r.path, r.answer, r.escalation_model) == ("escalated", "billing", "GenericFakeChatModel")
    assert r.probabilities == {"billing": 1.0, "tech": 0.0}  # no logprobs: one-hot
    # the retry shows the model its invalid reply and asks again
    first, second = prompts.calls
    assert second[:len(first)] == first
    assert second[len(first)].content == bad.content
    assert "That reply was invalid (no JSON object" in second[-1].content
    canvas_out = sum(len(read.canvas) for read in model.engine.reads)  # FunctionEngine: the canvas width
    assert resp.canvas_reads == 1 and canvas_out > 0
    assert resp.usage["input_tokens"] == 300 + 340
    assert resp.usage["output_tokens"] == canvas_out + 8 + 6


@pytest.mark.parametrize("text, expected", [
    ('```json\n{"team": "Tech"}\n```', {"team": "tech"}),
    ('Here you go: {"team": "billing", "note": {"x": 1}} Hope that helps {}', {"team": "billing"}),
    ('{"urgent": true, "severity": 2}', {"urgent": "yes", "severity": "2"}),
    ('{"urgent": "No", "severity": "critical"}', {"urgent": "no", "severity": "2"}),  # a level by its legend
])
async def test_replies_are_read_leniently_but_only_into_allowed_options(text, expected):
    chat, _ = fake(AIMessage(text))
    resp = await bounded(canvas_model(chat).adecide(STATE, {k: ALL[k] for k in expected}))
    assert {q: r.answer for q, r in resp.reads.items()} == expected
    assert {r.path for r in resp.reads.values()} == {"escalated"}


async def test_a_missing_question_in_the_reply_is_malformed():
    chat, prompts = fake(AIMessage('{"team": "tech"}'), AIMessage('{"team": "tech"}'))
    with pytest.raises(EscalationError, match="'urgent': None"):
        await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM, "urgent": URGENT}))
    assert len(prompts.calls) == 2


async def test_a_slow_target_times_out_as_an_escalation_error():
    async def slow(messages):
        await asyncio.sleep(30)

    model = canvas_model(RunnableLambda(slow), timeout=0.05)
    with pytest.raises(EscalationError, match="timed out") as info:
        await bounded(model.adecide(STATE, {"team": TEAM}), 5)
    assert info.value.failure == "network" and info.value.retryable


# -- the prompt -------------------------------------------------------------------------------


async def test_the_prompt_carries_state_questions_options_and_canvas_probabilities():
    chat, prompts = fake(reply({"team": "tech", "urgent": "no"}))
    await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM, "urgent": URGENT}))
    (call,) = prompts.calls
    system, _example_in, example_out, request = call
    assert "JSON object" in system.content
    assert json.loads(example_out.content) == {"weather": "sunny", "cold": "no"}
    text = request.content
    assert text.startswith(f"Input:\n{STATE}\n")
    assert ('Question "team": Which team should handle this ticket? Options: "billing" (payments, refunds, '
            'invoices), "tech" (bugs, errors, outages).') in text
    assert 'Question "urgent": Is the customer asking for urgent help? Options: "yes", "no".' in text
    assert 'Fast model\'s probabilities: {"billing": 0.5, "tech": 0.5}' in text
    assert text.endswith('JSON with the keys "team", "urgent":')


async def test_the_decisions_instructions_reach_the_escalation_prompt():
    """Defect (issue 28.3): `instructions` shaped the canvas read but never reached the target."""
    chat, prompts = fake(reply({"team": "tech"}), reply({"team": "tech"}), reply({"team": "tech"}))
    model = canvas_model(chat)
    await bounded(model.adecide(STATE, {"team": TEAM}, read={"instructions": "All tickets are from EU customers"}))
    await bounded(model.ainvoke({"state": STATE, "questions": {"team": TEAM},
                                 "read": ReadOptions(instructions="Answer for the EU desk")}))
    texts = [call[-1].content for call in prompts.calls]
    assert texts[0].startswith("Context for every question: All tickets are from EU customers\n\nInput:\n")
    assert "Answer for the EU desk" in texts[1]
    from langchain_core.prompts import ChatPromptTemplate

    own = ChatPromptTemplate.from_messages([("human", "Ticket: {state}\n{questions}")])  # no {instructions}
    await bounded(canvas_model(chat, prompt=own).adecide(STATE, {"team": TEAM}, read={"instructions": "EU only"}))
    assert prompts.calls[-1][-1].content.startswith("Ticket: Context for every question: EU only\n\n")


async def test_the_escalation_prompt_is_a_template_of_the_model():
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([
        ("system", "You route support tickets. Answer with JSON: {keys}."),
        ("human", "Ticket: {state}\n{questions}")])
    chat, prompts = fake(reply({"team": "tech"}))
    await bounded(canvas_model(chat, prompt=prompt).adecide(STATE, {"team": TEAM}))
    (call,) = prompts.calls
    assert [m.type for m in call] == ["system", "human"]
    assert call[0].content == 'You route support tickets. Answer with JSON: "team".'
    assert call[1].content.startswith(f"Ticket: {STATE}\nQuestion \"team\": Which team")
    with pytest.raises(ValueError, match=r"unknown variables \['ticket'\]"):
        canvas_model(chat, prompt=ChatPromptTemplate.from_messages([("human", "{ticket}")]))
    with pytest.raises(ValueError, match="ChatPromptTemplate"):
        canvas_model(chat, prompt="Answer in JSON")


async def test_a_structured_output_method_the_target_lacks_is_a_target_error():
    chat, prompts = fake(reply({"team": "tech"}))  # GenericFakeChatModel has no structured output
    with pytest.raises(EscalationError, match="no structured output") as info:
        await bounded(canvas_model(chat, output="json_schema").adecide(STATE, {"team": TEAM}))
    assert info.value.failure == "target" and not prompts.calls
    resp = await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))  # "auto": a JSON reply in text
    assert resp.reads["team"].answer == "tech" and len(prompts.calls) == 1


# -- distributions from logprobs ----------------------------------------------------------------


def _logprobs(tokens: list[tuple[str, float, dict[str, float]]]) -> dict:
    """OpenAI-shaped logprobs: (token, logprob, {alternative: logprob}) per generated token."""
    return {"content": [{"token": t, "logprob": lp,
                         "top_logprobs": [{"token": a, "logprob": v} for a, v in alts.items()]}
                        for t, lp, alts in tokens]}


async def test_logprobs_become_a_distribution_over_options():
    # '{"team": "tech"}' tokenized; where the value starts the model weighed tech/bill/other
    lp = _logprobs([('{"', -0.01, {}), ("team", -0.01, {}), ('":', -0.01, {}), (' "', -0.01, {}),
                    ("tech", -0.2, {"tech": -0.2, "bill": -1.8, "sales": -3.0}), ('"}', -0.01, {})])
    chat, _ = fake(AIMessage('{"team": "tech"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))).reads["team"]
    # tech: the chosen path up to its closing quote; billing: "bill" begins billing alone; "sales" names no option
    w = {"tech": math.exp(-0.2 - 0.01), "billing": math.exp(-1.8)}
    z = sum(w.values())
    assert r.probabilities == pytest.approx({k: v / z for k, v in w.items()})
    assert r.canvas_probabilities == pytest.approx({"billing": 0.5, "tech": 0.5})


async def test_an_option_no_path_spells_gets_no_mass():
    lp = _logprobs([('{"severity": ', -0.01, {}), ('"', -0.01, {}),
                    ("crit", -0.1, {"crit": -0.1, "major": -2.5, "x": -4.0}), ('ical"}', -0.01, {})])
    chat, _ = fake(AIMessage('{"severity": "critical"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat).adecide(STATE, {"severity": SEVERITY}))).reads["severity"]
    w = {"0": 0.0, "1": math.exp(-2.5), "2": math.exp(-0.1 - 0.01)}  # "minor" never weighed: 0, no floor
    z = sum(w.values())
    assert r.answer == "2" and r.probabilities == pytest.approx({k: v / z for k, v in w.items()})


async def test_an_answer_by_name_is_weighed_against_names_not_descriptions():
    # seen from SmolLM2: at the answer, "b" (-1.07) and "tech" (-1.26); tech's description
    # "bugs, errors, outages" also starts with "b", which must not count for tech here
    lp = _logprobs([('{"team": "', -0.01, {}), ("b", -1.07, {"b": -1.07, "tech": -1.26, "paying": -4.4}),
                    ('illing"}', -0.01, {})])
    chat, _ = fake(AIMessage('{"team": "billing"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))).reads["team"]
    z = math.exp(-1.07 - 0.01) + math.exp(-1.26)
    assert r.probabilities == pytest.approx({"billing": math.exp(-1.08) / z, "tech": math.exp(-1.26) / z})


async def test_a_distribution_that_contradicts_the_answer_is_dropped():
    lp = _logprobs([('{"team": "', -0.01, {}), ("tech", -0.9, {"tech": -0.9, "billing": -0.1})])
    chat, _ = fake(AIMessage('{"team": "tech"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat).adecide(STATE, {"team": TEAM}))).reads["team"]
    assert r.answer == "tech" and r.probabilities == {"billing": 0.0, "tech": 1.0}


ELEVEN = Score(instructions="How many stars, 0 to 10?", criteria=[f"{n} stars" for n in range(11)])
EIGHTY = Choice(instructions="Which option?", criteria={f"opt{n}": None for n in range(80)})


async def test_options_that_prefix_each_other_are_read_per_option():
    """Issue 34.1: `1` and `10` shared the mass of a first token `1`, and `opt` gave every `optN`
    the same mass. A path counts for an option only when it spells it and ends it, or begins it
    where no other option goes on."""
    # '{"stars": "10"}' as a BPE tokenizer writes it: " "1", "0", then the closing quote
    lp = _logprobs([('{"stars":', -0.01, {}), (' "1', -0.1, {' "1': -0.1, ' "2': -3.0, " 1": -4.0}),
                    ("0", -0.5, {"0": -0.5, '"': -1.0, "1": -2.0}), ('"}', -0.02, {'"': -5.0})])
    chat, _ = fake(AIMessage('{"stars": "10"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat).adecide(STATE, {"stars": ELEVEN}))).reads["stars"]
    # 10: the chosen path, closed; 1: "1" then the closing quote; 2: begins no other level; " 1" (bare)
    # and "11" name no level; '"' after "10" closes it too (the same option, another path)
    w = {"10": math.exp(-0.1 - 0.5 - 0.02) + math.exp(-0.1 - 0.5 - 5.0), "1": math.exp(-0.1 - 1.0),
         "2": math.exp(-3.0)}
    z = sum(w.values())
    assert r.answer == "10" and r.probabilities == pytest.approx({str(n): w.get(str(n), 0.0) / z for n in range(11)})
    # opt12 written "opt", "12", '"': "1" goes on to opt1 and opt10..opt19, "7" to opt7 and opt70..opt79
    lp = _logprobs([('{"pick": "', -0.01, {}), ("opt", -0.05, {"opt": -0.05, "option": -4.0}),
                    ("12", -0.4, {"12": -0.4, "1": -1.5, "7": -2.0, "13": -2.5, '3"': -3.0}), ('"}', -0.01, {})])
    chat, _ = fake(AIMessage('{"pick": "opt12"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat).adecide(STATE, {"pick": EIGHTY}))).reads["pick"]
    w = {"opt12": math.exp(-0.05 - 0.4 - 0.01), "opt13": math.exp(-0.05 - 2.5), "opt3": math.exp(-0.05 - 3.0)}
    z = sum(w.values())
    assert r.probabilities == pytest.approx({f"opt{n}": w.get(f"opt{n}", 0.0) / z for n in range(80)})


async def test_a_bare_value_ends_at_its_delimiter():
    # '{"stars": 1, ...}': a Score level as a JSON number; "1" then "," ends it, "10" is another level
    lp = _logprobs([('{"stars": ', -0.01, {}), ("1", -0.3, {"1": -0.3, "10": -1.6, "null": -3.0}),
                    (", ", -0.2, {"0": -1.9}), ('"team": "tech"}', 0.0, {})])
    chat, _ = fake(AIMessage('{"stars": 1, "team": "tech"}', response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat, output="text").adecide(STATE, {"stars": ELEVEN, "team": TEAM}))).reads
    w = {"1": math.exp(-0.3 - 0.2), "10": math.exp(-1.6) + math.exp(-0.3 - 1.9)}
    z = sum(w.values())
    assert r["stars"].answer == "1"
    assert r["stars"].probabilities == pytest.approx({str(n): w.get(str(n), 0.0) / z for n in range(11)})


@pytest.mark.parametrize(("question", "script", "expected"), [
    (ELEVEN, {"1": 0.9, "10": 0.1}, {"1": 0.9, "10": 0.1}),
    (ELEVEN, {"10": 0.6, "1": 0.3, "0": 0.1}, {"10": 0.6, "1": 0.3, "0": 0.1}),
    (EIGHTY, {"opt12": 0.7, "opt1": 0.2, "opt7": 0.1}, {"opt12": 0.7, "opt1": 0.2, "opt7": 0.1}),
])
async def test_a_scripted_target_with_options_that_prefix_each_other_reads_back_as_scripted(question, script,
                                                                                             expected):
    """Issue 34.1: a Score 0-10 whose target says level 1 at 0.9 comes back as level 1 at 0.9 (it
    was split with 10), and opt0..opt79 get no mass the target never gave."""
    from canvasroute.router.testing import ScriptedTarget

    even = FunctionEngine(lambda read: [{i: -math.log(len(read.label_ids)) for i in read.label_ids}] * len(read.slots))
    model = CanvasDecisionModel(engine=even, policy=GatePolicy(rereads=0),
                                escalate_to=ScriptedTarget(script={"q": script}))
    r = (await bounded(model.adecide(STATE, {"q": question}))).reads["q"]
    assert r.path == "escalated" and r.answer == max(script, key=script.__getitem__)
    assert r.probabilities == pytest.approx({o: expected.get(o, 0.0) for o in r.probabilities}, abs=1e-9)


LANGUE = Choice(instructions="Which language is the ticket in?",
                criteria={"english": None, "français": None, "español": None})


async def test_options_and_question_ids_that_are_not_ascii_keep_their_mass():
    """Issue 40.1: `{"english": 0.6, "français": 0.4}` came back `{english: 1.0, français: 0.0}`: a
    reply writes `français` as `fran\\u00e7ais` (JSON's escape, as `json.dumps` does) and a question id
    `catégorie` too; the reader compares what the JSON says, not how it is spelled."""
    from canvasroute.router.testing import ScriptedTarget

    even = FunctionEngine(lambda read: [{i: -math.log(len(read.label_ids)) for i in read.label_ids}] * len(read.slots))
    target = ScriptedTarget(script={"langue": {"english": 0.6, "français": 0.4},
                                    "catégorie": {"billing": 0.3, "tech": 0.7}})
    model = CanvasDecisionModel(engine=even, policy=GatePolicy(rereads=0), escalate_to=target)
    resp = await bounded(model.adecide(STATE, {"langue": LANGUE, "catégorie": TEAM}))
    langue, categorie = resp.reads["langue"], resp.reads["catégorie"]
    assert langue.path == "escalated" and langue.answer == "english"
    assert langue.probabilities == pytest.approx({"english": 0.6, "français": 0.4, "español": 0.0})
    assert resp.answers["langue"].confidence < 1.0
    assert categorie.probabilities == pytest.approx({"billing": 0.3, "tech": 0.7})


def _byte_logprobs(tokens: list[tuple[str, bytes, float, list[tuple[str, bytes, float]]]]) -> dict:
    """OpenAI-shaped logprobs with each token's `bytes`: (token, bytes, logprob, alternatives)."""
    return {"content": [{"token": t, "bytes": list(b), "logprob": lp,
                         "top_logprobs": [{"token": a, "bytes": list(ab), "logprob": v} for a, ab, v in alts]}
                        for t, b, lp, alts in tokens]}


C3, A9, A7 = b"\xc3", b"\xa9", b"\xa7"  # é is C3 A9, ç is C3 A7 in UTF-8
SPLIT = {  # '{"catégorie": "français"}' as each server writes a character split across tokens
    # OpenAI: a token that is part of a character is "bytes:\\x.." and its `bytes` are its own
    "openai": [('{"cat', b'{"cat', 0.0, []), ("bytes:\\xc3", C3, 0.0, []), ("bytes:\\xa9", A9, 0.0, []),
               ('gorie": "', b'gorie": "', 0.0, []),
               ("fran", b"fran", math.log(0.7), [("fran", b"fran", math.log(0.7)), ("eng", b"eng", math.log(0.2)),
                                                  ("esp", b"esp", math.log(0.1))]),
               ("bytes:\\xc3", C3, 0.0, [("bytes:\\xc3", C3, 0.0)]), ("bytes:\\xa7", A7, 0.0, []),
               ('ais"}', b'ais"}', 0.0, [])],
    # vLLM: the tokens before a character's last are "" (no bytes), the last carries it whole
    "vllm": [('{"cat', b'{"cat', 0.0, []), ("", b"", 0.0, [("", b"", 0.0)]), ("é", C3 + A9, 0.0, []),
             ('gorie": "', b'gorie": "', 0.0, []),
             ("fran", b"fran", math.log(0.7), [("fran", b"fran", math.log(0.7)), ("eng", b"eng", math.log(0.2)),
                                                ("esp", b"esp", math.log(0.1))]),
             ("", b"", 0.0, [("", b"", 0.0), ("", b"", -3.0)]), ("ç", C3 + A7, 0.0, []), ('ais"}', b'ais"}', 0.0, [])],
}


@pytest.mark.parametrize("shape", sorted(SPLIT))
async def test_a_character_split_across_tokens_is_read_from_their_bytes(shape):
    """Non-ASCII names are split across tokens in OpenAI-shaped logprobs; the reply's text is read
    from each token's `bytes` where given (OpenAI's "bytes:\\xc3" tokens, vLLM's empty ones)."""
    lp = _byte_logprobs(SPLIT[shape])
    text = b"".join(bytes(e["bytes"]) for e in lp["content"]).decode()
    assert text == '{"catégorie": "français"}'
    chat, _ = fake(AIMessage(text, response_metadata={"logprobs": lp}))
    r = (await bounded(canvas_model(chat, output="text").adecide(STATE, {"catégorie": LANGUE}))).reads["catégorie"]
    assert r.answer == "français"
    assert r.probabilities == pytest.approx({"english": 0.2, "français": 0.7, "español": 0.1})


# -- other targets: Runnables and decision models -------------------------------------------------


class Route(BaseModel):
    team: str


@pytest.mark.parametrize("value", [{"team": "billing"}, Route(team="billing")])
async def test_a_structured_output_runnable_is_a_target(value):
    seen = []
    target = RunnableLambda(lambda messages: seen.append(messages) or value, name="structured")
    r = (await bounded(canvas_model(target).adecide(STATE, {"team": TEAM}))).reads["team"]
    assert (r.path, r.answer, r.escalation_model) == ("escalated", "billing", "structured")
    assert len(seen) == 1


async def test_a_decision_model_is_a_target():
    def confident(read):
        return [dict.fromkeys(read.label_ids, -5.02) | {big_engine.token_id("B"): -0.01,
                                                        big_engine.token_id("no"): -0.02}] * len(read.slots)

    big_engine = FunctionEngine(confident, model="big-canvas")
    big = CanvasDecisionModel(engine=big_engine, policy=GatePolicy(rereads=0))
    resp = await bounded(canvas_model(big).adecide(STATE, {"team": TEAM, "urgent": URGENT}))
    assert {q: (r.path, r.answer, r.escalation_model) for q, r in resp.reads.items()} == {
        "team": ("escalated", "tech", "big-canvas"), "urgent": ("escalated", "no", "big-canvas")}
    assert resp.reads["team"].probabilities["tech"] > 0.99  # the target's own distribution
    assert big_engine.calls == 1  # both questions in one call


async def test_a_failing_decision_model_target_is_asked_once_and_keeps_its_engines_attempts():
    def down(read):
        raise EngineUnavailable("big model down", attempts=4)  # as VLLMServerEngine raises it, retried

    big_engine = FunctionEngine(down, model="big-canvas")
    big = CanvasDecisionModel(engine=big_engine, outcomes=OutcomePolicy(engine_fault="raise"))
    with pytest.raises(EscalationError, match=r"failed \(network") as info:
        await bounded(canvas_model(big).adecide(STATE, {"team": TEAM}))
    assert isinstance(info.value.__cause__, EngineUnavailable) and big_engine.calls == 1
    assert info.value.failure == "network" and info.value.retryable and info.value.attempts == 4


def test_escalate_to_must_be_a_target():
    with pytest.raises(ValueError, match="escalate_to"):
        CanvasDecisionModel(engine=uncertain_engine(), escalate_to=42)


# -- a REAL AR model over a REAL OpenAI-compatible HTTP server -----------------------------------------


@pytest.fixture(scope="module")
def ar_server(smol):
    """tests/ar_server.py serving SmolLM2-135M-Instruct (greedy) on a loopback port."""
    with smollm2_ar_server(smol, max_new_tokens=40) as server:
        yield server


def smollm2(server, **kwargs: Any):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", model="smollm2", api_key="x", logprobs=True, top_logprobs=5,
                      max_retries=0, timeout=deadlines.patience(300), **kwargs)


def _requests_since(server, n: int) -> list[dict]:
    return list(server.requests[n:])


@pytest.mark.smollm
@pytest.mark.slow  # SmolLM2 generates over HTTP: 3-100 s a test on 2 shared cores
@pytest.mark.asyncio(loop_scope="module")  # ChatOpenAI caches its async HTTP client: one loop, like an app
async def test_real_ar_escalation_with_a_distribution_from_logprobs(ar_server):
    before = len(ar_server.requests)
    model = canvas_model(smollm2(ar_server), timeout=deadlines.patience(300))  # the test's bound is the guard
    resp = await bounded(model.adecide(STATE, {"team": TEAM}), 300)
    r = resp.reads["team"]
    assert r.path == "escalated" and r.escalation_model == "smollm2" and not r.confident
    assert r.answer in OPTIONS["team"] and resp.answers["team"].choice == r.answer
    assert r.canvas_probabilities == pytest.approx({"billing": 0.5, "tech": 0.5})
    (sent,) = _requests_since(ar_server, before)  # one HTTP call: structured output cannot be malformed
    assert sent["logprobs"] is True and sent["top_logprobs"] == 5
    schema = sent["response_format"]["json_schema"]["schema"]  # with_structured_output's JSON schema
    assert sent["response_format"]["type"] == "json_schema"
    assert schema["properties"]["team"]["enum"] == ["billing", "tech"]
    assert STATE in sent["messages"][-1]["content"] and '"billing" (payments' in sent["messages"][-1]["content"]
    # the distribution came from the server's logprobs, not a one-hot stand-in
    assert set(r.probabilities) == set(OPTIONS["team"]) and math.isclose(sum(r.probabilities.values()), 1.0)
    assert max(r.probabilities, key=r.probabilities.get) == r.answer
    assert min(r.probabilities.values()) > 0.0
    assert resp.usage["input_tokens"] > 200  # the escalation prompt's tokens, as the server counted them


@pytest.mark.smollm
@pytest.mark.slow  # SmolLM2 generates over HTTP: 3-100 s a test on 2 shared cores
@pytest.mark.asyncio(loop_scope="module")  # ChatOpenAI caches its async HTTP client: one loop, like an app
async def test_real_ar_structured_output_answers_three_questions_in_one_call(ar_server):
    before = len(ar_server.requests)
    model = canvas_model(smollm2(ar_server), timeout=deadlines.patience(300))  # a 2-core CI box: ~10 s per prefill
    resp = await bounded(model.adecide(STATE, ALL), 300)
    (sent,) = _requests_since(ar_server, before)  # three questions, one guided answer
    for qid in ALL:
        assert f'Question "{qid}"' in sent["messages"][3]["content"]
    assert sorted(sent["response_format"]["json_schema"]["schema"]["required"]) == sorted(ALL)
    for qid in ALL:
        r = resp.reads[qid]
        assert r.path == "escalated" and r.answer in OPTIONS[qid] and r.escalation_model == "smollm2"
    assert resp.answers["urgent"].noul == resp.reads["urgent"].probabilities["yes"]


@pytest.mark.smollm
@pytest.mark.slow  # SmolLM2 generates over HTTP: 3-100 s a test on 2 shared cores
@pytest.mark.asyncio(loop_scope="module")  # ChatOpenAI caches its async HTTP client: one loop, like an app
async def test_real_ar_text_replies_are_retried_once_when_malformed_then_typed(ar_server):
    """Without structured output (`Escalation(output="text")`), three questions at once are
    beyond SmolLM2-135M more often than not: whatever it does, the outcome is either valid
    options or EscalationError (format) after exactly one retry that showed the model its
    invalid reply."""
    before = len(ar_server.requests)
    try:
        model = canvas_model(smollm2(ar_server), output="text", timeout=deadlines.patience(300))
        resp = await bounded(model.adecide(STATE, ALL), 300)
    except EscalationError as exc:
        sent = _requests_since(ar_server, before)
        assert len(sent) == 2 and "outside the allowed options" in str(exc) and exc.failure == "format"
        assert "response_format" not in sent[0]
        first, second = sent[0]["messages"], sent[1]["messages"]
        assert second[:len(first)] == first and second[len(first)]["role"] == "assistant"
        assert re.match(r"That reply was invalid \(.+\)\. Reply with the JSON object only\.", second[-1]["content"])
    else:
        assert len(_requests_since(ar_server, before)) in (1, 2)
        for qid, r in resp.reads.items():
            assert r.path == "escalated" and r.answer in OPTIONS[qid]


@pytest.mark.smollm
@pytest.mark.slow  # SmolLM2 generates over HTTP: 3-100 s a test on 2 shared cores
@pytest.mark.asyncio(loop_scope="module")  # ChatOpenAI caches its async HTTP client: one loop, like an app
async def test_real_ar_server_speaks_the_openai_shape(ar_server):
    """The server itself: what ChatOpenAI parses, with consistent logprobs and usage."""
    chat = smollm2(ar_server, max_tokens=8)
    msg = await bounded(chat.ainvoke("Reply with the word yes."), 300)
    lp = msg.response_metadata["logprobs"]["content"]
    assert "".join(e["token"] for e in lp) == msg.content and 1 <= len(lp) <= 8
    for e in lp:
        assert e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 5
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])  # greedy: the chosen is the top
    assert msg.usage_metadata["output_tokens"] == len(lp)
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
