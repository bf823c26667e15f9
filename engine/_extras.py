"""The optional extras (pyproject's `[project.optional-dependencies]`) and the one check that names a missing one.

Every command and public name that needs an extra calls `require_extra` before it imports the
extra's packages, so a missing one is an `ExtraMissing` naming the pip command, never a raw
`ModuleNotFoundError` from deep inside an import. The check only looks the modules up
(`importlib.util.find_spec`): it imports none of them.

Example:
    ```python
    require_extra("serve", "canvasroute serve")   # ExtraMissing: ... pip install 'canvasroute[serve]'
    ```
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from .errors import ExtraMissing

__all__ = ["EXTRAS", "require_extra"]

EXTRAS: dict[str, dict[str, str]] = {
    "local": {"torch": "torch", "transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate",
              "numpy": "numpy"},
    "vllm": {"vllm": "vllm"},
    "otel": {"opentelemetry-sdk": "opentelemetry.sdk",
             "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http"},
    "openai": {"langchain-openai": "langchain_openai"},
    "serve": {"starlette": "starlette", "uvicorn": "uvicorn", "prometheus-client": "prometheus_client"},
    "plots": {"matplotlib": "matplotlib"},
}
"""Extra -> {distribution, as pyproject names it: the module it installs} (tests/test_package.py holds
this to pyproject.toml)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing (or a half-imported one)
        return False


def require_extra(extra: str, needed_by: str, modules: Sequence[str] | None = None, *, note: str = "") -> None:
    """Raise `ExtraMissing` unless the modules of `extra` (all of them, or those named) can be imported.

    `needed_by` says what needs them, as a user would type it (`canvasroute serve`,
    `TransformersEngine`); it starts the message, and `note` (another way, say) ends it."""
    for dist, module in EXTRAS[extra].items():
        if (modules is None or module in modules) and not _installed(module):
            raise ExtraMissing(f"{needed_by} needs {dist} (canvasroute's [{extra}] extra), which is not installed"
                               + (f"; {note}" if note else ""), extra=extra, name=module)
