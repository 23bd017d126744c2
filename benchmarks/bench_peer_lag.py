"""How far behind its own reads a rank copies the other ranks' parts of a replicated state.

    python -m benchmarks.bench_peer_lag [--gb 1] [--worlds 2,3,4] [--lags 0,2,8] [--rounds 4]
    python -m benchmarks.bench_peer_lag --lags 2:0,2:512 [--layout sharded]   # LAG:PIECE_KB

A replicated state (DDP: every rank holds all of it) restores on one node by splitting its
bytes into one part per rank: each rank reads its own part from storage and copies the
others' out of the page cache as their owners bring them in (``resilient/_restore.py``,
``_share_through_page_cache``). ``PEER_LAG_TASKS`` sets how many of its own reads a rank
queues before each read of another's part. Too few and a rank asks for pages nobody has read
yet; too many and every copy waits until the disk is done. Each cell runs ``--worlds``
ranks on gloo. They save the state once, then restore it cold ``--rounds`` times per lag,
the lags in a rotating order, in the same processes (a lag written ``LAG warm`` restores
with the step's files already in the page cache: the copies alone, without the disk).
Beside them runs a cold read of the step's data files, by one reader and by every rank
reading its own share. Medians of the slowest rank's seconds. A lag may carry a piece
size, ``LAG:PIECE_KB``: how many kB of a run of shared chunks are read and checksummed at a
time (``SHARED_PIECE_BYTES``; 0 reads each run in one ``preadv``, then checksums it). ``--layout sharded`` restores an FSDP-like
state instead, which shares nothing, so that lags and pieces change nothing there (at
f58ee28, where every read came in pieces, it measured pieces on sharded state).
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

import torch.distributed as dist

from benchmarks.bench_checkpoint import _rotated, _timed_together, build_state, zero_state
from benchmarks.common import GB, drop_cache, read_range_seconds, rendered, worker_results
from resilient._restore import SHARED_PIECE_BYTES

READ = "cold read"
#: a lag with this suffix restores from a warm page cache (the step's files read just
#: before): what the restore costs when the disk costs nothing, the floor of its copies
WARM = " warm"


def worker(args: dict[str, Any]) -> None:
    """One rank: save once, then restore cold with each lag in turn, the reads beside."""
    import resilient._restore as restore
    from resilient import Checkpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build_state(int(args["gb"] * GB), world, args["layout"])
    with Checkpointer(args["root"], keep=1, rng=False) as ckpt:
        ckpt.save(1, state).result()
    step_dir = os.path.join(args["root"], "step-0000000001")
    files = [os.path.join(step_dir, f) for f in sorted(os.listdir(step_dir)) if f.endswith(".data")]
    total = sum(map(os.path.getsize, files))
    share = (total * rank // world, total * (rank + 1) // world)
    samples: dict[str, list[float]] = {}
    for rnd in range(args["rounds"]):
        for turn in _rotated([*map(str, args["lags"]), READ, READ + " per rank"], rnd):
            if turn.endswith(WARM):
                _read_span(files, *share)  # every rank its share: the whole step, cached
            else:
                drop_cache(step_dir)
            time.sleep(1.0)  # the last turn's I/O settles first, as in bench_checkpoint
            if turn.startswith(READ):
                per_rank = turn != READ
                took = _timed_together(lambda: (per_rank or rank == 0) and _read_span(
                    files, *(share if per_rank else (0, total))))
            else:
                lag, _, piece_kb = turn.removesuffix(WARM).partition(":")
                restore.PEER_LAG_TASKS = int(lag)
                restore.SHARED_PIECE_BYTES = int(piece_kb or SHARED_PIECE_BYTES >> 10) << 10
                zero_state(state)
                with Checkpointer(args["root"], keep=1, rng=False) as ckpt:
                    took = _timed_together(lambda: ckpt.restore(state))
            samples.setdefault(turn, []).append(took)
    if rank == 0:
        print("RESULT " + json.dumps(samples), flush=True)
    dist.destroy_process_group()


def _read_span(files: list[str], lo: int, hi: int) -> None:
    """Read bytes ``[lo, hi)`` of ``files`` laid end to end (the step's data files: a
    replicated state's writes are spread over the ranks)."""
    start = 0
    for path in files:
        size = os.path.getsize(path)
        if lo < start + size and start < hi:
            read_range_seconds(path, max(lo, start) - start, min(hi, start + size) - start)
        start += size


def run_cell(gb: float, world: int, lags: list[str], rounds: int, layout: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="resilient-peer-lag-")
    try:
        args = {"gb": gb, "root": os.path.join(root, "ck"), "lags": lags, "rounds": rounds, "layout": layout}
        samples = worker_results("benchmarks.bench_peer_lag", world, args, timeout=1800)[0]  # rank 0 prints
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert samples is not None
    read_s = min(statistics.median(samples[READ]), statistics.median(samples[READ + " per rank"]))
    return {"gb": gb, "world": world, "layout": layout, "read_s": read_s, "samples": samples,
            "restore_s": {lag: statistics.median(samples[str(lag)]) for lag in lags}}


def render(cells: list[dict[str, Any]]) -> str:
    lags = list(cells[0]["restore_s"]) if cells else []
    lines = ["| state | ranks | cold read (faster pattern) | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
             "|---|---|---|" + "---|" * len(lags)]
    for c in cells:
        state = f"{c['gb']:g} GB, {c.get('layout', 'replicated')}"
        lines.append(f"| {state} | {c['world']} | {c['read_s']:.3f} s | " + " | ".join(
            f"{s:.3f} s ({c['read_s'] / s:.0%})" for s in c["restore_s"].values()) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="replicated state in GB (default: %(default)s)")
    p.add_argument("--worlds", default="2,3,4", help="ranks on this node, comma separated (default: %(default)s)")
    p.add_argument("--lags", default="0,2,8",
                   help="values of PEER_LAG_TASKS to compare, each LAG or LAG:PIECE_KB, "
                        "either with ' warm' to restore from a warm page cache (default: %(default)s)")
    p.add_argument("--layout", choices=["replicated", "sharded"], default="replicated",
                   help="the state's layout; sharded shares nothing (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4, help="cold restores per lag (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the cells here")
    p.add_argument("--render", default=None, help="print the table of an earlier --json file and exit")
    a = p.parse_args()
    if rendered(a.render, render):
        return
    lags = a.lags.split(",")
    cells = []
    for world in map(int, a.worlds.split(",")):
        cells.append(run_cell(a.gb, world, lags, a.rounds, a.layout))
        print(render(cells[-1:]), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(cells, f, indent=1)
    print(render(cells))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
