"""A LangGraph worker process for the durable-run tests (tests/test_durable.py).

    python tests/durable_worker.py DSN THREAD LOG [--ticket TEXT] [--block read|lane] [--resume]
        [--fork-before triage]

The graph, checkpointed in PostgreSQL (PostgresSaver):

    START -> intake -> triage (decision node) -> billing | technical -> close -> END

The FunctionEngine's rows are a hash of the canvas text, so a different canvas gives a
different answer, and every read is appended to LOG (one JSON line: pid, canvas text,
slots, prompt). `--block read` makes the read block after logging (the test SIGKILLs
the worker there); `--block lane` makes the lane node block after the decision has been
committed. On exit the final state is printed as JSON on stdout.
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
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from canvasroute.engine import FunctionEngine
from canvasroute.engine._types import CanvasRead
from canvasroute.harness import decision_node, merge_decisions
from canvasroute.router import CanvasDecisionModel, GatePolicy

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


def build(checkpointer: PostgresSaver, log: str, block: str | None) -> Any:
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
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=1.0))
    triage = decision_node(model, QUESTIONS, inputs="ticket",
                           route=("team", {"billing": "billing", "technical": "technical"}))

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
    args = p.parse_args(argv)
    with PostgresSaver.from_conn_string(args.dsn) as saver:
        saver.setup()
        graph = build(saver, args.log, args.block)
        config: dict[str, Any] = {"configurable": {"thread_id": args.thread}}
        if args.fork_before:
            before = next(s for s in graph.get_state_history(config) if s.next == (args.fork_before,))
            out = graph.invoke(None, before.config, durability="sync")
        else:
            out = graph.invoke(None if args.resume else {"ticket": args.ticket}, config, durability="sync")
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main()
