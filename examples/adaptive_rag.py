"""Adaptive RAG, LangGraph's tutorial ported: its four graders are canvas reads.

```
START -> route_question -.-> retrieve | web_search          web_search -> generate
retrieve -.Send per document.-> grade_documents -> decide_to_generate -.-> generate | transform_query
transform_query -> retrieve      generate -> grade_generation -.-> generate | transform_query | END
```

The router (`RouteQuery`) and the per-document grader (`GradeDocuments`, one `Send` branch per
document, its records keyed by document id) are the tutorial's schemas (`questions_from_schema`);
its hallucination and answer graders are two yes/no questions read in one canvas. The steps that
are not decisions (retrieval, web search, generation, rewriting) are STAND-INs: plain functions,
so the example runs offline. The tutorial's loops are unbounded; here `generate` and
`transform_query` each count a pass in `loop_step`, and a route loops back only while
`loop_step < max_retries` (at most `max_retries + 1` passes; the last is an answer).

Reads per run: one decision set to route, one per document graded, one per generation graded
(its two questions share a canvas); each set is one canvas read when the gate passes it, up to
`GatePolicy.rereads` more when not. `history=` keeps every loop's records, so
`run_totals(out["decisions"])` counts them all.
Run it: `python -m examples.adaptive_rag [vLLM URL]`.
"""

from __future__ import annotations

import operator
import re
import sys
from typing import Annotated, Any, Literal

from langchain_core.decisions import Noul
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, RetryPolicy, Send
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from canvasroute import CanvasDecisionModel, decision_node, merge_decisions, questions_from_schema, retry_on, run_totals

from . import EMBEDDED_NOTE, make_model

MAX_RETRIES = 3
CORPUS = {  # STAND-IN for the tutorial's vector store (three blog posts: agents, prompting, attacks)
    "agent-memory": "Short-term memory is in-context learning; long-term memory is a vector store the agent queries.",
    "agent-planning": "An agent breaks a task into subgoals and reflects on past actions to refine its plan.",
    "prompt-cot": "Chain-of-thought prompting asks the model to reason step by step before it answers.",
    "attack-jailbreak": "Jailbreak prompts are adversarial inputs that make a model ignore its safety rules.",
}
SAMPLE_QUESTIONS = ("What are the types of agent memory?", "Who won the 2024 Super Bowl?")
ROUTER_PROMPT = ("You are an expert at routing a user question to a vectorstore or web search. The vectorstore "
                 "contains documents related to agents, prompt engineering, and adversarial attacks.")


class RouteQuery(BaseModel):
    """Route a user query to the most relevant datasource."""

    datasource: Literal["vectorstore", "web_search"] = Field(
        description="Route the question to web search or a vectorstore.")


class GradeDocuments(BaseModel):
    """Binary score for relevance check on retrieved documents."""

    binary_score: Literal["yes", "no"] = Field(description="Documents are relevant to the question, 'yes' or 'no'")


class GraphState(TypedDict, total=False):
    question: str
    documents: dict[str, str]  # document id -> text
    generation: str
    decisions: Annotated[dict[str, Any], merge_decisions]
    loop_step: Annotated[int, operator.add]
    max_retries: int


def words(text: str) -> list[str]:
    return re.findall(r"\w{4,}", text.lower())


def retrieve(state: GraphState) -> dict[str, Any]:
    """STAND-IN for the retriever: the two documents sharing the most words with the question."""
    asked = set(words(state["question"]))
    ranked = sorted(CORPUS, key=lambda d: -len(asked & set(words(CORPUS[d]))))
    return {"documents": {d: CORPUS[d] for d in ranked[:2]}}


def web_search(state: GraphState) -> dict[str, Any]:
    """STAND-IN for the Tavily search: one document of results."""
    return {"documents": {"web": f"Web results for {state['question']!r}."}}


def generate(state: GraphState) -> dict[str, Any]:
    """STAND-IN for the RAG chain: the answer is the documents' text."""
    return {"generation": " ".join(state["documents"].values()) or "I don't know.", "loop_step": 1}


