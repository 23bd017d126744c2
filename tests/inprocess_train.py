"""A tiny DDP training script written with ``@resilient.elastic``, for tests and benchmarks.

Every rank trains on the same batch per step (seeded by the step), so the weights after a
step do not depend on the world size: a run that lost a rank and recovered must end with
the weights of a run that never failed. Appends JSON lines to ``--events``: ``start``
(restored step, world size, weight digest), ``step`` (step, digest), ``done``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=None, help="local tier (default: $NODE_ROOT)")
    p.add_argument("--remote", default=None)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--events", required=True)
    p.add_argument("--no-peer-copies", action="store_true")
    p.add_argument("--width", type=int, default=16, help="the model is WIDTH x WIDTH")
    args = p.parse_args()

    def emit(event: str, **fields: object) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        record = {"t": time.time(), "event": event, "rank": rank, "world": world, "pid": os.getpid(),
                  "node": os.environ.get("NODE_NAME", ""), **fields}
        with open(args.events, "a") as f:
            f.write(json.dumps(record) + "\n")

    @resilient.elastic(root=args.root or os.environ["NODE_ROOT"], remote=args.remote, every=args.every,
                       keep=3, peer_copies=not args.no_peer_copies)
    def train(ckpt: resilient.Checkpointer) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(args.width, args.width)
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        net = DDP(model) if dist.is_initialized() else model
        state = {"model": model, "optim": optim}
        start = ckpt.restore(state)
        emit("start", restored=start, digest=digest(model))
        for step in range(start, args.steps):
            x = torch.randn(8, args.width, generator=torch.Generator().manual_seed(step))
            loss = net(x).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            time.sleep(args.step_time)
            ckpt.save(step + 1, state)
            emit("step", step=step + 1, digest=digest(model))
        ckpt.flush()
        emit("done", digest=digest(model))

    train()


if __name__ == "__main__":
    main()
    # Exit handlers still run; the interpreter's final collection over torch's modules (about
    # half a second per process here, on the path of every launcher test) is skipped.
    import gc

    gc.freeze()
