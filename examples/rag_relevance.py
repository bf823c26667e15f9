"""RAG relevance grading: one Noul per retrieved document, all in ONE canvas read.

```
START -> retrieve -> grade -.-> generate | no_answer -> END
```

`grade` builds its questions from the state (one per document), so a single read grades
every document; `generate` keeps the documents graded relevant. Run it:
`python -m examples.rag_relevance [vLLM URL]`.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from langchain_core.decisions import Noul
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import RetryPolicy
from typing_extensions import TypedDict

from canvasroute import CanvasDecisionModel, decision_node, merge_decisions, retry_on

from . import EMBEDDED_NOTE, make_model

CORPUS = (
    "Refunds are issued to the original payment method within 5 business days.",
    "The API rate limit is 100 requests per minute per key.",
    "Passwords must be at least 12 characters long.",
    "Invoices can be downloaded as PDF from the billing page.",
    "Refund requests older than 90 days need a manager's approval.",
)
SAMPLE_QUESTIONS = ("How long does a refund take?", "What is the rate limit of the API?")


class RAGState(TypedDict, total=False):
    question: str
    documents: list[str]
    decisions: Annotated[dict, merge_decisions]
    answer: str


def retrieve(state: RAGState) -> dict[str, list[str]]:
    """Top three documents by shared words (a stand-in for a vector store)."""
    words = set(state["question"].lower().strip("?").split())
    ranked = sorted(CORPUS, key=lambda doc: -len(words & set(doc.lower().strip(".").split())))
    return {"documents": ranked[:3]}


def grading_questions(state: RAGState) -> dict[str, Noul]:
    """One yes/no question per retrieved document."""
    return {f"doc{i}": Noul(instructions=f"Does document {i} help answer the question?")
            for i in range(len(state["documents"]))}


def grading_inputs(state: RAGState) -> dict[str, Any]:
    return {"question": state["question"], "documents": {f"document {i}": d for i, d in enumerate(state["documents"])}}


def any_relevant(decisions: dict[str, Any]) -> str:
    return "generate" if any(d["answer"] == "yes" for d in decisions.values()) else "no_answer"


def generate(state: RAGState) -> dict[str, str]:
    """Answer from the relevant documents (a stand-in for an LLM call)."""
    keep = [doc for i, doc in enumerate(state["documents"]) if state["decisions"][f"doc{i}"]["answer"] == "yes"]
    return {"answer": " ".join(keep)}


def no_answer(state: RAGState) -> dict[str, str]:
    return {"answer": "No retrieved document answers this question."}


def build_graph(model: CanvasDecisionModel) -> CompiledStateGraph:
    grade = decision_node(model, grading_questions, inputs=grading_inputs, route=any_relevant,
                          destinations=["generate", "no_answer"])
    builder = StateGraph(RAGState)
    builder.add_node(retrieve)
    builder.add_node("grade", grade, retry_policy=RetryPolicy(retry_on=retry_on))
    builder.add_node(generate)
    builder.add_node(no_answer)
    builder.add_edge(START, "retrieve")
    builder.add_edge("retrieve", "grade")
    builder.add_edge("generate", END)
    builder.add_edge("no_answer", END)
    return builder.compile()


def main(engine_url: str | None = None) -> list[dict[str, Any]]:
    """Grade the documents retrieved for each sample question and print the outcome."""
    if engine_url is None:
        print(EMBEDDED_NOTE)
    graph = build_graph(make_model(engine_url))
    results = []
    for question in SAMPLE_QUESTIONS:
        out = graph.invoke({"question": question})
        grades = {qid: d["answer"] for qid, d in out["decisions"].items()}
        results.append({"question": question, "grades": grades, "answer": out["answer"]})
        print(f"{question}  grades={grades}  -> {out['answer'][:60]}")
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
