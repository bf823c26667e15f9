"""The example graphs on a real LangGraph Server (`langgraph dev`), driven through its API.

`langgraph_sdk` and `RemoteGraph` talk to the server the suite started (tests/services.py);
the engine is the deterministic FunctionEngine behind `CANVASROUTE_ENGINE=function`.
"""

from __future__ import annotations

import json

import pytest
from langgraph.pregel.remote import RemoteGraph
from langgraph.types import Command
from langgraph_sdk import get_sync_client
from services import SLOW_IMPORT_WARNING, LangGraphServer

TICKET = "I was charged twice for my subscription this month. Please refund one payment."
pytestmark = pytest.mark.services  # `langgraph dev`


def test_langgraph_json_graphs_are_served_and_import_fast(langgraph_server: LangGraphServer) -> None:
    client = get_sync_client(url=langgraph_server.url)
    graphs = {a["graph_id"] for a in client.assistants.search(limit=100)}
    assert graphs >= {"triage", "triage_review", "rag_relevance", "tool_routing"}
    log = langgraph_server.log_text()
    assert SLOW_IMPORT_WARNING not in log, "a graph import did slow work at import time"
    schema = client.assistants.get_schemas(next(a["assistant_id"] for a in client.assistants.search(
        graph_id="triage", limit=1)))
    assert "ticket" in json.dumps(schema["input_schema"])


def test_decisions_come_back_in_state_through_the_sdk(langgraph_server: LangGraphServer) -> None:
    client = get_sync_client(url=langgraph_server.url)
    thread = client.threads.create()
    out = client.runs.wait(thread["thread_id"], "triage", input={"ticket": TICKET})
    decisions = out["decisions"]
    assert set(decisions) == {"team", "urgent", "severity"}
    assert decisions["team"]["answer"] in ("billing", "technical", "account")
    assert decisions["team"]["path"] == "canvas"
    assert decisions["team"]["read"]["normalized_entropy"] < 0.5
    expected = ("on_call" if decisions["urgent"]["answer"] == "yes" and int(decisions["severity"]["answer"]) >= 2
                else decisions["team"]["answer"])
    assert out["handled_by"] == expected
    # the state is checkpointed on the server: the thread holds the same decisions
    state = client.threads.get_state(thread["thread_id"])
    assert state["values"]["decisions"] == decisions and state["next"] == []


def test_remote_graph_takes_the_same_branch_as_the_local_graph(langgraph_server: LangGraphServer) -> None:
    from canvasroute.router import CanvasDecisionModel
    from examples import server_graphs, triage

    local = triage.build_graph(CanvasDecisionModel(engine=server_graphs.make_function_engine()))
    remote = RemoteGraph("triage", url=langgraph_server.url)
    thread = get_sync_client(url=langgraph_server.url).threads.create()["thread_id"]
    remote_out = remote.invoke({"ticket": TICKET}, {"configurable": {"thread_id": thread}})
    local_out = local.invoke({"ticket": TICKET})  # same FunctionEngine rows, same seed
    assert {q: d["answer"] for q, d in remote_out["decisions"].items()} == \
        {q: d["answer"] for q, d in local_out["decisions"].items()}
    assert remote_out["handled_by"] == local_out["handled_by"]


def test_review_lane_interrupts_and_resumes_through_the_api(langgraph_server: LangGraphServer) -> None:
    client = get_sync_client(url=langgraph_server.url)
    thread = client.threads.create()["thread_id"]
    client.runs.wait(thread, "triage_review", input={"ticket": "Something is off with my account [unsure]"})
    state = client.threads.get_state(thread)
    assert state["next"] == ["triage"], "the unsure decision did not pause the graph"
    [interrupt] = [i for t in state["tasks"] for i in t["interrupts"]]
    payload = interrupt["value"]
    assert payload["type"] == "canvasroute.review" and payload["node"] == "triage"
    assert set(payload["questions"]) == {"team", "urgent", "severity"}
    assert payload["questions"]["team"]["options"] == ["billing", "technical", "account"]
    assert payload["questions"]["team"]["normalized_entropy"] > 0.99  # flat rows: a real toss-up

    # resume through RemoteGraph with the reviewer's answers
    remote = RemoteGraph("triage_review", url=langgraph_server.url)
    out = remote.invoke(Command(resume={"team": "account", "urgent": "no", "severity": "1"}),
                        {"configurable": {"thread_id": thread}})
    assert out["handled_by"] == "account"
    assert {q: (d["answer"], d["path"]) for q, d in out["decisions"].items()} == \
        {"team": ("account", "human"), "urgent": ("no", "human"), "severity": ("1", "human")}
    assert client.threads.get_state(thread)["next"] == []
