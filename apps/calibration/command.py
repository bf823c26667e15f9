"""`canvasroute calibrate DATA -o policy.json`: temperatures and thresholds from labelled decisions.

DATA is JSONL of `{"state": ..., "questions": {id: question}, "gold": {id: option}}`, or
a BIG-bench `task.json` (or its folder): intent_recognition and emojis_emotion_prediction
become a Choice over the `target_scores` keys, strategyqa a Noul; the gold option is the
top-scored key. `--from-traces TRACES` uses escalated questions in exported spans instead
(canvas distribution + the escalation's answer as the label; these rows are the uncertain
ones only, so the fit describes that region).

The canvas is read with the gate off (no re-reads, no escalation); then, per question,
`canvasroute.router.calibrate` fits a temperature on one split and keeps it only if the other split's
NLL and ECE do not get worse, and picks a `max_normalized_entropy` for `--target-accuracy`
or `--target-escalation`. Writes the policy file (`canvasroute.router.load_policy` reads it), a
reliability diagram and an accuracy-vs-escalation curve (PNG, next to the policy). With
an escalation target (`--escalate-url/--escalate-model`, `--escalate-systemone`,
`--escalate-embedded`) the target answers every row on its own and the curve's overall
accuracy is measured with its answers, instead of the bound "if escalations were right".

`--max-error A --confidence C` certifies each question's threshold instead
(`canvasroute.router.calibration.certify_threshold`: fixed-sequence testing over the thresholds
strict to loose, the exact binomial p-value, every row): with probability at least C over the
rows, the error rate of the answers its gate passes is at most A. `--joint` makes that hold for
all the rows' questions at once. A question whose rows cannot certify A gets what `--uncertified`
says: `looser` (default) the error its rows do prove, stated beside A; `threshold` the gate's own
threshold (`--fallback-threshold`), uncertified; `escalate` a gate that passes nothing. The
summary says which, and the policy file records each gate's `Certificate`. `--from-traces`
cannot certify: traces hold only the escalated questions, labelled by the target, so no bound
on the answers the gate passed could rest on them.

Example:
    ```bash
    canvasroute calibrate data/bigbench/intent_recognition --limit 40 \\
        --engine-url http://127.0.0.1:8000 --target-escalation 0.3 -o policy.json
    canvasroute calibrate rows.jsonl --engine-url http://127.0.0.1:8000 \\
        --max-error 0.05 --confidence 0.9 -o certified.json
    ```
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from canvasroute.engine import CalibrationError, CanvasRouteError, ExtraMissing, TraceFileError
from canvasroute.router import (
    CanvasDecisionModel,
    Escalation,
    GatePolicy,
    Labelled,
    calibrate,
    save_policy,
    target_name,
)
from canvasroute.router import calibration as cm

from .._console import plain_table, print_table, progress
from .._engine_options import add_engine_options, open_engine
from ..observability.report import near_chance
from ..observability.traces import read_spans
from .plots import plot_escalation, plot_reliability
from .reading import collect, labelled_from_spans
from .rows import load_rows

__all__ = ["COLUMNS", "configure", "run"]

COLUMNS = {
    "question": "the question id",
    "rows": "its labelled rows, split into fit and check rows by --holdout (--max-error tests every row)",
    "T": "the temperature fitted on the fit rows: softmax(log p / T), T > 1 softens the canvas's distribution, "
         "T < 1 sharpens it",
    "kept": "yes: the check rows confirmed T (neither NLL nor ECE got worse) and the policy uses it; no: T = 1",
    "acc": "canvas accuracy over all its rows: the top option is the gold one (T never changes it)",
    "ECE before": "expected calibration error on the check rows at T = 1 (0: confidence matches accuracy)",
    "ECE after": "the same at the policy's T",
    "threshold": "the policy's max_normalized_entropy: an answer whose H/lnK is above it escalates (-: none set)",
    "escalate": "share of the check rows (with --max-error, of every row) that threshold escalates",
    "certified": "--max-error: yes, the rows certify the bound asked; at X%: they certify only the looser X% "
                 "(--uncertified looser); NO: uncertified, the gate keeps its own threshold or passes nothing "
                 "(--uncertified threshold | escalate)",
    "errors/passed": "wrong answers among the rows the certified gate passes",
    "bound": "the bound asked for: the passed answers' error rate, with probability C over the labelled rows",
}
"""The summary table's columns, in words: printed under the table and in `--help`."""


