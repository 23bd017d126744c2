"""Checkpoint save/restore: resilient against torch.save and torch.distributed.checkpoint.

    python -m benchmarks.bench_checkpoint                  # 1 and 4 GB, world sizes 1 and 2
    python -m benchmarks.bench_checkpoint --sizes 1 --worlds 1

For each state size (model + Adam moments: 26 fp32 parameter tensors and their two
moments), world size and layout (replicated as under DDP, sharded as DTensor Shard(0)),
every method saves twice (the second, steady-state save is measured) and restores once
from a cold page cache. The machine's limits (memcpy into a touched buffer, fsync'd
sequential write, cold sequential read) are measured in the same run; the table reports
times and ratios against them. Results go to stdout (markdown) and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from benchmarks.common import (GB, PeakRSS, direct_write_seconds, disk_seconds, drop_cache, mean_step_seconds,
                               memcpy_seconds)

N_PARAMS = 26
METHODS = ["resilient", "torch.save", "dcp.save", "dcp.async_save(thread)", "dcp.async_save(process)",
           "dcp.async_save+DefaultStager"]


# ---------------------------------------------------------------------------------------------
# worker side (one process per rank)
# ---------------------------------------------------------------------------------------------
def build_state(total_bytes: int, world: int, layout: str, seed: int = 0) -> dict[str, Any]:
    """Params + exp_avg + exp_avg_sq, as nested dicts (what model/optimizer state_dicts hold)."""
    per_param = total_bytes // 3 // 4  # fp32 elements for all parameters together
    weights = [i + 1 for i in range(N_PARAMS)]  # uneven sizes, like real layers
    g = torch.Generator().manual_seed(seed)
    mesh = None
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))

    def make(rows: int, cols: int) -> torch.Tensor:
        if mesh is None:
            return torch.randn(rows, cols, generator=g)
        from torch.distributed.tensor import DTensor, Shard

        local = torch.randn(rows // world, cols, generator=g)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model, optim = {}, {}
    cols = 1024
    for i, w in enumerate(weights):
        rows = max(world, per_param * w // sum(weights) // cols // world * world)
        model[f"layer{i}.weight"] = make(rows, cols)
        optim[i] = {"step": torch.tensor(10.0), "exp_avg": make(rows, cols), "exp_avg_sq": make(rows, cols)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(range(N_PARAMS))}]}}


def local_nbytes(state: dict[str, Any]) -> int:
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            total += t.numel() * t.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list):
            for v in obj:
                visit(v)

    visit(state)
    return total


def zero_state(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for per in [state["model"], *state["optim"]["state"].values()]:
            for t in per.values():
                (t.to_local() if hasattr(t, "to_local") else t).zero_()


class Method:
    """save(step) -> (stall seconds, seconds to durable); restore() -> seconds."""

    def __init__(self, name: str, root: str, state: dict[str, Any], rank: int, world: int, layout: str) -> None:
        self.name, self.root, self.state, self.rank, self.world, self.layout = name, root, state, rank, world, layout
        self.stager = None
        self.ckpt = None
        if name == "resilient":
            from resilient import Checkpointer

            self.ckpt = Checkpointer(root, keep=1, rng=False)
        if name == "dcp.async_save+DefaultStager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, True, False))

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def save(self, step: int) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.perf_counter()
        if self.ckpt is not None:
            handle = self.ckpt.save(step, self.state)
            stall = time.perf_counter() - t0
            handle.result()
            return stall, time.perf_counter() - t0
        if self.name == "torch.save":
            if self.layout == "replicated" and self.rank != 0:
                return 0.0, 0.0
            os.makedirs(self.path(step), exist_ok=True)
            local = _local_tensors(self.state)
            with open(os.path.join(self.path(step), f"rank{self.rank}.pt"), "wb") as f:
                torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())
            took = time.perf_counter() - t0
            return took, took
        if self.name == "dcp.save":
            dcp.save(self.state, checkpoint_id=self.path(step))
            took = time.perf_counter() - t0
            return took, took
        kind = AsyncCheckpointerType.PROCESS if "process" in self.name else AsyncCheckpointerType.THREAD
        response = dcp.async_save(self.state, checkpoint_id=self.path(step), async_checkpointer_type=kind,
                                  async_stager=self.stager)
        if self.stager is not None:
            response.staging_completion.result()  # training may touch the state only after this
            stall = time.perf_counter() - t0
            response.upload_completion.result()
        else:
            stall = time.perf_counter() - t0
            response.result()
        return stall, time.perf_counter() - t0

    def restore(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        if self.name == "torch.save":
            rank_file = os.path.join(self.path(step), f"rank{0 if self.layout == 'replicated' else self.rank}.pt")
            drop_cache(rank_file)
            _barrier()
            t0 = time.perf_counter()
            loaded = torch.load(rank_file, weights_only=True)
            local = _local_tensors(self.state)
            with torch.no_grad():
                for k, v in loaded.items():
                    local[k].copy_(v)
            return time.perf_counter() - t0
        where = os.path.join(self.root, f"step-{step:010d}") if self.ckpt is not None else self.path(step)
        drop_cache(where)
        _barrier()
        t0 = time.perf_counter()
        if self.ckpt is not None:
            got = self.ckpt.restore(self.state)
            assert got == step, (got, step)
        else:
            dcp.load(self.state, checkpoint_id=self.path(step))
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.stager is not None:
            self.stager.close()


def _local_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in state["model"].items():
        out[f"model.{k}"] = t.to_local() if hasattr(t, "to_local") else t
    for i, per in state["optim"]["state"].items():
        for k, t in per.items():
            out[f"optim.{i}.{k}"] = t.to_local() if hasattr(t, "to_local") else t
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_slowdown(save: Callable[[], Callable[[], bool]]) -> float:
    """Mean step time while a save is being written / the same without one."""
    idle = mean_step_seconds(lambda: False, 20)
    done = save()
    return mean_step_seconds(done, 10_000) / idle


def worker(args: dict[str, Any]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")  # DCP's process executor needs one even for a single rank
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = build_state(int(args["gb"] * GB), world, args["layout"])
    nbytes = local_nbytes(state)
    memcpy_local = memcpy_seconds(nbytes, sync=_barrier)  # every rank copying at once, as in a save
    results = []
    for name in args["methods"]:
        root = os.path.join(args["root"], name.replace("+", "_").replace("(", "_").strip(")"))
        _barrier()
        stalls, durables, restores = [], [], []
        with PeakRSS() as rss:  # from before the method exists: buffers it keeps count too
            method = Method(name, root, state, rank, world, args["layout"])
            method.save(1)  # warm-up: buffers, daemons, first touch
            for step in range(2, 2 + args["repeats"]):
                time.sleep(args.get("gap", 1.0))  # saves are spaced by training steps, not back to back
                _barrier()
                stall, durable = method.save(step)
                stalls.append(stall)
                durables.append(durable)
        last = 1 + args["repeats"]
        for _ in range(2):
            _barrier()
            zero_state(state)
            restores.append(method.restore(last))
        slowdown = None
        if args.get("slowdown") and name in ("resilient", "dcp.async_save+DefaultStager"):
            slowdown = step_slowdown(lambda: _start_async(method, last + 1))
        method.close()
        _barrier()
        results.append({"method": name, "rank": rank, "stall": statistics.median(stalls),
                         "durable": statistics.median(durables), "restore": statistics.median(restores),
                         "rss_extra": rss.extra, "local_bytes": nbytes, "memcpy_local": memcpy_local,
                        "slowdown": slowdown})
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        method = None  # drop its buffers before the next method allocates its own
        gc.collect()
    print("RESULT " + json.dumps(results), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _start_async(method: Method, step: int) -> Callable[[], bool]:
    """Start a save in the background; return a 'finished?' probe."""
    import threading

    done = threading.Event()
    threading.Thread(target=lambda: (method.save(step), done.set()), daemon=True).start()
    time.sleep(0.001)
    return done.is_set


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,4", help="state sizes in GB, comma separated (default: %(default)s)")
    p.add_argument("--worlds", default="1,2", help="world sizes (default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS), help="methods to run (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="measured saves per method (median; default: %(default)s)")
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    p.add_argument("--out", default="bench-out/checkpoint.json", help="JSON results (default: %(default)s)")
    p.add_argument("--render", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    a = p.parse_args()
    if a.render:
        with open(a.render) as f:
            rows = json.load(f)
        for r in rows:  # ratios are recomputed, so an old file renders with today's definitions
            r["restore_frac"] = (r["gb"] / r["restore"]) / r["limits"]["read_gbps"]
        print(table(rows))
        return
    from tests.launch import finish, start_ranks

    base = a.dir or tempfile.mkdtemp(prefix="resilient-bench-")
    os.makedirs(base, exist_ok=True)
    methods = a.methods.split(",")
    rows = []
    for gb in [float(s) for s in a.sizes.split(",")]:
        nbytes = int(gb * GB)
        probes = [disk_seconds(base, nbytes) for _ in range(3)]  # the disk is the noisiest part
        write_s = statistics.median(w for w, _ in probes)
        read_s = statistics.median(r for _, r in probes)
        direct_s = statistics.median(direct_write_seconds(base, nbytes) for _ in range(3))
        limits = {"memcpy_gbps": nbytes / memcpy_seconds(nbytes) / GB,
                  # the disk's write limit, whichever way it is reached (the writer uses direct I/O)
                  "write_gbps": nbytes / min(write_s, direct_s) / GB,
                  "write_buffered_gbps": nbytes / write_s / GB, "write_direct_gbps": nbytes / direct_s / GB,
                  "read_gbps": nbytes / read_s / GB}
        print(f"# {gb:g} GB: memcpy {limits['memcpy_gbps']:.1f} GB/s, fsync'd write {limits['write_buffered_gbps']:.2f} "
              f"GB/s buffered, {limits['write_direct_gbps']:.2f} GB/s direct, cold read {limits['read_gbps']:.2f} GB/s",
              flush=True)
        for world in [int(w) for w in a.worlds.split(",")]:
            for layout in ("replicated", "sharded") if world > 1 else ("replicated",):
                runnable = [m for m in methods if _fits(m, gb, world, layout)]
                for m in sorted(set(methods) - set(runnable), key=methods.index):
                    print(f"# {gb:g} GB, {world} rank(s), {layout}: {m} skipped (its copies would not fit in RAM)")
                args = {"gb": gb, "layout": layout, "methods": runnable, "root": os.path.join(base, "ck"),
                        "slowdown": world == 1, "repeats": a.repeats}
                threads = max(1, (os.cpu_count() or 1) // world)
                procs = start_ranks("worker", world, args, module="benchmarks.bench_checkpoint",
                                    env={"OMP_NUM_THREADS": str(threads)})
                outs = finish(procs, timeout=3600)
                per_rank = []
                for r in outs:
                    line = [ln for ln in r.output.splitlines() if ln.startswith("RESULT ")]
                    if r.returncode != 0 or not line:
                        sys.exit(f"worker rank {r.rank} failed ({r.returncode}):\n{r.output[-4000:]}")
                    per_rank.append(json.loads(line[0][7:]))
                for i, name in enumerate(runnable):
                    rr = [pr[i] for pr in per_rank]
                    worst = {k: max(x[k] or 0 for x in rr) for k in ("stall", "durable", "restore", "rss_extra")}
                    memcpy_local = max(x["memcpy_local"] for x in rr)
                    row = {"gb": gb, "world": world, "layout": layout, "method": name, **worst, "limits": limits,
                           "stall_x_memcpy": worst["stall"] / memcpy_local,
                           "write_frac": (nbytes / worst["durable"] / GB) / limits["write_gbps"],
                           # every rank restores at once from one disk: the checkpoint's
                           # bytes are read from it once (replicas share the page cache)
                           "restore_frac": (nbytes / worst["restore"] / GB) / limits["read_gbps"],
                           "slowdown": rr[0]["slowdown"]}
                    rows.append(row)
                    print(_row(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("\n" + table(rows))
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


# host copies of the rank's local state each method holds at its peak, besides the state itself
_COPIES = {"resilient": 1.0, "torch.save": 0.2, "dcp.save": 0.2, "dcp.async_save(thread)": 1.0,
           "dcp.async_save(process)": 2.0, "dcp.async_save+DefaultStager": 1.0}


def _fits(method: str, gb: float, world: int, layout: str) -> bool:
    local = gb if layout == "replicated" else gb / world
    need = world * local * (1 + _COPIES[method]) + gb  # + page cache the writes pin while in flight
    return need * GB < 0.8 * psutil.virtual_memory().total


def _row(r: dict[str, Any]) -> str:
    slow = f"{r['slowdown']:.2f}×" if r.get("slowdown") else "–"
    return (f"| {r['gb']:g} GB | {r['world']} | {r['layout']} | {r['method']} | {r['stall']:.3f} s "
            f"({r['stall_x_memcpy']:.2f}×) | {r['durable']:.2f} s ({r['write_frac'] * 100:.0f}%) | "
            f"{r['restore']:.2f} s ({r['restore_frac'] * 100:.0f}%) | {r['rss_extra'] / GB:.2f} GB | {slow} |")


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| state | ranks | layout | method | stall (× memcpy of rank's state) | committed (% of write bw) "
            "| restore (% of cold read bw) | peak extra RSS | step slowdown while writing |\n"
            "|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *(_row(r) for r in rows)])


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
