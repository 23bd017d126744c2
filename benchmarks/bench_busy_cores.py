"""Saving while other processes keep every core busy, and the training step while a save is
written: what the background work's priority (``resilient/_background.py``) buys and costs.

    python -m benchmarks.bench_busy_cores [--gb 1] [--rounds 3] [--busy 2]
        [--methods "resilient,resilient(buffered),resilient(zstd),dcp.async_save+DefaultStager"]
        [--out JSON] [--render JSON]

Data-loader workers, tokenizers and other processes of the job often keep every core of a
node busy at the default priority. A save's background work then gets what the scheduler
gives it. Each run, in a fresh process, first saves ``--gb`` of model and Adam state
(``bench_checkpoint.build_state``) with ``--busy`` processes spinning at the default
priority (default: one per core): the stall and the time from the call until the checkpoint
is durable, first watched (polled, as a training loop that goes on), then waited for (as
``wait()`` at the end of training or on SIGTERM; a waiter stops resilient's yielding), and,
in the same minute, the physical limit: an fsync'd write of as many bytes by a thread at
the default priority beside the same busy processes (the faster of direct and buffered).
Then, with nothing else running, a 1024² matmul's mean
time while a save is written, from the end of its stall, against without
(``bench_checkpoint.step_slowdown``). ``resilient(buffered)``: ``direct_io=False``;
``resilient(zstd)``: ``compress="zstd"``. Rounds rotate the methods' order; the table gives
medians over rounds and their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

from benchmarks.common import GB, in_rounds, rendered, reported, write_file

METHODS = ["resilient", "resilient(buffered)", "resilient(zstd)", "dcp.async_save+DefaultStager"]


@contextmanager
def spinning(busy: int) -> Iterator[None]:
    """``busy`` processes that keep a core each busy at the default priority meanwhile."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def parser(doc: str) -> argparse.ArgumentParser:
    """The options both busy-cores benchmarks take."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes (default: one a core)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--render", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    p.add_argument("--root", help=argparse.SUPPRESS)
    return p


def footer(runs: list[dict[str, Any]], rounds: int) -> str:
    return f"\n\n{runs[0]['gb']:g} GB state, {runs[0]['busy']} busy process(es), {rounds} round(s)"


def child(method: str, gb: float, busy: int, root: str) -> dict[str, Any]:
    """One run in this process: the save beside busy cores, the limit, the step's slowdown."""
    import torch

    from benchmarks.bench_checkpoint import Method, build_state, local_nbytes, step_slowdown

    torch.set_num_threads(os.cpu_count() or 1)
    state = build_state(int(gb * GB), 1, "replicated")
    nbytes = local_nbytes(state)
    saver = Method(method, os.path.join(root, "ckpt"), state, 0, 1, "replicated")
    try:
        saver.save(1)  # buffers made, files laid out: every later save is a steady one
        with spinning(busy):
            stall, durable = saver.save(2)  # as a training loop that goes on
            _, waited = saver.save(3, waited=True)  # as wait() at the end, or on SIGTERM
            probe = os.path.join(root, "limit.bin")
            limit = min(write_file(probe, nbytes, direct=True), write_file(probe, nbytes))
            os.unlink(probe)
        while_written, _ = step_slowdown(saver, 4)
    finally:
        saver.close()
    return {"method": method, "gb": gb, "busy": busy, "bytes": nbytes, "stall_s": stall, "durable_s": durable,
            "waited_s": waited, "limit_s": limit, "slowdown": while_written}


def run(method: str, scratch: str, gb: float, busy: int) -> dict[str, Any]:
    """One run in a fresh process (no thread or buffer left over from another method's)."""
    root = tempfile.mkdtemp(dir=scratch)
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_busy_cores", "--child", method, "--gb", str(gb),
                          "--busy", str(busy), "--root", root], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{method}: the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(values: list[float], fmt: str) -> str:
    mid = statistics.median(values)
    return f"{fmt.format(mid)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def table(runs: list[dict[str, Any]]) -> str:
    rows = ["| method | stall | durable, cores busy (÷ fsync'd write) | a wait() for the save, cores busy "
            "| step while written, cores idle |", "|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        rows.append(f"| {method} | {_cell([r['stall_s'] for r in mine], '{:.3f}')} s "
                    f"| {_cell([r['durable_s'] for r in mine], '{:.2f}')} s "
                    f"({_cell([r['durable_s'] / r['limit_s'] for r in mine], '{:.1f}')}×) "
                    f"| {_cell([r['waited_s'] for r in mine], '{:.2f}')} s "
                    f"| {_cell([r['slowdown'] for r in mine], '{:.2f}')}× |")
    return "\n".join(rows) + footer(runs, len(runs) // max(1, len({r["method"] for r in runs})))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.gb, args.busy, args.root)), flush=True)
        return
    if rendered(args.render, table):
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; known: {METHODS}")
    runs = in_rounds(methods, args.rounds, lambda method, scratch: run(method, scratch, args.gb, args.busy),
                     lambda r: (f"stall {r['stall_s']:.3f} s, durable {r['durable_s']:.2f} s beside busy cores "
                                f"(limit {r['limit_s']:.2f} s; waited for: {r['waited_s']:.2f} s), "
                                f"step {r['slowdown']:.2f}x while written"),
                     "bench-busy-", args.dir)
    reported(runs, args.out, table)


if __name__ == "__main__":
    main()
