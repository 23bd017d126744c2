"""A training loop of one's own with Hugging Face ``accelerate``, checkpointed by resilient:
the prepared model, optimizer, scheduler and data loader go into ``save`` as they are.

    python examples/accelerate_train.py --dir runs/accel                     # one process
    resilient-run --nproc-per-node 2 examples/accelerate_train.py --dir runs/accel   # DDP, gloo

Run it again and it resumes from the newest committed step: the weights, Adam's moments, the
schedule, the generators and the data loader's position (a ``StatefulDataLoader``, which
``accelerate`` makes with ``use_stateful_dataloader=True``), so a resumed run ends bit for
bit where an uninterrupted one does, and at another number of processes it goes on from
the same point of the epoch. ``--kill-at N`` SIGKILLs every process after step N.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

from resilient import Checkpointer


class RegressionPairs(torch.utils.data.Dataset):
    """Fixed random regression pairs: the same data on every run."""

    def __init__(self, n: int = 512, width: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, width, generator=g)
        self.y = self.x.sin().sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="checkpoint root (a directory, or an fsspec URL)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=8, help="checkpoint every N steps")
    p.add_argument("--width", type=int, default=256, help="hidden width")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after that step (a crash)")
    p.add_argument("--out", default=None, help="torch.save the final weights here (rank 0)")
    a = p.parse_args(argv)

    # a stateful loader keeps its position; a seedable sampler, its shuffled order (see the README)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                                  use_seedable_sampler=True))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, a.width), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(a.width, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    loader = torch.utils.data.DataLoader(RegressionPairs(), batch_size=16, shuffle=True)
    model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)

    # the three lines: the state, restore, save
    state = {"model": model, "optim": optim, "sched": sched, "data": loader}
    with Checkpointer(a.dir, every=a.every) as ckpt:
        step, loss = ckpt.restore(state), None
        if accelerator.is_main_process:
            print(f"{'resumed at step ' + str(step) if step else 'starting fresh'} "
                  f"on {accelerator.num_processes} process(es)", flush=True)
        while step < a.steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optim.step()
                sched.step()
                optim.zero_grad()
                step += 1
                ckpt.save(step, state)
                if step == a.kill_at:
                    # the saves before the crash durable first, so that a test knows the step it
                    # resumes from (under load, a save 5 steps back could still be in flight)
                    ckpt.wait()
                    print(f"killed at step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == a.steps:
                    break
            else:  # the loader is done: an epoch ended
                if accelerator.is_main_process:
                    print(f"epoch {loader.iteration - 1} ended at step {step}", flush=True)
        if accelerator.is_main_process:
            said = f", loss {loss.item():.6f}" if loss is not None else " (it had been trained that far)"
            print(f"trained to step {step}{said}", flush=True)
    if a.out and accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, a.out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