def _legend(columns: Sequence[str]) -> list[str]:
    """One entry per column, its words wrapped under one another."""
    width = max(len(c) for c in columns)
    return [line for c in columns for line in textwrap.wrap(
        COLUMNS[c], 100, initial_indent=f"  {c:<{width}}  ", subsequent_indent=" " * (width + 4))]


# -- CLI ----------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(["The summary table's columns:", *_legend(list(COLUMNS)), "", *textwrap.wrap(
        "A question whose rows cannot meet the target asked for is named on stderr ('target not met'): why, and "
        "the labelled rows it would need or what else could. The policy file is written either way (a gate no "
        "threshold or certificate could meet escalates every answer), and the exit status is 0.", 100)])
    parser.add_argument("data", nargs="?", help="JSONL of {state, questions, gold}, or a BIG-bench task.json / folder")
    parser.add_argument("-o", "--output", required=True, help="policy file to write (JSON)")
    parser.add_argument("--from-traces", nargs="+", metavar="TRACES",
                        help="use escalated questions in exported spans as labelled rows instead of DATA")
    parser.add_argument("--limit", type=int, help="read at most N rows (a seeded random sample)")
    add_engine_options(parser)
    targets = parser.add_mutually_exclusive_group()
    targets.add_argument("--target-accuracy", type=float,
                         help="threshold so canvas-answered questions reach this accuracy")
    targets.add_argument("--target-escalation", type=float, help="threshold so this share of questions escalates")
    targets.add_argument("--max-error", type=float,
                         help="certify thresholds: with probability --confidence over the rows, the answers the "
                              "gate passes err at most this often (fixed-sequence testing on every row)")
    parser.add_argument("--confidence", type=float,
                        help="with --max-error: the probability the bound holds (default 0.9), per question")
    parser.add_argument("--joint", action="store_true",
                        help="with --max-error: the bound holds for all the questions at once (Bonferroni)")
    parser.add_argument("--uncertified", choices=cm.UNCERTIFIED,
                        help="with --max-error, a question its rows cannot certify gets: looser (default: the "
                             "error its rows do prove, stated), threshold (--fallback-threshold, uncertified) or "
                             "escalate (passes nothing)")
    parser.add_argument("--fallback-threshold", type=float,
                        help="with --uncertified threshold: the H/lnK threshold an uncertified gate keeps "
                             "(default 0.5)")
    parser.add_argument("--holdout", type=float, default=0.5, help="share of rows that checks the fit (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and splitting (default 0)")
    parser.add_argument("--rereads", type=int, default=0,
                        help="re-reads in the written policy (default 0: thresholds are measured on single reads)")
    parser.add_argument("--concurrency", type=int, default=4, help="decisions in flight (default 4)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    from ..eval.target import add_target_options

    add_target_options(parser)  # with a target, the escalation plot's overall curve is measured



async def _read(args: argparse.Namespace,
                target: Any = None) -> tuple[list[Labelled], str, str, dict[int, bool] | None]:
    rows = load_rows(args.data, limit=args.limit, seed=args.seed)
    engine = open_engine(args)
    measured = None
    try:
        info = await engine.info()
        with progress(len(rows), f"calibrate {info.model}") as advance:
            samples = await collect(engine, rows, concurrency=args.concurrency, progress=advance)
        if target is not None:
            from ..eval.measure import target_correct

            model = CanvasDecisionModel(engine=engine, escalate_to=Escalation(target, timeout=args.escalate_timeout))
            ok = await target_correct(model, rows, concurrency=args.concurrency)
            measured = {id(s): good for s, good in zip(samples, ok, strict=True)}
    finally:
        await engine.aclose()
    return samples, info.model, info.provider, measured


def run(args: argparse.Namespace) -> int:
    if (args.data is None) == (args.from_traces is None):
        print("canvasroute calibrate: give DATA or --from-traces TRACES (one of them)", file=sys.stderr)
        return 2
    if args.confidence is not None and args.max_error is None:
        print("canvasroute calibrate: --confidence needs --max-error (the bound it is the confidence of)",
              file=sys.stderr)
        return 2
    needs = [flag for flag, given in (("--joint", args.joint), ("--uncertified", args.uncertified is not None),
                                        ("--fallback-threshold", args.fallback_threshold is not None)) if given]
    if needs and args.max_error is None:
        print(f"canvasroute calibrate: {', '.join(needs)} needs --max-error (the bound it is about)", file=sys.stderr)
        return 2
    if args.fallback_threshold is not None and args.uncertified != "threshold":
        print("canvasroute calibrate: --fallback-threshold is the gate --uncertified threshold keeps (give both)",
              file=sys.stderr)
        return 2
    if args.max_error is not None and args.from_traces:
        print("canvasroute calibrate: --max-error cannot certify from --from-traces: traces hold only the questions "
              "the gate escalated (the uncertain region, labelled by the target), so a bound on the answers it "
              "passes would rest on rows it never sampled. Certify from labelled rows (DATA), or audit a sample of "
              "the passed answers live", file=sys.stderr)
        return 2
    if args.max_error is not None and args.rereads:
        print("canvasroute calibrate: --max-error certifies single reads; re-reads would pass answers the "
              "certificate never tested (drop --rereads)", file=sys.stderr)
        return 2
    confidence = 0.9 if args.confidence is None else args.confidence
    measured, target_label = None, ""
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
            from ..eval.target import open_target

            with open_target(args) as target:
                samples, model, provider, measured = asyncio.run(_read(args, target))
                target_label = target_name(target) if target is not None else ""
            source = str(args.data)
        base = GatePolicy(rereads=args.rereads) if args.fallback_threshold is None else GatePolicy(
            rereads=args.rereads, max_normalized_entropy=args.fallback_threshold)
        cal = calibrate(samples, base=base, holdout=args.holdout, seed=args.seed,
                        target_accuracy=args.target_accuracy, target_escalation=args.target_escalation,
                        max_error=args.max_error, confidence=confidence, uncertified=args.uncertified or "looser",
                        joint=args.joint)
    except (CanvasRouteError, TraceFileError, ValueError) as exc:
        print(f"canvasroute calibrate: {exc}", file=sys.stderr)
        return 2
    chance = near_chance(model, provider)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": model, "provider": provider, "source": source, "rows": len(samples),
            "near_chance": chance, "holdout": args.holdout, "seed": args.seed,
            "target_accuracy": args.target_accuracy, "target_escalation": args.target_escalation,
            "max_error": args.max_error, "confidence": confidence if args.max_error is not None else None,
            "joint": args.joint, "uncertified": (args.uncertified or "looser") if args.max_error is not None else None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "questions": cal.summary()}
    subtitle = f"{model}" + (" (near chance: not the product's accuracy)" if chance else "")
    if not args.no_plots:
        try:
            plots = [plot_reliability(cal, out.with_suffix(".reliability.png"), subtitle),
                     plot_escalation(cal, out.with_suffix(".escalation.png"), subtitle, measured, target_label)]
            meta["plots"] = [p.name for p in plots]
        except ExtraMissing as exc:
            print(f"canvasroute calibrate: {exc.message}; the policy is written without the plots (--no-plots "
                  "skips them quietly)\n"
                  f"  hint: {exc.hint}", file=sys.stderr)
    save_policy(out, cal.policy, meta)
    _print_summary(cal, model, chance, out, meta.get("plots", []))
    if args.max_error is not None:
        _print_guarantees(cal, chance)
    targeted = any(t is not None for t in (args.target_accuracy, args.target_escalation, args.max_error))
    for line in _shortfalls(cal, args):
        print(f"canvasroute calibrate: {'target not met' if targeted else 'not calibrated'}: {line}", file=sys.stderr)
    return 0


