"""The applications: programs built on the library, above the LangGraph layer.

They use `canvasroute` as a user would; nothing in `engine`, `router` or `harness` imports them.

```
cli            canvasroute demo | bench | calibrate | eval | dashboard | serve
demo/          `demo`: the support-triage graph and its command (the main job)
server/        `serve`: gated decisions over HTTP (POST /v1/systemone)
bench/         `bench`: overhead, client throughput, packing, canvas vs AR, in-process
eval/          `eval`: canvas alone vs escalation target vs the gated cascade
calibration/   `calibrate`: labelled rows read with the gate off, the fit, plots
observability/ trace files read back, the dashboard (report, charts, page)
_console       progress and tables on a terminal, plain text off one
_engine_options  the engine options the offline commands share
```
"""
