"""`canvasroute demo`: the support-triage agent, shipped with the package.

- `triage`: the graph (team, urgency and severity in one read, then route).
- `model`: `make_model`, a vLLM server or the embedded CPU model.
- `command`: the CLI command (prints every decision, writes a JSONL trace).
"""
