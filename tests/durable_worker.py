"""A LangGraph worker process for the durable-run tests (tests/test_durable.py).

    python tests/durable_worker.py DSN THREAD LOG [--ticket TEXT] [--block read|lane] [--resume]
        [--fork-before triage] [--review AR_LOG [--resume-with OPTION]]

The graph, checkpointed in PostgreSQL (PostgresSaver):

    START -> intake -> triage (decision node) -> billing | technical -> close -> END

The FunctionEngine's rows are a hash of the canvas text, so a different canvas gives a
different answer, and every read is appended to LOG (one JSON line: pid, canvas text,
slots, prompt). `--block read` makes the read block after logging (the test SIGKILLs
the worker there); `--block lane` makes the lane node block after the decision has been
committed. On exit the final state is printed as JSON on stdout.

`--review AR_LOG` makes triage unsure of everything, with an escalation target (one
escalation per thread: `team` escalates, `urgent` goes to a human review) that appends
each call to AR_LOG and answers by its process id, so a second call in another process
could answer differently. `--resume-with OPTION` resumes the review with OPTION.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Annotated, Any

from langchain_core.decisions import Choice, Noul
from langchain_core.runnables import RunnableLambda
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command
from typing_extensions import TypedDict

from canvasroute.engine import CanvasRead, FunctionEngine
from canvasroute.harness import ReviewPolicy, decision_node, merge_decisions
from canvasroute.router import CanvasDecisionModel, Escalation, EscalationBudget, GatePolicy, OutcomePolicy

QUESTIONS = {
    "team": Choice(instructions="Which team handles this ticket?",
                   criteria={"billing": "payments and refunds", "technical": "bugs and outages"}),
    "urgent": Noul(instructions="Does it need an answer within the hour?"),
}


class State(TypedDict, total=False):
    ticket: str
    intake: str
    decisions: Annotated[dict, merge_decisions]
    lane: str
    closed: bool


def escalation_target(ar_log: str) -> RunnableLambda:
    def answer(messages: Any) -> dict[str, str]:
        with open(ar_log, "a") as f:
            f.write(json.dumps({"pid": os.getpid()}) + "\n")
        return {"team": ("billing", "technical")[os.getpid() % 2]}

    return RunnableLambda(answer, name="big-ar")


def build(checkpointer: PostgresSaver, log: str, block: str | None, ar_log: str | None = None) -> Any:
    engine: FunctionEngine

    def rows(read: CanvasRead) -> list[dict[int, float]]:
        words = {i: w for w, i in engine._vocab.items()}
        canvas = "".join(words.get(t, f"<{t}>") for t in read.canvas)
        prompt = json.dumps(list(read.messages), sort_keys=True)
        digest = hashlib.sha256((canvas + prompt).encode()).digest()
        out = []
        for k, _slot in enumerate(read.slots):
            # a decisive row: the label picked by the canvas hash gets most of the mass
            pick = digest[k] % len(read.label_ids)
            out.append({lid: (-0.05 if j == pick else -4.0) for j, lid in enumerate(read.label_ids)})
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "canvas": canvas, "slots": list(read.slots),
                                "prompt": prompt, "picks": [words.get(max(r, key=r.get)) for r in out],
                                "labels": [words.get(i) for i in read.label_ids]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if block == "read":
            _block("reading")
        return out

    engine = FunctionEngine(rows, model="durable-fn")
    if ar_log is None:
        model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=1.0))
    else:  # unsure of everything: team escalates (the budget's one), urgent goes to review
        model = CanvasDecisionModel(engine=engine,
                                    policy=GatePolicy(max_normalized_entropy=0.01, rereads=0),
                                    escalate_to=Escalation(escalation_target(ar_log),
                                                           budget=EscalationBudget(max_per_thread=1)),
                                    outcomes=OutcomePolicy(over_budget="answer"))
    triage = decision_node(model, QUESTIONS, inputs="ticket",
                           route=("team", {"billing": "billing", "technical": "technical"}),
                           review=ReviewPolicy() if ar_log else None)

    def intake(state: State) -> dict[str, Any]:
        return {"intake": f"pid {os.getpid()}"}

    def lane(name: str) -> Any:
        def run(state: State) -> dict[str, Any]:
            if block == "lane":
                _block("in_lane")
            return {"lane": name}

        run.__name__ = name
        return run

    def close(state: State) -> dict[str, Any]:
        return {"closed": True}

    builder = StateGraph(State)
    builder.add_node("intake", intake)
    builder.add_node("triage", triage)
    builder.add_node("billing", lane("billing"))
    builder.add_node("technical", lane("technical"))
    builder.add_node("close", close)
    builder.add_edge(START, "intake")
    builder.add_edge("intake", "triage")
    builder.add_edge("billing", "close")
    builder.add_edge("technical", "close")
    builder.add_edge("close", END)
    return builder.compile(checkpointer=checkpointer)


def _block(marker: str) -> None:
    """Tell the test where we are (a marker file), then wait to be killed."""
    path = os.environ["DURABLE_MARKER_DIR"] + "/" + marker
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dsn")
    p.add_argument("thread")
    p.add_argument("log")
    p.add_argument("--ticket", default="I was charged twice this month, please refund one payment.")
    p.add_argument("--block", choices=["read", "lane"])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--fork-before", help="re-run the thread from the checkpoint before this node")
    p.add_argument("--review", metavar="AR_LOG", help="unsure answers: escalate team, review urgent")
    p.add_argument("--resume-with", help="resume the review with this option")
    args = p.parse_args(argv)
    with PostgresSaver.from_conn_string(args.dsn) as saver:
        saver.setup()
        graph = build(saver, args.log, args.block, args.review)
        config: dict[str, Any] = {"configurable": {"thread_id": args.thread}}
        if args.resume_with:
            out = graph.invoke(Command(resume=args.resume_with), config, durability="sync")
        elif args.fork_before:
            before = next(s for s in graph.get_state_history(config) if s.next == (args.fork_before,))
            out = graph.invoke(None, before.config, durability="sync")
        else:
            out = graph.invoke(None if args.resume else {"ticket": args.ticket}, config, durability="sync")
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main()
