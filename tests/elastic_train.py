"""A tiny DDP training script for launcher tests and the recovery benchmark.

Runs under ``resilient-run`` or ``torchrun`` (gloo), checkpoints with resilient, and
appends one JSON line per event to ``--events`` (start: restored step and world size;
step: every step; done), so that a test can tell exactly when and where the gang resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=None, help="local tier (default: $NODE_ROOT)")
    p.add_argument("--remote", default=None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--events", required=True)
    p.add_argument("--log", default=None, help="an option torchrun's parser would mistake for its own")
    p.add_argument("--steps-after-resume", type=int, default=0,
                   help="a run that resumed from a checkpoint trains at most this many more steps (0: to --steps):"
                        " what a test checks after a recovery, without the rest of a run sized to outlast it")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def emit(event: str, **fields: object) -> None:
        record = {"t": time.time(), "event": event, "rank": rank, "world": world, "pid": os.getpid(),
                  "node": os.environ.get("NODE_NAME", ""), **fields}
        with open(args.events, "a") as f:
            f.write(json.dumps(record) + "\n")

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    net = DDP(model)
    root = args.root or os.environ["NODE_ROOT"]
    with Checkpointer(root, remote=args.remote, every=args.every, keep=3,
                      state={"model": model, "optim": optim}) as ckpt:
        start = ckpt.restore()
        emit("start", restored=start, log=args.log)
        end = min(args.steps, start + args.steps_after_resume) if start and args.steps_after_resume else args.steps
        for step in range(start, end):
            x = torch.randn(8, 16)
            loss = net(x).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            time.sleep(args.step_time)
            ckpt.save(step + 1)
            emit("step", step=step + 1)
        ckpt.flush()
    emit("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Exit handlers still run; the interpreter's final collection over torch's modules (about
    # half a second per process here, on the path of every launcher test) is skipped.
    import gc

    gc.freeze()
