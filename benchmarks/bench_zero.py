"""ZeRO-1 (torch's ``ZeroRedundancyOptimizer``) saves and restores, against torch's recipe.

    python -m benchmarks.bench_zero [--gb 1] [--world 2] [--rounds 3] [--saves 1] [--restores 2]
                                    [--out results-zero.json]
    python -m benchmarks.bench_zero --render benchmarks/results-zero.json

A ZeRO optimizer's ``state_dict`` runs only after ``consolidate_state_dict(to=r)`` has sent
every rank's part to rank ``r``; torch's documented way to checkpoint it is that, then
``torch.save`` on rank ``r``, and at restore every rank loads the whole file and keeps its
part (``load_state_dict``). resilient saves each rank's part from that rank and each rank
reads its part alone (``resilient/_zero.py``).

``--world`` ranks on gloo hold a model of fp32 linear layers and ZeRO(Adam) over it, one
step taken: ``--gb`` is the parameters and Adam's two moments together. Each round runs
both methods in a rotating order: two unmeasured saves, then ``--saves`` measured ones,
then ``--restores`` cold restores (page cache dropped) into the same objects. (This VM's
disk reads a file just written with direct I/O, as resilient writes, slower the first time:
1 GB in 1.18 s, then 0.41 s twice, where a file written through the page cache read at
0.45-0.79 s; so each method's restores are several, and the median is reported.) Measured in the same run:
a memcpy of a rank's part (the stall's floor), an fsync'd write of the checkpoint's size
(the faster of a new file and an overwrite in place, as resilient reuses its files) and a
cold read of it (the disk's limits). Times are the slowest rank's, from a barrier before
to a barrier after (``torch.save``'s recipe holds every rank at its next collective until
rank 0 is done). Peak extra RSS is the largest of the ranks', from before a round's first
save (a staging buffer counts) and from before a restore.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench_checkpoint import _rotated, _timed_together
from benchmarks.common import (GB, PeakRSS, disk_seconds, drop_cache, memcpy_seconds, rendered, reported,
                               worker_results)

METHODS = ("resilient", "consolidate + torch.save")
LAYERS = 16


def build(total_bytes: int) -> tuple[list[torch.nn.Parameter], Any]:
    """Parameters of ``total_bytes / 3`` (Adam keeps two moments of each) in layers of unlike
    sizes, and ZeRO(Adam) over them after one step (its state made)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    per_layer = total_bytes // 3 // 4 // sum(range(1, LAYERS + 1))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn((i + 1) * per_layer, generator=g)) for i in range(LAYERS)]
    optim = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optim.step()
    return params, optim


def _own_bytes(optim: Any) -> int:
    """Bytes of this rank's part: its parameters and their Adam state."""
    return sum(3 * p.numel() * p.element_size() for group in optim.optim.param_groups for p in group["params"])


class Recipe:
    """torch's: consolidate on rank 0, ``torch.save`` there (then fsync); every rank loads
    the whole file and keeps its part."""

    def __init__(self, root: str, params: list[torch.nn.Parameter], optim: Any) -> None:
        self.path, self.params, self.optim = os.path.join(root, "zero.pt"), params, optim

    def save(self, step: int) -> tuple[float, float]:
        rank = dist.get_rank()
        started = time.perf_counter()

        def held() -> None:
            self.optim.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save({"step": step, "params": list(self.params), "optim": self.optim.state_dict()}, self.path)

        stall = _timed_together(held)
        if rank == 0:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dist.barrier()
        return stall, time.perf_counter() - started

    def restore(self) -> None:
        saved = torch.load(self.path, weights_only=True)
        with torch.no_grad():
            for live, value in zip(self.params, saved["params"]):
                live.copy_(value)
        self.optim.load_state_dict(saved["optim"])

    def directory(self) -> str:
        return os.path.dirname(self.path)


class Resilient:
    """A ``Checkpointer`` holding the parameters and the ZeRO optimizer as they are."""

    def __init__(self, root: str, params: list[torch.nn.Parameter], optim: Any) -> None:
        from resilient import Checkpointer

        self.root = root
        self.state = {"params": params, "optim": optim}
        self.ckpt = Checkpointer(root, keep=1, rng=False)

    def save(self, step: int) -> tuple[float, float]:
        started = time.perf_counter()
        handles = []
        stall = _timed_together(lambda: handles.append(self.ckpt.save(step, self.state, force=True)))
        handles[0].result()
        dist.barrier()
        return stall, time.perf_counter() - started

    def restore(self) -> None:
        self.ckpt.restore(self.state)

    def directory(self) -> str:
        return self.root


