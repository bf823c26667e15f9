"""Benchmarks behind `canvasroute bench` (see `command` for the sections and BENCHMARKS.md).

- `common`: tickets, node shapes, the instant engine and the section/recorder types.
- `overhead`, `client`, `packing`, `canvas_vs_ar`: one module per section.
- `command`: the CLI command.
"""
