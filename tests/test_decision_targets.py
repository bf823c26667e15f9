"""Escalating to decision models (router/_escalation.py) over real HTTP: langchain-openai's
`OpenAIDecisions`, a plain `BaseDecisionModel` subclass on the `openai` SDK, and
`SystemOneDecisionModel`, all against the known-answers server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from decisions_server import PNG, REFUSE, DecisionsServer, Known
from langchain_core.decisions import (
    BaseDecisionModel,
    Choice,
    ChoiceAnswer,
    ClassifierResponse,
    Noul,
    NoulAnswer,
    NoulCriteria,
    Score,
    ScoreAnswer,
)
from langchain_core.exceptions import ModelRefusalError
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableLambda
from langchain_openai.decisions import OpenAIDecisions
from pydantic import SecretStr

from canvasroute.engine import Connection, EscalationError
from canvasroute.router import SystemOneDecisionModel, parse_questions
from canvasroute.router._escalation import (
    Asked,
    Restated,
    TargetAnswer,
    ask_decision_target,
    is_decision_target,
)

pytestmark = pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")

TICKET = "I was charged twice and the app crashes. Fix it now!"
QUESTIONS: dict[str, Noul | Choice | Score] = {
    "urgent": Noul(instructions="Is this urgent?", criteria=NoulCriteria(true="needs action today")),
    "team": Choice(instructions="Which team?", criteria={"billing": "Payments.", "technical": None}),
    "severity": Score(instructions="How severe?", criteria=["Cosmetic", "Workaround", "Blocked"]),
}
SCRIPT = {"urgent": Known(0.8), "team": Known({"billing": 0.6, "technical": 0.4}, confidence=0.3),
          "severity": Known({0: 0.1, 1: 0.3, 2: 0.6}, confidence=0.5), "secret": REFUSE}


@pytest.fixture(scope="module")
def server() -> Iterator[DecisionsServer]:
    with DecisionsServer(SCRIPT) as running:
        yield running


@pytest.fixture
def fresh(server: DecisionsServer) -> Iterator[DecisionsServer]:
    server.failures.clear()
    yield server
    server.failures.clear()


def openai_decisions(server: DecisionsServer, **kwargs: Any) -> OpenAIDecisions:
    return OpenAIDecisions(model="gpt-6-luna", api_key=SecretStr("test-key"), base_url=server.url + "/v1", **kwargs)


def ask(questions: dict[str, Any] | None = None, **fields: Any) -> Asked:
    """What an escalation asks (`Asked`) about TICKET, for `questions` (default: all)."""
    specs = tuple(parse_questions(QUESTIONS if questions is None else questions).values())
    return Asked(**{"specs": specs, "state": TICKET, "text": TICKET, **fields})


EXPECTED = {
    "urgent": TargetAnswer(answer="yes", probabilities={"yes": 0.8, "no": 1.0 - 0.8},
                           confidence=pytest.approx(0.6)),  # System One's |2p - 1|: a predicate reports none
    "team": TargetAnswer(answer="billing", probabilities={"billing": 0.6, "technical": 0.4}, confidence=0.3),
    "severity": TargetAnswer(answer="2", probabilities={"0": 0.1, "1": 0.3, "2": 0.6}, confidence=0.5),
}


# -- OpenAIDecisions -----------------------------------------------------------------------------


async def test_openai_decisions_answers_keep_the_targets_distribution(fresh: DecisionsServer) -> None:
    reply = await ask_decision_target(openai_decisions(fresh), ask())
    assert dict(reply.answers) == EXPECTED
    assert list(reply.answers) == list(QUESTIONS)
    assert reply.model == "known-answers"
    assert reply.usage == {"input_tokens": 11, "output_tokens": 2}
    assert reply.request_id == f"req_{fresh.count}"
    sent = fresh.bodies[-1]
    assert sent["input"] == TICKET
    assert [(q["type"], q["name"]) for q in sent["questions"]] == [
        ("predicate", "urgent"), ("choice", "team"), ("score", "severity")]
    assert sent["questions"][0]["instructions"] == "Is this urgent?\n\nYes means: needs action today"
    assert sent["questions"][1]["choices"] == [{"value": "billing", "description": "Payments."},
                                               {"value": "technical"}]
    assert sent["questions"][2]["levels"] == [{"label": "Cosmetic"}, {"label": "Workaround"}, {"label": "Blocked"}]


async def test_openai_decisions_instructions_and_restated_parents(fresh: DecisionsServer) -> None:
    parents = {"severity": (Restated("Which team?", "billing"), Restated("Is this urgent?", "yes"))}
    await ask_decision_target(openai_decisions(fresh), ask(instructions="Tickets of ACME Corp.", parents=parents))
    urgent, _, severity = fresh.bodies[-1]["questions"]
    assert urgent["instructions"].startswith("Tickets of ACME Corp.\n\nIs this urgent?")
    assert severity["instructions"] == ("Tickets of ACME Corp.\n\nHow severe?\n\nEarlier answers about this input:\n"
                                        "- Which team?: billing\n- Is this urgent?: yes")


async def test_openai_decisions_images_go_beside_the_text(fresh: DecisionsServer) -> None:
    await ask_decision_target(openai_decisions(fresh), ask(images=(PNG,)))
    assert fresh.bodies[-1]["input"] == [{"role": "user", "content": [
        {"type": "input_text", "text": TICKET}, {"type": "input_image", "image_url": PNG}]}]
    before = fresh.count
    with pytest.raises(EscalationError) as info:
        await ask_decision_target(openai_decisions(fresh), ask(images=("https://example.com/a.png",)))
    assert info.value.failure == "target" and "data URLs" in str(info.value)
    assert fresh.count == before  # refused before any request


async def test_openai_decisions_a_refusal_is_not_an_answer(fresh: DecisionsServer) -> None:
    reply = await ask_decision_target(openai_decisions(fresh), ask(questions={
        "urgent": QUESTIONS["urgent"], "secret": Noul(instructions="What is the card number?")}))
    assert reply.answers["secret"] == TargetAnswer(answer=None, refusal="the target refused to answer")
    assert reply.answers["urgent"].answer == "yes"


@pytest.mark.parametrize(("status", "kind", "retryable"), [
    (401, "target", False), (404, "target", False), (400, "target", False), (500, "target", True),
    (429, "target", True),
])
async def test_openai_decisions_failures_are_classified(fresh: DecisionsServer, status: int, kind: str,
                                                        retryable: bool) -> None:
    fresh.fail(status)
    with pytest.raises(EscalationError) as info:
        await ask_decision_target(openai_decisions(fresh, max_retries=0), ask())
    assert (info.value.failure, info.value.retryable, info.value.attempts) == (kind, retryable, 1)
    assert "answered with an error" in str(info.value)


async def test_openai_decisions_the_sdks_own_retries_are_counted(fresh: DecisionsServer) -> None:
    fresh.fail(503, times=3, headers={"retry-after-ms": "1"})
    before = fresh.count
    with pytest.raises(EscalationError) as info:
        await ask_decision_target(openai_decisions(fresh), ask())  # max_retries=None: the SDK's 2 retries
    assert fresh.count == before + 3
    assert (info.value.failure, info.value.retryable, info.value.attempts) == ("target", True, 3)


async def test_openai_decisions_unreachable_is_a_network_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    target = OpenAIDecisions(model="m", api_key=SecretStr("k"), base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
    with pytest.raises(EscalationError) as info:
        await ask_decision_target(target, ask())
    assert (info.value.failure, info.value.retryable) == ("network", True)


@pytest.mark.parametrize(("reply", "message"), [
    ({"answers": [{"type": "predicate", "name": "urgent", "probability": 2.0}], "model": "m"}, "cannot read"),
    ({"answers": [], "model": "m", "usage": {}}, "no answer for 'urgent'"),
    ({"answers": [{"type": "choice", "name": "urgent", "choice": "yes", "confidence": 1.0,
                   "probabilities": [{"value": "yes", "probability": 1.0}]}], "model": "m"}, "is a noul"),
])
async def test_openai_decisions_answers_outside_the_wire_are_format_failures(fresh: DecisionsServer,
                                                                            reply: Any, message: str) -> None:
    fresh.fail(200, body=reply)
    with pytest.raises(EscalationError, match=message) as info:
        await ask_decision_target(openai_decisions(fresh, max_retries=0),
                                  ask(questions={"urgent": QUESTIONS["urgent"]}))
    assert (info.value.failure, info.value.retryable) == ("format", False)


async def test_openai_decisions_an_option_that_was_not_offered_is_a_format_failure(fresh: DecisionsServer) -> None:
    fresh.fail(200, body={"model": "m", "answers": [
        {"type": "choice", "name": "team", "choice": "sales", "confidence": 1.0,
         "probabilities": [{"value": "sales", "probability": 1.0}]}]})
    with pytest.raises(EscalationError, match='"sales" is not one of') as info:
        await ask_decision_target(openai_decisions(fresh, max_retries=0), ask(questions={"team": QUESTIONS["team"]}))
    assert info.value.failure == "format"
    fresh.fail(200, body={"model": "m", "answers": [
        {"type": "choice", "name": "team", "choice": True, "confidence": 1.0,
         "probabilities": [{"value": True, "probability": 1.0}]}]})
    with pytest.raises(EscalationError, match="true is not one of"):  # typed: a boolean is no string option
        await ask_decision_target(openai_decisions(fresh, max_retries=0), ask(questions={"team": QUESTIONS["team"]}))


async def test_the_typeerror_of_the_chat_path_explained(fresh: DecisionsServer) -> None:
    """`OpenAIDecisions` is a Runnable over `{"input", "questions"}`, not a `BaseDecisionModel`: invoked
    with chat messages (the chat path's call) its `_payload` indexes the list with "input", before any
    request; and it takes only its own question types, not langchain-core's."""
    target = openai_decisions(fresh)
    assert not isinstance(target, BaseDecisionModel) and is_decision_target(target)
    before = fresh.count
    with pytest.raises(TypeError, match="list indices must be integers or slices, not str"):
        await target.ainvoke([HumanMessage(TICKET)])  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="_to_api"):
        await target.ainvoke({"input": TICKET, "questions": {"urgent": QUESTIONS["urgent"]}})  # type: ignore[dict-item]
    assert fresh.count == before


