"""Evaluation: `canvasroute eval` measures canvas only, the escalation target alone and the cascade.

- `measure`: the three arms over labelled rows (`evaluate`).
- `metrics`: AUROC, risk-coverage, the measured threshold sweep.
- `report`: the figures as JSON; `plots`: the risk-coverage plot.
- `target`: the escalation target from command-line options; `ar_server`: an
  OpenAI-compatible AR server on a causal LM (the embedded SmolLM2 for offline runs).
"""

from .measure import Arm, Evaluation, evaluate, gate_off
from .metrics import Item, SweepPoint, auroc, mix_accuracy, risk_coverage, sweep
from .report import figures

__all__ = ["Arm", "Evaluation", "Item", "SweepPoint", "auroc", "evaluate", "figures", "gate_off", "mix_accuracy",
           "risk_coverage", "sweep"]
