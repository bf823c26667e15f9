"""Questions from a schema and `with_structured_output`: LangGraph's tutorial graders, ported.

The schemas are the Adaptive RAG tutorial's own (`GradeDocuments`, `RouteQuery`, ...), used as
the tutorial uses them: after a `ChatPromptTemplate`, inside a real LangGraph graph. Canvases
come from `FunctionEngine` (the answer each test wants, by label), and in the last section from
the real vLLM CPU server (a random tiny DiffusionGemma: plumbing, not accuracy).
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Annotated, Any, Literal, NotRequired

import pytest
from conftest import fixed_engine, label_rows
from langchain_core.decisions import Choice, ClassifierResponse, Noul, NoulAnswer
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tracers.context import collect_runs
from pydantic import BaseModel, Field, ValidationError, field_validator
from typing_extensions import TypedDict

from canvasroute.engine import DecisionError, FunctionEngine, UnsupportedQuestion, VLLMServerEngine
from canvasroute.harness import decision_node, route_on
from canvasroute.router import (
    CanvasDecisionModel,
    GatePolicy,
    StructuredDecision,
    answers_to_schema,
    questions_from_schema,
    render_state,
)


class GradeDocuments(BaseModel):
    """Binary score for relevance check on retrieved documents."""

    binary_score: Literal["yes", "no"] = Field(description="Documents are relevant to the question, 'yes' or 'no'")


class RouteQuery(BaseModel):
    """Route a user query to the most relevant datasource."""

    datasource: Literal["vectorstore", "web_search"] = Field(
        ..., description="Given a user question choose to route it to web search or a vectorstore.")


GRADE_PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a grader assessing relevance of a retrieved document to a user question."),
    ("human", "Retrieved document: \n\n {document} \n\n User question: {question}"),
])
NO = {"yes": -6.0, "no": -0.01, "A": -6.0, "B": -0.01, "C": -6.0}
"""Every slot reads its second label: `no` for a Noul, the second option of a Choice."""


def canvas(logprobs: dict[str, float] = NO, **kwargs: Any) -> CanvasDecisionModel:
    return CanvasDecisionModel(engine=fixed_engine(logprobs), **kwargs)


# -- questions from a schema ---------------------------------------------------------------------


def test_the_tutorial_graders_become_a_noul_and_a_choice_with_their_descriptions():
    assert questions_from_schema(GradeDocuments) == {
        "binary_score": Noul(instructions="Documents are relevant to the question, 'yes' or 'no'")}
    assert questions_from_schema(RouteQuery) == {"datasource": Choice(
        instructions="Given a user question choose to route it to web search or a vectorstore.",
        criteria={"vectorstore": None, "web_search": None})}


class Color(str, Enum):  # noqa: UP042 - the (str, Enum) form of the schemas users write, under test
    RED = "red"
    BLUE = "blue"


class Every(BaseModel):
    flag: bool
    truth: Literal[True, False] = Field(description="Is it true?")
    shouted: Literal["No", "Yes"]
    rating: Literal[1, 2, 3]
    color: Annotated[Color, Field(description="Which color?")]
    team: Literal["billing", "tech", "yes"]


@pytest.mark.parametrize(("second", "expected"), [
    (False, {"flag": True, "truth": True, "shouted": "Yes", "rating": 1, "color": Color.RED, "team": "billing"}),
    (True, {"flag": False, "truth": False, "shouted": "No", "rating": 2, "color": Color.BLUE, "team": "tech"}),
])
def test_every_supported_field_maps_to_a_question_and_back_to_its_own_value(second, expected):
    questions = questions_from_schema(Every)
    assert {q: type(v).__name__ for q, v in questions.items()} == {
        "flag": "Noul", "truth": "Noul", "shouted": "Noul", "rating": "Choice", "color": "Choice", "team": "Choice"}
    assert list(questions["rating"].criteria) == ["1", "2", "3"]  # an int's option is its text
    assert list(questions["team"].criteria) == ["billing", "tech", "yes"]  # three values: a Choice, even with "yes"
    assert (questions["color"].instructions, questions["flag"].instructions) == ("Which color?", "flag?")
    picks = NO if second else {"yes": -0.01, "no": -6.0, "A": -0.01, "B": -6.0, "C": -6.0}
    out = canvas(picks).with_structured_output(Every).invoke("anything")
    assert isinstance(out, Every) and out.model_dump() == expected
    assert type(out.rating) is int and out.color is expected["color"]


def test_a_typeddict_reads_descriptions_from_annotated_and_answers_with_a_dict():
    class Grade(TypedDict):
        """Grade an answer."""

        grounded: Annotated[bool, ..., "Is the answer grounded in the facts?"]
        useful: NotRequired[Annotated[Literal["yes", "no"], Field(description="Does it resolve the question?")]]

    questions = questions_from_schema(Grade)
    assert questions == {"grounded": Noul(instructions="Is the answer grounded in the facts?"),
                         "useful": Noul(instructions="Does it resolve the question?")}
    assert canvas().with_structured_output(Grade).invoke("an answer") == {"grounded": False, "useful": "no"}


def test_the_questions_are_fresh_models_each_time():
    questions_from_schema(RouteQuery)["datasource"].criteria["other"] = None
    assert list(questions_from_schema(RouteQuery)["datasource"].criteria) == ["vectorstore", "web_search"]


class Nested(BaseModel):
    inner: GradeDocuments


@pytest.mark.parametrize(("annotation", "says"), [
    (str, "str has no question form (a free value"),
    (int, "int has no question form (a free value"),
    (float, "float has no question form"),
    (Literal["a", "b"] | None, "(an Optional or a union"),
    (bool | int, "(a union: give the field one Literal"),
    (list[Literal["a", "b"]], "(a collection: a question has one answer)"),
    (GradeDocuments, "GradeDocuments has no question form (a nested schema"),
    (Literal["only"], "one value leaves nothing to decide"),
    (Literal["1", 1], "two values have the same text"),
    (Literal[True, "maybe"], "the value True is not a str or an int"),
    (Literal[None, "a"], "the value None is not a str or an int"),  # noqa: PYI061 - None as a value
    (Literal[1.5, 2.5], "the value 1.5 is not a str or an int"),
])
def test_a_field_without_a_question_form_is_refused_by_name(annotation, says):
    class Schema(BaseModel):
        ok: bool
        odd: annotation  # type: ignore[valid-type]

    with pytest.raises(UnsupportedQuestion, match=r"^Schema\.odd: ") as caught:
        canvas().with_structured_output(Schema)  # refused when ported, not at the first call
    assert says in caught.value.message and "Literal[...]" in caught.value.hint


@pytest.mark.parametrize("schema", [
    {"title": "answers", "type": "object", "properties": {"x": {"enum": ["a", "b"]}}},
    GradeDocuments(binary_score="yes"),
    Literal["a", "b"],
    int,
])
def test_what_is_not_a_schema_class_is_refused(schema):
    with pytest.raises(UnsupportedQuestion, match="a schema is a pydantic model or TypedDict class"):
        questions_from_schema(schema)


def test_a_schema_without_fields_is_refused():
    class Empty(BaseModel):
        pass

    with pytest.raises(UnsupportedQuestion, match="Empty has no fields to ask"):
        questions_from_schema(Empty)


# -- a schema where questions go -------------------------------------------------------------------


def docstring_engine(schema: type) -> FunctionEngine:
    """Every slot reads its first label when the schema's docstring is in the canvas's prompt, its
    second when it is not: what a decision answers says whether its instructions reached the read."""
    doc = schema.__doc__.strip()

    def rows(read):
        seen = doc in json.dumps(read.messages)
        first, second = (-0.01, -6.0) if seen else (-6.0, -0.01)
        return label_rows(engine, {"yes": first, "no": second, "A": first, "B": second}, read)

    engine = FunctionEngine(rows)
    return engine


class Routed(TypedDict):
    """Route a user query to the most relevant datasource."""

    datasource: Annotated[Literal["vectorstore", "web_search"], "Web search or a vectorstore?"]


def figures(response) -> dict[str, Any]:
    return {q: r.model_dump(exclude={"latency_s"}) for q, r in response.reads.items()}


@pytest.mark.parametrize("schema", [GradeDocuments, Routed], ids=["pydantic", "typeddict"])
async def test_a_schema_given_as_questions_asks_its_fields_with_its_docstring_as_instructions(schema):
    """`decide`, `adecide`, `request` and `invoke` take the schema itself and ask what the README's
    spelling asks: `questions_from_schema(schema)` with `read={"instructions": schema.__doc__}`."""
    model = CanvasDecisionModel(engine=docstring_engine(schema))
    spelled = model.request("doc", questions_from_schema(schema), read={"instructions": schema.__doc__})
    assert model.request("doc", schema).key == spelled.key  # the same questions, instructions, seed, gate
    assert spelled.read.instructions == schema.__doc__.strip()
    expected = figures(model.decide("doc", questions_from_schema(schema), read={"instructions": schema.__doc__}))
    assert next(iter(expected.values()))["path"] == "canvas" and next(iter(expected.values()))["answer"] in (
        "yes", "vectorstore")  # the docstring reached the canvas
    assert figures(model.decide("doc", schema)) == expected
    assert figures(await model.adecide("doc", schema)) == expected
    assert figures(model.invoke({"state": "doc", "questions": schema})) == expected
    assert figures(await model.ainvoke({"state": "doc", "questions": schema})) == expected
    # the call's own instructions come instead of the docstring, as a call's read comes over the model's
    own = model.request("doc", schema, read={"instructions": "Only EU documents."})
    assert own.read.instructions == "Only EU documents."


def test_a_decision_node_takes_a_schema_as_the_tutorials_write_it():
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        question: str
        decisions: dict[str, Any]
        went: str

    def graph(questions, **kwargs):
        model = CanvasDecisionModel(engine=docstring_engine(GradeDocuments))
        builder = StateGraph(State)
        builder.add_node("grade", decision_node(model, questions, inputs="question",
                                                route=("binary_score", {"yes": "use", "no": "rewrite"}), **kwargs))
        builder.add_node("use", lambda state: {"went": "use"})
        builder.add_node("rewrite", lambda state: {"went": "rewrite"})
        builder.add_edge(START, "grade")
        builder.add_edge("use", END)
        builder.add_edge("rewrite", END)
        return builder.compile()

    out = graph(GradeDocuments).invoke({"question": "agent memory"})
    spelled = graph(questions_from_schema(GradeDocuments), read={"instructions": GradeDocuments.__doc__}).invoke(
        {"question": "agent memory"})
    assert out["went"] == spelled["went"] == "use"  # the docstring reached the canvas: yes
    assert out["decisions"]["binary_score"]["answer"] == "yes"
    strip = {"timing", "totals"}
    assert {k: v for k, v in out["decisions"]["binary_score"].items() if k not in strip} == {
        k: v for k, v in spelled["decisions"]["binary_score"].items() if k not in strip}


def test_route_on_takes_a_schema_of_one_field():
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        question: str
        went: str

    paths = {"vectorstore": "vectorstore", "web_search": "web_search"}
    edge = route_on(CanvasDecisionModel(engine=docstring_engine(RouteQuery)), RouteQuery, paths, inputs="question")
    assert (edge.question_id, edge.read.instructions) == ("datasource", RouteQuery.__doc__.strip())
    builder = StateGraph(State)
    builder.add_node("start", lambda state: {})
    builder.add_node("vectorstore", lambda state: {"went": "vectorstore"})
    builder.add_node("web_search", lambda state: {"went": "web_search"})
    builder.add_edge(START, "start")
    builder.add_conditional_edges("start", edge, paths)
    builder.add_edge("vectorstore", END)
    builder.add_edge("web_search", END)
    assert builder.compile().invoke({"question": "agent memory"})["went"] == "vectorstore"  # docstring seen

    class Two(BaseModel):
        """Two questions."""

        first: bool
        second: bool

    with pytest.raises(UnsupportedQuestion, match=r"route_on asks one question, and Two has 2 fields") as caught:
        route_on(canvas(), Two, {"yes": "a", "no": "b"})
    assert "decision_node(model, Two" in caught.value.hint


def test_route_on_keeps_an_explicit_question_id_even_the_default_spelling():
    """`question_id="route"` given with a schema is the caller's id, not the field's name."""
    model = CanvasDecisionModel(engine=docstring_engine(RouteQuery))
    paths = {"vectorstore": "vectorstore", "web_search": "web_search"}
    assert route_on(model, RouteQuery, paths, question_id="route").question_id == "route"
    assert route_on(model, RouteQuery, paths, question_id="source").question_id == "source"
    assert route_on(model, RouteQuery, paths).question_id == "datasource"  # not given: the field's name
    assert route_on(model, Noul(instructions="Relevant?"), {"yes": "a", "no": "b"}).question_id == "route"


def test_a_schema_field_with_no_question_form_is_refused_where_the_schema_is_given():
    class Graded(BaseModel):
        """Grade it."""

        binary_score: Literal["yes", "no"]
        reason: str

    model = canvas()
    for build in (lambda: decision_node(model, Graded), lambda: route_on(model, Graded, {"yes": "a", "no": "b"}),
                  lambda: model.request("doc", Graded), lambda: model.decide("doc", Graded),
                  lambda: model.invoke({"state": "doc", "questions": Graded})):
        with pytest.raises(UnsupportedQuestion, match=r"^Graded\.reason: str has no question form"):
            build()
    with pytest.raises(UnsupportedQuestion, match="a schema is a pydantic model or TypedDict class"):
        decision_node(model, Color)  # a class that is no schema: refused when the node is built, not in the run


def test_a_schema_as_one_question_is_refused_with_the_way_to_ask_it():
    with pytest.raises(DecisionError) as caught:
        canvas().decide("doc", {"grade": GradeDocuments})
    assert "questions_from_schema(schema)" in caught.value.hint
    assert "model.with_structured_output(schema)" in str(caught.value)


# -- the way back ---------------------------------------------------------------------------------


def test_answers_come_back_from_any_decision_models_response():
    """A `CanvasResponse` answers by its read reports; another decision model's response by its answers."""
    resp = ClassifierResponse.model_validate({"model": "other", "answers": {
        "binary_score": NoulAnswer(type="noul", noul=0.7)}})
    assert answers_to_schema(GradeDocuments, resp) == GradeDocuments(binary_score="yes")
    resp = canvas().decide("doc", questions_from_schema(GradeDocuments))
    assert resp.reads["binary_score"].answer == "no"
    assert answers_to_schema(GradeDocuments, resp) == GradeDocuments(binary_score="no")
    with pytest.raises(DecisionError, match="the decision has no answer for 'datasource'"):
        answers_to_schema(RouteQuery, resp)


