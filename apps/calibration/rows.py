"""Labelled decision sets for calibration: JSONL rows or a BIG-bench multiple-choice task."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.decisions import Choice, Noul

from canvasroute.engine import CalibrationError, CanvasRouteError
from canvasroute.router import QuestionSpec, parse_questions

__all__ = ["Row", "bigbench_rows", "check_rows", "gold_index", "load_rows"]


_BIGBENCH = {
    "intent_recognition": ("intent", "Which intent does the utterance express?"),
    "emojis_emotion_prediction": ("emotion", "Which emotion does this emoji express?"),
    "strategyqa": ("answer", "Is the answer to this question yes?"),
}


@dataclass(frozen=True, slots=True)
class Row:
    """One labelled decision set."""

    state: Any
    questions: Mapping[str, Any]
    gold: Mapping[str, Any]


def load_rows(path: str | Path, *, limit: int | None = None, seed: int = 0) -> list[Row]:
    """Rows from JSONL or a BIG-bench task; `limit` takes a seeded random sample."""
    path = Path(path)
    if path.is_dir():
        path = path / "task.json"
    if not path.is_file():
        raise CalibrationError(f"no calibration data at {path}")
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, Mapping) and "examples" in doc:
        rows = bigbench_rows(doc, path.parent.name)
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                rows.append(Row(item["state"], item["questions"], item["gold"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CalibrationError(f"{path}:{n}: not a {{state, questions, gold}} row ({exc!r})") from exc
    if not rows:
        raise CalibrationError(f"{path} holds no rows")
    if limit is not None:
        if limit < 1:
            raise CalibrationError(f"--limit must be >= 1, got {limit}")
        if limit < len(rows):
            rows = random.Random(seed).sample(rows, limit)
    check_rows(rows)
    return rows


def bigbench_rows(task: Mapping[str, Any], name: str = "") -> list[Row]:
    """BIG-bench multiple-choice examples as rows: Yes/No targets a Noul, others a Choice."""
    name = str(task.get("name") or name)
    examples = task.get("examples") or []
    if not examples or "target_scores" not in examples[0]:
        raise CalibrationError(f"BIG-bench task {name!r} has no multiple-choice examples (target_scores)")
    qid, instructions = _BIGBENCH.get(name, ("answer", str(task.get("description") or "Choose the answer.")))
    prefix = str(task.get("task_prefix") or "").strip()
    rows = []
    for ex in examples:
        scores = ex["target_scores"]
        gold = max(scores, key=lambda k: float(scores[k]))
        if {k.casefold() for k in scores} == {"yes", "no"}:
            question: Any = Noul(instructions=instructions)
            gold = gold.casefold()
        else:
            question = Choice(instructions=instructions, criteria=dict.fromkeys(scores))
        state = f"{prefix}\n{ex['input']}" if prefix else ex["input"]
        rows.append(Row(state, {qid: question}, {qid: gold}))
    return rows


def check_rows(rows: Sequence[Row]) -> list[dict[str, QuestionSpec]]:
    """Parse every row's questions and check its gold options (before any read)."""
    specs = []
    for n, row in enumerate(rows, 1):
        try:
            spec = parse_questions(row.questions)
        except CanvasRouteError as exc:
            raise CalibrationError(f"row {n}: {exc}") from exc
        for qid, value in row.gold.items():
            if qid not in spec:
                raise CalibrationError(f"row {n}: gold names {qid!r}, which is not one of its questions")
            gold_index(spec[qid], value)
        specs.append(spec)
    return specs


def gold_index(spec: QuestionSpec, value: Any) -> int:
    if isinstance(value, bool) and spec.kind == "noul":
        value = "yes" if value else "no"
    folded = {o.casefold(): i for i, o in enumerate(spec.options)}
    key = str(value).strip().casefold()
    if key not in folded:
        raise CalibrationError(f"gold {value!r} for {spec.id!r} is not one of {list(spec.options)}")
    return folded[key]
