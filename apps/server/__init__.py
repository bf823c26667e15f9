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

The server needs the `[serve]` extra (starlette, uvicorn, prometheus-client): without it, the names
below raise `ExtraMissing` naming `pip install 'canvasroute[serve]'`, and `canvasroute serve --help`
still prints its help (the command module, `cli`, imports none of them before it runs).
"""

from typing import TYPE_CHECKING, Any

from .limits import ConnectionLimits, Limits

if TYPE_CHECKING:
    from .app import JEV_ALIASES, create_app
    from .serving import run_in_thread

__all__ = ["JEV_ALIASES", "ConnectionLimits", "Limits", "create_app", "run_in_thread"]

_HOME = {"JEV_ALIASES": ".app", "create_app": ".app", "run_in_thread": ".serving"}


def __getattr__(name: str) -> Any:
    """The server's names load on first use, once the `[serve]` extra is there."""
    if name not in _HOME:
        raise AttributeError(f"module 'canvasroute.apps.server' has no attribute {name!r}")
    from importlib import import_module

    from canvasroute.engine._extras import require_extra

    require_extra("serve", f"canvasroute.apps.server.{name}")
    value = getattr(import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value