def _print_summary(cal: cm.Calibration, model: str, chance: str | None, out: Path, plots: Sequence[str]) -> None:
    certifying = any(c.risk is not None for c in cal.questions.values())
    columns = ["question", "rows", "T", "kept", "acc", "ECE before", "ECE after", "threshold", "escalate"]
    if certifying:
        columns += ["certified", "errors/passed", "bound"]
    rows = []
    for q, c in cal.questions.items():
        t = c.temperature
        thr = cal.policy.for_question(q).max_normalized_entropy
        row = [q, str(c.rows), f"{t.fitted if t else 1.0:.3f}", "yes" if t and t.accepted else "no",
               f"{c.accuracy:.1%}", f"{c.ece_before:.3f}", f"{c.ece_after:.3f}",
               f"{thr:.3f}" if thr is not None else "-",
               f"{c.check_escalation_rate:.0%}" if c.check_escalation_rate is not None else "-"]
        if (risk := c.risk) is not None:
            verdict = {"none": "yes", "looser": f"at {_percent(risk.max_error)}"}.get(risk.fallback, "NO")
            row += [verdict, f"{risk.errors}/{risk.passed}" if risk.certified else "-",
                    f"error <= {_percent(risk.asked)} at {_percent(risk.confidence)}"]
        rows.append(row)
    title = f"model {model}" + (f"  ** {chance}: these figures are not the product's **" if chance else "")
    print_table(title, columns, rows, plain="\n".join([title, *plain_table(columns, rows, indent="")]))
    print("\n".join(["columns:", *_legend(columns)]))
    print(f"wrote {out}" + "".join(f", {out.parent / p}" for p in plots))


