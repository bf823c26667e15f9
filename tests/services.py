"""Real services the deployment tests start themselves: PostgreSQL, LangGraph Server, Phoenix.

Each is a session-scoped fixture that starts the service on a free loopback port in a
temporary folder and stops it afterwards. A service that cannot start skips its tests
locally and fails them under CI=true (`conftest.unavailable`). conftest loads this module as a
plugin (`pytest_plugins`), so every test module can ask for these fixtures by name; a test that
does must carry `@pytest.mark.services` (conftest refuses the run otherwise).

Startup costs measured on a shared 2-core box: PostgreSQL 1.5-2 s (initdb with fsync off,
then start); `langgraph dev` 1.6-3 s (graphs import lazily); Phoenix 14 s idle, 24-37 s
under load, so Phoenix starts in the background at collection (tests/background.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from background import NICE, run_folder, starts_in_background, take
from conftest import IMPORT_ROOT, ROOT, _free_port, unavailable
from deadlines import FIGURES, Limit, Overdue, Watch, patience, wait_until

PYTHON = sys.executable
PHOENIX_VENV = Path(os.environ.get("CANVASROUTE_PHOENIX_VENV",
                                   Path.home() / ".cache" / "canvasroute" / "phoenix-venv"))
PHOENIX_CPU_S = 300
"""The CPU-seconds Phoenix may use starting, or ingesting what a test sent, before it counts as stuck
(it runs at nice 19: wall time says nothing; `Phoenix.watch`)."""
PHOENIX_IDLE_S = 120
"""The seconds Phoenix may spend all blocked (neither running nor waiting for a CPU) while a test waits on it."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout first on PYTHONPATH (`canvasroute` from
    its import root, `examples` and the test helpers from the repository), no proxies."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = os.pathsep.join([str(IMPORT_ROOT), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def wait_for(check: Callable[[], bool], proc: subprocess.Popen, limit: Limit, what: str,
             log: Path | None = None) -> float:
    """Poll `check` until it is true; the seconds it took, or (it exited, or `limit` passed: a `Watch`
    on the service's processes) stop it and report the service unavailable, with its log's tail."""
    try:
        return wait_until(check, limit, what=what, proc=proc, log=log)
    except Overdue as exc:
        stop(proc)
        unavailable(f"{what} did not start: {exc}")
        raise AssertionError("unreachable") from None


def starting(proc: subprocess.Popen, what: str, cpu_s: float = 120, idle_s: float = 120) -> Watch:
    """The deadline of a service's start: `cpu_s` CPU-seconds, `idle_s` seconds all blocked."""
    return Watch(proc.pid, cpu_s=cpu_s, idle_s=idle_s, what=what)


