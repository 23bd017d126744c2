"""DDP + ``ZeroRedundancyOptimizer`` scenarios run by ``tests.launch``, one per rank.

The reference is ZeRO's own consolidated state (``consolidate_state_dict`` onto rank 0,
then ``state_dict``): the global optimizer state, which does not depend on the world size
that produced it. Each scenario writes what it compares into ``a["out"]`` with
``torch.save`` (the test's own files, read with ``weights_only=True``).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient import Checkpointer, StateError
from tests.workers import batch, finish_scenario, init

#: layers of unlike sizes, so that ZeRO's partition (by size) moves parameters between
#: ranks when the world size changes
WIDTHS = (32, 96, 24, 64, 8)


def build() -> tuple[torch.nn.Module, torch.nn.Module, ZeroRedundancyOptimizer]:
    """(the model, its DDP wrapper, ZeRO over two parameter groups of unlike learning rates)."""
    torch.manual_seed(7)
    layers = [torch.nn.Linear(i, o) for i, o in zip(WIDTHS, WIDTHS[1:])]
    model = torch.nn.Sequential(*layers)
    ddp = DDP(model)
    groups = [{"params": [p for layer in layers[:2] for p in layer.parameters()], "lr": 1e-2},
              {"params": [p for layer in layers[2:] for p in layer.parameters()], "lr": 3e-3}]
    return model, ddp, ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, weight_decay=0.1)


def train_step(ddp: torch.nn.Module, optim: ZeroRedundancyOptimizer, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, _ = batch(step, rank, world)
    ddp(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def consolidated(optim: ZeroRedundancyOptimizer) -> dict | None:
    """ZeRO's global state on rank 0 (None elsewhere): torch's own way to gather it, copied
    (rank 0's own part is the live tensors, which the next step changes)."""
    optim.consolidate_state_dict(to=0)
    return copy.deepcopy(optim.state_dict()) if dist.get_rank() == 0 else None


def _state(a: dict, model: torch.nn.Module, optim: ZeroRedundancyOptimizer) -> dict:
    """The state as saved: top-level entries, or (``a["nested"]``) both under one entry."""
    return {"train": {"model": model, "optim": optim}} if a.get("nested") else {"model": model, "optim": optim}


def save(a: dict) -> None:
    """``a["steps"]`` steps, the reference state, a save (staged as ``a["staging"]`` says;
    with ``a["nested_root"]``, another there with the state under one entry);
    then one more step, at once (with overlapped staging it waits for the copy), whose
    parameters a resumed run at the same world size must reach bit for bit."""
    rank, _ = init()
    model, ddp, optim = build()
    for step in range(a["steps"]):
        train_step(ddp, optim, step)
    expected = consolidated(optim)
    if a.get("nested_root"):  # the same state, under one entry of the program's own dict
        with Checkpointer(a["nested_root"]) as ckpt:
            ckpt.save(a["steps"], _state({"nested": True}, ddp, optim), force=True)
    with Checkpointer(a["root"], staging=a.get("staging", "auto")) as ckpt:
        ckpt.save(a["steps"], {"model": ddp, "optim": optim}, force=True)
        train_step(ddp, optim, a["steps"])
        ckpt.wait()
    if rank == 0:
        torch.save(expected, os.path.join(a["out"], "expected.pt"))
        torch.save(model.state_dict(), os.path.join(a["out"], "next-uninterrupted.pt"))


def resume(a: dict) -> None:
    """A fresh model and ZeRO optimizer (no step taken), restored; the bytes each rank
    loaded, the consolidated state, and the parameters after one more step, for the test to
    compare. ``a["nested"]``: the state under one entry, as ``save`` wrote it to its nested root."""
    rank, world = init()
    model, ddp, optim = build()
    with Checkpointer(a["root"]) as ckpt:
        assert ckpt.restore(_state(a, model, optim)) == a["steps"]
        loaded = ckpt.stats["bytes_restored"]
    with open(os.path.join(a["out"], f"loaded-{world}-{rank}.json"), "w") as f:
        json.dump(loaded, f)
    restored = consolidated(optim)
    train_step(ddp, optim, a["steps"])
    if rank == 0:
        torch.save(restored, os.path.join(a["out"], f"restored-{world}.pt"))
        torch.save(model.state_dict(), os.path.join(a["out"], f"next-{world}.pt"))


def refused(a: dict) -> None:
    """Each of ``a["cases"]`` ([root, text]): a restore from that root into a fresh ZeRO
    optimizer is refused with a ``StateError`` naming the entry and the text."""
    init()
    for root, text in a["cases"]:
        model, _, optim = build()
        with Checkpointer(root) as ckpt:
            try:
                ckpt.restore({"model": model, "optim": optim})
            except StateError as exc:
                assert "'optim': ZeroRedundancyOptimizer" in str(exc) and text in str(exc), exc
                print("refused as expected:", exc, flush=True)
                continue
        raise AssertionError(f"the restore from {root} was not refused")


def overlap_refused(a: dict) -> None:
    """ZeRO made with ``overlap_with_ddp=True`` (its partition comes from DDP's buckets
    during the first steps): a save is refused, naming the setting."""
    from resilient import UnsupportedStateError

    init()
    model = torch.nn.Linear(4, 4)
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                    overlap_with_ddp=True)
    with Checkpointer(a["root"]) as ckpt:
        try:
            ckpt.save(1, {"optim": optim}, force=True)
        except UnsupportedStateError as exc:
            assert "overlap_with_ddp=False" in str(exc), exc
            print("refused as expected:", exc, flush=True)
            return
    raise AssertionError("the save was not refused")


SCENARIOS = {f.__name__: f for f in (save, resume, refused, overlap_refused)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    finish_scenario()
