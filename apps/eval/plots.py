"""`canvasroute eval` plot: risk-coverage of the canvas, and measured accuracy vs escalation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..calibration.plots import _pyplot

__all__ = ["plot_eval"]


def plot_eval(fig_data: dict[str, Any], path: Path, subtitle: str) -> Path:
    """Left: risk (error rate of canvas answers) against coverage, least uncertain first.
    Right (with a target): measured cascade accuracy against escalation rate, the
    "if escalations were right" bound for comparison, and the three arms as points."""
    plt = _pyplot()
    sweep = fig_data.get("sweep")
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 6.5, 4.8), squeeze=False)
    ax = axes[0][0]
    rc = fig_data["risk_coverage"]
    ax.step([p["coverage"] for p in rc], [p["risk"] for p in rc], where="post", color="#2563eb",
            label="canvas answers, least uncertain first")
    au = fig_data.get("auroc_normalized_entropy")
    ax.set_title(f"Risk vs coverage · AUROC(entropy → error) {au:.3f}" if au is not None else "Risk vs coverage",
                 fontsize=10)
    ax.set_xlim(0, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("coverage (share answered from the canvas)")
    ax.set_ylabel("risk (error rate of those answers)")
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    if sweep:
        ax = axes[0][1]
        arms = fig_data["arms"]
        ax.plot([p["escalation_rate"] for p in sweep], [p["accuracy"] for p in sweep], "-o", ms=3, color="#16a34a",
                label=f"measured: target ({fig_data['target']}) answers escalations")
        ax.plot([p["escalation_rate"] for p in sweep], [p["oracle_accuracy"] for p in sweep], "--", color="#94a3b8",
                label="if escalations were right (bound)")
        ax.plot([0], [arms["canvas"]["accuracy"]], "s", ms=8, color="#2563eb", label="canvas only")
        ax.plot([1], [arms["target"]["accuracy"]], "D", ms=8, color="#f59e0b", label="target only")
        casc = arms["cascade"]
        rate = casc["escalations"] / casc["questions"] if casc["questions"] else 0.0
        ax.plot([rate], [casc["accuracy"]], "*", ms=14, color="#dc2626", markeredgecolor="black",
                label="cascade at the policy (re-reads included)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("escalation rate")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.25)
        ax.legend(fontsize=7.5, loc="lower right")
        ax.set_title("Accuracy vs escalation rate (measured)", fontsize=10)
    fig.suptitle(subtitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