def stop(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """SIGTERM the process group of `proc`, SIGKILL it if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


# -- Chromium ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> str:
    """The headless Chromium that opens the dashboard (scripts/test.sh installs it when run as root)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        unavailable("chromium is not installed (apt-get install -y chromium): cannot open the dashboard")
    return exe


# -- PostgreSQL ----------------------------------------------------------------------------


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for base in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (base / name).exists():
            return str(base / name)
    return None


def _as_postgres_user() -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the `postgres` user."""
    if os.geteuid() != 0:
        return []
    import pwd

    try:
        pwd.getpwnam("postgres")
    except KeyError:
        unavailable("running as root and there is no `postgres` user to run PostgreSQL as")
    return ["runuser", "-u", "postgres", "--"]


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A throwaway PostgreSQL 15 on a free loopback port (1.5-2 s: initdb + start), trust auth.

    fsync is off: the tests kill LangGraph workers, never the database.
    """
    initdb, postgres = _pg_bin("initdb"), _pg_bin("postgres")
    if not initdb or not postgres:
        unavailable("PostgreSQL binaries (initdb, postgres) not found on PATH or /usr/lib/postgresql/*/bin")
    as_user = _as_postgres_user()
    # its own temporary folder, outside pytest's: pytest sets its base folders to 0700 whenever a
    # pytest process starts, which would lock the postgres user out of a data folder inside them
    root = Path(tempfile.mkdtemp(prefix="canvasroute-postgres-"))
    data, sockets, log = root / "data", root / "sock", root / "postgres.log"
    sockets.mkdir()
    if as_user:
        shutil.chown(root, "postgres")
        shutil.chown(sockets, "postgres")
        root.chmod(0o755)
    started = time.monotonic()
    init = subprocess.run([*as_user, initdb, "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync",
                           "-E", "UTF8", "--locale=C"], capture_output=True, text=True)
    if init.returncode != 0:
        unavailable(f"initdb failed: {init.stderr[-2000:]}")
    port = _free_port()
    with open(log, "w") as out:
        if as_user:
            shutil.chown(log, "postgres")
        proc = subprocess.Popen([*as_user, postgres, "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                                 "-k", str(sockets), "-c", "fsync=off", "-c", "synchronous_commit=off",
                                 "-c", "full_page_writes=off", "-c", "max_connections=50"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def ready() -> bool:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=round(patience(2))) as conn:
            return conn.execute("select 1").fetchone() == (1,)

    wait_for(ready, proc, starting(proc, "PostgreSQL"), "PostgreSQL", log)
    print(f"\n[services] PostgreSQL ready in {time.monotonic() - started:.1f}s at {dsn}")
    try:
        yield dsn
    finally:
        stop(proc)
        shutil.rmtree(root, ignore_errors=True)


# -- LangGraph Server (langgraph dev) ---------------------------------------------------------

SLOW_IMPORT_WARNING = "Graph import exceeded the expected startup time"


class LangGraphServer:
    """A running `langgraph dev`: its URL and its log."""

    def __init__(self, url: str, log: Path, startup_s: float) -> None:
        self.url, self.log, self.startup_s = url, log, startup_s

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def langgraph_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LangGraphServer]:
    """`langgraph dev` serving langgraph.json on a free port (1.6-3 s), in-memory persistence.

    The config is copied into a temporary folder (the server writes its `.langgraph_api`
    state there, not into the repository); graphs import from this worktree via PYTHONPATH.
    The engine is the deterministic FunctionEngine (`CANVASROUTE_ENGINE=function`): this
    test is about the server plumbing, and the embedded model would add ~20 s of loading
    and near-chance answers that cannot be asserted on.
    """
    langgraph = Path(PYTHON).parent / "langgraph"
    if not langgraph.exists():
        unavailable("langgraph CLI not installed (pip install 'langgraph-cli[inmem]')")
    import json

    work = tmp_path_factory.mktemp("langgraph-server")
    config = json.loads((ROOT / "langgraph.json").read_text())
    config["dependencies"] = [str(ROOT)]
    (work / "langgraph.json").write_text(json.dumps(config))
    port = _free_port()
    log = work / "server.log"
    env = child_env(CANVASROUTE_ENGINE="function", LANGSMITH_TRACING="false", LANGCHAIN_TRACING_V2="false",
                    LANGGRAPH_CLI_NO_ANALYTICS="1", LANGSMITH_API_KEY="", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(langgraph), "dev", "--config", str(work / "langgraph.json"),
                                 "--host", "127.0.0.1", "--port", str(port), "--no-browser", "--no-reload"],
                                cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    start = starting(proc, "langgraph dev", cpu_s=240)  # /ok, then every graph registered
    wait_for(lambda: httpx.get(f"{url}/ok", timeout=patience(2)).status_code == 200, proc, start, "langgraph dev",
             log)
    # graphs are registered after /ok answers; wait until every one is listed
    wanted = set(config["graphs"])
    def registered() -> bool:
        found = httpx.post(f"{url}/assistants/search", json={"limit": 100}, timeout=patience(5)).json()
        return wanted <= {a["graph_id"] for a in found}

    wait_for(registered, proc, start, "graph registration", log)
    server = LangGraphServer(url, log, time.monotonic() - started)
    print(f"\n[services] langgraph dev ready in {server.startup_s:.1f}s at {url}")
    try:
        yield server
    finally:
        stop(proc)


# -- Arize Phoenix ------------------------------------------------------------------------------


class Phoenix:
    """`phoenix serve` (arize-phoenix, own venv, SQLite in a temporary PHOENIX_WORKING_DIR) on free
    loopback ports: its base URL (UI, REST API and OTLP/HTTP at `/v1/traces`). Started on construction
    (at collection, tests/background.py: 14 s idle, 24-37 s on a loaded 2-core box), `ready()` waits."""

    def __init__(self) -> None:
        exe = PHOENIX_VENV / "bin" / "phoenix"
        self.work = run_folder() / f"phoenix-{time.monotonic_ns()}"
        self.work.mkdir(parents=True)
        port, grpc_port = _free_port(), _free_port()
        self.log = self.work / "phoenix.log"
        env = {k: v for k, v in child_env().items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.pop("PYTHONPATH", None)  # its own venv, nothing of ours
        env.update(PHOENIX_WORKING_DIR=str(self.work), PHOENIX_PORT=str(port), PHOENIX_GRPC_PORT=str(grpc_port),
                   PHOENIX_HOST="127.0.0.1", PHOENIX_TELEMETRY_ENABLED="false")
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([*NICE, str(exe), "serve"], cwd=self.work, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, process_group=0)
        self.url = f"http://127.0.0.1:{port}"
        self.start = self.watch()

    def watch(self) -> Watch:
        """A deadline on what Phoenix does from now on (`PHOENIX_CPU_S`, `PHOENIX_IDLE_S`): for a wait on it."""
        return Watch(self.proc.pid, cpu_s=PHOENIX_CPU_S, idle_s=PHOENIX_IDLE_S, what="Phoenix")

    def ready(self) -> Phoenix:
        """Wait until it answers `/healthz` (its start's `Watch` open); it, or the test reports it unavailable."""
        wait_for(lambda: httpx.get(f"{self.url}/healthz", timeout=patience(2)).status_code == 200, self.proc,
                 self.start, "Phoenix", self.log)
        print(f"\n[services] Phoenix ready {time.monotonic() - self.started:.1f}s after its start at {self.url}")
        FIGURES.append(f"Phoenix started: {self.start.figures()}")
        return self

    def stop(self) -> None:
        stop(self.proc)

    def spans(self, project: str) -> list[dict]:
        """Every span Phoenix stored for `project`, through its REST API."""
        out: list[dict] = []
        cursor = None
        while True:
            params: dict[str, object] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            r = httpx.get(f"{self.url}/v1/projects/{project}/spans", params=params, timeout=patience(10))
            if r.status_code == 404:
                return []
            r.raise_for_status()
            body = r.json()
            out += body["data"]
            cursor = body.get("next_cursor")
            if not cursor:
                return out

    def sessions(self, project: str) -> list[dict]:
        r = httpx.get(f"{self.url}/v1/projects/{project}/sessions", params={"limit": 100}, timeout=patience(10))
        r.raise_for_status()
        return r.json()["data"]


def _phoenix_installed() -> bool:
    return (PHOENIX_VENV / "bin" / "phoenix").exists()


starts_in_background("phoenix", lambda: Phoenix() if _phoenix_installed() else None)


@pytest.fixture(scope="session")
def phoenix() -> Iterator[Phoenix]:
    """A running Phoenix (`Phoenix`), started at collection when a selected test takes it."""
    if not _phoenix_installed():
        unavailable(f"arize-phoenix not installed at {PHOENIX_VENV} (scripts/bootstrap.sh installs it; "
                    "or set CANVASROUTE_PHOENIX_VENV)")
    started = take("phoenix")
    server = started if isinstance(started, Phoenix) else Phoenix()
    try:
        yield server.ready()
    finally:
        server.stop()