def worker(args: dict[str, Any]) -> None:
    """One rank: every method's saves and cold restores, round by round, with the limits."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params, optim = build(int(args["gb"] * GB))
    total = sum(3 * p.numel() * p.element_size() for p in params)
    methods = {"resilient": Resilient(os.path.join(args["root"], "resilient"), params, optim),
               "consolidate + torch.save": Recipe(args["root"], params, optim)}
    os.makedirs(os.path.join(args["root"], "resilient"), exist_ok=True)
    samples: dict[str, dict[str, list[float]]] = {m: {"stall": [], "durable": [], "restore": [], "save_rss": [],
                                                      "restore_rss": []} for m in methods}
    limits: dict[str, list[float]] = {"memcpy": [], "write": [], "read": []}
    step = 0
    for rnd in range(args["rounds"]):
        limits["memcpy"].append(memcpy_seconds(_own_bytes(optim), sync=dist.barrier))
        if rank == 0:
            write, read = disk_seconds(args["root"], total, in_place=True)
            limits["write"].append(write)
            limits["read"].append(read)
        dist.barrier()
        for name in _rotated(list(methods), rnd):
            method, got = methods[name], samples[name]
            with PeakRSS() as rss:  # from before the first save: a staging buffer counts
                for _ in range(2):  # unmeasured: the first saves make files that later ones reuse
                    step += 1
                    method.save(step)
                for _ in range(args["saves"]):
                    step += 1
                    stall, durable = method.save(step)
                    got["stall"].append(stall)
                    got["durable"].append(durable)
            got["save_rss"].append(rss.extra)
            for _ in range(args["restores"]):
                drop_cache(method.directory())
                if rank == 0:
                    os.sync()  # what the saves wrote is on disk before a restore is timed
                time.sleep(1.0)  # the writes' I/O settles first
                with PeakRSS() as rss:
                    got["restore"].append(_timed_together(method.restore))
                got["restore_rss"].append(rss.extra)
            print(f"rank {rank} round {rnd + 1}: {name}: stall {got['stall'][-1]:.3f} s, durable "
                  f"{got['durable'][-1]:.3f} s, restore {got['restore'][-1]:.3f} s", flush=True)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"samples": samples, "limits": limits})
    if rank == 0:
        print("RESULT " + json.dumps({"gb": total / GB, "world": dist.get_world_size(), "ranks": everyone}),
              flush=True)
    dist.destroy_process_group()


def run(gb: float, world: int, rounds: int, saves: int, restores: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="resilient-zero-")
    try:
        args = {"gb": gb, "root": root, "rounds": rounds, "saves": saves, "restores": restores}
        result = worker_results("benchmarks.bench_zero", world, args)[0]  # rank 0's holds every rank's
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert result is not None
    return result


def render(result: dict[str, Any]) -> str:
    ranks = result["ranks"]
    median = statistics.median
    memcpy = median(s for r in ranks for s in r["limits"]["memcpy"])
    write, read = median(ranks[0]["limits"]["write"]), median(ranks[0]["limits"]["read"])
    lines = [f"{result['gb']:.2f} GB of parameters + Adam state on {result['world']} ranks; limits in the same "
             f"run: memcpy of a rank's part {memcpy:.3f} s, fsync'd write {result['gb'] / write:.2f} GB/s, "
             f"cold read {result['gb'] / read:.2f} GB/s",
             "",
             "| method | stall (x memcpy of a rank's part) | durable (% of write bw) | cold restore (% of read bw) "
             "| peak extra RSS, save / restore |",
             "|---|---|---|---|---|"]
    for name in METHODS:
        def worst(field: str) -> list[float]:  # per sample, the slowest (largest) rank's
            return [max(values) for values in zip(*(r["samples"][name][field] for r in ranks))]

        stall, durable, restore = median(worst("stall")), median(worst("durable")), median(worst("restore"))
        lines.append(
            f"| {name} | {stall:.3f} s ({stall / memcpy:.1f}x) | {durable:.3f} s ({write / durable:.0%}) | "
            f"{restore:.3f} s ({read / restore:.0%}; {min(worst('restore')):.2f}-{max(worst('restore')):.2f}) | "
            f"{max(worst('save_rss')) / GB:.2f} / "
            f"{max(worst('restore_rss')) / GB:.2f} GB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=1)
    parser.add_argument("--restores", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--render", default=None, help="print the table of an earlier run's JSON")
    args = parser.parse_args()
    if rendered(args.render, render):
        return
    reported(run(args.gb, args.world, args.rounds, args.saves, args.restores), args.out, render)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
