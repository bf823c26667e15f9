#!/usr/bin/env bash
# Lint and types, as CI runs them: `ruff check .` on the repository and `mypy --strict` on the
# library. mypy runs in the import root (src/, where `canvasroute` is the package as the wheel lays
# it out: scripts/import_root.py) with `-p canvasroute`, so it checks the package as installed. Both run even when the first fails; the exit status is non-zero if either did.
#   scripts/check.sh            ruff + mypy (uses .venv, else the python3 on PATH)
#   PYTHON=/path/to/python scripts/check.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-$([ -x .venv/bin/python ] && echo "$root/.venv/bin/python" || echo python3)}
case "$py" in */*) py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py") ;; esac  # absolute: mypy runs in src/
import_root=$("$py" scripts/import_root.py) || exit 1
status=0
echo "check: ruff check ." >&2
"$py" -m ruff check . || status=1
echo "check: mypy --strict -p canvasroute (in $import_root)" >&2
(cd "$import_root" && "$py" -m mypy --strict --config-file "$root/pyproject.toml" -p canvasroute) || status=1
exit "$status"
