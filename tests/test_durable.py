"""Durable runs on PostgreSQL: a worker killed with SIGKILL, the thread resumed elsewhere.

Workers are separate Python processes (tests/durable_worker.py) sharing one real
PostgreSQL (PostgresSaver). The test waits for a marker file the worker writes at the
moment it should die, SIGKILLs it, inspects the checkpoint from this process, and
resumes the thread from a new process. A review paused in one process is resumed in
another without a second read or escalation.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from deadlines import Watch, finish
from langgraph.checkpoint.postgres import PostgresSaver
from services import PYTHON, child_env

WORKER = str(ROOT / "tests" / "durable_worker.py")
pytestmark = pytest.mark.services  # PostgreSQL


def _spawn(dsn: str, thread: str, log: Path, markers: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, WORKER, dsn, thread, str(log), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(DURABLE_MARKER_DIR=str(markers)))


def _run(dsn: str, thread: str, log: Path, markers: Path, *args: str) -> dict[str, Any]:
    proc = _spawn(dsn, thread, log, markers, *args)
    out, err = finish(proc, Watch(proc.pid, cpu_s=120, idle_s=120, what="the durable worker"))
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def _kill_at(proc: subprocess.Popen, marker: Path) -> None:
    working = Watch(proc.pid, cpu_s=120, idle_s=120, what=f"the worker, on its way to {marker.name},")
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited before {marker.name}: {proc.stderr.read()[-3000:]}")
        assert not (why := working.overdue()), why
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup, no final checkpoint write
    proc.wait(10)
    assert proc.returncode == -9


def _reads(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _checkpoint(dsn: str, thread: str) -> tuple[dict[str, Any], list[Any]]:
    """Channel values and pending writes of the thread's latest checkpoint, read from this process."""
    with PostgresSaver.from_conn_string(dsn) as saver:
        tup = saver.get_tuple({"configurable": {"thread_id": thread}})
        assert tup is not None, "no checkpoint for the thread"
        return dict(tup.checkpoint["channel_values"]), list(tup.pending_writes or [])


@pytest.fixture
def work(tmp_path: Path) -> tuple[str, Path, Path]:
    markers = tmp_path / "markers"
    markers.mkdir()
    return f"durable-{uuid.uuid4().hex[:8]}", tmp_path / "reads.jsonl", markers


def test_killed_after_the_decision_committed_resumes_on_the_same_branch(postgres_dsn: str, work) -> None:
    thread, log, markers = work
    worker = _spawn(postgres_dsn, thread, log, markers, "--block", "lane")
    _kill_at(worker, markers / "in_lane")
    [first] = _reads(log)
    assert first["pid"] == worker.pid

    # the decision is in the committed checkpoint; the lane it chose is next
    values, _ = _checkpoint(postgres_dsn, thread)
    decided = values["decisions"]
    team = decided["team"]["answer"]
    assert team in ("billing", "technical")
    assert "lane" not in values and "closed" not in values

    out = _run(postgres_dsn, thread, log, markers, "--resume")
    assert _reads(log) == [first], "the committed decision was read again on resume"
    assert out["decisions"] == decided, "the decision changed on resume"
    assert out["lane"] == team and out["closed"] is True

    # re-executing the decision node (replay from the checkpoint before it) reads the identical canvas
    forked = _run(postgres_dsn, thread, log, markers, "--fork-before", "triage")
    reads = _reads(log)
    assert len(reads) == 2 and reads[1]["pid"] != first["pid"]
    assert {k: reads[1][k] for k in ("canvas", "slots", "prompt")} == \
        {k: first[k] for k in ("canvas", "slots", "prompt")}
    assert forked["decisions"]["team"]["answer"] == team and forked["lane"] == team


def test_killed_during_the_read_reruns_the_node_and_leaves_nothing_half_written(postgres_dsn: str, work) -> None:
    thread, log, markers = work
    worker = _spawn(postgres_dsn, thread, log, markers, "--block", "read")
    _kill_at(worker, markers / "reading")

    values, pending = _checkpoint(postgres_dsn, thread)
    assert values.get("intake") == f"pid {worker.pid}", "the node before the decision is committed"
    assert "decisions" not in values and "lane" not in values
    assert not [w for w in pending if w[1] == "decisions"], "a half-written decision is pending"

    out = _run(postgres_dsn, thread, log, markers, "--resume")
    killed, rerun = _reads(log)
    assert rerun["pid"] != killed["pid"]
    assert {k: rerun[k] for k in ("canvas", "slots", "prompt")} == \
        {k: killed[k] for k in ("canvas", "slots", "prompt")}, "the re-run read a different canvas"
    assert out["intake"] == f"pid {worker.pid}", "intake ran once, before the kill"
    assert out["lane"] == out["decisions"]["team"]["answer"]
    assert rerun["picks"] == killed["picks"]
    assert out["closed"] is True


def test_a_review_resumed_in_another_process_never_reads_or_escalates_again(postgres_dsn: str, work) -> None:
    """Process 1 reads, escalates `team` and pauses for a human on `urgent`; process 2 resumes.
    The read and the escalation are a checkpointed task: process 2 neither reads nor calls the
    target (whose answer depends on the process), and takes the branch process 1's target chose."""
    thread, log, markers = work
    ar_log = log.parent / "escalations.jsonl"
    paused = _run(postgres_dsn, thread, log, markers, "--review", str(ar_log))
    assert paused.get("__interrupt__"), paused
    [escalated] = _reads(ar_log)
    [read] = _reads(log)
    assert escalated["pid"] == read["pid"]  # both in process 1
    _, pending = _checkpoint(postgres_dsn, thread)
    assert any(w[1] == "__return__" for w in pending), "the decision task's result is checkpointed"

    done = _run(postgres_dsn, thread, log, markers, "--review", str(ar_log), "--resume-with", "yes")
    assert _reads(ar_log) == [escalated], "the resume called the escalation target again"
    assert _reads(log) == [read], "the resume read the canvas again"
    team = ("billing", "technical")[escalated["pid"] % 2]  # what process 1's target answered
    assert done["decisions"]["team"]["answer"] == team and done["decisions"]["team"]["path"] == "escalated"
    assert done["lane"] == team and done["closed"] is True
    assert done["decisions"]["urgent"]["answer"] == "yes" and done["decisions"]["urgent"]["path"] == "human"
