#!/usr/bin/env bash
# Watch a recovery: two simulated nodes train a small model under resilient-run (a real etcd
# on 127.0.0.1) with @resilient.elastic, node b is SIGKILLed mid-run, and node a's worker
# process re-forms the gang alone without restarting, restores the last consistent step
# (b's half of it from the copy b left in a's memory) and finishes. Prints the timeline
# (fault, detected, re-formed, restored, first step) and the run's goodput.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
dir=$(realpath -m "${RESILIENT_DEMO_DIR:-runs/failure-demo-$(date +%Y%m%d-%H%M%S)}")
"$PY" launchers/local/simulate.py --nodes 2 --nnodes 1:2 --dir "$dir" --kill b@step:110 -- \
    examples/train.py --elastic --root "$dir/{node}" --remote "file://$dir/remote" \
    --steps 400 --every 20 --step-time 0.05
echo "timeline plot: $dir/timeline.png"
