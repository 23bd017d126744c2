"""The first save of a process: its stall with the staging buffer prepared ahead of it, and
without (the buffer made and touched inside the stall, as before).

    python -m benchmarks.bench_first_save --gb 1 --rounds 3

Each sample is a fresh process (a new process's memory is what the first save touches): a
state of ``--gb`` GB, ``save()`` called every step of ``--step-s`` seconds with
``every=--every``, the stall of the first due save and of the second. "ahead" is the
Checkpointer as it is (``prepare`` at the first call not due); "inside" turns that
off. Variants alternate by round. ``--out`` keeps the samples as JSON; ``--render`` prints a
kept file's table again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.common import rendered, reported

_CHILD = r"""
import json, sys, time, torch
from resilient import Checkpointer
gb, every, step_s, root, variant = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
if variant == "inside":
    Checkpointer.prepare = lambda self, state=None: None
n = int(gb * 1e9) // 4 // 8
state = {f"w{i}": torch.randn(n) for i in range(8)}
stalls = []
with Checkpointer(root, every=every, keep=1) as ckpt:
    for step in range(1, 2 * every + 1):
        time.sleep(step_s)
        started = time.perf_counter()
        handle = ckpt.save(step, state)
        if handle is not None:
            stalls.append(time.perf_counter() - started)
            handle.result()
print(json.dumps(stalls))
"""

VARIANTS = ("ahead", "inside")


def one(variant: str, a: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench-first-", dir=a.dir) as root:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(a.gb), str(a.every), str(a.step_s), root, variant],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, Any]) -> str:
    rows = ["| staging buffer | first save's stall (median, range) | second save's stall (median) |", "|---|---|---|"]
    for variant in VARIANTS:
        firsts = [s[0] for s in results["samples"][variant]]
        seconds = [s[1] for s in results["samples"][variant]]
        rows.append(f"| {'prepared ahead (now)' if variant == 'ahead' else 'made in the stall (before)'} | "
                    f"{statistics.median(firsts):.3f} s ({min(firsts):.3f}-{max(firsts):.3f}) | "
                    f"{statistics.median(seconds):.3f} s |")
    return "\n".join(rows) + (f"\n\n{results['gb']} GB of state, a save every {results['every']} steps of "
                              f"{results['step_s']} s, {results['rounds']} fresh processes each")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory by default)")
    p.add_argument("--out", default=None)
    p.add_argument("--render", default=None, help="print the table of a results file and exit")
    a = p.parse_args(argv)
    if rendered(a.render, table):
        return
    samples: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for round_ in range(a.rounds):
        for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):
            samples[variant].append(one(variant, a))
            print(f"round {round_ + 1}: {variant}: {[round(s, 3) for s in samples[variant][-1]]}", flush=True)
    results = {"gb": a.gb, "every": a.every, "step_s": a.step_s, "rounds": a.rounds, "samples": samples}
    reported(results, a.out, table)


if __name__ == "__main__":
    main()
