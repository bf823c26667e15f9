"""`canvasroute calibrate DATA -o policy.json`: temperatures and thresholds from labelled decisions.

DATA is JSONL of `{"state": ..., "questions": {id: question}, "gold": {id: option}}`, or
a BIG-bench `task.json` (or its folder): intent_recognition and emojis_emotion_prediction
become a Choice over the `target_scores` keys, strategyqa a Noul; the gold option is the
top-scored key. `--from-traces TRACES` uses escalated questions in exported spans instead
(canvas distribution + the escalation's answer as the label; these rows are the uncertain
ones only, so the fit describes that region).

The canvas is read with the gate off (no re-reads, no escalation); then, per question,
`router.calibrate` fits a temperature on one split and keeps it only if the other split's
NLL and ECE do not get worse, and picks a `max_normalized_entropy` for `--target-accuracy`
or `--target-escalation`. Writes the policy file (`router.load_policy` reads it), a
reliability diagram and an accuracy-vs-escalation curve (PNG, next to the policy).

Example:
    ```bash
    canvasroute calibrate /work/shared/data/bigbench/intent_recognition --limit 40 \\
        --engine-url http://127.0.0.1:8000 --target-escalation 0.3 -o policy.json
    ```
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from langchain_core.decisions import Choice, Noul

from engine import CalibrationError, CanvasRouteError, Engine, TraceFileError, VLLMServerEngine
from router import CanvasDecisionModel, GatePolicy, Labelled, calibrate, save_policy
from router import calibration as cm
from router import QuestionSpec, parse_questions

from .dashboard import near_chance
from .traces import SpanRecord, decision_figures, read_spans

__all__ = ["Row", "collect", "configure", "labelled_from_spans", "load_rows", "plot_escalation",
           "plot_reliability", "run"]

GATE_OFF = GatePolicy(max_normalized_entropy=None, rereads=0)
"""Read every question once and trust it: calibration needs the raw canvas distributions."""

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


# -- data --------------------------------------------------------------------------------


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
    _check(rows)
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
            question = Choice(instructions=instructions, criteria={k: None for k in scores})
        state = f"{prefix}\n{ex['input']}" if prefix else ex["input"]
        rows.append(Row(state, {qid: question}, {qid: gold}))
    return rows


def _check(rows: Sequence[Row]) -> list[dict[str, QuestionSpec]]:
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
            _gold_index(spec[qid], value)
        specs.append(spec)
    return specs


def _gold_index(spec: QuestionSpec, value: Any) -> int:
    if isinstance(value, bool) and spec.kind == "noul":
        value = "yes" if value else "no"
    folded = {o.casefold(): i for i, o in enumerate(spec.options)}
    key = str(value).strip().casefold()
    if key not in folded:
        raise CalibrationError(f"gold {value!r} for {spec.id!r} is not one of {list(spec.options)}")
    return folded[key]


# -- reading the canvas ---------------------------------------------------------------------


class Progress:
    """A progress bar on stderr (redrawn on a terminal, a line per 10 % otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._shown = -1

    def update(self, n: int = 1) -> None:
        self.done += n
        tenth = self.done * 10 // max(1, self.total)
        if self.tty or tenth != self._shown or self.done == self.total:
            self._shown = tenth
            filled = self.done * 30 // max(1, self.total)
            rate = self.done / max(1e-9, time.perf_counter() - self.start)
            start, end = ("\r" if self.tty else ""), ("" if self.tty and self.done < self.total else "\n")
            self.stream.write(f"{start}{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                              f"{self.done}/{self.total} {rate:.1f} rows/s{end}")
            self.stream.flush()


async def collect(engine: Engine, rows: Sequence[Row], *, concurrency: int = 4,
                  progress: Progress | None = None) -> list[Labelled]:
    """Read every row once with the gate off; one `Labelled` per question with a gold option."""
    model = CanvasDecisionModel(engine=engine, policy=GATE_OFF)
    slots = asyncio.Semaphore(max(1, concurrency))
    specs = _check(rows)

    async def one(row: Row, spec: Mapping[str, QuestionSpec]) -> list[Labelled]:
        async with slots:
            resp = await model.adecide(row.state, row.questions)
        if progress is not None:
            progress.update()
        out = []
        for qid, value in row.gold.items():
            canvas = resp.reads[qid].canvas_probabilities or {}
            out.append(Labelled(question_id=qid, probabilities=tuple(canvas[o] for o in spec[qid].options),
                                gold=_gold_index(spec[qid], value)))
        return out

    batches = await asyncio.gather(*(one(r, s) for r, s in zip(rows, specs, strict=True)))
    return [x for b in batches for x in b]


def labelled_from_spans(spans: Sequence[SpanRecord]) -> list[Labelled]:
    """Escalated questions in decide spans as labelled rows (the escalation's answer is gold).

    The recorded canvas distribution is at the policy's temperature; it is mapped back
    to temperature 1. Re-read questions contribute their mean distribution.
    """
    out = []
    for s in spans:
        if not s.name.startswith("decide "):
            continue
        for qid, f in decision_figures(s.attributes).items():
            options, probs, answer = f.get("options"), f.get("canvas_probabilities"), f.get("answer")
            if f.get("path") != "escalated" or not options or not probs or answer not in options:
                continue
            t = float(f.get("temperature") or 1.0)
            raw = cm.tempered([float(p) for p in probs], 1.0 / t) if t != 1.0 else tuple(float(p) for p in probs)
            out.append(Labelled(question_id=qid, probabilities=tuple(raw), gold=list(options).index(answer)))
    return out


# -- plots --------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _held_out(cal: cm.Calibration) -> dict[str, list[Labelled]]:
    """Each question's check split (all its rows when it was too small to split)."""
    return {q: (check or fit) for q, (fit, check) in cal.samples.items()}


def plot_reliability(cal: cm.Calibration, path: Path, subtitle: str) -> Path:
    """Reliability diagram of the held-out rows, before and after temperature scaling."""
    plt = _pyplot()
    held = _held_out(cal)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, after in zip(axes, (False, True), strict=True):
        conf, ok = [], []
        for q, rows in held.items():
            t = cal.policy.for_question(q).temperature if after else 1.0
            c, k, _ = cm.scores(rows, t)
            conf += c
            ok += k
        bins = cm.reliability(conf, ok)
        width = 1 / len(bins)
        filled = [b for b in bins if b.count]
        ax.bar([b.low for b in filled], [b.accuracy for b in filled], width=width, align="edge",
               color="#2563eb", edgecolor="white", label="accuracy")
        ax.bar([b.low for b in filled], [b.confidence - b.accuracy for b in filled],
               bottom=[b.accuracy for b in filled], width=width, align="edge", color="#f87171", alpha=0.45,
               edgecolor="#dc2626", label="gap to confidence")
        for b in filled:
            ax.text(b.low + width / 2, min(0.97, max(b.accuracy, b.confidence) + 0.02), str(b.count),
                    ha="center", fontsize=7, color="#475569")
        ax.plot([0, 1], [0, 1], "--", color="#334155", lw=1, label="perfect calibration")
        e = cm.expected_calibration_error(conf, ok) if conf else math.nan
        stage = "after" if after else "before"
        ax.set_title(f"{stage} temperature scaling · ECE {e:.3f} (n={len(conf)})", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence (probability of the canvas answer)")
        ax.grid(alpha=0.25)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Reliability on held-out rows · {subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_escalation(cal: cm.Calibration, path: Path, subtitle: str) -> Path:
    """Accuracy against escalation rate per question (held-out rows, calibrated temperature)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (q, rows) in enumerate(sorted(_held_out(cal).items())):
        if not rows:
            continue
        color = colors[i % len(colors)]
        pts = cm.escalation_curve(rows, cal.policy.for_question(q).temperature)
        canvas = [(p.escalation_rate, p.canvas_accuracy) for p in pts if p.canvas_accuracy is not None]
        ax.plot([x for x, _ in canvas], [y for _, y in canvas], "-o", ms=3, color=color,
                label=f"{q}: accuracy of canvas answers")
        ax.plot([p.escalation_rate for p in pts], [p.routed_accuracy for p in pts], "--", color=color, alpha=0.6,
                label=f"{q}: overall if escalations were right")
        qc = cal.questions[q]
        if qc.check_escalation_rate is not None and qc.check_canvas_accuracy is not None:
            ax.plot([qc.check_escalation_rate], [qc.check_canvas_accuracy], "*", ms=13, color=color,
                    markeredgecolor="black", label=f"{q}: chosen threshold")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("escalation rate (share of questions above the entropy threshold)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.25)
    ax.legend(fontsize=7.5, loc="lower right")
    ax.set_title(f"Accuracy vs escalation rate (held-out rows)\n{subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- CLI ----------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", nargs="?", help="JSONL of {state, questions, gold}, or a BIG-bench task.json / folder")
    parser.add_argument("-o", "--output", required=True, help="policy file to write (JSON)")
    parser.add_argument("--from-traces", nargs="+", metavar="TRACES",
                        help="use escalated questions in exported spans as labelled rows instead of DATA")
    parser.add_argument("--limit", type=int, help="read at most N rows (a seeded random sample)")
    parser.add_argument("--engine", choices=["embedded"], default="embedded",
                        help="in-process engine when no --engine-url is given (embedded: SmolLM2-135M, near chance)")
    parser.add_argument("--engine-url", action="append", metavar="URL",
                        help="vLLM server(s) serving DiffusionGemma (repeat for replicas); overrides --engine")
    parser.add_argument("--served-model", help="model name on the vLLM server (default: the first served)")
    parser.add_argument("--api-key-env", default="CANVASROUTE_API_KEY", metavar="VAR",
                        help="environment variable holding the vLLM API key (default CANVASROUTE_API_KEY)")
    targets = parser.add_mutually_exclusive_group()
    targets.add_argument("--target-accuracy", type=float,
                         help="threshold so canvas-answered questions reach this accuracy")
    targets.add_argument("--target-escalation", type=float, help="threshold so this share of questions escalates")
    parser.add_argument("--holdout", type=float, default=0.5, help="share of rows that checks the fit (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and splitting (default 0)")
    parser.add_argument("--rereads", type=int, default=0,
                        help="re-reads in the written policy (default 0: thresholds are measured on single reads)")
    parser.add_argument("--concurrency", type=int, default=4, help="decisions in flight (default 4)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def _engine(args: argparse.Namespace) -> Engine:
    if args.engine_url:
        return VLLMServerEngine(args.engine_url, model=args.served_model, api_key=os.environ.get(args.api_key_env))
    from engine import embedded_engine

    return embedded_engine()


async def _read(args: argparse.Namespace) -> tuple[list[Labelled], str, str]:
    rows = load_rows(args.data, limit=args.limit, seed=args.seed)
    engine = _engine(args)
    try:
        info = await engine.info()
        samples = await collect(engine, rows, concurrency=args.concurrency,
                                progress=Progress(len(rows), f"calibrate {info.model}"))
    finally:
        await engine.aclose()
    return samples, info.model, info.provider


def run(args: argparse.Namespace) -> int:
    if (args.data is None) == (args.from_traces is None):
        print("canvasroute calibrate: give DATA or --from-traces TRACES (one of them)", file=sys.stderr)
        return 2
    try:
        if args.from_traces:
            spans = read_spans(*args.from_traces)
            samples = labelled_from_spans(spans)
            models = sorted({s.name[len("decide "):] for s in spans if s.name.startswith("decide ")})
            model, provider, source = ", ".join(models) or "unknown", "", " ".join(args.from_traces)
            if not samples:
                raise CalibrationError("the traces hold no escalated question with a canvas distribution",
                                       hint="export spans from a model with escalate_to set")
        else:
            samples, model, provider = asyncio.run(_read(args))
            source = str(args.data)
        cal = calibrate(samples, base=GatePolicy(rereads=args.rereads), holdout=args.holdout, seed=args.seed,
                        target_accuracy=args.target_accuracy, target_escalation=args.target_escalation)
    except (CanvasRouteError, TraceFileError, ValueError) as exc:
        print(f"canvasroute calibrate: {exc}", file=sys.stderr)
        return 2
    chance = near_chance(model, provider)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": model, "provider": provider, "source": source, "rows": len(samples),
            "near_chance": chance, "holdout": args.holdout, "seed": args.seed,
            "target_accuracy": args.target_accuracy, "target_escalation": args.target_escalation,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "questions": cal.summary()}
    subtitle = f"{model}" + (" (near chance: not the product's accuracy)" if chance else "")
    if not args.no_plots:
        try:
            plots = [plot_reliability(cal, out.with_suffix(".reliability.png"), subtitle),
                     plot_escalation(cal, out.with_suffix(".escalation.png"), subtitle)]
            meta["plots"] = [p.name for p in plots]
        except ImportError:
            print("canvasroute calibrate: matplotlib is not installed; skipping plots", file=sys.stderr)
    save_policy(out, cal.policy, meta)
    _print_summary(cal, model, chance, out, meta.get("plots", []))
    return 0


def _print_summary(cal: cm.Calibration, model: str, chance: str | None, out: Path, plots: Sequence[str]) -> None:
    print(f"model {model}" + (f"  ** {chance}: these figures are not the product's **" if chance else ""))
    print(f"{'question':<16}{'rows':>6}{'T':>8}{'kept':>6}{'acc':>7}{'ECE before':>12}{'ECE after':>11}"
          f"{'threshold':>11}{'escalate':>10}")
    for q, c in cal.questions.items():
        t = c.temperature
        thr = cal.policy.for_question(q).max_normalized_entropy
        rate = f"{c.check_escalation_rate:.0%}" if c.check_escalation_rate is not None else "-"
        print(f"{q:<16}{c.rows:>6}{(t.fitted if t else 1.0):>8.3f}{('yes' if t and t.accepted else 'no'):>6}"
              f"{c.accuracy:>7.1%}{c.ece_before:>12.3f}{c.ece_after:>11.3f}"
              f"{(f'{thr:.3f}' if thr is not None else '-'):>11}{rate:>10}")
    print(f"wrote {out}" + "".join(f", {out.parent / p}" for p in plots))
