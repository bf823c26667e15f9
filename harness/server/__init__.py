"""The decision server: `POST /v1/systemone` (the Jev wire), and `canvasroute serve` (`harness.server.cli`)."""

from .app import create_app, run_in_thread

__all__ = ["create_app", "run_in_thread"]
