"""Calibration plots: a reliability diagram and an accuracy-vs-escalation curve (matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from canvasroute.router import Labelled
from canvasroute.router import calibration as cm

__all__ = ["measured_curve", "plot_escalation", "plot_reliability"]



def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (`ExtraMissing` without the `[plots]` extra)."""
    from canvasroute.engine._extras import require_extra

    require_extra("plots", "plotting")
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


def measured_curve(rows: Sequence[Labelled], temperature: float,
                   target_ok: Mapping[int, bool]) -> list[tuple[float, float]]:
    """`(escalation rate, accuracy)` with escalations answered as the target really did
    (`target_ok` by `id(sample)`), for every distinct threshold, escalate-all first."""
    _, ok, ent = cm.scores(rows, temperature)
    ranked = sorted(zip(ent, ok, [target_ok[id(r)] for r in rows], strict=True), key=lambda r: r[0])
    n = len(ranked)
    points = [(1.0, sum(t for _, _, t in ranked) / n)]
    canvas_right = 0
    for k, (e, good, _) in enumerate(ranked, 1):
        canvas_right += good
        if k < n and ranked[k][0] == e:
            continue  # ties escalate together
        points.append((1.0 - k / n, (canvas_right + sum(t for _, _, t in ranked[k:])) / n))
    return points


def plot_escalation(cal: cm.Calibration, path: Path, subtitle: str,
                    target_ok: Mapping[int, bool] | None = None, target: str = "") -> Path:
    """Accuracy against escalation rate per question (held-out rows, calibrated temperature).

    With `target_ok` (whether the escalation target alone answers each sample right, by
    `id(sample)`) the overall curve is measured; else it is the bound "if escalations
    were right"."""
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
        if target_ok is not None:
            measured = measured_curve(rows, cal.policy.for_question(q).temperature, target_ok)
            ax.plot([x for x, _ in measured], [y for _, y in measured], "--", color=color, alpha=0.8,
                    label=f"{q}: overall, escalations answered by {target or 'the target'} (measured)")
        else:
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
