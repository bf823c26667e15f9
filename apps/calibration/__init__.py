"""Calibration: `canvasroute calibrate` reads labelled rows with the gate off and fits a policy.

- `rows`: JSONL rows and BIG-bench multiple-choice tasks as `Row`s.
- `reading`: `collect` reads rows with the gate off; `labelled_from_spans` takes escalated
  questions from exported spans.
- `plots`: reliability diagram and accuracy-vs-escalation curve.
- `command`: the CLI command. The fit itself is `canvasroute.router.calibrate`.
"""

from .plots import plot_escalation, plot_reliability
from .reading import GATE_OFF, collect, labelled_from_spans
from .rows import Row, bigbench_rows, load_rows

__all__ = ["GATE_OFF", "Row", "bigbench_rows", "collect", "labelled_from_spans", "load_rows", "plot_escalation",
           "plot_reliability"]
