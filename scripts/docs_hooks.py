"""MkDocs hooks (mkdocs.yml `hooks:`): what the pages take from the repository instead of copying it.

- `--8<-- "CHANGELOG.md"` on a line of its own is replaced by that file of the repository root
  (CHANGELOG.md, BENCHMARKS.md, QUALITY.md stay where they are, written for the repository's
  readers); their `docs/...` links are made relative to the page that includes them.
- `--8<-- "canvasroute COMMAND --help"` is replaced by that command's help, from the real parser
  (`canvasroute.apps.cli.build_parser`), so the command-line reference cannot drift.

tests/test_docs.py expands pages the same way (`expand`) before it runs their code blocks.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INCLUDE = re.compile(r'^--8<-- "([^"]+)"[ \t]*$', re.MULTILINE)
HELP = re.compile(r"canvasroute(?: (\w+))? --help")
ROOT_FILES = ("CHANGELOG.md", "BENCHMARKS.md", "QUALITY.md")


def command_help(command: str | None) -> str:
    """`canvasroute [COMMAND] --help` as the real parser prints it, 100 columns wide."""
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from canvasroute.apps.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    parser = build_parser([command] if command else [])
    if command is None:
        return parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse keeps subparsers there
    return sub.choices[command].format_help()


def include(target: str, page: str) -> str:
    """What `--8<-- "target"` stands for on the page `page` (its path under docs/)."""
    if m := HELP.fullmatch(target):
        return "```text\n" + command_help(m.group(1)) + "```"
    if target not in ROOT_FILES:
        raise ValueError(f'{page}: --8<-- "{target}" names neither a root file {ROOT_FILES} nor a --help')
    text = (ROOT / target).read_text(encoding="utf-8")
    up = posixpath.relpath(".", posixpath.dirname(page) or ".")

    def relink(m: re.Match[str]) -> str:
        return f"]({posixpath.normpath(posixpath.join(up, m.group(1)))}"

    return re.sub(r"\]\(docs/([^)]+)", relink, text)


def expand(markdown: str, page: str) -> str:
    """The page's markdown with every `--8<--` line replaced."""
    return INCLUDE.sub(lambda m: include(m.group(1), page), markdown)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return expand(markdown, page.file.src_uri)
