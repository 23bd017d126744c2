#!/usr/bin/env bash
# Installs everything the project needs into the current Python. torch==2.13.0 first:
# it is the CPU wheel available locally; any other spec would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[test]'