def transform_query(state: GraphState) -> dict[str, Any]:
    """STAND-IN for the question rewriter: the question's keywords."""
    return {"question": " ".join(words(state["question"])), "loop_step": 1}


def send_documents(state: GraphState) -> list[Send]:
    """One grading branch per retrieved document."""
    return [Send("grade_documents", {"question": state["question"], "doc_id": d, "document": text})
            for d, text in state["documents"].items()]


def retries_left(state: GraphState) -> bool:
    return state.get("loop_step", 0) < state.get("max_retries", MAX_RETRIES)


def decide_to_generate(state: GraphState) -> Command[Literal["generate", "transform_query"]]:
    """Keep the documents graded relevant; none left: rewrite the question (while retries last)."""
    grades = state["decisions"]["binary_score"]
    relevant = {d: text for d, text in state["documents"].items() if grades[d]["answer"] == "yes"}
    retry = not relevant and retries_left(state)
    return Command(goto="transform_query" if retry else "generate", update={"documents": relevant})


def grade_generation_v_documents_and_question(decisions: dict[str, Any], state: GraphState) -> str:
    """Not grounded: generate again; grounded but not useful: rewrite the question; while retries last."""
    if not retries_left(state):
        return END
    if decisions["grounded"]["answer"] == "no":
        return "generate"
    return END if decisions["useful"]["answer"] == "yes" else "transform_query"


def build_graph(model: CanvasDecisionModel) -> CompiledStateGraph[Any]:
    route_question = decision_node(model, questions_from_schema(RouteQuery), inputs="question",
                                   read={"instructions": ROUTER_PROMPT},
                                   route=("datasource", {"vectorstore": "retrieve", "web_search": "web_search"}))
    grade_documents = decision_node(model, questions_from_schema(GradeDocuments), branch="doc_id",
                                    inputs=lambda s: {"document": s["document"], "question": s["question"]},
                                    history=MAX_RETRIES)
    grade_generation = decision_node(model, {
        "grounded": Noul(instructions="Is the generation grounded in / supported by the documents?"),
        "useful": Noul(instructions="Does the generation address / resolve the question?"),
    }, inputs=lambda s: {k: s[k] for k in ("documents", "question", "generation")}, history=MAX_RETRIES,
        route=grade_generation_v_documents_and_question, destinations=("generate", "transform_query", END))
    builder = StateGraph(GraphState)
    for name, node in (("route_question", route_question), ("grade_documents", grade_documents),
                       ("grade_generation", grade_generation)):
        builder.add_node(name, node, retry_policy=RetryPolicy(retry_on=retry_on))
    for step in (retrieve, web_search, generate, transform_query, decide_to_generate):
        builder.add_node(step)
    builder.add_edge(START, "route_question")
    builder.add_conditional_edges("retrieve", send_documents, ["grade_documents"])
    builder.add_edge("grade_documents", "decide_to_generate")
    builder.add_edge("web_search", "generate")
    builder.add_edge("transform_query", "retrieve")
    builder.add_edge("generate", "grade_generation")
    return builder.compile()


def main(engine_url: str | None = None) -> list[dict[str, Any]]:
    """Answer each sample question and print its route, answer and what its decisions cost."""
    if engine_url is None:
        print(EMBEDDED_NOTE)
    graph = build_graph(make_model(engine_url))
    results = []
    for question in SAMPLE_QUESTIONS:
        out = graph.invoke({"question": question, "max_retries": MAX_RETRIES})
        totals = run_totals(out["decisions"])
        results.append({"question": question, "route": out["decisions"]["datasource"]["answer"],
                        "generation": out["generation"], "loop_step": out["loop_step"], "totals": totals})
        print(f"{question} -> {results[-1]['route']}, {out['loop_step']} pass(es), {totals.reads} reads: "
              f"{out['generation'][:60]}")
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