def _shortfalls(cal: cm.Calibration, args: argparse.Namespace) -> list[str]:
    """Each question whose rows cannot meet the target asked for, in words: why, and how many rows
    (or what else) would. Without a target, only the questions too small to fit a temperature."""
    asked = (f"--target-accuracy {args.target_accuracy:g}" if args.target_accuracy is not None
             else f"--target-escalation {args.target_escalation:g}" if args.target_escalation is not None else "")
    out = []
    for q, c in cal.questions.items():
        if (risk := c.risk) is not None:
            words = f"error <= {_percent(risk.asked)} at {_percent(risk.confidence)}"
            if risk.fallback == "none":
                continue
            looser = f"until then its gate states the looser bound its rows prove ({_percent(risk.max_error)})"
            until = {"looser": looser,
                     "threshold": "until then its gate keeps its own threshold, uncertified",
                     "escalate": "every answer to it escalates until then"}[risk.fallback]
            if risk.rows < risk.rows_needed:
                out.append(f"{q}: not certified: {words} needs at least {risk.rows_needed} rows its gate passes, all "
                           f"right; it has {risk.rows} labelled rows; give it at least {risk.rows_needed} ({until})")
            else:
                out.append(f"{q}: not certified ({risk.note}): more rows help only if the canvas errs less often "
                           f"than {_percent(risk.asked)} on the answers it is surest of; else a looser "
                           f"--max-error or a lower --confidence ({until})")
            continue
        if c.temperature is None:
            kept = cal.policy.for_question(q).max_normalized_entropy
            out.append(f"{q}: {c.rows} labelled row{'s' if c.rows != 1 else ''}, fewer than the {cm.MIN_ROWS} a fit "
                       "needs: no temperature is fitted" + (f", and its gate keeps the base threshold (H/lnK <= "
                       f"{kept:g}) rather than one for {asked}" if asked and kept is not None else "")
                       + f"; give it at least {cm.MIN_ROWS} rows")
            continue
        target = args.target_accuracy
        if target is None or c.threshold is None:
            continue
        fit, _ = cal.samples[q]
        if not c.threshold.reachable:
            curve = cm.escalation_curve(fit, c.temperature.temperature)
            best = max((p for p in curve if p.canvas_accuracy is not None),
                       key=lambda p: (p.canvas_accuracy or 0.0, -p.escalation_rate))
            answered = round((1.0 - best.escalation_rate) * len(fit))
            out.append(f"{q}: no threshold reaches accuracy {target:.0%} on its {len(fit)} fit rows (the canvas's "
                       f"best is {best.canvas_accuracy or 0.0:.0%}, answering {answered} of them): its gate escalates "
                       "every answer; lower --target-accuracy, or hold an escalation rate with --target-escalation")
        elif c.check_canvas_accuracy is not None and c.check_canvas_accuracy < target:
            answered = round((1.0 - (c.check_escalation_rate or 0.0)) * c.check_rows)
            instead = (f"; --max-error {1.0 - target:g} could certify a bound instead; it needs at least "
                       f"{cm.rows_needed(1.0 - target, 0.9)} labelled rows (--max-error tests every row)"
                       if target < 1.0 else "")
            out.append(f"{q}: its threshold reaches accuracy {target:.0%} on its {len(fit)} fit rows, but on its "
                       f"{c.check_rows} check rows its {answered} answers were {c.check_canvas_accuracy:.0%} right: "
                       f"the target does not hold on rows it was not fitted on (more rows would tell whether it "
                       f"holds at all){instead}")
    return out


