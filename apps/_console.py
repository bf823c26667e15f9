"""Terminal output for the CLI commands: rich progress bars and tables on a terminal.

When the stream is not a terminal (a pipe, a file, a test) progress is one closing line and
tables are plain aligned text, so logs stay greppable and `--json` output stays pure JSON.
`rich` is imported only on a terminal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

__all__ = ["is_terminal", "plain_table", "print_table", "progress", "say"]


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@contextmanager
def progress(total: int, label: str, *, unit: str = "rows", stream: TextIO | None = None
             ) -> Iterator[Callable[[int], None]]:
    """A progress bar on `stream` (stderr); yields `advance(n=1)`.

    Off a terminal there is no bar: one line when the work is done (`label: 24/24 rows in 3.1 s`).
    """
    stream = stream or sys.stderr
    if not is_terminal(stream):
        done, start = [0], time.perf_counter()

        def count(n: int = 1) -> None:
            done[0] += n

        yield count
        print(f"{label}: {done[0]}/{total} {unit} in {time.perf_counter() - start:.1f} s", file=stream, flush=True)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=stream), transient=False) as bar:
        task = bar.add_task(label, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)

        yield advance


def say(line: str, stream: TextIO | None = None) -> None:
    """One line of what is happening now (stderr): dimmed on a terminal, plain text otherwise
    (no carriage returns or bars, so a log keeps one line per step)."""
    stream = stream or sys.stderr
    if is_terminal(stream):
        from rich.console import Console

        Console(file=stream, highlight=False).print(f"[dim]{line}[/dim]")
    else:
        print(line, file=stream, flush=True)


def plain_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "   ") -> list[str]:
    """Left-aligned text columns, one line per row, a header line first."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return indent + "  ".join(v.ljust(w) for v, w in zip(cells, widths, strict=True))

    return [line(columns), *(line(r) for r in rows)]


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *, notes: Sequence[str] = (),
                plain: str, stream: TextIO | None = None) -> None:
    """A rich table with notes under it on a terminal; `plain` (the text form) otherwise."""
    stream = stream or sys.stdout
    if not is_terminal(stream):
        print(plain, file=stream, flush=True)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns, title=title, title_justify="left", caption="\n".join(notes) or None,
                  caption_justify="left")
    for row in rows:
        table.add_row(*row)
    Console(file=stream).print(table)
