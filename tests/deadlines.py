"""How the suite waits: deadlines that follow the machine's speed, not a quiet machine's.

A deadline a starved process cannot meet is not a failure of the code under test. Two kinds, one
module, used by every wait in tests/ (conftest loads it as a plugin; the session header says what
it measured):

- Work in processes of its own (a background job, a server starting, a subprocess a test runs) is
  judged by what it did, not by the clock: `Watch(pid, cpu_s=..., idle_s=...)` is overdue once the
  process and its descendants used `cpu_s` CPU-seconds without finishing (spinning: stuck), or
  spent `idle_s` seconds neither running nor waiting for a CPU (blocked on something that does
  not come: stuck). Time spent runnable but waiting for a CPU counts for neither (a thread in state
  R now, or run-queue time in /proc/PID/task/TID/schedstat): a job at nice 19 beside a CPU hog is
  starved, not stuck, and its deadline stays open however long that takes.
- A wait in this process (`until`, `holds`, `bounded`, and `patience(s)` for a timeout handed
  to the code under test) is `s` seconds of a quiet 2-core machine, stretched by `scale()`: the CPU
  speed factor (a calibrated loop's CPU time against the reference machine's) times the contention
  from work outside the suite (busy cores in /proc/stat that are not the suite's own processes).
  A `Deadline` re-reads the scale as it runs, so load that arrives during a wait stretches it.

Every wait polls; nothing sleeps for its deadline, so a quiet machine runs the suite as fast as before.
`CANVASROUTE_TEST_SCALE=3` sets a floor under the scale (a machine known to be slow in ways the
measure misses). Example (in a test):
    ```python
    from deadlines import Watch, bounded, holds, patience, until, wait_until

    await until(lambda: server.reads >= 2, within=10, what="the second read")  # 10 s, stretched
    holds(started.is_set, within=5, what="the read starting")  # the same, off the event loop
    resp = await bounded(model.adecide(ticket, questions), 60)  # TimeoutError once overdue
    wait_until(ready, Watch(proc.pid, cpu_s=60, idle_s=60, what="the server"), proc=proc, log=log)
    ```
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

REFERENCE_CORES = 2
"""The quiet reference machine's cores: the suite's fixed numbers were set on it."""
REFERENCE_LOOP_S = 0.011
"""CPU seconds `_loop()` takes on the reference machine (the best of six runs: 9.9-10.7 ms on the 2-core
AMD EPYC VM the suite's numbers were set on, busy or not)."""
SUITE = "CANVASROUTE_SUITE_PID"
"""The environment variable naming the suite's pytest process in every process it starts, however
started: a vLLM server that bash left to init, like a job's grandchild, is the suite's own work."""
FLOOR = "CANVASROUTE_TEST_SCALE"
"""An environment variable setting the least scale (a machine slow in ways the measure misses)."""
SPEED = "CANVASROUTE_TEST_SPEED"
"""The suite's measured CPU speed factor, handed to its child processes (measured once per run)."""
SAMPLE_EVERY_S = 2.0
"""How often `scale()` samples the machine (it is asked far more often)."""
SMOOTHING_S = 20.0
"""The time constant of the moving average of the outside load."""
LAST_RESORT_S = 3600.0
"""The wall seconds after which any `Watch` is overdue, starved or not: only a machine that gives the
work no CPU for an hour gets there (the suite takes under 10 minutes on a quiet 2-core machine)."""
TICK = os.sysconf("SC_CLK_TCK")


def _loop() -> int:
    total = 0
    for i in range(200_000):
        total += (i * i) % 7
    return total


# -- /proc --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Proc:
    """One process as /proc/PID/stat has it."""

    pid: int
    """Its id."""
    ppid: int
    """Its parent's id."""
    started: int
    """Its start time in ticks since boot (with `pid`, who it is: ids are reused)."""
    ticks: int
    """CPU ticks of its own (user and system, every thread)."""
    reaped: int
    """CPU ticks of the children it waited for (theirs and their own reaped children's)."""
    dead: bool
    """A zombie: exited, not yet reaped (its CPU times are final)."""


def processes() -> dict[int, Proc]:
    """Every process on the machine now (one pass over /proc: ~2 ms for 100 processes)."""
    found: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    rest = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            found[int(name)] = Proc(pid=int(name), ppid=int(rest[1]), started=int(rest[19]),
                                    ticks=int(rest[11]) + int(rest[12]), reaped=int(rest[13]) + int(rest[14]),
                                    dead=rest[0] in (b"Z", b"X"))
    return found


def descendants(pid: int, procs: dict[int, Proc]) -> set[int]:
    """`pid` and every process below it (by parent id)."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _threads(pid: int) -> tuple[int, bool]:
    """Of the threads of `pid` alive now: the nanoseconds they ran or waited on a run queue (schedstat,
    0 where the kernel keeps none), and whether one is runnable now (state R: running, or waiting for a
    CPU; the kernel adds a wait to schedstat only once the thread runs)."""
    total, runnable = 0, False
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    runnable = runnable or f.read().rsplit(b")", 1)[1].split()[0] == b"R"
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    ran, waited, _ = f.read().split()
                total += int(ran) + int(waited)
    return total, runnable


# -- the machine's pace: scale() ------------------------------------------------------------------


@dataclass(kw_only=True)
class Pace:
    """What the suite measured of the machine: CPU speed once, the outside load as it goes."""

    speed: float
    """A calibrated loop's CPU time against the reference machine's (at least 1)."""
    loop_s: float
    """The loop's CPU time here (the best of a few runs)."""
    cores: int
    """CPUs this process may run on."""
    outside: float = 0.0
    """Cores busy with work that is not the suite's (moving average)."""
    floor: float = 1.0
    """The least scale (`CANVASROUTE_TEST_SCALE`)."""
    at: float = 0.0
    """When the machine was last sampled (monotonic)."""
    busy: int = 0
    """The machine's busy ticks (/proc/stat) at the last sample."""
    own: dict[tuple[int, int], int] = field(default_factory=dict)
    """The suite's processes at the last sample: (pid, start) -> CPU ticks."""
    marked: dict[tuple[int, int], bool] = field(default_factory=dict)
    """(pid, start) -> whether the process carries the suite's mark (read once per process)."""
    seen: list[float] = field(default_factory=list)
    """The least and the greatest scale seen in this process."""

    def scale(self) -> float:
        """How much longer than on the quiet reference machine things take now (at least 1): the
        speed factor times the reference's cores over the cores outside work leaves the suite (what
        is idle, or a fair share against it, whichever is more)."""
        left = min(REFERENCE_CORES, max(self.cores - self.outside, self.cores / (1 + self.outside)))
        value = max(self.floor, self.speed * max(1.0, REFERENCE_CORES / left))
        self.seen[:] = [min([*self.seen, value]), max([*self.seen, value])]
        return value

    def sample(self, *, smooth: bool = True) -> None:
        """The outside load since the last sample: the machine's busy ticks less the suite's own
        (folded into the moving average, or, not `smooth`, taken as it is)."""
        now, busy, own = time.monotonic(), _machine_busy(), self._own_ticks()
        elapsed = now - self.at
        if elapsed > 0 and self.at:
            ours = sum(max(0, t - self.own.get(key, 0)) for key, t in own.items())
            load = max(0.0, min(float(self.cores), (busy - self.busy - ours) / TICK / elapsed))
            weight = 1 - math.exp(-elapsed / SMOOTHING_S) if smooth else 1.0
            self.outside += weight * (load - self.outside)
        self.at, self.busy, self.own = now, busy, own

    def _own_ticks(self) -> dict[tuple[int, int], int]:
        """The suite's processes now, by (pid, start): below its pytest process (or this one), or
        marked as started by it; each with its CPU ticks."""
        procs = processes()
        root = int(os.environ.get(SUITE, os.getpid()))
        ours = descendants(root, procs) | descendants(os.getpid(), procs)
        mark = f"{SUITE}={root}".encode()
        own = {}
        for p in procs.values():
            key = (p.pid, p.started)
            if key not in self.marked:
                self.marked[key] = _has_mark(p.pid, mark)
            if p.pid in ours or self.marked[key]:
                own[key] = p.ticks
        self.marked = {key: v for key, v in self.marked.items() if key[0] in procs}
        return own


def _machine_busy() -> int:
    """Busy ticks of every CPU since boot (/proc/stat: all but idle and iowait; steal counts as busy)."""
    with open("/proc/stat", "rb") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:  # another user's process: not the suite's unless below it
        return False


def calibrate(rounds: int = 6, window_s: float = 0.5) -> Pace:
    """Time `_loop()` (the best of `rounds`, in this thread's CPU time: its speed whatever the load)
    and sample the outside load over the `window_s` that takes; the speed is the suite's
    (`CANVASROUTE_TEST_SPEED`) in a process the suite started."""
    pace = Pace(speed=1.0, loop_s=math.inf, cores=len(os.sched_getaffinity(0)),
                floor=float(os.environ.get(FLOOR) or 1.0))
    pace.sample()
    for _ in range(rounds):
        cpu = time.thread_time()
        _loop()
        pace.loop_s = min(pace.loop_s, time.thread_time() - cpu)
        time.sleep(max(0.0, window_s / rounds - (time.thread_time() - cpu)))
    pace.sample(smooth=False)
    inherited = os.environ.get(SPEED)
    pace.speed = float(inherited) if inherited else max(1.0, pace.loop_s / REFERENCE_LOOP_S)
    return pace


@functools.cache
def pace() -> Pace:
    """This process's `Pace` (calibrated on first use, about half a second)."""
    return calibrate()


def scale() -> float:
    """How much longer a wait in this process may take than on the quiet reference machine, now."""
    p = pace()
    if time.monotonic() - p.at >= SAMPLE_EVERY_S:
        p.sample()
    return p.scale()


def speed() -> float:
    """The CPU speed factor: the same work takes this many times the reference machine's CPU time."""
    return pace().speed


def patience(seconds: float) -> float:
    """`seconds` of the quiet reference machine as wall seconds now: for a timeout handed to the code
    under test (an HTTP client's, an escalation's) when the test is not about that timeout."""
    return seconds * scale()


# -- deadlines ------------------------------------------------------------------------------------


class Limit(Protocol):
    """A deadline: `overdue()` says why it passed, or None while it is open."""

    def overdue(self) -> str | None: ...

    def wall_left(self) -> float:
        """Wall seconds it stays open at least, at the pace seen now (how long to block before asking again)."""
        ...

    def done(self) -> None:
        """The work ended (a process: exited, not yet reaped): what it did is final."""
        ...


class Deadline:
    """`seconds` of the quiet reference machine, counted at the machine's pace: each wall second
    counts 1/scale() of one, the scale read as the wait goes."""

    def __init__(self, seconds: float, what: str = "it") -> None:
        self.seconds, self.what = seconds, what
        self.started = self._at = time.monotonic()
        self.spent = 0.0
        self._scale = scale()

    def _count(self) -> None:
        now, pace_now = time.monotonic(), scale()
        self.spent += (now - self._at) / max(self._scale, pace_now)  # the slower pace of the interval's two ends
        self._at, self._scale = now, pace_now

    def overdue(self) -> str | None:
        self._count()
        if self.spent < self.seconds:
            return None
        return (f"{self.what} did not happen within {self.seconds:g} s (counted at the machine's pace: "
                f"{time.monotonic() - self.started:.1f} s of wall time, scale now {self._scale:.2f})")

    def wall_left(self) -> float:
        self._count()
        return max(0.0, (self.seconds - self.spent) * self._scale)

    def done(self) -> None:
        pass


class Watch:
    """A process tree's deadline, in what the tree did: `cpu_s` CPU-seconds (× the CPU speed factor)
    used without finishing, or `idle_s` seconds in which none of its threads ran or waited to run
    (and, as a last resort, `LAST_RESORT_S` of wall time). Counted from construction (make it when
    the process starts, or when the wait on it starts); checked at most every `every_s`."""

    def __init__(self, pid: int, *, cpu_s: float, idle_s: float, what: str, every_s: float = 0.5) -> None:
        self.pid, self.what, self.every_s = pid, what, every_s
        self.cpu_limit, self.idle_limit = cpu_s * speed(), idle_s
        self.started = self._at = time.monotonic()
        self.cpu = self.idle = 0.0
        self._base: int | None = None
        self._most = 0
        self._runnable: dict[tuple[int, int], int] = {}
        self._why: str | None = None
        self._ended: float | None = None
        self._sample()

    def _sample(self) -> None:
        if self._ended is not None:
            return
        now = time.monotonic()
        procs = processes()
        tree = [procs[pid] for pid in descendants(self.pid, procs) if pid in procs]
        ticks = sum(p.ticks + p.reaped for p in tree)
        self._base = ticks if self._base is None else self._base
        self._most = max(self._most, ticks - self._base)  # a descendant left to init takes its ticks along
        self.cpu = self._most / TICK
        elapsed, self._at = now - self._at, now
        threads = {(p.pid, p.started): _threads(p.pid) for p in tree}
        if self.pid not in procs or procs[self.pid].dead:  # it exited: its figures are final
            self._ended = now
        elif not any(runnable for _, runnable in threads.values()):  # none runnable now: blocked, but since when?
            # the run-queue time since the last sample says how much of it the tree wanted the CPU
            # (a process new since then counts whole: it started within the interval)
            wanted = sum(max(0, ns - self._runnable.get(key, 0)) for key, (ns, _) in threads.items()) / 1e9
            self.idle += max(0.0, elapsed - wanted)
        self._runnable = {key: ns for key, (ns, _) in threads.items()}
        if self.cpu > self.cpu_limit:
            self._why = f"used {self.cpu:.3g} CPU-s without finishing (its budget: {self.cpu_limit:.3g})"
        elif self.idle > self.idle_limit:
            self._why = (f"spent {self.idle:.3g} s neither running nor waiting for a CPU "
                         f"(its budget: {self.idle_limit:.3g} s)")
        elif now - self.started > LAST_RESORT_S:
            self._why = f"ran {now - self.started:.0f} s of wall time (the last resort: {LAST_RESORT_S:.0f} s)"

    def overdue(self) -> str | None:
        if self._why is None and time.monotonic() - self._at >= self.every_s:
            self._sample()
        if self._why is None:
            return None
        return f"{self.what} {self._why}, {self.figures()}"

    def wall_left(self) -> float:
        return self.every_s

    def done(self) -> None:
        """Sample a last time (call it before the process is reaped: a zombie keeps its CPU times) and stop."""
        self._sample()
        self._ended = time.monotonic()

    def figures(self) -> str:
        """What it did (so far, or until `done`): CPU-seconds in wall seconds, and the seconds it was blocked."""
        self._sample()
        return (f"{self.cpu:.1f} CPU-s in {(self._ended or time.monotonic()) - self.started:.0f} s of wall time "
                f"({self.idle:.0f} s blocked)")


class Overdue(AssertionError):
    """A wait passed its deadline (the message says which, and what the work did)."""


# -- waiting --------------------------------------------------------------------------------------


async def until(check: Callable[[], bool], *, within: float = 10.0, what: str = "the condition") -> None:
    """Poll `check` every 5 ms until it holds, failing the test after `within` seconds (stretched by
    the scale): for a state that signals no event (a queue's length, a counter in a fake)."""
    deadline = Deadline(within, what)
    while not check():
        if why := deadline.overdue():
            raise Overdue(why.replace("did not happen", "did not hold", 1))
        await asyncio.sleep(0.005)


def holds(check: Callable[[], bool], *, within: float = 10.0, what: str = "the condition") -> None:
    """`until` off the event loop (a test driving a server in a thread): poll `check` every 20 ms."""
    deadline = Deadline(within, what)
    while not check():
        if why := deadline.overdue():
            raise Overdue(why.replace("did not happen", "did not hold", 1))
        time.sleep(0.02)


async def bounded(aw: Awaitable[T], seconds: float, what: str = "it") -> T:
    """Await `aw` (in this task, as `asyncio.timeout` does), raising TimeoutError once `seconds` of the
    reference machine passed, counted by a `Deadline` (the scale re-read as it goes): `asyncio.wait_for`
    for a test's own bound on the code under test."""
    deadline = Deadline(seconds, what)
    loop = asyncio.get_running_loop()
    timeout = asyncio.timeout(None)

    def check() -> None:  # the deadline decides, at most a second apart
        if deadline.overdue():
            timeout.reschedule(loop.time())
        else:
            handle[0] = loop.call_later(min(1.0, max(0.005, deadline.wall_left())), check)

    handle = [loop.call_later(min(1.0, max(0.005, deadline.wall_left())), check)]
    try:
        async with timeout:
            return await aw
    except TimeoutError as exc:
        if timeout.expired():
            raise TimeoutError(deadline.overdue() or f"{what} did not happen within {seconds:g} s") from exc
        raise
    finally:
        handle[0].cancel()


def wait_until(check: Callable[[], bool], limit: Limit, *, what: str, proc: subprocess.Popen[Any] | None = None,
               log: Path | None = None, every_s: float = 0.25) -> float:
    """Poll `check` (an exception counts as not yet) until it holds; the seconds it took. Raises
    `Overdue` with `log`'s tail once `limit` passed, or once `proc` exited first."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if check():
                return time.monotonic() - started
        if proc is not None and proc.poll() is not None:
            why = f"{what}: its process exited {proc.returncode}"
            break
        if why_over := limit.overdue():
            why = why_over
            break
        time.sleep(min(every_s, max(limit.wall_left(), 0.01)))
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise Overdue(f"{why}" + (f"; log tail:\n{tail}" if tail else ""))


def wait(proc: subprocess.Popen[Any], limit: Limit, every_s: float = 0.05) -> int | None:
    """Wait for `proc` to exit (polling every `every_s`): its exit status, or None once `limit` passed
    (it still runs). Seen exited before it is reaped, so `limit.done()` reads what it did whole."""
    while proc.returncode is None:
        try:
            exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already (Popen.poll elsewhere)
            break
        if exited:
            limit.done()
            break
        if limit.overdue():
            return None
        time.sleep(every_s)
    return proc.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it."""
    for child in descendants(pid, processes()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def finish(proc: subprocess.Popen[str], limit: Limit) -> tuple[str, str]:
    """`proc.communicate()` (its pipes read as it runs) until it exits; `Overdue` with its output once
    `limit` passes first (it and what it started are killed)."""
    while True:
        try:
            return proc.communicate(timeout=max(0.01, min(1.0, limit.wall_left())))
        except subprocess.TimeoutExpired:
            if why := limit.overdue():
                kill_tree(proc.pid)
                out, err = proc.communicate()
                raise Overdue(f"{why}; its output:\n{(out or '')[-2000:]}{(err or '')[-3000:]}") from None


def run(argv: Sequence[str], *, cpu_s: float, idle_s: float = 300.0, what: str | None = None,
        **popen: Any) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, capture_output=True, text=True, **popen)` bounded by a `Watch` on the
    child's process tree instead of a wall-clock timeout; `Overdue` (with its output) once it passes."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    what = what or f"`{' '.join(map(str, argv[:3]))}`"
    out, err = finish(proc, Watch(proc.pid, cpu_s=cpu_s, idle_s=idle_s, what=what))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# -- the session's report -------------------------------------------------------------------------

FIGURES: list[str] = []
"""Lines for the end of the run: what each watched start or job did (CPU-seconds, wall, blocked)."""


def header() -> str:
    """The session header's line: what was measured, and the scale the waits start with."""
    p = pace()
    return (f"deadlines (tests/deadlines.py): CPU speed x{p.speed:.2f} (a calibration loop took "
            f"{p.loop_s * 1000:.1f} ms of CPU; the reference 2-core machine {REFERENCE_LOOP_S * 1000:.0f} ms), "
            f"work outside the suite on {p.outside:.2f} of {p.cores} cores: waits stretched x{scale():.2f}"
            + (f" (at least {p.floor:g}: {FLOOR})" if p.floor > 1 else ""))


def pytest_configure(config: Any) -> None:
    """Mark every process the suite starts as its own, and hand them its CPU speed (measured once)."""
    os.environ.setdefault(SUITE, str(os.getpid()))
    os.environ.setdefault(SPEED, f"{pace().speed:.3f}")


def pytest_report_header(config: Any) -> str:
    return header()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How the scale moved in this run, and what each watched start and job did."""
    low, high = pace().seen or [scale()] * 2
    terminalreporter.write_line(f"deadlines: waits stretched x{low:.2f} to x{high:.2f} in this run "
                                f"(outside work on {pace().outside:.2f} cores at the end)")
    for line in FIGURES:
        terminalreporter.write_line(f"  {line}")