# -- a plain BaseDecisionModel -------------------------------------------------------------------


class WireDecisionModel(BaseDecisionModel):
    """A user's own decision model: langchain-core questions over the OpenAI Decisions wire (the SDK)."""

    model: str = "gpt-6-luna"
    base_url: str

    @property
    def _provider(self) -> str:
        return "known-answers"

    def _classify(self, state: Any, questions: dict[str, Any]) -> ClassifierResponse:
        raise NotImplementedError("async only")

    async def _aclassify(self, state: Any, questions: dict[str, Any]) -> ClassifierResponse:
        wire: list[Any] = []
        for name, q in questions.items():
            item: dict[str, Any] = {"name": name, "instructions": q.instructions}
            if isinstance(q, Noul):
                item["type"] = "predicate"
            elif isinstance(q, Choice):
                item |= {"type": "choice", "choices": [{"value": k} for k in q.criteria]}
            else:
                item |= {"type": "score", "levels": [{"label": str(c)} for c in q.criteria]}
            wire.append(item)
        async with openai.AsyncOpenAI(base_url=self.base_url, api_key="test-key", max_retries=0) as client:
            decision = await client.decisions.create(model=self.model, input=state, questions=wire)
        answers: dict[str, Any] = {}
        for a in decision.answers:
            if a.type == "refusal":
                raise ModelRefusalError(f"refused {a.name}")
            if a.type == "predicate":
                answers[str(a.name)] = NoulAnswer(type="noul", noul=a.probability)
            elif a.type == "choice":
                probabilities = {str(p.value): p.probability for p in a.probabilities}
                answers[str(a.name)] = ChoiceAnswer(type="choice", choice=str(a.choice), confidence=a.confidence,
                                                    probabilities=probabilities)
            else:
                answers[str(a.name)] = ScoreAnswer(type="score", score=a.score, confidence=a.confidence,
                                                   legend={p.value: p.label for p in a.probabilities},
                                                   probabilities={p.value: p.probability for p in a.probabilities})
        return ClassifierResponse(model=decision.model, answers=answers,
                                  usage={"input_tokens": decision.usage.input_tokens,
                                         "output_tokens": decision.usage.output_tokens, "total_tokens": 0})


