"""Optional extras that are missing say so, with the pip command (issue #39, point 5).

`canvasroute.engine._extras.EXTRAS` names each extra's packages (held to pyproject.toml here);
a command or public name that needs a missing one raises `ExtraMissing` (an `ImportError`)
before importing it, and the command line prints the message and the pip command and exits 2,
with no traceback; a command's `--help` needs no extra. These checks hide the `[serve]` extra
from a child interpreter with a `sys.meta_path` finder, so they run in the fast lane; the same
checks on a fresh venv that really lacks every extra are in tests/test_package.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import IMPORT_ROOT, ROOT
from deadlines import run

from canvasroute import ExtraMissing, __version__
from canvasroute.apps.cli import main
from canvasroute.engine._extras import EXTRAS, require_extra

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

HIDDEN = '''
import importlib.abc, sys
HIDE = {hide!r}
class Hide(importlib.abc.MetaPathFinder):
    """Answers as if the extra's packages were not installed."""
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDE):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Hide())
'''
"""A child's prologue that hides packages (and their submodules), as if pip had never installed them."""


def _without(hide: set[str], code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT)}
    return run([sys.executable, "-c", HIDDEN.format(hide=sorted(hide)) + code], env=env, cpu_s=60)


def test_the_extras_table_is_pyprojects():
    """Every extra but the contributors' (`dev`, `docs`: the library never imports them) and each of its
    distributions, as pyproject.toml declares them."""
    declared = {extra: sorted(re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in reqs)
                for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()
                if extra not in ("dev", "docs")}
    assert declared == {extra: sorted(dists) for extra, dists in EXTRAS.items()}


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"canvasroute {__version__}"


def test_require_extra_names_the_first_missing_package_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(EXTRAS, "probe", {"a-real-one": "json", "not-installed": "canvasroute_not_installed.sub"})
    require_extra("probe", "probing", ("json",))  # installed: nothing raised
    with pytest.raises(ImportError) as raised:
        require_extra("probe", "probing")
    exc = raised.value
    assert isinstance(exc, ExtraMissing) and (exc.extra, exc.name) == ("probe", "canvasroute_not_installed.sub")
    assert exc.message == "probing needs not-installed (canvasroute's [probe] extra), which is not installed"
    assert exc.hint == "pip install 'canvasroute[probe]'"
    assert str(exc).endswith("(hint: pip install 'canvasroute[probe]')")


@pytest.mark.slow
def test_serve_without_the_serve_extra_prints_help_and_the_pip_command():
    """On main, `canvasroute serve --help` died with `ModuleNotFoundError: starlette`."""
    serve = {"starlette", "uvicorn", "prometheus_client"}
    code = '''
import json, sys
from canvasroute.apps.cli import main
try:
    main(["serve", "--help"])
except SystemExit as exc:
    print("HELP EXIT", exc.code)
print("RUN EXIT", main(["serve", "--engine-url", "http://127.0.0.1:9"]))
import canvasroute.apps.server as server
print("LIMITS", server.Limits().max_questions > 0)
try:
    server.create_app
except ImportError as exc:
    print("IMPORT", json.dumps([type(exc).__name__, exc.extra, exc.name, exc.hint]))
print("LOADED", sorted(m for m in ("starlette", "uvicorn", "prometheus_client") if m in sys.modules))
'''
    done = _without(serve, code)
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    assert "HELP EXIT 0" in out and "usage: canvasroute serve" in out
    assert "pip install 'canvasroute[serve]'" in out.split("HELP EXIT")[0]  # the help says which extra
    assert "RUN EXIT 2" in out
    assert err.strip() == ("canvasroute serve: the server needs starlette (canvasroute's [serve] extra), which is not "
                           "installed\n  hint: pip install 'canvasroute[serve]'")
    assert "LIMITS True" in out
    imported = json.loads(out.split("IMPORT ", 1)[1].splitlines()[0])
    assert imported == ["ExtraMissing", "serve", "starlette", "pip install 'canvasroute[serve]'"]
    assert "LOADED []" in out  # nothing was half-imported


@pytest.mark.slow
def test_the_demo_and_calibrates_plots_name_their_extras(tmp_path):
    """The demo without the OTel SDK stops before it prints or loads anything; `calibrate` without
    matplotlib writes its policy and names the pip command (on main: a raw `ModuleNotFoundError`,
    and "matplotlib is not installed" with no command)."""
    demo = _without({"opentelemetry.sdk"}, 'from canvasroute.apps.cli import main\n'
                                           'print("EXIT", main(["demo", "--engine-url", "http://127.0.0.1:9"]))')
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert demo.stdout.strip() == "EXIT 2"
    assert demo.stderr.strip() == ("canvasroute demo: tracing needs opentelemetry-sdk (canvasroute's [otel] extra), "
                                   "which is not installed\n  hint: pip install 'canvasroute[otel]'")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"state": f"case {i}", "questions": {"q": {"type": "noul", "instructions": "?"}},
                                        "gold": {"q": "yes" if i % 2 else "no"}}) + "\n" for i in range(8)))
    out = tmp_path / "policy.json"
    code = f"""
import canvasroute.engine as engine
from canvasroute.apps.cli import main
engine.embedded_engine = lambda: engine.FunctionEngine(
    lambda read: [{{i: -0.2 - 0.1 * n for n, i in enumerate(read.label_ids)}}] * len(read.slots))
print("EXIT", main(["calibrate", {str(rows)!r}, "-o", {str(out)!r}]))
"""
    calibrated = _without({"matplotlib"}, code)
    assert calibrated.returncode == 0, calibrated.stderr[-3000:]
    assert "EXIT 0" in calibrated.stdout and out.is_file()
    assert ("canvasroute calibrate: plotting needs matplotlib (canvasroute's [plots] extra), which is not installed; "
            "the policy is written without the plots (--no-plots skips them quietly)\n"
            "  hint: pip install 'canvasroute[plots]'") in calibrated.stderr
    assert "Traceback" not in calibrated.stderr
