#!/usr/bin/env bash
# The GPU measurement of overlapped staging (stall, D2H time, the next step and the time to
# durable for 8 and 32 GB of state) and of a restore into CUDA state (against a cold read
# and the host-to-device copy, 8 GB), as one command for the device machine:
#
#   here:            bash scripts/gpu-wheels.sh      # the wheels its image lacks, into .whl/
#   device `run`:    command "bash benchmarks/gpu_staging.sh", carry [".whl"], timeout_s 600
#
# Rows are printed and saved to $OUT/staging-cuda.json and $OUT/restore-cuda.json as they
# are measured, so a run cut short keeps them. DEVICE=cpu SIZES=0.2 RESTORE_SIZES=0.2 tries
# the script on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
DIR=${DIR:-/tmp/resilient-staging}
mkdir -p "$OUT" "$DIR"
if ! python3 -c "import zstandard, isal, etcd3gw" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu_staging: run scripts/gpu-wheels.sh here and carry .whl"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    df -h "$DIR"
    free -g
} 2>&1 | tee "$OUT/machine.txt"
# first the GPU tests: exact-size locked staging memory, an overlapped save's correctness
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_staging.py 2>&1 | tee "$OUT/gpu-tests.log"
# the device run's 600 s, less set-up: staging first (the target), then restore into CUDA
# state with what is left (at least RESTORE_S seconds kept for it)
left() { echo $(( ${BUDGET:-570} - SECONDS )); }
RESTORE_S=${RESTORE_S:-90}
timeout "$(( $(left) - RESTORE_S ))" python3 -m benchmarks.bench_staging --device "${DEVICE:-cuda}" \
    --sizes "${SIZES:-8,32}" --dir "$DIR" --json "$OUT/staging-cuda.json" 2>&1 | tee "$OUT/staging-cuda.log"
rc=${PIPESTATUS[0]}
rm -rf "$DIR"; mkdir -p "$DIR"
timeout "$(left)" python3 -m benchmarks.bench_restore_device --device "${DEVICE:-cuda}" \
    --sizes "${RESTORE_SIZES:-8}" --repeats 2 --dir "$DIR" --json "$OUT/restore-cuda.json" 2>&1 | tee "$OUT/restore-cuda.log"
rm -rf "$DIR"
# last, with what is left: Lightning's strategy hands the save its shards on the device
if (( $(left) > 60 )); then
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider tests/test_lightning_parallel.py -k on_a_gpu 2>&1 \
        | tee "$OUT/gpu-lightning.log"
fi
exit "$rc"