def test_the_schemas_own_validators_decide_and_include_raw_keeps_what_they_refused():
    class Strict(BaseModel):
        binary_score: Literal["yes", "no"]

        @field_validator("binary_score")
        @classmethod
        def _only_yes(cls, value: str) -> str:
            if value != "yes":
                raise ValueError("only yes will do")
            return value

    with pytest.raises(ValidationError, match="only yes will do"):
        canvas().with_structured_output(Strict).invoke("doc")
    out = canvas().with_structured_output(Strict, include_raw=True).invoke("doc")
    assert out["parsed"] is None and isinstance(out["parsing_error"], ValidationError)
    assert out["raw"].reads["binary_score"].answer == "no"


# -- with_structured_output -----------------------------------------------------------------------


def test_the_tutorial_chain_ports_in_one_line_one_read_per_call_the_prompt_as_state():
    model = canvas()
    grader = GRADE_PROMPT | model.with_structured_output(GradeDocuments)
    out = grader.invoke({"document": "Agents keep a memory of past steps.", "question": "agent memory"})
    assert out == GradeDocuments(binary_score="no")
    engine = model.engine
    assert engine.calls == 1 and len(engine.reads) == 1  # one canvas read
    system, user = engine.reads[0].messages
    assert user["content"] == ("system: You are a grader assessing relevance of a retrieved document to a user "
                               "question.\nhuman: Retrieved document: \n\n Agents keep a memory of past steps. "
                               "\n\n User question: agent memory")
    assert system["content"].startswith("Binary score for relevance check on retrieved documents.")  # the docstring
    assert "Documents are relevant to the question" in system["content"]


