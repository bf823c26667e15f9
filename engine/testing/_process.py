"""The loopback server in a child process (the bench, kill tests), and its command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from importlib import import_module
from pathlib import Path

from ._loopback import ANSWERS, LoopbackVLLM

__all__ = ["LoopbackProcess", "main", "spawn"]


class LoopbackProcess:
    """A loopback server in a child process; it exits when killed or when its parent dies."""

    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url

    def __repr__(self) -> str:
        return f"LoopbackProcess({self.url!r}, pid={self.proc.pid})"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would (no graceful close of open connections)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """Close stdin (the server exits by itself), else kill."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def spawn(*, port: int = 0, canvas_width: int = 64, answer: str = "ranked",
          model: str = "loopback") -> Iterator[LoopbackProcess]:
    """Run a loopback server in a child process for the duration of the block."""
    # `-c`, not `-m canvasroute.engine.testing._loopback`: the package already imports this
    # module, and running it again as __main__ makes runpy warn
    cmd = [sys.executable, "-c", f"import sys; from {__name__} import main; sys.exit(main())",
           "--port", str(port), "--canvas-width", str(canvas_width), "--answer", answer, "--model", model]
    # the child imports the canvasroute this process runs, wherever that was found
    found = str(Path(import_module("canvasroute").__file__ or "").parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [found, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        if not line.startswith("http://"):
            raise RuntimeError(f"the loopback server did not start (exit {proc.poll()})")
        handle = LoopbackProcess(proc, line)
        yield handle
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canvasroute.engine.testing._loopback",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--canvas-width", type=int, default=64)
    parser.add_argument("--answer", choices=list(ANSWERS), default="ranked")
    parser.add_argument("--model", default="loopback")
    args = parser.parse_args(argv)

    async def serve() -> None:
        server = LoopbackVLLM(model=args.model, canvas_width=args.canvas_width, answer=args.answer)
        print(await server.start(args.port), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def watch_stdin() -> None:  # parent gone or stdin closed: exit
            sys.stdin.read()
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=watch_stdin, daemon=True).start()
        await stop.wait()
        await server.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
