"""Order-bias views measured: canvas accuracy with and without `GatePolicy.order_views`.

    python -m canvasroute.apps.bench.order_bias [--limit 100] [--views 0 1 2] [--tasks intent_recognition ...]

Reads labelled BIG-bench Choice rows (`canvasroute.apps.calibration.rows`) with the embedded
SmolLM2-135M engine, gate and escalation off (one read per row, the canvas argmax is
the answer), once per `order_views` setting, and prints per task and setting: rows,
accuracy, and the share of answers that name the first listed option (a position-bias
figure). The embedded model is near chance: the figures show whether the averaging
moves anything on this model, not the product's quality.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path

from canvasroute.router import CanvasDecisionModel, GatePolicy

from ..calibration.rows import load_rows

DATA = Path(os.environ.get("CANVASROUTE_BIGBENCH", "data/bigbench"))
TASKS = ("intent_recognition", "emojis_emotion_prediction")
BATCH = 8
OFF = GatePolicy(max_normalized_entropy=None, rereads=0)
"""Every threshold off, no re-reads: one read per row, the canvas argmax answers."""


async def measure(engine: object, task: str, limit: int, views: int) -> dict[str, float]:
    rows = load_rows(DATA / task, limit=limit, seed=0)
    model = CanvasDecisionModel(engine=engine, policy=OFF.with_overrides(order_views=views))
    hits = first = 0
    start = time.perf_counter()
    resps = []
    for at in range(0, len(rows), BATCH):  # concurrent decisions share one forward pass
        resps += await asyncio.gather(*(model.adecide(row.state, row.questions, seed=0)
                                        for row in rows[at:at + BATCH]))
    for row, resp in zip(rows, resps, strict=True):
        (qid, gold), = row.gold.items()
        report = resp.reads[qid]
        options = list(report.probabilities)
        hits += report.answer is not None and gold_index_of(options, gold) == options.index(report.answer)
        first += report.answer == options[0]
    n = len(rows)
    return {"rows": n, "accuracy": hits / n, "first_option": first / n,
            "chance": 1 / len(options), "s_per_row": (time.perf_counter() - start) / n}


def gold_index_of(options: Sequence[str], gold: str) -> int:
    folded = [o.casefold() for o in options]
    return folded.index(str(gold).strip().casefold())


async def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--views", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    args = ap.parse_args(argv)
    from canvasroute.engine import embedded_engine

    engine = embedded_engine()
    print("embedded SmolLM2-135M-Instruct (near chance: machinery, not product quality)")
    print(f"{'task':28} {'views':>5} {'rows':>5} {'accuracy':>9} {'first opt':>9} {'chance':>7} {'s/row':>6}")
    for task in args.tasks:
        for views in args.views:
            m = await measure(engine, task, args.limit, views)
            print(f"{task:28} {views:>5} {m['rows']:>5} {m['accuracy']:>9.3f} {m['first_option']:>9.3f} "
                  f"{m['chance']:>7.3f} {m['s_per_row']:>6.2f}", flush=True)


__all__ = ["main", "measure"]

if __name__ == "__main__":
    asyncio.run(main())
