"""What a training thread waits for beside busy cores, besides a save's own write: the
upload that ``flush()`` (a preemption's drain, ``close``) waits for, and the staging buffer
that ``prepare()`` has made in the background, which the first save needs.

    python -m benchmarks.bench_busy_drain [--gb 1] [--rounds 3] [--busy 2] [--after 0.5]
        [--out JSON] [--render JSON]

Both are done by background threads (``resilient/_background.py``). Each round runs three
parts, each in a fresh process, in a rotating order, with ``--busy`` processes spinning at
the default priority (data loader workers, say):

- upload: a save of ``--gb`` of model and Adam state to the local tier, watched until
  committed, then ``flush()`` to a remote tier that is a directory on the same disk (a
  shared file system's mount): the seconds ``flush()`` took, against the physical limit, a
  plain copy of the same bytes (read from a cold cache, as the upload reads them; written;
  fsync'd) by a thread at the default priority beside the same busy processes, and against
  the same ``flush()`` with the cores idle;
- first save: ``prepare()``, then ``--after`` seconds later the first due save: its stall,
  against the next save's (its buffer touched by then);
- first save, no prepare(): the same without ``prepare()``: the first save's stall makes and
  touches its buffer.
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
from typing import Any, Callable

from benchmarks.bench_busy_cores import _cell, footer, parser, spinning
from benchmarks.common import GB, drop_cache, in_rounds, rendered, reported


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


PARTS = ["upload", "first save", "first save, no prepare()"]


def child(part: str, gb: float, busy: int, after: float, root: str) -> dict[str, Any]:
    """One part of a round in this process, beside busy cores."""
    import torch

    from benchmarks.bench_checkpoint import build_state, local_nbytes
    from resilient import Checkpointer
    from resilient._names import data_file_name, step_dir_name

    torch.set_num_threads(os.cpu_count() or 1)
    state = build_state(int(gb * GB), 1, "replicated")
    row: dict[str, Any] = {"method": part, "gb": gb, "busy": busy, "after_s": after, "bytes": local_nbytes(state)}
    if part == "upload":
        remote = os.path.join(root, "remote")
        with Checkpointer(os.path.join(root, "local"), remote=f"file://{remote}", keep=1, rng=False) as ckpt:
            _watched(ckpt.save(1, state))
            ckpt.flush()  # files laid out, threads started: the next ones are steady
            with spinning(busy):
                _watched(ckpt.save(2, state))
                data = os.path.join(root, "local", step_dir_name(2), data_file_name(0))
                row["seconds"] = _timed(ckpt.flush)
                drop_cache(data)  # read cold, as the upload read it (written with direct I/O)
                row["limit_s"] = copy_seconds(data, os.path.join(remote, "limit.bin"))
            _watched(ckpt.save(3, state))
            row["idle_s"] = _timed(ckpt.flush)
        return row
    with spinning(busy), Checkpointer(os.path.join(root, "ckpt"), keep=1, rng=False) as ckpt:
        if part == "first save":
            ckpt.prepare(state)
            time.sleep(after)
        # (without prepare(), save() at its first call, due, makes the buffer in its stall)
        for key, step in (("seconds", 1), ("limit_s", 2)):  # the first save's stall, a steady one's
            t = time.perf_counter()
            handle = ckpt.save(step, state)
            row[key] = time.perf_counter() - t
            _watched(handle)
    return row


def _timed(action: Callable[[], object]) -> float:
    t = time.perf_counter()
    action()
    return time.perf_counter() - t


def run(part: str, scratch: str, gb: float, busy: int, after: float) -> dict[str, Any]:
    """One part in a fresh process: no thread, buffer or freed memory left over from another
    part (memory a process has just freed is backed by the host, and a new buffer on it was
    first touched 3x faster here)."""
    root = tempfile.mkdtemp(dir=scratch)
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_busy_drain", "--child", part, "--gb", str(gb),
                          "--busy", str(busy), "--after", str(after), "--root", root],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{part}: the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs: list[dict[str, Any]]) -> str:
    rows = ["| what, cores busy | resilient | limit | ÷ limit | same, cores idle |", "|---|---|---|---|---|"]
    what = {"upload": ("`flush()` after a save (upload to a directory)", "plain fsync'd copy, cold read", "{:.2f}"),
            "first save": (f"first save's stall, {runs[0]['after_s']:g} s after `prepare()`", "a steady save's",
                           "{:.3f}"),
            "first save, no prepare()": ("first save's stall, no `prepare()` (buffer touched in the stall)",
                                         "a steady save's", "{:.3f}")}
    for part in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == part]
        name, limit, fmt = what[part]
        idle = f"{_cell([r['idle_s'] for r in mine], fmt)} s" if "idle_s" in mine[0] else ""
        rows.append(f"| {name} | {_cell([r['seconds'] for r in mine], fmt)} s "
                    f"| {_cell([r['limit_s'] for r in mine], fmt)} s ({limit}) "
                    f"| {_cell([r['seconds'] / r['limit_s'] for r in mine], '{:.1f}')}× | {idle} |")
    return "\n".join(rows) + footer(runs, len(runs) // max(1, len({r["method"] for r in runs}))) + "; medians (range)"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--after", type=float, default=0.5, help="seconds from prepare() to the first save")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.gb, args.busy, args.after, args.root)), flush=True)
        return
    if rendered(args.render, table):
        return
    runs = in_rounds(PARTS, args.rounds, lambda part, scratch: run(part, scratch, args.gb, args.busy, args.after),
                     lambda r: f"{r['seconds']:.3f} s beside busy cores (limit {r['limit_s']:.3f} s)"
                               + (f", idle {r['idle_s']:.2f} s" if "idle_s" in r else ""),
                     "bench-drain-", args.dir)
    reported(runs, args.out, table)


if __name__ == "__main__":
    main()
