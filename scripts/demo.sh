#!/usr/bin/env bash
# The main job: set up, train with checkpoints, crash on purpose, resume, finish.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
root=${RESILIENT_DEMO_ROOT:-runs/demo-$(date +%Y%m%d-%H%M%S)}
echo "== training; the process kills itself (SIGKILL) after step 130 =="
"$PY" examples/train.py --root "$root" --steps 200 --every 25 --crash-at 130 || echo "(process died with status $?, as planned)"
echo "== same command again: resumes from the last committed checkpoint =="
"$PY" examples/train.py --root "$root" --steps 200 --every 25