@pytest.mark.parametrize(("given", "state"), [
    ("Is it sunny?", "Is it sunny?"),
    ([("system", "Route it."), ("human", "Is it sunny?")], "system: Route it.\nhuman: Is it sunny?"),
    ([SystemMessage("Route it."), HumanMessage("Is it sunny?")], "system: Route it.\nhuman: Is it sunny?"),
    (HumanMessage("Is it sunny?"), "human: Is it sunny?"),
    ({"question": "Is it sunny?", "documents": []}, '{"question": "Is it sunny?", "documents": []}'),
])
async def test_a_chat_models_inputs_and_a_graph_state_are_the_decisions_state(given, state):
    model = canvas()
    router = model.with_structured_output(RouteQuery)
    assert (await router.ainvoke(given)).datasource == "web_search"
    assert router.invoke(given).datasource == "web_search"
    assert [r.messages[1]["content"] for r in model.engine.reads] == [state, state]


class Router(TypedDict):
    """Worker to route to next. If no workers needed, route to FINISH."""

    next: Literal["researcher", "coder", "FINISH"]


def test_the_supervisor_tutorials_router_takes_its_message_dicts_and_answers_a_dict():
    model = canvas()
    messages = [{"role": "system", "content": "You are a supervisor managing: researcher, coder."},
                HumanMessage("Plot the GDP of France.")]
    assert model.with_structured_output(Router).invoke(messages) == {"next": "coder"}
    system, user = model.engine.reads[0].messages
    assert user["content"] == ("system: You are a supervisor managing: researcher, coder.\n"
                               "human: Plot the GDP of France.")
    assert system["content"].startswith("Worker to route to next. If no workers needed, route to FINISH.")
    assert "next?" in system["content"]  # a field without a description is asked by its name


