#!/usr/bin/env bash
# The documentation site (mkdocs.yml, docs/): MkDocs Material, the API reference from the docstrings.
#   scripts/docs.sh serve    live at http://127.0.0.1:8200 (reloads on edits)
#   scripts/docs.sh build    mkdocs build --strict into site/: a broken link, anchor or reference fails
# Needs the `docs` extra (scripts/bootstrap.sh dev installs it); uses .venv, else the python3 on PATH,
# or PYTHON=/path/to/python.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-$([ -x .venv/bin/python ] && echo "$root/.venv/bin/python" || echo python3)}
export NO_MKDOCS_2_WARNING=1  # Material's banner about MkDocs 2.0, printed on every build
case "${1:-}" in
  serve) shift; exec "$py" -m mkdocs serve "$@" ;;
  build) shift; exec "$py" -m mkdocs build --strict "$@" ;;
  *) echo "usage: $0 serve | build [mkdocs options]" >&2; exit 2 ;;
esac
