"""What a training thread waits for beside busy cores, besides a save's own write: the
upload that ``flush()`` (a preemption's drain, ``close``) waits for, and the staging buffer
that ``prepare()`` has made in the background, which the first save needs.

    python -m benchmarks.bench_busy_drain [--gb 1] [--rounds 3] [--busy 2] [--after 0.5]
        [--out JSON] [--render JSON]

Both are background work that yields to training (``resilient/_background.py``). Each
round, in a fresh process, with ``--busy`` processes spinning at the default priority (data
loader workers, say):

- upload: a save of ``--gb`` of model and Adam state to the local tier, watched until
  committed, then ``flush()`` to a remote tier that is a directory on the same disk (a
  shared file system's mount): the seconds ``flush()`` took, against the physical limit, a
  plain copy of the same bytes (read, write, fsync) by a thread at the default priority
  beside the same busy processes, and against the same ``flush()`` with the cores idle;
- first save: ``prepare()``, then ``--after`` seconds later the first due save: its stall,
  against a steady save's (a buffer made and touched long before) and against a first save
  without ``prepare()``, whose stall makes and touches its buffer, beside the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.bench_busy_cores import _cell, footer, parser, spinning
from benchmarks.common import GB, in_rounds, rendered, reported


def copy_seconds(src: str, dst: str) -> float:
    """A plain fsync'd copy of ``src`` to ``dst`` by the calling thread: the upload's limit."""
    t = time.perf_counter()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 16 << 20)
        fout.flush()
        os.fsync(fout.fileno())
    took = time.perf_counter() - t
    os.unlink(dst)
    return took


def _watched(handle: Any) -> None:
    """Until the save is committed, watched as a training loop does (not waited for)."""
    while not handle.done():
        time.sleep(0.002)
    handle.result()


def child(gb: float, busy: int, after: float, root: str) -> dict[str, Any]:
    """One round in this process: the upload's flush and the first save, beside busy cores."""
    import torch

    from benchmarks.bench_checkpoint import build_state, local_nbytes
    from resilient import Checkpointer
    from resilient._names import data_file_name, step_dir_name

    torch.set_num_threads(os.cpu_count() or 1)
    state = build_state(int(gb * GB), 1, "replicated")
    remote = os.path.join(root, "remote")
    with Checkpointer(os.path.join(root, "local"), remote=f"file://{remote}", keep=1, rng=False) as ckpt:
        _watched(ckpt.save(1, state))
        ckpt.flush()  # files laid out, threads started: the next ones are steady
        with spinning(busy):
            _watched(ckpt.save(2, state))
            data = os.path.join(root, "local", step_dir_name(2), data_file_name(0))
            t = time.perf_counter()
            ckpt.flush()
            upload = time.perf_counter() - t
            limit = copy_seconds(data, os.path.join(remote, "limit.bin"))
        _watched(ckpt.save(3, state))
        t = time.perf_counter()
        ckpt.flush()
        idle = time.perf_counter() - t
    with spinning(busy), Checkpointer(os.path.join(root, "first"), keep=1, rng=False) as ckpt:
        ckpt.prepare(state)
        time.sleep(after)
        t = time.perf_counter()
        handle = ckpt.save(1, state)
        first = time.perf_counter() - t
        _watched(handle)
        t = time.perf_counter()
        handle = ckpt.save(2, state)
        steady = time.perf_counter() - t
        _watched(handle)
    with spinning(busy), Checkpointer(os.path.join(root, "unprepared"), keep=1, rng=False) as ckpt:
        t = time.perf_counter()
        handle = ckpt.save(1, state)  # due at its first call: no prepare(), the buffer made in the stall
        unprepared = time.perf_counter() - t
        _watched(handle)
    return {"gb": gb, "busy": busy, "after_s": after, "bytes": local_nbytes(state), "upload_s": upload,
            "copy_s": limit, "idle_upload_s": idle, "first_stall_s": first, "steady_stall_s": steady,
            "unprepared_stall_s": unprepared}


def run(scratch: str, gb: float, busy: int, after: float) -> dict[str, Any]:
    """One round in a fresh process (no thread or buffer left over from another round's)."""
    root = tempfile.mkdtemp(dir=scratch)
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_busy_drain", "--child", "--gb", str(gb),
                          "--busy", str(busy), "--after", str(after), "--root", root],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the round failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs: list[dict[str, Any]]) -> str:
    rows = ["| what, cores busy | resilient | limit | ÷ limit | same, cores idle |", "|---|---|---|---|---|"]
    rows.append(f"| `flush()` after a save (upload to a directory) | {_cell([r['upload_s'] for r in runs], '{:.2f}')} s "
                f"| {_cell([r['copy_s'] for r in runs], '{:.2f}')} s (plain fsync'd copy) "
                f"| {_cell([r['upload_s'] / r['copy_s'] for r in runs], '{:.1f}')}× "
                f"| {_cell([r['idle_upload_s'] for r in runs], '{:.2f}')} s |")
    rows.append(f"| first save's stall, {runs[0]['after_s']:g} s after `prepare()` "
                f"| {_cell([r['first_stall_s'] for r in runs], '{:.3f}')} s "
                f"| {_cell([r['steady_stall_s'] for r in runs], '{:.3f}')} s (a steady save's) "
                f"| {_cell([r['first_stall_s'] / r['steady_stall_s'] for r in runs], '{:.1f}')}× | |")
    rows.append(f"| first save's stall, no `prepare()` (buffer touched in the stall) "
                f"| {_cell([r['unprepared_stall_s'] for r in runs], '{:.3f}')} s | | "
                f"{_cell([r['unprepared_stall_s'] / r['steady_stall_s'] for r in runs], '{:.1f}')}× | |")
    return "\n".join(rows) + footer(runs, len(runs)) + "; medians (range)"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--after", type=float, default=0.5, help="seconds from prepare() to the first save")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.gb, args.busy, args.after, args.root)), flush=True)
        return
    if rendered(args.render, table):
        return
    runs = in_rounds(["round"], args.rounds, lambda _, scratch: run(scratch, args.gb, args.busy, args.after),
                     lambda r: (f"flush {r['upload_s']:.2f} s beside busy cores (copy {r['copy_s']:.2f} s, "
                                f"idle flush {r['idle_upload_s']:.2f} s); first stall {r['first_stall_s']:.3f} s "
                                f"(steady {r['steady_stall_s']:.3f} s, unprepared {r['unprepared_stall_s']:.3f} s)"),
                     "bench-drain-", args.dir)
    reported(runs, args.out, table)


if __name__ == "__main__":
    main()
