"""`canvasroute demo`, the whole loop: canvas reads on a vLLM-wire server, the gate, and
escalation to an OpenAI-compatible AR server (`--escalate-url`), or, without one, a report
of what would have escalated. The canvas server is the loopback vLLM (`answer="uniform"`:
every slot unsure, so every decision reaches the gate's escalation step); the AR server is
tests/ar_server.py on SmolLM2-135M (`smollm`): near chance, so its replies may be invalid,
which the demo reports instead of crashing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import smollm2_ar_server
from opentelemetry import trace
from opentelemetry.util._once import Once

from canvasroute.apps.cli import main
from canvasroute.apps.observability.dashboard import build_report
from canvasroute.apps.observability.traces import read_spans
from canvasroute.engine.testing import spawn
from canvasroute.router import telemetry as tm


@contextmanager
def unset_tracer_provider() -> Iterator[None]:
    """The global tracer provider unset, as in a fresh `canvasroute demo` process (which installs
    its own); the previous one is put back afterwards."""
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    try:
        yield
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


TICKET = "I was charged twice for my subscription this month. Please refund one payment."


def test_without_a_target_the_demo_says_what_would_escalate_and_how_to_add_one(tmp_path, capsys):
    trace = tmp_path / "demo.jsonl"
    with spawn(answer="uniform") as server, unset_tracer_provider():
        assert main(["demo", "--engine-url", server.url, "--ticket", TICKET, "--ticket", "My app crashes",
                     "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "escalate (no target set: reported, not sent)" in out
    assert out.count("would escalate") == 6  # 2 tickets x 3 questions, all unsure
    assert "answered: canvas 0/6 (0%), re-read 6/6 (100%), escalated 0/6 (0%)" in out
    assert "would have escalated at H/lnK > 0.5: 6/6 decisions" in out
    assert "--escalate-url http://HOST:8001/v1 --escalate-model MODEL" in out
    report = build_report(read_spans(trace))
    assert report.graph is not None and "triage" in report.graph["nodes"]  # the demo records its graph
    assert sum(report.routes.values()) == 2


def test_escalate_url_and_model_go_together(capsys):
    assert main(["demo", "--engine-url", "http://127.0.0.1:9", "--escalate-url", "http://127.0.0.1:9/v1"]) == 2
    assert "go together" in capsys.readouterr().err


@pytest.fixture(scope="module")
def ar_server():
    with smollm2_ar_server(max_new_tokens=40) as server:
        yield server


@pytest.mark.smollm
def test_the_demo_escalates_to_an_openai_compatible_ar_server(ar_server, tmp_path, capsys):
    trace = tmp_path / "demo.jsonl"
    before = len(ar_server.requests)
    with spawn(answer="uniform") as server, unset_tracer_provider():
        assert main(["demo", "--engine-url", server.url, "--ticket", TICKET, "--trace", str(trace),
                     "--escalate-url", ar_server.url, "--escalate-model", "smollm2"]) == 0
    out = capsys.readouterr().out
    print(out)
    sent = ar_server.requests[before:]
    # one call, one more on an invalid reply; a slow CPU may time a call out, and the node retries that
    assert sent and all(r["model"] == "smollm2" for r in sent)
    assert TICKET in sent[0]["messages"][-1]["content"]
    assert f"escalate to smollm2 at {ar_server.url}" in out and "would escalate" not in out
    summary = re.search(r"answered: (.*?); model load", out).group(1)
    if "escalation failed" in out:  # SmolLM2 answered outside the options twice: reported, not hidden
        assert "escalation failed 3/3 (100%)" in summary
    else:
        assert out.count("escalated to smollm2") == 3 and "escalated 3/3 (100%)" in summary
    spans = read_spans(trace)
    (chat,) = [s for s in spans if s.name == "chat smollm2"][:1]
    assert chat.attributes[tm.GEN_AI_PROVIDER] == "openai"
    report = build_report(spans)
    assert report.escalation_models == {"smollm2": "openai"}  # the provider, read from the chat span
