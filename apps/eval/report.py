"""The figures of one evaluation as a JSON-able dict (what `--json` prints)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from canvasroute.router import GatePolicy

from .measure import Evaluation
from .metrics import auroc, risk_coverage, sweep

__all__ = ["figures"]


def figures(ev: Evaluation, policy: GatePolicy, *, model: str, provider: str, near_chance: str | None,
            thresholds: list[float] | None = None) -> dict[str, Any]:
    """Accuracy and cost per arm, AUROC of normalized entropy for canvas errors, risk-coverage,
    and (with a target) the measured threshold sweep."""
    items = ev.items
    n = len(items)
    arms: dict[str, Any] = {"canvas": ev.canvas.summary(sum(it.canvas_ok for it in items), n)}
    if ev.target is not None:
        arms["target"] = ev.target.summary(sum(it.target_ok for it in items), n)
    if ev.cascade is not None:
        arms["cascade"] = ev.cascade.summary(sum(it.cascade_answer == it.gold for it in items), n)
    out: dict[str, Any] = {
        "model": model, "provider": provider, "target": ev.target_name, "near_chance": near_chance,
        "note": (f"{near_chance}: these figures show the machinery, not the product" if near_chance else None),
        "rows": len({it.row for it in items}), "questions": n,
        "policy": {**_gate(policy), "per_question": {q: _gate(p) for q, p in sorted(policy.per_question.items())}},
        "arms": arms,
        "auroc_normalized_entropy": auroc([it.normalized_entropy for it in items], [not it.canvas_ok for it in items]),
        "risk_coverage": [{"coverage": c, "risk": r} for c, r in risk_coverage(items)],
    }
    if ev.target is not None:
        out["sweep"] = [asdict(p) for p in sweep(items, thresholds)]
        out["sweep_note"] = ("single gate-off reads at the policy's temperature; escalated questions take the "
                             "target's measured answer on its own (no canvas hint, no re-reads)")
    return out


def _gate(policy: GatePolicy) -> dict[str, Any]:
    """What the figures depend on in one gate: its threshold, re-reads and temperature."""
    return {"max_normalized_entropy": policy.max_normalized_entropy, "rereads": policy.rereads,
            "temperature": policy.temperature}
