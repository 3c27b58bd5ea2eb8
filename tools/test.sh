#!/usr/bin/env bash
# Lint and run the whole test suite (after tools/setup.sh). Extra arguments go to pytest
# (`-n 0`: one process, in order).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPENGINE_VENV:-.venv}
"$venv/bin/ruff" format --check .
"$venv/bin/ruff" check .
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
