"""One training script, two ways to survive faults, for ``bench_goodput.py``.

* ``--mode resilient``: the loop inside ``@resilient.elastic`` (run it with ``resilient-run``);
* ``--mode dcp``: the usual torchrun recipe: ``torch.distributed.checkpoint.async_save``
  every ``--every`` steps to a shared directory (with a gloo group of its own, as DCP's
  async recipe does), and on start the newest complete one (``.metadata`` present) is
  loaded with ``dcp.load``.

Same model (an MLP of ``--layers`` x ``--width``^2, SGD with momentum), same batches
(seeded by the step, identical on every rank), the same ``--step-time`` of simulated
accelerator work per step. Appends timeline events (``restored``, ``step``; rank 0 only)
to ``--events`` in the schema ``resilient-ckpt timeline`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def train_step(net: torch.nn.Module, optim: torch.optim.Optimizer, step: int, args: argparse.Namespace) -> None:
    x = torch.randn(16, args.width, generator=torch.Generator().manual_seed(step))
    loss = net(x).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    time.sleep(args.step_time)  # the accelerator's share of a step


class Events:
    def __init__(self, path: str) -> None:
        self.path, self.incarnation = path, 0

    def emit(self, event: str, **fields: object) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        record = {"t": time.time(), "event": event, "rank": 0, "pid": os.getpid(), "gen": self.incarnation,
                  "world": dist.get_world_size() if dist.is_initialized() else 1, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def run_resilient(args: argparse.Namespace, events: Events) -> None:
    import resilient

    @resilient.elastic(root=args.root, every=args.every, keep=2)
    def train(ckpt: resilient.Checkpointer) -> None:
        events.incarnation += 1  # called again after each in-process recovery
        model, optim = build(args)
        net = DDP(model)
        state = {"model": model, "optim": optim}
        start = ckpt.restore(state)
        events.emit("restored", step=start)
        for step in range(start, args.steps):
            train_step(net, optim, step, args)
            ckpt.save(step + 1, state)
            events.emit("step", step=step + 1)

    train()


def newest_complete(root: str) -> int:
    steps = [int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")
             and os.path.exists(os.path.join(root, n, ".metadata"))] if os.path.isdir(root) else []
    return max(steps, default=0)


def run_dcp(args: argparse.Namespace, events: Events) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo")
    # DCP's recipe: the background save's collectives get a group of their own, or they
    # interleave with the training loop's on one gloo group and deadlock
    ckpt_group = dist.new_group(backend="gloo")
    model, optim = build(args)
    net = DDP(model)
    start = newest_complete(args.root)
    if start:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(args.root, f"step-{start}"))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    events.emit("restored", step=start)
    pending = None
    for step in range(start, args.steps):
        train_step(net, optim, step, args)
        if (step + 1) % args.every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time, as resilient does
            model_sd, optim_sd = get_state_dict(model, optim)
            pending = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                     checkpoint_id=os.path.join(args.root, f"step-{step + 1}"),
                                     process_group=ckpt_group)
        events.emit("step", step=step + 1)
    if pending is not None:
        pending.result()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("resilient", "dcp"), required=True)
    p.add_argument("--root", default=None, help="checkpoints (default: $NODE_ROOT)")
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    args.root = args.root or os.environ["NODE_ROOT"]
    events = Events(args.events)
    (run_resilient if args.mode == "resilient" else run_dcp)(args, events)


if __name__ == "__main__":
    main()