CALL = {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": '{"order" :7}'}}


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Refund order 7."}, {"role": "assistant", "content": "", "tool_calls": [CALL]}],
    [{"role": "user", "content": "Refund it."},
     {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "refund", "arguments": "{7"}}]}],
    [{"role": "developer", "content": "Route it."}, {"role": "assistant", "tool_calls": [CALL]}],
], ids=["arguments as sent", "arguments that do not parse", "a turn of calls only"])
def test_structured_output_reads_message_dicts_as_a_decision_reads_them(messages):
    """Defect: `with_structured_output` converted message dicts its own way: it refused calls whose
    arguments do not parse and an assistant turn without content, and re-spaced the arguments, where
    a decision on the same messages reads them (`read_state`)."""
    model = canvas()
    assert model.with_structured_output(RouteQuery).invoke(messages) == RouteQuery(datasource="web_search")
    model.invoke({"state": messages, "questions": {"datasource": questions_from_schema(RouteQuery)["datasource"]}})
    structured, decided = (read.messages[1]["content"] for read in model.engine.reads)
    assert structured == decided == render_state(messages)
    assert "ai: [call refund id=c1] " + messages[-1]["tool_calls"][0]["function"]["arguments"] in decided


def test_a_list_that_is_not_messages_is_refused_with_a_hint():
    with pytest.raises(DecisionError, match="a list input is messages") as caught:
        canvas().with_structured_output(RouteQuery).invoke([1, 2])
    assert "inside a dict" in caught.value.hint