async def test_a_plain_decision_model_gets_the_state_value_and_its_own_question_types(fresh: DecisionsServer) -> None:
    target = WireDecisionModel(base_url=fresh.url + "/v1")
    reply = await ask_decision_target(target, ask(state=TICKET.upper(), instructions="Tickets of ACME Corp.",
                                                  parents={"team": (Restated("Is this urgent?", "yes"),)}))
    assert dict(reply.answers) == EXPECTED
    assert (reply.model, reply.usage) == ("known-answers", {"input_tokens": 11, "output_tokens": 2})
    sent = fresh.bodies[-1]
    assert sent["input"] == TICKET.upper()  # the value, not the rendered text
    assert [q["instructions"] for q in sent["questions"]] == [
        "Tickets of ACME Corp.\n\nIs this urgent?",  # the Noul's criteria stay in its own field
        "Tickets of ACME Corp.\n\nWhich team?\n\nEarlier answers about this input:\n- Is this urgent?: yes",
        "Tickets of ACME Corp.\n\nHow severe?"]


async def test_a_plain_decision_model_is_asked_the_questions_as_they_are(fresh: DecisionsServer) -> None:
    target = WireDecisionModel(base_url=fresh.url + "/v1")
    await ask_decision_target(target, ask())
    assert [q["instructions"] for q in fresh.bodies[-1]["questions"]] == [
        "Is this urgent?", "Which team?", "How severe?"]


