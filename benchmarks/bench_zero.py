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
step taken: ``--gb`` is the parameters and Adam's two moments together. The rounds
(unmeasured and measured saves, cold restores, the limits beside them) are
``benchmarks/save_restore_rounds.py``'s. (``torch.save``'s recipe holds every rank at its
next collective until rank 0 is done.)
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench_checkpoint import _timed_together
from benchmarks.common import GB
from benchmarks.save_restore_rounds import ResilientMethod, measured_rounds, rounds_main, rounds_table

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


def worker(args: dict[str, Any]) -> None:
    """One rank: every method's saves and cold restores, round by round, with the limits."""
    dist.init_process_group("gloo")
    params, optim = build(int(args["gb"] * GB))
    total = sum(3 * p.numel() * p.element_size() for p in params)
    methods = {"resilient": ResilientMethod(os.path.join(args["root"], "resilient"),
                                            {"params": params, "optim": optim}),
               "consolidate + torch.save": Recipe(args["root"], params, optim)}
    measured_rounds(methods, _own_bytes(optim), total, args)
    dist.destroy_process_group()


def render(result: dict[str, Any]) -> str:
    return rounds_table(result, METHODS, "parameters + Adam state")


if __name__ == "__main__":
    rounds_main("benchmarks.bench_zero", __doc__, worker, render)