def test_include_raw_returns_langchains_shape_with_the_canvas_figures():
    out = canvas().with_structured_output(RouteQuery, include_raw=True).invoke("Is it sunny?")
    assert set(out) == {"raw", "parsed", "parsing_error"} and out["parsing_error"] is None
    assert out["parsed"] == RouteQuery(datasource="web_search")
    report = out["raw"].reads["datasource"]
    assert report.path == "canvas" and report.probabilities["web_search"] > 0.99 and out["raw"].canvas_reads == 1


def test_a_chat_models_structured_output_options_are_accepted_others_refused():
    model = canvas()
    runnable = model.with_structured_output(RouteQuery, method="function_calling", strict=True)
    assert isinstance(runnable, StructuredDecision) and runnable.OutputType is RouteQuery
    assert runnable.questions == questions_from_schema(RouteQuery) and runnable.model is model
    with pytest.raises(ValueError, match=r"not \['tools'\]"):
        model.with_structured_output(RouteQuery, tools=[])


def test_the_decision_is_traced_inside_the_chains_run():
    with collect_runs() as runs:
        (GRADE_PROMPT | canvas().with_structured_output(GradeDocuments)).invoke({"document": "d", "question": "q"})
    (root,) = runs.traced_runs
    assert [child.name for child in root.child_runs] == ["ChatPromptTemplate", "StructuredDecision"]
    (decision,) = root.child_runs[1].child_runs
    assert decision.name == "CanvasDecisionModel" and decision.run_type == "llm"
    assert decision.inputs["read"] == {"instructions": "Binary score for relevance check on retrieved documents."}
    assert decision.outputs["output"].reads["binary_score"].path == "canvas"
    assert root.child_runs[1].outputs == {"output": GradeDocuments(binary_score="no")}


