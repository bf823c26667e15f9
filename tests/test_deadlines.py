"""The suite's deadlines (tests/deadlines.py), each against real processes on this machine.

A starved child (nice 19, on one CPU beside a CPU hog) keeps its deadline open however long it
waits for the CPU; one that spins past its CPU budget, or sits blocked past its idle budget, is
overdue, and the failure carries its output; a grandchild's CPU counts, and is killed with it. The
scale counts work outside the suite (a hog left to init, unmarked) and not the suite's own (below
pytest, or marked as started by it), and a `Deadline` or `bounded` stretches with it as it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import deadlines
import pytest
from deadlines import Deadline, Overdue, Pace, Watch, bounded, holds, processes, run, until, wait

HOG = "while True: pass"
CPU = min(os.sched_getaffinity(0))
"""The one CPU the starvation test pins its processes to (so one hog is enough, whatever the cores)."""


def _pinned(argv: list[str], nice: int = 0) -> subprocess.Popen:
    """`argv` started, then held to `CPU` alone at `nice` (its first milliseconds run as it was started)."""
    proc = subprocess.Popen(argv)
    os.sched_setaffinity(proc.pid, {CPU})
    os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    return proc


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@contextlib.contextmanager
def _outside_hog():
    """A CPU hog that is not the suite's: left to init by a shell that exits, without the suite's mark."""
    env = {k: v for k, v in os.environ.items() if k != deadlines.SUITE}
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -S -c "{HOG}" >/dev/null 2>&1 & echo $!'],
                           capture_output=True, text=True, env=env, check=True)
    pid = int(shell.stdout.strip())
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _ticks(pid: int) -> int:
    return processes()[pid].ticks


# -- what a process did: Watch --------------------------------------------------------------------


def test_a_starved_child_keeps_its_deadline_open_beside_a_cpu_hog():
    """At nice 19 on one CPU beside a hog, a child needing a few CPU-milliseconds waits seconds for
    them: more wall time than both of its budgets, and its deadline stays open (it wanted the CPU)."""
    hog = _pinned([sys.executable, "-S", "-c", HOG])
    try:
        time.sleep(0.2)  # the hog runs
        code = "import time\nwhile time.process_time() < 0.08: pass"
        child = _pinned([sys.executable, "-S", "-c", code], nice=19)
        watch = Watch(child.pid, cpu_s=1.0, idle_s=1.0, what="the starved child", every_s=0.05)
        started = time.monotonic()
        overdue = None
        while child.poll() is None and time.monotonic() - started < 120:
            overdue = overdue or watch.overdue()
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        figures = watch.figures()
    finally:
        hog.kill()
        hog.wait()
        child.kill()
        child.wait()
    assert child.returncode == 0, figures
    assert elapsed > 2.0, f"the child was not starved ({elapsed:.1f} s): the test proves nothing; {figures}"
    assert overdue is None, overdue
    assert watch.idle < 1.0 and watch.cpu < 1.0, figures  # it waited for the CPU: neither blocked nor spinning
    print(f"starved child: {figures} beside a hog on CPU {CPU}")


def test_a_child_spinning_past_its_cpu_budget_is_overdue_with_its_output_and_killed_with_its_grandchild():
    """The budget counts the whole tree: a parent that only waits for a spinning grandchild is stuck too."""
    code = ("import subprocess, sys\n"
            f"spinning = subprocess.Popen([sys.executable, '-S', '-c', {HOG!r}])\n"
            "print('the parent says why: grandchild', spinning.pid, flush=True)\n"
            "spinning.wait()")
    started = time.monotonic()
    with pytest.raises(Overdue) as info:
        run([sys.executable, "-c", code], cpu_s=0.5, idle_s=60, what="the spinning job")
    said = str(info.value)
    assert "the spinning job used" in said and "CPU-s without finishing" in said, said
    assert "the parent says why: grandchild" in said  # its output comes with the failure
    assert time.monotonic() - started < 60  # the CPU budget ended it, not the idle one
    grandchild = int(said.split("grandchild", 1)[1].split()[0])
    holds(lambda: not _alive(grandchild), within=5, what="the spinning grandchild ending with its job")


def test_a_blocked_child_is_overdue_after_its_idle_budget():
    child = subprocess.Popen(["sleep", "60"])
    watch = Watch(child.pid, cpu_s=60, idle_s=1.0, what="the sleeper")
    started = time.monotonic()
    try:
        assert wait(child, watch) is None  # still running: the deadline passed first
        elapsed = time.monotonic() - started
    finally:
        child.kill()
        child.wait()
    said = watch.overdue()
    assert said is not None and "neither running nor waiting for a CPU" in said, said
    assert 1.0 <= elapsed < 30, elapsed


def test_a_child_that_finishes_in_time_gives_its_output():
    done = run([sys.executable, "-c", "print('done')"], cpu_s=30, idle_s=30)
    assert (done.returncode, done.stdout) == (0, "done\n")


# -- the scale: work outside the suite --------------------------------------------------------------


def test_the_scale_follows_the_cores_outside_work_leaves():
    pace = Pace(speed=1.0, loop_s=0.01, cores=2)
    figures = {}
    for outside in (0.0, 0.5, 1.0, 2.0):
        pace.outside = outside
        figures[outside] = round(pace.scale(), 2)
    assert figures == {0.0: 1.0, 0.5: 1.33, 1.0: 2.0, 2.0: 3.0}  # idle cores, or a fair share against it
    pace.speed, pace.outside = 1.5, 1.0
    assert pace.scale() == 3.0  # a slower CPU stretches it further
    pace.floor = 4.0
    assert pace.scale() == 4.0  # CANVASROUTE_TEST_SCALE
    assert Pace(speed=1.0, loop_s=0.01, cores=16).scale() == 1.0  # more cores than the reference: no faster
    assert Pace(speed=1.0, loop_s=0.01, cores=1).scale() == 2.0  # one core: half the reference's


def test_work_outside_the_suite_counts_and_the_suites_own_does_not():
    """A hog left to init without the suite's mark is outside work; one below pytest, and one left to
    init that carries the mark (as bash leaves a vLLM server), are the suite's own."""
    pace = deadlines.calibrate(rounds=1, window_s=0.0)
    os.environ.setdefault(deadlines.SUITE, str(os.getpid()))  # what pytest_configure sets in the suite
    own_child = subprocess.Popen([sys.executable, "-S", "-c", HOG])
    marked = subprocess.run(["sh", "-c", f'"{sys.executable}" -S -c "{HOG}" >/dev/null 2>&1 & echo $!'],
                            capture_output=True, text=True, check=True)
    marked_pid = int(marked.stdout.strip())
    try:
        with _outside_hog() as outside_pid:
            pace.sample(smooth=False)
            before, started = _ticks(outside_pid), time.monotonic()
            time.sleep(2.0)
            pace.sample(smooth=False)
            hog_cores = (_ticks(outside_pid) - before) / deadlines.TICK / (time.monotonic() - started)
            own = {pid for pid, _ in pace.own}
            assert outside_pid not in own
    finally:
        own_child.kill()
        own_child.wait()
        os.kill(marked_pid, signal.SIGKILL)
    assert own_child.pid in own and marked_pid in own and os.getpid() in own
    # at least the outside hog (others' work may add to it); the two hogs of the suite's own are not in it
    assert pace.outside >= 0.9 * hog_cores - 0.05, (pace.outside, hog_cores)
    print(f"outside hog: {hog_cores:.2f} cores; outside work measured: {pace.outside:.2f} cores; "
          f"scale {pace.scale():.2f}")


