#!/usr/bin/env bash
# Set up, then run the whole test suite (the command CI runs).
#
# As root with util-linux's unshare, the suite runs in a network namespace of its own with
# only loopback up: every networked test is loopback-only by construction, and torch's
# TCPStore client's reverse lookups of 127.0.0.1 fail at once there instead of waiting on a
# resolver (in this sandbox one lookup in ~25 stalls 5 s: tests that open hundreds of store
# connections then time out). RESILIENT_TEST_NETNS=0 runs it in the current namespace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
if [[ "${RESILIENT_TEST_NETNS:-1}" != 0 && $(id -u) == 0 ]] && command -v unshare >/dev/null \
        && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
    export RESILIENT_TEST_NETNS=0 RESILIENT_BENCH_NETNS=1
    exec unshare -n sh -c 'ip link set lo up && exec "$0" -m pytest -q --durations=15 "$@"' "$PY" "$@"
fi
exec "$PY" -m pytest -q --durations=15 "$@"