class RagState(TypedDict, total=False):
    question: str
    documents: list[str]
    relevant: list[str]


def test_the_adaptive_rag_router_and_grader_run_in_a_real_graph():
    from langgraph.graph import END, START, StateGraph

    route_prompt = ChatPromptTemplate.from_messages([("system", "Route the question."), ("human", "{question}")])
    question_router = route_prompt | canvas({"A": -0.01, "B": -6.0}).with_structured_output(RouteQuery)
    grader = GRADE_PROMPT | canvas({"yes": -0.01, "no": -6.0}).with_structured_output(GradeDocuments)  # yes to all

    def route_question(state: RagState) -> str:
        return question_router.invoke({"question": state["question"]}).datasource

    def grade_documents(state: RagState) -> RagState:
        return {"relevant": [d for d in state["documents"]
                             if grader.invoke({"question": state["question"], "document": d}).binary_score == "yes"]}

    builder = StateGraph(RagState)
    builder.add_node("vectorstore", grade_documents)
    builder.add_node("web_search", lambda state: {"relevant": []})
    builder.add_conditional_edges(START, route_question, {"vectorstore": "vectorstore", "web_search": "web_search"})
    builder.add_edge("vectorstore", END)
    builder.add_edge("web_search", END)
    out = builder.compile().invoke({"question": "What is agent memory?", "documents": ["a", "b"]})
    assert out["relevant"] == ["a", "b"]


# -- the real server ------------------------------------------------------------------------------


@pytest.mark.vllm
async def test_the_grader_on_the_real_server_answers_what_its_one_read_chose(vllm_url):
    model = CanvasDecisionModel(engine=VLLMServerEngine(vllm_url),
                                policy=GatePolicy(max_normalized_entropy=None, rereads=0))
    grader = GRADE_PROMPT | model.with_structured_output(RouteQuery, include_raw=True)
    out = await grader.ainvoke({"document": "Agents keep a memory.", "question": "agent memory"})
    report = out["raw"].reads["datasource"]
    assert out["raw"].canvas_reads == 1 and report.path == "canvas"
    assert out["parsed"] == RouteQuery(datasource=report.answer)
    assert math.isclose(sum(report.probabilities.values()), 1.0, abs_tol=1e-6)
