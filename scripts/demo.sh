#!/usr/bin/env bash
# The main job: the support-triage agent on the embedded default engine, offline.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
exec .venv/bin/canvasroute demo "$@"