async def test_a_decision_models_refusal_refuses_every_question(fresh: DecisionsServer) -> None:
    target = WireDecisionModel(base_url=fresh.url + "/v1")
    reply = await ask_decision_target(target, ask(questions={"urgent": QUESTIONS["urgent"],
                                                             "secret": Noul(instructions="Card number?")}))
    assert reply.answers == {"urgent": TargetAnswer(answer=None, refusal="refused secret"),
                             "secret": TargetAnswer(answer=None, refusal="refused secret")}


async def test_a_decision_models_failures_are_classified(fresh: DecisionsServer) -> None:
    target = WireDecisionModel(base_url=fresh.url + "/v1")
    fresh.fail(503)
    with pytest.raises(EscalationError) as info:
        await ask_decision_target(target, ask())
    assert (info.value.failure, info.value.retryable) == ("target", True)
    fresh.fail(200, body={"model": "m", "answers": [
        {"type": "choice", "name": "team", "choice": "billing", "confidence": 0.5,
         "probabilities": [{"value": "billing", "probability": 0.5}, {"value": "sales", "probability": 0.5}]}],
        "usage": {"input_tokens": 1, "output_tokens": 1}})
    with pytest.raises(EscalationError, match='"sales", which is not one of') as info:
        await ask_decision_target(target, ask(questions={"team": QUESTIONS["team"]}))
    assert info.value.failure == "format"


# -- SystemOneDecisionModel ----------------------------------------------------------------------


async def test_systemone_decision_model(fresh: DecisionsServer) -> None:
    target = SystemOneDecisionModel(Connection(fresh.url, retries=0), model="jev-latest")
    reply = await ask_decision_target(target, ask(parents={"severity": (Restated("Which team?", "billing"),)}))
    assert dict(reply.answers) == EXPECTED
    sent = fresh.bodies[-1]
    assert sent["state"] == TICKET and list(sent["questions"]) == list(QUESTIONS)
    assert sent["questions"]["severity"]["instructions"].endswith("- Which team?: billing")
    fresh.fail(503)
    with pytest.raises(EscalationError) as info:
        await ask_decision_target(target, ask())
    assert (info.value.failure, info.value.retryable) == ("network", True)  # EngineOverloaded: shed load


