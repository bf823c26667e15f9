"""The package a real project installs: one namespace, rooms that follow the data flow, a wheel.

The layout checks read the source (imports as the AST has them); the signature check reads
the public API (`inspect.signature`); the structure check counts the modules one decision
runs through (`canvasroute bench --only structure`); the install check builds the wheel,
installs it into a fresh venv (a background job, tests/background.py) and uses it from a project
folder that holds its own `router.py`, `engine.py` and `harness.py`, as a user's LangGraph app may
(`services`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from background import job
from conftest import IMPORT_ROOT, LAYERS, ROOT
from deadlines import run

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ORDER = ("engine", "router", "harness", "apps")
"""The rooms in data-flow order: each may import only the rooms before it."""
MAX_PARAMETERS = 12
"""The most parameters (self and cls not counted) a public constructor, function or method may take."""
OVER_MAX_PARAMETERS = {
    "canvasroute.DecisionNode": 13,
    "canvasroute.decision_node": 13,
    "canvasroute.GatePolicy": 13,
    "canvasroute.Escalation": 14,
}
"""Over the bound, and why: a decision node is configured where it is added to a graph
(questions, inputs, route, review, shadow, fan-out, history), each a value of its own; 13 is
"about 12" (issue #28). `GatePolicy`'s thirteenth field is `certificate`, a record of what a
calibration proved (issue #35), not a knob a caller sets. `Escalation`'s ten knobs are joined by
four holders of where its counts live (`meter`, `controller_state`, and since issues #39 and #40
`breaker_state` and `audit_state`), each None by default and made by the model or the graph store,
so a caller sets at most the two that are shared across workers; grouping them into one state value
is the way down. An entry may only go down, and goes
away at 12 or fewer."""
RECORDS = {
    "canvasroute.ReadReport": "one question's figures, as the library built them",
    "canvasroute.apps.observability.Report": "the dashboard's totals over a trace file",
    "canvasroute.apps.observability.SpanRecord": "one span read back from a trace file",
    "canvasroute.router.QuestionCalibration": "one question's calibration figures, as `calibrate` built them",
}
"""Records the library builds and a caller reads, never calls: their fields are not a signature."""


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from the repository's folders."""
    found = {"canvasroute" if p.stem == "__init__" else f"canvasroute.{p.stem}": p
             for p in (ROOT / "canvasroute").glob("*.py")}
    for name, folder in LAYERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join(("canvasroute", name, *parts))] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> set[str]:
    """The canvasroute modules `module` imports (relative imports resolved), TYPE_CHECKING ones too."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def test_pyproject_maps_every_folder_and_ships_every_package():
    setup = PYPROJECT["tool"]["setuptools"]
    assert setup["package-dir"] == {"": "src"}  # a plain path: an editable install static tools can read
    assert {room: room for room in ORDER} == LAYERS  # the import root (scripts/import_root.py) links the same
    for room in ORDER:  # canvasroute/ is the whole package: a committed symlink to each layer folder
        assert (ROOT / "canvasroute" / room).is_symlink() and (ROOT / "canvasroute" / room).resolve() == ROOT / room
    assert (ROOT / "src" / "canvasroute").resolve() == ROOT / "canvasroute"
    on_disk = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert set(setup["packages"]) == on_disk
    assert PYPROJECT["project"]["scripts"]["canvasroute"] == "canvasroute.apps.cli:main"


def test_the_rooms_import_one_way():
    backwards = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if _room(m)
                       for d in deps if _room(d) and ORDER.index(_room(d)) > ORDER.index(_room(m)))
    assert not backwards, backwards


def test_engine_and_router_do_not_import_langgraph():
    for module, path in MODULES.items():
        if _room(module) in ("engine", "router"):
            tree = ast.parse(path.read_text())
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not any(n.split(".")[0] == "langgraph" for n in names), module


def test_no_import_cycles():
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node]):
            # a package importing its own submodules is how a package re-exports, not a cycle
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    # a submodule importing its parent package (for the parent's re-exports) closes no real loop
    real = [c for c in cycles if not any(b.startswith(a + ".") or a.startswith(b + ".")
                                         for a, b in itertools.pairwise(c))]
    assert not real, real


def _public_callables() -> dict[str, object]:
    """Every public constructor, function and method, by its shortest public name.

    Public: a name in `__all__` of `canvasroute` or of a package it ships (pyproject's
    `packages`; a package without `__all__`: its names defined in canvasroute), and the
    methods not starting with `_` that a public class defines itself."""
    found: dict[str, object] = {}
    for package in sorted(PYPROJECT["tool"]["setuptools"]["packages"], key=lambda p: (p.count("."), p)):
        module = importlib.import_module(package)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n, v in vars(module).items()
                     if not n.startswith("_") and getattr(v, "__module__", "").startswith("canvasroute.")]
        for name in names:
            obj = getattr(module, name)
            if not getattr(obj, "__module__", "").startswith("canvasroute.") or any(o is obj for o in found.values()):
                continue
            if inspect.isclass(obj):
                found[f"{package}.{name}"] = obj
                for attr, member in vars(obj).items():
                    function = member.__func__ if isinstance(member, classmethod | staticmethod) else member
                    if not attr.startswith("_") and inspect.isfunction(function):
                        found[f"{package}.{name}.{attr}"] = function
            elif inspect.isfunction(obj):
                found[f"{package}.{name}"] = obj
    return found


def _parameters(obj: object) -> int:
    """Parameters of a function, or of a class's constructor (its fields, for a dataclass or model)."""
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return len([f for f in dataclasses.fields(obj) if f.init])
    signature = inspect.signature(obj)  # type: ignore[arg-type]
    return len([p for p in signature.parameters.values() if p.name not in ("self", "cls")])


def test_no_public_constructor_or_function_takes_more_than_12_parameters():
    counts = {name: _parameters(obj) for name, obj in _public_callables().items() if name not in RECORDS}
    assert counts.keys() >= {"canvasroute.decision_node", "canvasroute.CanvasDecisionModel.adecide"}  # it looks
    over = {name: n for name, n in counts.items() if n > MAX_PARAMETERS}
    grown = {name: (n, OVER_MAX_PARAMETERS.get(name)) for name, n in over.items()
             if n > OVER_MAX_PARAMETERS.get(name, MAX_PARAMETERS)}
    assert not grown, f"over {MAX_PARAMETERS} parameters (now, allowed): {grown}; take a value object instead"
    fixed = sorted(set(OVER_MAX_PARAMETERS) - set(over))
    assert not fixed, f"no longer over {MAX_PARAMETERS} (or gone): remove {fixed} from OVER_MAX_PARAMETERS"
    shrunk = {name: n for name, n in over.items() if n < OVER_MAX_PARAMETERS[name]}
    assert not shrunk, f"fewer parameters now: lower OVER_MAX_PARAMETERS to {shrunk}"


def test_one_decision_node_run_stays_within_its_structure():
    """The bench's figure, in a fresh interpreter as the bench runs it (what earlier tests set up in
    this process, such as an OTel SDK provider, would add hops of their own)."""
    from canvasroute.apps.bench.structure import MAX_MODULES, MAX_RETURNS

    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT)}
    done = run([sys.executable, "-m", "canvasroute", "bench", "--json", "--only", "structure"], env=env, cpu_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["sections"]["structure"]["rows"]
    row = next(r for r in rows if r["path"].startswith("decision_node"))
    assert row["hops"] > row["modules"] >= 5  # the trace saw the run (engine, router, harness)
    assert row["modules"] <= MAX_MODULES and row["returns"] <= MAX_RETURNS, row


def test_the_import_surface_lists_what_it_serves():
    import canvasroute

    assert set(canvasroute.__all__) == {*canvasroute._HOME, "__version__"}
    assert canvasroute.__all__ == sorted(canvasroute.__all__)
    for name in canvasroute.__all__:
        assert getattr(canvasroute, name) is not None, name


def test_errors_report_the_canvasroute_module():
    import canvasroute

    for name in ("CanvasRouteError", "EngineUnavailable", "InputTooLong", "EscalationError"):
        assert getattr(canvasroute, name).__module__ == "canvasroute.engine.errors"


@job
def everything_imported(work: Path) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter imports every module of the package and prints the generic top-level names loaded."""
    code = ("import importlib, sys\n"
            f"for m in {sorted(MODULES)!r}:\n"
            "    if not m.endswith('__main__'):\n"
            "        importlib.import_module(m)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('engine', 'router', 'harness', 'apps')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return run([sys.executable, "-c", code], env=env, cwd="/", cpu_s=120)


@pytest.mark.slow
def test_importing_everything_loads_no_generic_top_level_package(everything_imported):
    out = everything_imported
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


# -- installed like a user ---------------------------------------------------------------------

USER_ROUTER = '''"""The user's own router module, named as LangGraph apps often name theirs."""
ROUTES = {"billing": "billing_desk"}
'''
USER_ENGINE = 'ENGINE = "the user\'s own engine module"\n'
USER_HARNESS = 'HARNESS = "the user\'s own harness module"\n'
USER_APP = '''"""A user's typed script: a decision on the FunctionEngine, then a graph that routes on it."""

from __future__ import annotations

from typing import Annotated

from langchain_core.decisions import Choice, ChoiceAnswer
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

import engine
import harness
import router
from canvasroute import CanvasDecisionModel, CanvasRead, FunctionEngine, GatePolicy, decision_node, merge_decisions


def rows(read: CanvasRead) -> list[dict[int, float]]:
    return [{fake.token_id("A"): -0.05, fake.token_id("B"): -3.0} for _ in read.slots]


fake = FunctionEngine(rows)
model = CanvasDecisionModel(engine=fake, policy=GatePolicy(max_normalized_entropy=0.9))
team = Choice(instructions="Which team owns this?", criteria={"billing": None, "technical": None})
resp = model.invoke({"state": "Refund me", "questions": {"team": team}})
answer = resp.answers["team"]
assert isinstance(answer, ChoiceAnswer) and answer.choice == "billing", resp.answers
assert resp.reads["team"].path == "canvas"


class State(TypedDict, total=False):
    ticket: str
    decisions: Annotated[dict[str, object], merge_decisions]
    handled_by: str


builder = StateGraph(State)
builder.add_node("triage", decision_node(model, {"team": team}, inputs="ticket",
                                         route=("team", {"billing": router.ROUTES["billing"], "technical": "tech"})))
builder.add_node("billing_desk", lambda state: {"handled_by": "billing"})
builder.add_node("tech", lambda state: {"handled_by": "tech"})
builder.add_edge(START, "triage")
builder.add_edge("billing_desk", END)
builder.add_edge("tech", END)
out = builder.compile().invoke({"ticket": "I was charged twice."})
assert out["handled_by"] == "billing", out
print("ok", engine.ENGINE, harness.HARNESS, type(resp).__module__)
'''


@job
def installed(work: Path) -> Path:
    """A fresh venv holding the built wheel (and mypy), as a user's project would: built and installed
    by a background job, beside the suite."""
    dist = work / "dist"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], cpu_s=120)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(dist.glob("canvasroute-*.whl"))
    venv = work / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], cpu_s=60).returncode == 0
    pip = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
               str(wheel), "mypy"], cpu_s=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder with modules named like ours."""
    (tmp_path / "router.py").write_text(USER_ROUTER)
    (tmp_path / "engine.py").write_text(USER_ENGINE)
    (tmp_path / "harness.py").write_text(USER_HARNESS)
    (tmp_path / "app.py").write_text(USER_APP)
    return tmp_path


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.mark.services
def test_the_wheel_installs_only_canvasroute(installed):
    pip = run([str(installed / "bin" / "python"), "-m", "pip", "show", "-f", "canvasroute"], env=_clean_env(), cpu_s=60)
    assert pip.returncode == 0, pip.stderr[-2000:]
    shown = pip.stdout
    files = [line.strip() for line in shown.split("Files:", 1)[1].splitlines() if line.strip()]
    tops = {f.split("/")[0] for f in files if not f.startswith("..")}
    assert tops == {"canvasroute", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for expected in ("canvasroute/py.typed", "canvasroute/engine/errors.py", "canvasroute/apps/cli.py",
                     "canvasroute/harness/_node.py", "canvasroute/router/telemetry/__init__.py"):
        assert expected in files, expected
    assert not any(f.startswith(("tests/", "examples/", "engine/", "router/", "harness/")) for f in files)
    meta = run([str(installed / "bin" / "python"), "-c",
                "import importlib.metadata as m, canvasroute; d = m.metadata('canvasroute');"
                "print(d['License-Expression'], canvasroute.__version__ == d['Version'],"
                " bool(d.get_all('Classifier')), bool(d.get_all('Project-URL')))"], env=_clean_env(), cpu_s=60)
    assert meta.stdout.split() == ["Apache-2.0", "True", "True", "True"], meta.stderr[-2000:]


@pytest.mark.services
def test_a_project_with_its_own_router_engine_and_harness_modules_uses_the_package(installed, project):
    app = run([str(installed / "bin" / "python"), "app.py"], cwd=project, env=_clean_env(), cpu_s=120)
    assert app.returncode == 0, app.stderr[-3000:]
    assert app.stdout.split()[:1] == ["ok"] and "canvasroute.router._types" in app.stdout
    cli = run([str(installed / "bin" / "canvasroute"), "--help"], cwd=project, env=_clean_env(), cpu_s=60)
    assert cli.returncode == 0 and "dashboard" in cli.stdout


@pytest.mark.services
def test_mypy_strict_passes_on_a_typed_user_script(installed, project):
    checked = run([str(installed / "bin" / "python"), "-m", "mypy", "--strict", "--no-incremental", "app.py"],
                  cwd=project, env=_clean_env(), cpu_s=300)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
    assert "missing library stubs or py.typed marker" not in checked.stdout


NO_EXTRAS = """
import json
from canvasroute.engine._extras import EXTRAS, _installed
print(json.dumps(sorted(m for extra in EXTRAS.values() for m in extra.values() if _installed(m))))
"""
PUBLIC_NAMES = """
import json
out = {}
for name, call in (("create_app", "from canvasroute.apps.server import create_app"),
                   ("TransformersEngine", "from canvasroute import TransformersEngine"),
                   ("embedded_engine", "from canvasroute import embedded_engine; embedded_engine()"),
                   ("JsonlSpanExporter", "from canvasroute import JsonlSpanExporter; JsonlSpanExporter('x.jsonl')")):
    try:
        exec(call)
    except ImportError as exc:
        out[name] = [type(exc).__name__, exc.extra, exc.hint]
print(json.dumps(out))
"""


@pytest.mark.services
def test_a_venv_without_the_extras_names_the_pip_command_for_each_and_serve_help_works(installed, tmp_path):
    """Issue #39 point 5, on the wheel in a fresh venv that holds none of the extras (as `pip install
    canvasroute` leaves it): `--version`; `serve --help` prints its help (on main: ModuleNotFoundError
    starlette); each command and public name that needs a missing extra names the pip command, and no
    traceback; the dashboard and calibrate (without its plots) need none."""
    python, cli = str(installed / "bin" / "python"), str(installed / "bin" / "canvasroute")

    def here(*args: str) -> subprocess.CompletedProcess[str]:
        return run(args, cwd=tmp_path, env=_clean_env(), cpu_s=120)

    present = here(python, "-c", NO_EXTRAS)
    assert present.returncode == 0 and json.loads(present.stdout) == [], present.stdout + present.stderr
    version = here(cli, "--version")
    release = importlib.import_module("canvasroute").__version__
    assert (version.returncode, version.stdout.strip()) == (0, f"canvasroute {release}")
    helped = here(cli, "serve", "--help")
    assert helped.returncode == 0 and "usage: canvasroute serve" in helped.stdout, helped.stderr[-2000:]
    assert "pip install 'canvasroute[serve]'" in helped.stdout
    data = str(ROOT / "data" / "examples" / "decisions.jsonl")
    for args, extra in ((("serve", "--engine-url", "http://127.0.0.1:9"), "serve"),
                        (("demo", "--engine-url", "http://127.0.0.1:9"), "otel"),
                        (("eval", data, "--limit", "2", "--no-plots"), "local"),
                        (("calibrate", data, "--limit", "2", "-o", "p.json"), "local")):
        done = here(cli, *args)
        assert done.returncode == 2, (args, done.stdout[-1000:], done.stderr[-2000:])
        assert f"pip install 'canvasroute[{extra}]'" in done.stderr and "Traceback" not in done.stderr, (
            args, done.stderr[-2000:])
    names = here(python, "-c", PUBLIC_NAMES)
    assert json.loads(names.stdout) == {
        "create_app": ["ExtraMissing", "serve", "pip install 'canvasroute[serve]'"],
        "TransformersEngine": ["ExtraMissing", "local", "pip install 'canvasroute[local]'"],
        "embedded_engine": ["ExtraMissing", "local", "pip install 'canvasroute[local]'"],
        "JsonlSpanExporter": ["ExtraMissing", "otel", "pip install 'canvasroute[otel]'"],
    }, names.stderr[-2000:]
    spans = tmp_path / "spans.jsonl"
    _escalated_spans(spans)  # written here, with the SDK
    dashboard = here(cli, "dashboard", str(spans), "-o", "report.html")
    assert dashboard.returncode == 0 and (tmp_path / "report.html").is_file(), dashboard.stderr[-2000:]
    calibrated = here(cli, "calibrate", "--from-traces", str(spans), "-o", "policy.json")
    assert calibrated.returncode == 0 and (tmp_path / "policy.json").is_file(), calibrated.stderr[-2000:]
    assert "pip install 'canvasroute[plots]'" in calibrated.stderr and "Traceback" not in calibrated.stderr


def _escalated_spans(path: Path) -> None:
    """A trace file of decisions over the gate, each escalated to a scripted chat model."""
    from conftest import fresh_tracer_provider
    from langchain_core.decisions import Choice
    from langchain_core.language_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    from canvasroute import CanvasDecisionModel, FunctionEngine, GatePolicy, JsonlSpanExporter

    engine = FunctionEngine(lambda read: [{engine.token_id("A"): -0.69, engine.token_id("B"): -0.70}])
    replies = (AIMessage('{"side": "left"}') for _ in range(20))
    model = CanvasDecisionModel(engine=engine, policy=GatePolicy(max_normalized_entropy=0.5, rereads=0),
                                escalate_to=GenericFakeChatModel(messages=replies))
    side = {"side": Choice(instructions="Which side?", criteria={"left": None, "right": None})}
    with fresh_tracer_provider(JsonlSpanExporter(path)):
        for i in range(12):
            model.decide(f"case {i}", side)


# -- an editable install, as the README's contributors make it ---------------------------------

USER_TYPES = '''"""What a user's editor and type checker see of canvasroute after `pip install -e`."""

from langchain_core.decisions import Choice

from canvasroute import CanvasDecisionModel, FunctionEngine, GatePolicy

model = CanvasDecisionModel(engine=FunctionEngine(lambda read: []), policy=GatePolicy(max_normalized_entropy=0.5))
team = Choice(instructions="Which team?", criteria={"billing": None, "technical": None})
resp = model.invoke({"state": "Refund me", "questions": {"team": team}})
reveal_type(model)
reveal_type(resp)
reveal_type(resp.totals.reads)
'''
REVEALED = ("canvasroute.router._model.CanvasDecisionModel", "canvasroute.router._types.CanvasResponse", "int")


@job
def editable(work: Path) -> Path:
    """A fresh venv with this checkout installed editable (`pip install -e .`), mypy and pyright (its
    first run fetches the pyright npm package, done here, in the background)."""
    venv = work / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], cpu_s=60).returncode == 0
    pip = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "-e", str(ROOT), "mypy", "pyright"], cpu_s=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    warm = run([str(venv / "bin" / "pyright"), "--version"], env=_clean_env(), cpu_s=120)
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-2000:]
    return venv


@pytest.mark.services
def test_an_editable_install_shows_mypy_and_pyright_the_real_types(editable, tmp_path):
    (tmp_path / "user.py").write_text(USER_TYPES)
    python = str(editable / "bin" / "python")
    mypy = run([python, "-m", "mypy", "--no-incremental", "user.py"], cwd=tmp_path, env=_clean_env(), cpu_s=300)
    seen = [line.split("Revealed type is ", 1)[1].strip('"') for line in mypy.stdout.splitlines()
            if "Revealed type is" in line]
    assert mypy.returncode == 0 and seen == list(REVEALED), mypy.stdout[-3000:]
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"venvPath": str(editable.parent), "venv": editable.name}))
    pyright = run([str(editable / "bin" / "pyright"), "--outputjson", "user.py"], cwd=tmp_path, env=_clean_env(),
                  cpu_s=300)
    told = [d["message"] for d in json.loads(pyright.stdout)["generalDiagnostics"] if d["severity"] == "information"]
    assert told == [f'Type of "{expr}" is "{shown}"' for expr, shown in (
        ("model", "CanvasDecisionModel"), ("resp", "CanvasResponse"),
        ("resp.totals.reads", "int"))], pyright.stdout[-3000:]