def _print_guarantees(cal: cm.Calibration, chance: str | None) -> None:
    """What each certified gate guarantees, and what it does not, in words."""
    lines = []
    for q, c in cal.questions.items():
        risk = c.risk
        assert risk is not None
        bound, sure, asked = _percent(risk.max_error), _percent(risk.confidence), _percent(risk.asked)
        joint = f" (for all {risk.family} questions at once)" if risk.family > 1 else ""
        more = (f"; more labelled rows would help: at least {risk.rows_needed} (it has {risk.rows})"
                if risk.rows < risk.rows_needed else "")
        if risk.fallback == "none":
            lines.append(f"{q}: certified: with probability at least {sure} over its {risk.rows} rows{joint}, the "
                         f"answers its gate passes (H/lnK <= {risk.threshold:.4g}) are wrong at most {bound} of the "
                         f"time; that escalates {_percent(risk.escalation_rate, 3)} of the rows.")
        elif risk.fallback == "looser":
            lines.append(f"{q}: NOT certified at {asked} ({risk.note}). Certified at the looser error its rows prove "
                         f"instead: with probability at least {sure}{joint}, the answers its gate passes (H/lnK <= "
                         f"{risk.threshold:.4g}) are wrong at most {bound} of the time; that escalates "
                         f"{_percent(risk.escalation_rate, 3)} of the rows{more}.")
        elif risk.fallback == "threshold":
            lines.append(f"{q}: NOT certified ({risk.note}). Its gate keeps its own threshold (H/lnK <= "
                         f"{risk.threshold:.4g}) and claims no bound{more}.")
        else:
            lines.append(f"{q}: NOT certified ({risk.note}). Its gate passes nothing: every answer to {q!r} goes "
                         "where OutcomePolicy.uncertain says (escalated) rather than claim a bound the rows cannot "
                         f"support{more}.")
    unasked = cal.policy.certificate
    if unasked is not None and not unasked.certified:
        lines.append("Questions the rows never asked are not certified either: their gate "
                     + ("passes nothing." if unasked.passes_nothing else "keeps its own threshold and says so."))
    lines += ["Each bound holds for its question alone (--joint: for all of them at once), while live reads are "
              "drawn like the calibration rows (the same model, prompt, engine and traffic); drift breaks it."]
    if chance:
        lines.append(f"** {chance}: a bound certified on it shows the plumbing, not a real model's quality **")
    print("\n".join(lines))


def _percent(x: float, digits: int = 4) -> str:
    return f"{x * 100:.{digits}g}%"
