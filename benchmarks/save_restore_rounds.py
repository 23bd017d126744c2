"""Rounds of saves and cold restores by several methods on gloo ranks, with the machine's
limits measured in the same rounds, and their table: what ``bench_zero`` (ZeRO-1) and
``bench_low_bit`` (FSDP2 with a low-bit optimizer) share.

A method is an object with ``save(step) -> (stall, durable)`` (seconds), ``restore()`` and
``directory()`` (what a cold restore reads, its page cache dropped first). Each round runs
every method in a rotating order: two unmeasured saves (the first saves make files that
later ones reuse), then ``saves`` measured ones, then ``restores`` cold restores (several,
the median reported: this VM's disk reads a file just written with direct I/O, as
resilient writes, slower the first time). Measured in the same round: a memcpy of a rank's
part (the stall's floor), an fsync'd write of the checkpoint's size (the faster of a new
file and an overwrite in place, as resilient reuses its files) and a cold read of it. Times
are the slowest rank's, from a barrier before to a barrier after. Peak extra RSS is the
largest of the ranks', from before a round's first save (a staging buffer counts) and from
before a restore.
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
from typing import Any, Callable

import torch.distributed as dist

from benchmarks.bench_checkpoint import _rotated, _timed_together
from benchmarks.common import (GB, PeakRSS, disk_seconds, drop_cache, memcpy_seconds, rendered, reported,
                               worker_results)


def measured_rounds(methods: dict[str, Any], own_bytes: int, total_bytes: int, args: dict[str, Any],
                    failed: dict[str, str] | None = None) -> None:
    """This rank's part of the rounds (``args``: root, rounds, saves, restores); rank 0
    prints every rank's samples and limits as ``RESULT`` JSON, with ``failed``: the
    methods that could not save at all, and why."""
    rank = dist.get_rank()
    samples: dict[str, dict[str, list[float]]] = {m: {"stall": [], "durable": [], "restore": [], "save_rss": [],
                                                      "restore_rss": []} for m in methods}
    limits: dict[str, list[float]] = {"memcpy": [], "write": [], "read": []}
    step = 0
    for rnd in range(args["rounds"]):
        limits["memcpy"].append(memcpy_seconds(own_bytes, sync=dist.barrier))
        if rank == 0:
            write, read = disk_seconds(args["root"], total_bytes, in_place=True)
            limits["write"].append(write)
            limits["read"].append(read)
        dist.barrier()
        for name in _rotated(list(methods), rnd):
            method, got = methods[name], samples[name]
            with PeakRSS() as rss:  # from before the first save: a staging buffer counts
                for _ in range(2):
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
        print("RESULT " + json.dumps({"gb": total_bytes / GB, "world": dist.get_world_size(), "ranks": everyone,
                                      "failed": failed or {}}), flush=True)


def rounds_table(result: dict[str, Any], methods: tuple[str, ...], what: str) -> str:
    """The methods' medians against the limits: ``what`` names the state (its first line)."""
    ranks = result["ranks"]
    median = statistics.median
    memcpy = median(s for r in ranks for s in r["limits"]["memcpy"])
    write, read = median(ranks[0]["limits"]["write"]), median(ranks[0]["limits"]["read"])
    lines = [f"{result['gb']:.2f} GB of {what} on {result['world']} ranks; limits in the same "
             f"run: memcpy of a rank's part {memcpy:.3f} s, fsync'd write {result['gb'] / write:.2f} GB/s, "
             f"cold read {result['gb'] / read:.2f} GB/s",
             "",
             "| method | stall (x memcpy of a rank's part) | durable (% of write bw) | cold restore (% of read bw) "
             "| peak extra RSS, save / restore |",
             "|---|---|---|---|---|"]
    for name in methods:
        if name in result.get("failed", {}):
            lines.append(f"| {name} | fails: {result['failed'][name]} | – | – | – |")
            continue

        def worst(field: str) -> list[float]:  # per sample, the slowest (largest) rank's
            return [max(values) for values in zip(*(r["samples"][name][field] for r in ranks))]

        stall, durable, restore = median(worst("stall")), median(worst("durable")), median(worst("restore"))
        lines.append(
            f"| {name} | {stall:.3f} s ({stall / memcpy:.1f}x) | {durable:.3f} s ({write / durable:.0%}) | "
            f"{restore:.3f} s ({read / restore:.0%}; {min(worst('restore')):.2f}-{max(worst('restore')):.2f}) | "
            f"{max(worst('save_rss')) / GB:.2f} / "
            f"{max(worst('restore_rss')) / GB:.2f} GB |")
    return "\n".join(lines)


class ResilientMethod:
    """A ``Checkpointer`` (``keep=1``) holding ``state`` as the program gives it."""

    def __init__(self, root: str, state: dict[str, Any]) -> None:
        from resilient import Checkpointer

        os.makedirs(root, exist_ok=True)
        self.root, self.state = root, state
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


def rounds_main(module: str, doc: str, worker: Callable[[dict[str, Any]], None],
                table: Callable[[dict[str, Any]], str]) -> None:
    """A rounds benchmark's command line: as ``worker`` (a rank started by
    ``worker_results``), ``--render`` of an earlier run's JSON, or a run on ``--world``
    ranks in a scratch directory removed at the end."""
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=1)
    parser.add_argument("--restores", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--render", default=None, help="print the table of an earlier run's JSON")
    a = parser.parse_args()
    if rendered(a.render, table):
        return
    root = tempfile.mkdtemp(prefix=f"resilient-{module.rpartition('.')[2]}-")
    try:
        args = {"gb": a.gb, "root": root, "rounds": a.rounds, "saves": a.saves, "restores": a.restores}
        result = worker_results(module, a.world, args)[0]  # rank 0's holds every rank's
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert result is not None
    reported(result, a.out, table)
