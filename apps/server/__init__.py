"""The decision server: `POST /v1/systemone` (the Jev wire) and `POST /v1/decisions` (OpenAI
Decisions) over one gated decision model.

`create_app` builds the ASGI app, `Limits` bounds what one request may carry, and
`canvasroute.apps.server.cli` is `canvasroute serve`. Modules: `app` (routes, admission, timeouts:
what both wires share), `wires` (what each wire reads, asks and answers), `decisions` (the OpenAI
Decisions wire: parse, render, errors), `body` (reading the body), `parse` (the Jev wire's
validation and bounds), `wire` (error answers),
`gate` (load control, the shutdown drain), `outcomes` (the `OutcomePolicy` actions a server can
honour), `openapi` (the API description), `serving` (uvicorn
with `ConnectionLimits`: connection cap, head timeout, bounded shutdown), `metrics`
(Prometheus at `/metrics`), `logs` (text or JSON lines with the request id).
"""

from .app import JEV_ALIASES, create_app
from .limits import Limits
from .serving import ConnectionLimits, run_in_thread

__all__ = ["JEV_ALIASES", "ConnectionLimits", "Limits", "create_app", "run_in_thread"]