async def test_images_of_the_decision_reach_a_decision_model_target(fresh: DecisionsServer) -> None:
    """Defect: images given with the decision (`read={"images": ...}`) reached chat and OpenAIDecisions
    targets, never a `BaseDecisionModel`, which got the state value alone."""
    target = SystemOneDecisionModel(Connection(fresh.url, retries=0), model="jev-latest")
    await ask_decision_target(target, ask(images=(PNG,)))
    sent = fresh.bodies[-1]
    pictured = f"human: {TICKET}\n[image 1]"  # the transcript marks where the image is, as /v1/decisions does
    assert (sent["state"], sent["images"]) == (pictured, [PNG])  # what the canvas read, images beside
    own = [HumanMessage(content=[{"type": "text", "text": TICKET}, {"type": "image_url", "image_url": {"url": PNG}}])]
    await ask_decision_target(target, ask(state=own, text=pictured, images=(PNG,)))
    assert (fresh.bodies[-1]["state"], fresh.bodies[-1]["images"]) == (pictured, [PNG])
    await ask_decision_target(target, ask())
    assert (fresh.bodies[-1]["state"], "images" in fresh.bodies[-1]) == (TICKET, False)  # no images: the value


# -- what is a decision target --------------------------------------------------------------------


def test_is_decision_target(server: DecisionsServer) -> None:
    assert is_decision_target(openai_decisions(server))
    assert is_decision_target(WireDecisionModel(base_url=server.url))
    assert is_decision_target(SystemOneDecisionModel(server.url, model="m"))
    assert not is_decision_target(GenericFakeChatModel(messages=iter([AIMessage("{}")])))
    assert not is_decision_target(RunnableLambda(lambda x: x))


async def test_anything_else_is_refused_before_a_call() -> None:
    with pytest.raises(TypeError, match="not a decision model"):
        await ask_decision_target(RunnableLambda(lambda x: x), ask())


# -- through CanvasDecisionModel: escalate_to= a decision API ----------------------------------------


def unsure_canvas() -> Any:
    """A canvas engine unsure of everything (every slot 50/50 over its first labels)."""
    import math

    from canvasroute.engine import FunctionEngine

    def rows(read: Any) -> list[dict[int, float]]:
        return [{i: math.log(0.5) for i in read.label_ids}] * len(read.slots)

    return FunctionEngine(rows, model="canvas-fn")


async def test_escalating_to_openai_decisions_keeps_the_targets_distribution_and_its_refusal(
        fresh: DecisionsServer, spans: Any) -> None:
    """Issue 29.2: `escalate_to=OpenAIDecisions(...)` escalates (it failed with a TypeError reported
    as "the target answered with an error"); the escalated answer carries the target's own
    distribution and confidence; a refusal is not an answer and goes where an unsure answer goes."""
    from canvasroute.router import CanvasDecisionModel, GatePolicy

    model = CanvasDecisionModel(engine=unsure_canvas(), policy=GatePolicy(rereads=0),
                                escalate_to=openai_decisions(fresh))
    questions = {**QUESTIONS, "secret": Noul(instructions="secret")}
    resp = await model.adecide(TICKET, questions, read={"instructions": "Tickets of ACME Corp."})
    team = resp.reads["team"]
    assert (team.path, team.cause, team.answer, team.escalation_model) == (
        "escalated", "uncertain", "billing", "known-answers")
    assert team.probabilities == {"billing": 0.6, "technical": 0.4} and team.escalation_confidence == 0.3
    assert resp.answers["severity"].probabilities == {0: 0.1, 1: 0.3, 2: 0.6}
    assert resp.answers["urgent"].noul == pytest.approx(0.8)
    secret = resp.reads["secret"]
    assert (secret.path, secret.refusal is not None, secret.confident) == ("unsure", True, False)
    assert secret.probabilities == {"yes": 0.5, "no": 0.5}  # the canvas answer stands, flagged
    sent = fresh.bodies[-1]
    assert all(q["instructions"].startswith("Tickets of ACME Corp.") for q in sent["questions"])
    decide = next(s for s in spans.get_finished_spans() if s.name.startswith("decide "))
    events = {e.attributes["canvasroute.question.id"]: e.attributes for e in decide.events
              if e.name == "canvasroute.question"}
    assert events["team"]["canvasroute.decision.path"] == "escalated"  # traces see the target's answer


