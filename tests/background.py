"""Slow, self-contained work the suite starts at collection and runs beside the foreground tests.

Some fixtures cost a process of their own and a minute or more of one core: a vLLM server's start,
a wheel built and installed into a fresh venv, a schemathesis run against an app of its own, a
server's memory measured over rounds of requests. The suite does not start them when the first
test asks: once collection says which of them the selected tests take, each is started in the
background, and the modules that take none of them run first (module by module, each module's
order kept) while they work. A fixture then waits only for what is left. Work starts only for a
selected test, so `-m` never starts it for a deselected one (`scripts/test.sh --fast`).

Two ways in: `starts_in_background(fixture, start)` for a fixture that owns a long-lived process
(tests/vllm_servers.py: the vLLM servers), and `@job` for a function whose return value is the
fixture: it runs in a fresh interpreter (this file as a script), its value comes back pickled, and
if it fails, each test taking it fails with its output. Work needed only later (the jobs, Phoenix,
the in-process vLLM load) runs under `NICE`, so the test being run keeps its core. Starved that way,
it may take any wall time: a fixture waits for a job while its processes work, and fails it only once
they used its CPU-seconds (`JOB_CPU_S`, or `@job(cpu_s=...)`) or sat blocked `JOB_IDLE_S`
(tests/deadlines.py `Watch`). conftest loads this module as a plugin.

Example (in a test module):
    ```python
    @job
    def fuzz_run(work: Path) -> dict[str, int]:  # in a child process, beside the foreground tests
        return {"requests": 1000}

    def test_the_run(fuzz_run):  # waits for what is left of it
        assert fuzz_run["requests"] >= 1000
    ```
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

import pytest
from deadlines import FIGURES, Watch, wait

JOB_CPU_S = 300
"""The CPU-seconds a job (and everything it starts) may use before it counts as stuck (`@job(cpu_s=...)`
sets its own). A job runs at nice 19: starved beside the suite it may take any wall time, and only
what it did counts (tests/deadlines.py `Watch`)."""
JOB_IDLE_S = 600
"""The seconds a job's processes may spend all blocked (neither running nor waiting for a CPU: a
download, a hang) before it counts as stuck."""
JOB_HASH_SEED = "0"
"""A job's PYTHONHASHSEED, unless the suite runs under one: the same job gives the same result every run
(schemathesis draws through sets of names, so a run's cases, derandomized or not, follow the hash seed)."""
NICE = ("nice", "-n", os.environ.get("BACKGROUND_NICE", "19"))
"""The prefix of a background command whose result a test needs only later: it yields the CPU to the test
being run and to what the next tests wait for (the vLLM servers, which the modules run right after the
first ones take, start at normal priority). Such a process keeps the suite's session (its own process
group): with autogroup scheduling a new session gets a fair share of the CPU whatever its nice.
`BACKGROUND_NICE=0` runs it at its parent's priority: tests/test_background.py's own jobs, whose test
waits for them at once (at nice 19 beside the suite's starting servers, 0.8 CPU-s took 17 s)."""


class Started(Protocol):
    """What a background start returns: something to stop if no test takes it."""

    def stop(self) -> None: ...


_STARTS: dict[str, Callable[[], Started | None]] = {}
"""Fixture name -> how to start its work (returning None: nothing to start now, the fixture sees to it)."""
_STARTED: dict[str, Started] = {}
"""Fixture name -> its work, started at collection and not yet taken by the fixture."""


@functools.cache
def run_folder() -> Path:
    """This run's folder for background work (logs, each job's folder); removed when the run ends."""
    return Path(tempfile.mkdtemp(prefix="canvasroute-background-"))


def starts_in_background(fixture: str, start: Callable[[], Started | None]) -> None:
    """Call `start()` at collection when a selected test takes `fixture`; the fixture `take`s what it started."""
    if fixture in _STARTS:
        raise pytest.UsageError(f"two background starts for the fixture {fixture!r}")
    _STARTS[fixture] = start


def take(fixture: str) -> Started | None:
    """The work started at collection for `fixture` (the caller stops it), or None if none was."""
    return _STARTED.pop(fixture, None)


def _takes(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that take no background fixture run first, so the background work runs while they do."""
    late = {getattr(item, "module", None) for item in items if any(_takes(item, f) for f in _STARTS)}
    items.sort(key=lambda item: getattr(item, "module", None) in late)  # stable: each module keeps its order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start, in the background, the work of each registered fixture a selected test takes."""
    if session.config.option.collectonly:
        return
    for fixture, start in _STARTS.items():
        if any(_takes(item, fixture) for item in session.items) and (started := start()) is not None:
            _STARTED[fixture] = started


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop what was started and never taken (a run cut short, a test that failed before it asked)."""
    for started in _STARTED.values():
        started.stop()
    _STARTED.clear()
    if run_folder.cache_info().currsize:  # it was made
        shutil.rmtree(run_folder(), ignore_errors=True)


# -- jobs: a function run in a child process, its return value the fixture ---------------------

_JOBS: dict[str, Callable[[Path], Any]] = {}
"""Job name (its fixture's name) -> the function, as its module defines it."""


class Job:
    """One run of a `@job` function in a fresh interpreter: started on construction, `result()` waits
    while its `Watch` (`cpu_s`, `idle_s`; None: `JOB_CPU_S`, `JOB_IDLE_S`) says it works."""

    def __init__(self, name: str, module: str, cpu_s: float | None = None, idle_s: float | None = None) -> None:
        self.name, self.folder = name, run_folder() / name
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.log = self.folder / "output.log"
        argv = [*NICE, sys.executable, __file__, module, name, str(self.folder), str(os.getpid())]
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", JOB_HASH_SEED)}
        # a process group of its own: stop() ends whatever it started too, and so does the job when this process dies
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, process_group=0)
        self.started, self.started_at = time.monotonic(), time.time()
        self.watch = Watch(self.proc.pid, cpu_s=JOB_CPU_S if cpu_s is None else cpu_s,
                           idle_s=JOB_IDLE_S if idle_s is None else idle_s, what=f"background job {name}")

    def result(self) -> Any:
        """Wait for what is left of the run (until it exits or its `Watch` says it is stuck); its
        return value, or fail the test with its output."""
        asked = time.monotonic()
        code = wait(self.proc, self.watch)
        overdue = self.watch.overdue() if code is None else None
        figures = self.watch.figures()
        if code is None:
            self.stop()
        output = self.log.read_text(errors="replace")
        result = self.folder / "result.pickle"
        if code != 0 or not result.is_file():
            said = overdue if code is None else f"background job {self.name} exited {code}, {figures}"
            pytest.fail(f"{said} (the test asked {asked - self.started:.0f} s after its start); "
                        f"its output:\n{output[-6000:]}", pytrace=False)
        ran = self.log.stat().st_mtime - self.started_at  # its last word: when it was done
        said = (f"background job {self.name}: {self.watch.cpu:.1f} CPU-s in {ran:.0f} s of wall time "
                f"({self.watch.idle:.0f} s blocked); the test asked {asked - self.started:.0f} s after its start "
                f"and waited {time.monotonic() - asked:.1f} s for it")
        FIGURES.append(said)
        print(f"{output}{said}")
        return pickle.loads(result.read_bytes())

    def stop(self) -> None:
        """SIGKILL the run and everything it started, even when the run itself has exited."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # an empty group (or, macOS, zombies only)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def job(function: Callable[[Path], Any] | None = None, *, cpu_s: float | None = None,
        idle_s: float | None = None) -> Any:
    """A session fixture named as `function`, whose value is `function(work)` computed in a child process
    (`@job`, or `@job(cpu_s=..., idle_s=...)` for a job that may use more CPU-seconds than `JOB_CPU_S`,
    or sit blocked longer than `JOB_IDLE_S`: a download).

    `work` is a fresh folder of the job's own, kept until the run ends; the value must pickle. The
    child imports the function's module as the suite does (tests/ on `sys.path`, conftest first, so
    this checkout's import root), so the function can use the module's helpers; it must not count on
    anything a fixture or an earlier test set up in the suite's process."""
    if function is None:
        return functools.partial(job, cpu_s=cpu_s, idle_s=idle_s)
    name, module = function.__name__, function.__module__
    _JOBS[name] = function

    def start() -> Job:
        return Job(name, module, cpu_s, idle_s)

    starts_in_background(name, start)

    @pytest.fixture(scope="session", name=name)
    def fixture() -> Iterator[Any]:
        started = take(name)
        run = started if isinstance(started, Job) else start()
        try:
            yield run.result()
        finally:
            run.stop()

    fixture.__doc__ = function.__doc__
    return fixture


PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent (the thread that started it) dies (Linux)."""


def _end_group(*_: object) -> None:
    """SIGKILL this job and everything it started (its process group: `Job` gives it one of its own)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _end_with(parent: int) -> None:
    """End this job's process group when `parent` (the suite) dies, even by SIGKILL: SIGTERM on its
    death (prctl), else a daemon thread that sees this process handed to another parent."""
    signal.signal(signal.SIGTERM, _end_group)
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            _end_group()

        threading.Thread(target=watch, name="ends-with-its-parent", daemon=True).start()
    if os.getppid() != parent:  # it died before prctl
        _end_group()


def _exit(code: int) -> NoReturn:
    """Exit now, output flushed: a thread the job left running must not hold the exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(module: str, name: str, folder: Path, parent: int) -> None:
    """In the child (ending with `parent`): import the module (conftest first: the import root,
    loopback only), run the job, pickle its value, exit."""
    _end_with(parent)
    conftest = importlib.import_module("conftest")
    socket.socket.connect = conftest.loopback_only(socket.socket.connect)  # type: ignore[method-assign]
    importlib.import_module(module)
    started = time.monotonic()
    try:
        value = _JOBS[name](folder)
    except BaseException:  # noqa: BLE001 - printed for the test that takes it, which fails
        traceback.print_exc()
        _exit(1)
    (folder / "result.pickle").write_bytes(pickle.dumps(value))
    print(f"background job {name}: {time.monotonic() - started:.1f} s in its own process")
    _exit(0)


if __name__ == "__main__":  # the child: tests/ is sys.path[0]; the job's module imports this file as `background`
    importlib.import_module("background")._main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