# -- waits in this process: stretched as they go -------------------------------------------------------


@pytest.fixture
def scale(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The scale the deadlines read, set by the test (`scale[0] = 3.0`)."""
    value = [1.0]
    monkeypatch.setattr(deadlines, "scale", lambda: value[0])
    return value


def test_a_deadline_counts_seconds_at_the_machines_pace(scale):
    scale[0] = 4.0
    deadline = Deadline(0.1, "the thing")
    time.sleep(0.2)
    assert deadline.overdue() is None  # 0.2 s of wall time at x4 is 0.05 s of the reference machine's
    time.sleep(0.3)
    said = deadline.overdue()
    assert said is not None and "the thing did not happen within 0.1 s" in said and "scale now 4.00" in said


def test_holds_and_until_fail_with_what_did_not_hold(scale):
    with pytest.raises(Overdue, match=r"the queue full did not hold within 0\.05 s"):
        holds(lambda: False, within=0.05, what="the queue full")
    with pytest.raises(Overdue, match=r"the reply did not hold within 0\.05 s"):
        asyncio.run(until(lambda: False, within=0.05, what="the reply"))


async def test_bounded_stretches_when_the_machine_slows_during_the_wait(scale):
    async def slower() -> None:
        await asyncio.sleep(0.05)
        scale[0] = 10.0  # load arrives: the 0.15 s left of the bound become 1.5 s

    load = asyncio.ensure_future(slower())
    assert await bounded(asyncio.sleep(0.5, result="done"), 0.2) == "done"
    await load
    scale[0] = 1.0
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the read did not happen within 0\.1 s"):
        await bounded(asyncio.sleep(5), 0.1, what="the read")
    assert time.monotonic() - started < 2.0


def test_the_session_header_says_what_was_measured():
    line = deadlines.header()
    assert line.startswith("deadlines (tests/deadlines.py): CPU speed x") and "waits stretched x" in line
    assert os.environ[deadlines.SUITE] == str(os.getpid())  # pytest_configure marked the suite's processes
    assert float(os.environ[deadlines.SPEED]) >= 1.0  # and handed them its speed
