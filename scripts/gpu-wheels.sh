#!/usr/bin/env bash
# Wheels that `import resilient` (and the Lightning test) needs and the device machine's image lacks (it has torch,
# numpy, requests, wrapt, setuptools, prometheus-client): downloaded here, for Python 3.12
# on x86-64, into .whl/ (ignored by git), which a device run carries. See
# benchmarks/gpu_staging.sh for the run itself.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    zstandard==0.25.0 isal==1.9.1 etcd3gw==2.7.0 futurist==3.5.0 pbr==7.1.3 debtcollector==3.1.0 \
    pytorch-lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0 PyYAML==6.0.2 tqdm==4.67.1 \
    packaging==25.0
ls -l .whl
