"""The decision server: `POST /v1/systemone` (the Jev wire) over a gated decision model.

`create_app` builds the ASGI app, `Limits` bounds what one request may carry, and
`canvasroute.apps.server.cli` is `canvasroute serve`. Modules: `app` (routes, admission, timeouts),
`body` (reading the body), `parse` (validation and bounds), `wire` (error answers),
`gate` (load control), `openapi` (the API description).
"""

from .app import JEV_ALIASES, create_app, run_in_thread
from .limits import Limits

__all__ = ["JEV_ALIASES", "Limits", "create_app", "run_in_thread"]
