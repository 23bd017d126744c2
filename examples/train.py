"""A small real training run with resilient checkpoints: the Quickstart's main job.

Single process:            python examples/train.py
Two processes (DDP, gloo): torchrun --nproc-per-node 2 examples/train.py
Simulate a crash:          python examples/train.py --crash-at 120   (SIGKILLs itself)
Run it again and it resumes from the last committed checkpoint.
ZeRO-1 (optimizer state sharded over the ranks):
                           torchrun --nproc-per-node 2 examples/train.py --zero
                           (each rank saves its part; resumes at any number of processes)

With ``--elastic`` the loop runs inside ``@resilient.elastic``: under ``resilient-run`` a
lost peer is recovered in the surviving processes, without restarting them.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient
from resilient import Checkpointer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs/example", help="checkpoint directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=200, help="total training steps (default: %(default)s)")
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps (default: %(default)s)")
    p.add_argument("--width", type=int, default=512, help="hidden width (default: %(default)s)")
    p.add_argument("--crash-at", type=int, default=None, help="SIGKILL this process after that step")
    p.add_argument("--remote", default=None, help="remote tier URL, e.g. s3://bucket/run or file:///shared/run")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a bigger model)")
    p.add_argument("--elastic", action="store_true", help="recover lost peers in-process (@resilient.elastic)")
    p.add_argument("--zero", action="store_true",
                   help="shard AdamW's state over the ranks (torch's ZeroRedundancyOptimizer; under torchrun)")
    return p.parse_args()


def train(ckpt: Checkpointer, args: argparse.Namespace) -> None:
    """Build, restore, train: everything a recovery has to do again."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.GELU(), torch.nn.Dropout(0.05),
        torch.nn.Linear(args.width, args.width), torch.nn.GELU(), torch.nn.Linear(args.width, 1),
    )
    if args.zero:  # each rank keeps (and saves) its partition's state; a checkpoint loads at any world size
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not dist.is_initialized():
            raise SystemExit("--zero shards the optimizer over the ranks of a process group: run it under torchrun "
                             "or resilient-run (--nproc-per-node 1 for one)")
        optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    net = DDP(model) if world > 1 else model
    state = {"model": model, "optim": optim, "sched": sched, "log": {"losses": []}}

    start = ckpt.restore(state)
    if rank == 0:
        print(f"{'resumed from step ' + str(start) if start else 'starting fresh'} "
              f"(world size {world}, checkpoints in {os.path.abspath(ckpt.root)})", flush=True)
    stall = 0.0
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(128, 64, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(net(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        time.sleep(args.step_time)
        state["log"]["losses"].append(round(loss.item(), 6))
        s0 = time.perf_counter()
        handle = ckpt.save(step + 1, state)
        stall += time.perf_counter() - s0
        if rank == 0 and (handle or (step + 1) % 50 == 0):
            note = f"  checkpoint staged in {(handle.staged_at - handle.started) * 1e3:.1f} ms" if handle else ""
            print(f"step {step + 1:4d}  loss {loss.item():.5f}{note}", flush=True)
        if args.crash_at == step + 1:
            ckpt.wait()  # the saves before the crash durable first: the run says where it will resume
            if rank == 0:
                print(f"simulating a crash: SIGKILL at step {step + 1} (last checkpoint: {ckpt.latest()})",
                      flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    if args.remote:
        ckpt.flush()
    if rank == 0:
        took = time.perf_counter() - t0
        print(f"done: {args.steps - start} steps in {took:.1f} s; training stalled {stall * 1e3:.0f} ms "
              f"for checkpoints; newest checkpoint: step {ckpt.latest()}", flush=True)


def main() -> None:
    args = parse()
    if args.elastic:
        resilient.elastic(root=args.root, remote=args.remote, every=args.every)(train)(args)
        return
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    with Checkpointer(args.root, remote=args.remote, every=args.every) as ckpt:
        train(ckpt, args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