async def test_a_base_decision_model_target_answers_with_its_distribution(fresh: DecisionsServer) -> None:
    """Any langchain-core `BaseDecisionModel` is a target too: its probabilities and confidence are kept."""
    from canvasroute.router import CanvasDecisionModel, GatePolicy

    class Confident(BaseDecisionModel):
        model: str = "confident"

        @property
        def _provider(self) -> str:
            return "test"

        def _classify(self, state: Any, questions: dict[str, Any]) -> Any:
            from langchain_core.decisions import ChoiceAnswer, ClassifierResponse

            return ClassifierResponse(model=self.model, answers={q: ChoiceAnswer(
                type="choice", choice="technical", probabilities={"billing": 0.1, "technical": 0.9}, confidence=0.9)
                for q in questions})

    model = CanvasDecisionModel(engine=unsure_canvas(), policy=GatePolicy(rereads=0), escalate_to=Confident())
    team = (await model.adecide(TICKET, {"team": QUESTIONS["team"]})).reads["team"]
    assert (team.path, team.answer, team.escalation_model) == ("escalated", "technical", "confident")
    assert team.probabilities == {"billing": 0.1, "technical": 0.9} and team.escalation_confidence == 0.9


# -- options that prefix each other, on every kind of target (issue 34.1) ------------------------------

PREFIXED: dict[str, Noul | Choice | Score] = {
    "stars": Score(instructions="How many stars, 0 to 10?", criteria=[f"{n} stars" for n in range(11)]),
    "pick": Choice(instructions="Which option?", criteria={f"opt{n}": None for n in range(80)}),
    "flag": Choice(instructions="Which flag?", criteria={"true": None, "True": None, "truest": None}),
}
PREFIXED_SCRIPT = {"stars": {1: 0.9, 10: 0.1}, "pick": {"opt12": 0.7, "opt1": 0.2, "opt7": 0.1},
                   "flag": {"True": 0.5, "true": 0.3, "truest": 0.2}}
"""What the target says: level 1 at 0.9 beside level 10, opt12 beside opt1 and opt7 (never opt10..opt19 or
opt70..), and names that differ only in case or by a suffix."""


def _target(kind: str, server: DecisionsServer) -> Any:
    from canvasroute.router.testing import ScriptedTarget

    if kind == "chat":  # a chat model that reports OpenAI-shaped logprobs
        return ScriptedTarget(script={q: {str(k): p for k, p in d.items()} for q, d in PREFIXED_SCRIPT.items()})
    if kind == "openai_decisions":
        return openai_decisions(server, max_retries=0)
    if kind == "decision_model":
        return WireDecisionModel(base_url=server.url + "/v1")
    return SystemOneDecisionModel(Connection(server.url, retries=0), model="jev-latest")


@pytest.mark.parametrize("kind", ["chat", "openai_decisions", "decision_model", "systemone"])
async def test_every_target_kind_keeps_options_that_prefix_each_other_apart(kind: str) -> None:
    """The escalated answer's distribution is the target's, option by option: `1` is not `10`, `opt1`
    is not `opt12`, `true` is not `True`, and no option gets mass the target never gave it."""
    from canvasroute.router import CanvasDecisionModel, GatePolicy

    with DecisionsServer({q: Known(d) for q, d in PREFIXED_SCRIPT.items()}) as server:
        model = CanvasDecisionModel(engine=unsure_canvas(), policy=GatePolicy(rereads=0),
                                    escalate_to=_target(kind, server))
        resp = await model.adecide(TICKET, PREFIXED)
    for qid, script in PREFIXED_SCRIPT.items():
        report = resp.reads[qid]
        wanted = {str(k): p for k, p in script.items()}
        assert (report.path, report.answer) == ("escalated", max(wanted, key=wanted.__getitem__)), qid
        assert report.probabilities == pytest.approx({o: wanted.get(o, 0.0) for o in report.probabilities}), qid
        assert set(report.probabilities) == set(parse_questions({qid: PREFIXED[qid]})[qid].options)
    stars = resp.answers["stars"]
    assert isinstance(stars, ScoreAnswer) and stars.probabilities[1] == pytest.approx(0.9)
    assert stars.probabilities[10] == pytest.approx(0.1) and stars.probabilities[0] == 0.0
