"""Restore into device state (CUDA on a GPU machine), against its limits in the same run.

    python -m benchmarks.bench_restore_device --device cuda --sizes 8      # on a GPU machine
    python -m benchmarks.bench_restore_device --device cpu --sizes 0.5     # the same logic here

The state of ``bench_staging`` (fp32 matrices and Adam's moments, on the device) is saved
once; then, ``--repeats`` times, in an order that rotates:

- ``restore``: from a cold page cache into the same device tensors (zeroed first), checked
  against the saved values afterwards;
- ``read``: the checkpoint's data files read cold by 8 threads (the disk's limit);
- ``h2d``: the state copied from (pageable) host memory into the device tensors, tensor by
  tensor, which is what a restore adds after its reads.

A restore that copies each tensor to the device as soon as its reads are done comes close
to ``read`` alone; one that copies after every read takes ``read + h2d``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks.bench_staging import build, state_dict_of, timed
from benchmarks.bench_checkpoint import _rotated
from benchmarks.common import GB, drop_cache, read_range_seconds

READ_THREADS = 8


def _tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for g in optim.param_groups for p in g["params"]]
    return out + [t for st in optim.state.values() for t in st.values() if t.dim() > 0]


def measure(gb: float, device: str, base: str, repeats: int) -> dict:
    from resilient import Checkpointer

    params, optim = build(gb, device)
    for p in params:
        p.grad = torch.zeros_like(p)
    optim.step()  # the moments exist
    state = state_dict_of(params, optim)
    tensors = _tensors(optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    saved = [t.detach().sum(dtype=torch.float64).item() for t in tensors]
    root = os.path.join(base, f"restore-{gb:g}")
    with Checkpointer(root, staging="sync", rng=False) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    step_dir = os.path.join(root, "step-0000000001")
    files = [os.path.join(step_dir, f) for f in os.listdir(step_dir) if f.endswith(".data")]
    host = [torch.empty(t.shape, dtype=t.dtype).fill_(1) for t in tensors]  # touched pageable memory

    def restore() -> None:
        for t in tensors:
            t.detach().zero_()
        with Checkpointer(root, rng=False) as ckpt:
            assert ckpt.restore(state) == 1

    def read() -> None:
        for path in files:
            read_range_seconds(path, 0, os.path.getsize(path), threads=READ_THREADS)

    def h2d() -> None:
        for t, h in zip(tensors, host):
            t.detach().copy_(h)

    runs = {"restore": restore, "read": read, "h2d": h2d}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(repeats):
        for name in _rotated(list(runs), rnd):
            drop_cache(step_dir)
            times[name].append(timed(runs[name], device))
            if name == "restore":
                got = [t.detach().sum(dtype=torch.float64).item() for t in tensors]
                if got != saved:
                    raise SystemExit(f"{gb:g} GB: the restored state differs from the saved one")
    shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"gb": gb, "device": device, "nbytes": nbytes, "seconds": med, "samples": times,
            "restore_over_read": med["restore"] / med["read"],
            "restore_over_read_plus_h2d": med["restore"] / (med["read"] + med["h2d"])}


def row(r: dict) -> str:
    s = r["seconds"]
    return (f"| {r['nbytes'] / GB:.1f} GB | {r['device']} | {s['restore']:.2f} s | {s['read']:.2f} s | "
            f"{s['h2d']:.2f} s | {r['restore_over_read']:.2f} | {r['restore_over_read_plus_h2d']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="8", help="state sizes in GB (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (median; default: %(default)s)")
    p.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the rows here (after each size)")
    a = p.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="resilient-restore-")
    os.makedirs(base, exist_ok=True)
    rows = []
    print("| state | device | restore (cold) | read (cold, 8 threads) | h2d (pageable) | restore ÷ read "
          "| restore ÷ (read + h2d) |\n|---|---|---|---|---|---|---|", flush=True)
    try:
        for gb in [float(x) for x in a.sizes.split(",")]:
            t0 = time.perf_counter()
            rows.append(measure(gb, a.device, base, a.repeats))
            print(row(rows[-1]) + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
