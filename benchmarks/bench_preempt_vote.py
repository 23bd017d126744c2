"""What a ``save()`` that is not due costs a step on several ranks: the preemption vote.

    python -m benchmarks.bench_preempt_vote --ranks 2 --steps 1000 --rounds 5

Every ``save()`` call asks the ranks whether any was told to stop (SIGTERM, SIGUSR1), so
that all save the same step. Three loops per rank, interleaved by round, each step a
"step" of work then the call: the step alone; the step and ``Checkpointer.save`` (not due:
its vote is sent without waiting and the previous call's answer read); the step and the
same vote agreed within the call (``agree_max_many``, as ``save()`` did before). Two kinds
of step: ``idle`` sleeps 1 ms (a host waiting on its accelerator or its data), ``busy``
multiplies matrices on one thread per rank (this machine's 2 cores full with 2 ranks).
Prints the added time per step, medians over rounds; ``--out`` keeps them as JSON,
``--render`` prints a kept file's table again.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import rendered, reported


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_of(kind: str) -> Callable[[], None]:
    a = torch.randn(192, 192)
    if kind == "idle":
        return lambda: time.sleep(0.001)
    return lambda: [a @ a for _ in range(5)] and None


def _per_step(step: Callable[[], None], call: Callable[[int], None], steps: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    for i in range(steps):
        step()
        call(i)
    return (time.perf_counter() - started) / steps


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from resilient import Checkpointer

    results: dict[str, Any] = {}
    state = {"w": torch.ones(4)}
    with Checkpointer(root, every=10**9) as ckpt:
        coord = ckpt._coord
        loops = {
            "step alone": lambda i: None,
            "save() now": lambda i: ckpt.save(1 + i, state),
            "vote agreed in the call": lambda i: coord.agree_max_many([0, 0]),
        }
        for kind in a.kinds.split(","):
            step = _step_of(kind)
            samples: dict[str, list[float]] = {name: [] for name in loops}
            for round_ in range(a.rounds):
                names = list(loops) if round_ % 2 == 0 else list(loops)[::-1]
                for name in names:
                    samples[name].append(_per_step(step, loops[name], a.steps))
            alone = samples["step alone"]
            results[kind] = {name: [s - b for s, b in zip(values, alone)] for name, values in samples.items()
                             if name != "step alone"}
            results[kind]["step"] = alone
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def table(results: dict[str, Any]) -> str:
    rows = ["| step | step alone | added by save() not due, now | added by the vote agreed in the call (before) |",
            "|---|---|---|---|"]
    for kind, r in results["kinds"].items():
        us = {k: statistics.median(v) * 1e6 for k, v in r.items()}
        rows.append(f"| {kind} | {us['step']:.0f} µs | {us['save() now']:.0f} µs | "
                    f"{us['vote agreed in the call']:.0f} µs |")
    return "\n".join(rows) + f"\n\n{results['ranks']} gloo ranks on 127.0.0.1, medians of {results['rounds']} rounds"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kinds", default="idle,busy")
    p.add_argument("--out", default=None)
    p.add_argument("--render", default=None, help="print the table of a results file and exit")
    a = p.parse_args(argv)
    if rendered(a.render, table):
        return
    with tempfile.TemporaryDirectory(prefix="bench-vote-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank, args=(a.ranks, _free_port(), a, os.path.join(tmp, "ckpt"), out), nprocs=a.ranks)
        with open(out) as f:
            results = {"ranks": a.ranks, "steps": a.steps, "rounds": a.rounds, "kinds": json.load(f)}
    reported(results, a.out, table)


if __name__ == "__main__":
    main()
