#!/usr/bin/env bash
# Set up, then run the whole test suite (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q --durations=15 "$@"
