"""Figure 3: decisions per read: how many questions of a typical node share one canvas.

Counts the first reads the router sends for each node (re-reads off), on two
tokenizers: `FunctionEngine` with a 64-wide canvas (the width DiffusionGemma is served
with) and, when a server is given, the real vLLM server's tiny DiffusionGemma tokenizer
(a 1024-token BPE, canvas 32, where many labels are several tokens).
"""

from __future__ import annotations

import asyncio
from typing import Any

from canvasroute.engine import CanvasRouteError, Connection, VLLMServerEngine
from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, Recorder, Section, instant_engine

__all__ = ["run_packing"]


def run_packing(url: str | None) -> Section:
    section = Section("packing", "3. Decisions per read (questions that share one canvas)",
                      ["engine", "node", "questions", "reads", "questions/read", "canvas widths", "label ids/read"])
    engines: list[tuple[str, Any]] = [("FunctionEngine, canvas 64", lambda: instant_engine(64))]
    if url:
        engines.append(("vLLM tiny DiffusionGemma, canvas 32", lambda: VLLMServerEngine(Connection(url, timeout=120))))
    else:
        section.notes.append("real-tokenizer rows skipped: pass --vllm-url or set CANVASROUTE_VLLM_URL")

    async def go() -> None:
        for label, make in engines:
            for node, questions in NODES.items():
                recorder = Recorder(make())
                model = CanvasDecisionModel(engine=recorder, policy=GatePolicy(max_normalized_entropy=None, rereads=0))
                row: dict[str, Any] = {"engine": label, "node": node, "questions": len(questions)}
                try:
                    await model.adecide(TICKETS[0], questions)
                except CanvasRouteError as exc:
                    row.update(reads=0, error=f"{type(exc).__name__}: {exc.message}")
                    section.notes.append(f"{label} / {node}: {type(exc).__name__}: {exc.message}")
                else:
                    reads = recorder.reads
                    row.update({"reads": len(reads), "questions/read": len(questions) / len(reads),
                                "canvas widths": [len(r.canvas) for r in reads],
                                "label ids/read": [len(r.label_ids) for r in reads]})
                await recorder.aclose()
                section.rows.append(row)

    asyncio.run(go())
    section.notes += [
        "a read holds as many questions as fit the canvas (template + 1 <= width) with <= 128 label ids; "
        "the rest go to more reads of the same decision (chunks)",
        "canvas width = template + 1 rounded up to 16: narrower reads are cheaper on the server",
    ]
    return section
