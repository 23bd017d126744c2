"""Many small tensors: where a checkpoint's cost is per tensor, not per byte.

    python -m benchmarks.bench_many_tensors --params 6700 --elems 256 --rounds 3

A state of ``--params`` parameters of ``--elems`` fp32 elements each, every one with its
two Adam moments and a step counter (4 tensors a parameter: 6,700 parameters are 26,800
tensors, what a rank of a mixture-of-experts model with per-expert layers holds), plain or
as DTensors on a one-rank mesh (``--layout sharded``: what FSDP2 gives each rank). One
process, saved and restored by every method in rotated order each round, with the methods
of ``bench_checkpoint`` (the same code saves and restores, cold page cache for restores).
A memcpy of the state's bytes in one piece, measured in the same run, is the floor every
per-tensor overhead sits on. Prints a markdown table; ``--out`` keeps the samples as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench_checkpoint import Method, _rotated, local_nbytes, zero_state
from benchmarks.common import memcpy_seconds, rendered

METHODS = ["resilient", "torch.save", "dcp.save", "dcp.async_save+DefaultStager"]


def build_state(params: int, elems: int, layout: str) -> dict[str, Any]:
    """Parameters, moments and step counters, shaped as ``bench_checkpoint``'s states are
    (so its ``Method`` saves and restores them), each tensor ``elems`` elements."""
    g = torch.Generator().manual_seed(0)
    mesh = None
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))

    def make() -> torch.Tensor:
        t = torch.randn(elems, generator=g)
        if mesh is None:
            return t
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

    model = {f"layer{i}.weight": make() for i in range(params)}
    optim = {i: {"step": torch.tensor(10.0), "exp_avg": make(), "exp_avg_sq": make()} for i in range(params)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(range(params))}]}}


def run(params: int, elems: int, layout: str, methods: list[str], rounds: int, saves: int, root: str) -> dict[str, Any]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's async save and DTensor need one
    state = build_state(params, elems, layout)
    nbytes = local_nbytes(state)
    samples: dict[str, dict[str, list[float]]] = {m: {"stall": [], "durable": [], "restore": []} for m in methods}
    memcpy: list[float] = []
    try:
        for rnd in range(rounds):
            memcpy.append(memcpy_seconds(nbytes))
            for name in _rotated(methods, rnd):
                where = os.path.join(root, name.replace("+", "_"))
                method = Method(name, where, state, 0, 1, "replicated")
                for step in (1, 2):  # warm-up: buffers, first touch, recycled files
                    method.save(step)
                for step in range(3, 3 + saves):
                    time.sleep(0.5)
                    stall, durable = method.save(step)
                    samples[name]["stall"].append(stall)
                    samples[name]["durable"].append(durable)
                method.forget_before(2 + saves)
                method.close()
                reader = Method(name, where, state, 0, 1, "replicated", restore_only=True)
                zero_state(state)
                os.sync()
                samples[name]["restore"].append(reader.restore(2 + saves))
                reader.close()
                shutil.rmtree(where, ignore_errors=True)
                method = reader = None
                gc.collect()
                print(f"round {rnd}: {name} done", flush=True)
    finally:
        dist.destroy_process_group()
    tensors = params * 4
    return {"params": params, "elems": elems, "tensors": tensors, "layout": layout, "bytes": nbytes,
            "memcpy_s": statistics.median(memcpy), "samples": samples}


def table(result: dict[str, Any]) -> str:
    med = statistics.median
    n, floor = result["tensors"], result["memcpy_s"]
    rows = ["| tensors | layout | method | stall | stall per tensor | durable | restore (cold) |",
            "|---|---|---|---|---|---|---|"]
    mine = {k: med(v) for k, v in result["samples"].get("resilient", {}).items() if v}
    for name, s in result["samples"].items():
        if not s["stall"]:
            continue
        stall, durable, restore = med(s["stall"]), med(s["durable"]), med(s["restore"])

        def versus(key: str, value: float) -> str:
            return "" if name == "resilient" or key not in mine else f" ({value / mine[key]:.1f}× resilient's)"

        rows.append(f"| {n:,} | {result['layout']} | {name} | {stall:.3f} s{versus('stall', stall)} | "
                    f"{(stall - floor) / n * 1e6:.1f} µs | {durable:.3f} s{versus('durable', durable)} | "
                    f"{restore:.3f} s{versus('restore', restore)} |")
    rows.append(f"\n{result['bytes'] / 1e6:.0f} MB in {n:,} tensors; a memcpy of all of it in one piece: "
                f"{floor * 1e3:.1f} ms (the per-tensor column is the stall beyond it, divided by the tensors)")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=6700, help="parameters (4 tensors each; default: %(default)s)")
    p.add_argument("--elems", type=int, default=256, help="fp32 elements per tensor (default: %(default)s)")
    p.add_argument("--layout", choices=("replicated", "sharded"), default="replicated",
                   help="plain tensors, or DTensors on a one-rank mesh (default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma separated (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, methods rotated in each (default: %(default)s)")
    p.add_argument("--saves", type=int, default=3, help="measured saves per method and round (default: %(default)s)")
    p.add_argument("--out", help="JSON of the samples")
    p.add_argument("--render", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    a = p.parse_args()
    if rendered(a.render, table):
        return
    root = tempfile.mkdtemp(prefix="resilient-many-")
    try:
        result = run(a.params, a.elems, a.layout, a.methods.split(","), a.rounds, a.saves, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\n" + table(result))


if __name__ == "__main__":
    main()
