"""The real vLLM CPU servers the suite starts (scripts/vllm_cpu.sh), as session fixtures.

A server takes about 70 s of one core to start, so the suite does not wait for it at first use:
each of `vllm_url`, `second_vllm_url`, `spare_vllm` and `causal_vllm_url` that a selected test takes
is started in the background at collection (tests/background.py), and the modules that take none of
them run first while the servers come up. A fixture then waits only for what is left of the start.
`CANVASROUTE_VLLM_URL` stands in for `vllm_url` and `CANVASROUTE_CAUSAL_VLLM_URL` for
`causal_vllm_url`; the replica and the spare are always the suite's own. `causal_vllm_url` is the
same vLLM CPU build serving SmolLM2-135M-Instruct as a plain causal model (`start-causal`), from the
embedded model's converted copy, which is made first (with this venv's transformers) if missing.
conftest loads this module as a plugin; a test that takes one of these fixtures must carry
`@pytest.mark.vllm`.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from background import run_folder, starts_in_background, take
from conftest import IMPORT_ROOT, ROOT, _free_port, unavailable
from deadlines import FIGURES, Watch, descendants, patience, processes, run

SCRIPT = ROOT / "scripts" / "vllm_cpu.sh"
FIXTURES = ("vllm_url", "second_vllm_url", "spare_vllm", "causal_vllm_url")
"""The fixtures that each own one server (in the order they are started)."""
START_CPU_S = 600
"""The CPU-seconds a server's processes may use starting before it counts as stuck (a start takes
about 70 s of one core; three start beside the suite on two cores, so wall time says nothing)."""
START_IDLE_S = 300
"""The seconds its processes may spend all blocked (neither running nor waiting for a CPU) starting."""


@functools.cache
def _provision_error() -> str | None:
    """Provision the venv and the tiny checkpoint once per run (idempotent); the error, if any."""
    prov = subprocess.run(["bash", str(SCRIPT), "provision"], capture_output=True, text=True)
    return None if prov.returncode == 0 else prov.stderr[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _children(pid: int) -> set[int]:
    """Every descendant of pid (from /proc)."""
    return descendants(pid, processes()) - {pid}


class VLLMServer:
    """One real vLLM CPU server on a free loopback port: started on construction, `ready()` waits."""

    def __init__(self, log: Path, command: str = "start") -> None:
        if error := _provision_error() or (command == "start-causal" and _converted_error()):
            unavailable(f"could not provision the vLLM CPU server: {error}")
        self.port, self.log = _free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        started = subprocess.run(["bash", str(SCRIPT), command, str(self.port), str(log)],
                                 capture_output=True, text=True, check=True)
        self.pid = int(started.stdout.strip().splitlines()[-1])
        self.started = time.monotonic()
        self.watch = Watch(self.pid, cpu_s=START_CPU_S, idle_s=START_IDLE_S, what="the vLLM server")
        self.family: set[int] = set()

    def ready(self) -> str:
        """Wait until it answers `GET /v1/models` (or died, or its `Watch` says it is stuck); its URL."""
        why = None
        while True:  # asked at least once: a server started long ago may have been ready for minutes
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=patience(2)).status_code == 200:
                    self.family = _children(self.pid)
                    FIGURES.append(f"vLLM server on port {self.port} started: {self.watch.figures()}")
                    return self.url
            except httpx.HTTPError:
                pass
            if not _alive(self.pid) or (why := self.watch.overdue()):
                break
            time.sleep(0.5)
        tail = self.log.read_text()[-3000:] if self.log.exists() else "(no log)"
        self.stop()
        unavailable(f"vLLM server did not start ({why or 'it exited'}); log tail:\n{tail}")
        raise AssertionError("unreachable")  # unavailable raises

    def stop(self) -> None:
        """SIGTERM the API server, then SIGKILL whatever of its processes is left after 10 s."""
        family = self.family | _children(self.pid)
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in [self.pid, *family]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@functools.cache
def _converted_error() -> str | None:
    """The embedded SmolLM2's converted copy, made once with this venv's transformers if missing (the
    vLLM venv's own transformers is older); the error, if any."""
    from canvasroute.engine import embedded_cache_dir

    if (embedded_cache_dir() / "config.json").is_file():
        return None
    made = run([sys.executable, "-c", "from canvasroute.engine import embedded_engine; embedded_engine()"],
               env={**os.environ, "PYTHONPATH": str(IMPORT_ROOT)}, cpu_s=300)
    return None if made.returncode == 0 else f"could not convert the embedded SmolLM2: {made.stderr[-2000:]}"


_STAND_INS = {"vllm_url": "CANVASROUTE_VLLM_URL", "causal_vllm_url": "CANVASROUTE_CAUSAL_VLLM_URL"}
"""Fixture -> the environment variable naming a running server that stands in for it."""
_COMMANDS = {"causal_vllm_url": "start-causal"}
"""Fixture -> the script command that starts its server (default `start`)."""


def _start(fixture: str) -> VLLMServer | None:
    """At collection: the server of `fixture`, unless a running one stands in for it (`_STAND_INS`) or
    the venv could not be provisioned (the fixture then says why, in the test)."""
    if os.environ.get(_STAND_INS.get(fixture, "")) or _provision_error() is not None:
        return None
    if fixture == "causal_vllm_url" and _converted_error() is not None:
        return None
    return VLLMServer(run_folder() / f"{fixture}.log", _COMMANDS.get(fixture, "start"))


for _fixture in FIXTURES:
    starts_in_background(_fixture, functools.partial(_start, _fixture))


@contextmanager
def _server(fixture: str) -> Iterator[VLLMServer]:
    started = take(fixture)
    server = started if isinstance(started, VLLMServer) else VLLMServer(
        run_folder() / f"{fixture}-{time.monotonic_ns()}.log", _COMMANDS.get(fixture, "start"))
    try:
        server.ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_url() -> Iterator[str]:
    """Base URL of a real vLLM server serving the tiny DiffusionGemma (tests need `@pytest.mark.vllm`)."""
    if url := os.environ.get("CANVASROUTE_VLLM_URL"):
        try:
            httpx.get(f"{url}/v1/models", timeout=patience(10)).raise_for_status()
        except httpx.HTTPError:
            unavailable(f"CANVASROUTE_VLLM_URL={url} does not answer")
        yield url
        return
    with _server("vllm_url") as server:
        yield server.url


@pytest.fixture(scope="session")
def causal_vllm_url() -> Iterator[str]:
    """Base URL of a real vLLM CPU server serving SmolLM2-135M-Instruct as a plain causal model, the
    embedded engine's converted weights, served name `smollm2` (tests need `@pytest.mark.vllm`)."""
    if url := os.environ.get("CANVASROUTE_CAUSAL_VLLM_URL"):
        try:
            httpx.get(f"{url}/v1/models", timeout=patience(10)).raise_for_status()
        except httpx.HTTPError:
            unavailable(f"CANVASROUTE_CAUSAL_VLLM_URL={url} does not answer")
        yield url
        return
    with _server("causal_vllm_url") as server:
        yield server.url


@pytest.fixture(scope="session")
def second_vllm_url(vllm_url: str) -> Iterator[str]:
    """A second real vLLM server (a replica of the first), started by the suite, for replica tests."""
    with _server("second_vllm_url") as server:
        yield server.url


@pytest.fixture
def spare_vllm() -> Iterator[VLLMServer]:
    """A real vLLM server of the test's own, to kill: every process of it ends with the test."""
    with _server("spare_vllm") as server:
        yield server
