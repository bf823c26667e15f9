#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent), then runs the whole suite.
# The suite starts its own real vLLM CPU servers; set CANVASROUTE_VLLM_URL (the DiffusionGemma one) and
# CANVASROUTE_CAUSAL_VLLM_URL (SmolLM2 as a causal model) to reuse running ones.
#   scripts/test.sh [PYTEST ARGS...]          everything (what CI runs)
#   scripts/test.sh --fast [PYTEST ARGS...]   the inner loop: no vLLM server, no PostgreSQL, Phoenix,
#                                             `langgraph dev` or Chromium, no wheel build, no test over
#                                             ~20 s; the vLLM venv and Chromium are not provisioned
#                                             (-m "not vllm and not services and not slow")
# Either way pytest reports its 25 slowest tests and the time per marker group, and the last line
# says how long the whole command took.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$SECONDS
fast=0
if [ "${1:-}" = --fast ]; then
  fast=1
  shift
fi
bash scripts/bootstrap.sh dev
if [ "$fast" = 0 ]; then
  bash scripts/vllm_cpu.sh provision
  # headless Chromium renders the dashboard in its test (Debian package; needs root)
  if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "could not install chromium; the dashboard browser test will say so" >&2
  fi
  select=()
else
  select=(-m "not vllm and not services and not slow")
fi
status=0
.venv/bin/python -m pytest -q -rs --durations=25 "${select[@]}" "$@" || status=$?
echo "scripts/test.sh$([ "$fast" = 1 ] && echo " --fast"): $((SECONDS - start)) s in all (exit $status)"
exit "$status"
