"""A Hugging Face ``Trainer`` run with resilient's checkpoints: one word changed,
``Trainer`` -> ``ResilientTrainer``, and ``resume_from_checkpoint="auto"``.

    python examples/hf_trainer.py --dir runs/trainer --steps 24            # resumes if it can
    torchrun --nproc-per-node 2 examples/hf_trainer.py --dir runs/trainer  # DDP, the same

A small GPT-2 (built from a config, no download) learns random token sequences; dropout is
on, so a resumed run matches an uninterrupted one only if the generators and the data
position come back exactly. ``--kill-at N`` SIGKILLs the process after step N (a crash);
``--term-at N`` sends rank 0 SIGTERM after step N (a preemption: the step the ranks agree
on, N or N + 1, is saved whatever ``--save-steps`` says, and the run exits with status 0).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from resilient.hf import ResilientTrainer


class TokenData(torch.utils.data.Dataset):
    """Fixed random sequences: the same data on every run."""

    def __init__(self, n: int = 256) -> None:
        self.ids = torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Faults(TrainerCallback):
    """At the end of step ``kill_at``, SIGKILL this process (a crash: nothing flushed,
    nothing closed); at the end of step ``term_at``, send rank 0 alone SIGTERM (a preemption
    notice, which the other ranks learn of from rank 0)."""

    def __init__(self, kill_at: int | None, term_at: int | None) -> None:
        self.kill_at, self.term_at = kill_at, term_at

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - Trainer's signature
        if state.global_step == self.kill_at:
            print(f"killed at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == self.term_at and args.process_index == 0:
            print(f"signalled at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the Trainer's output_dir (resilient's checkpoints in resilient/)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL every rank after this step (a crash)")
    p.add_argument("--term-at", type=int, default=None,
                   help="SIGTERM rank 0 after this step (preemption: it or the next is saved, then the run exits)")
    p.add_argument("--remote", default=None,
                   help="drain checkpoints to this object store URL (or directory) too; a run whose --dir is "
                        "empty (a new node) resumes from there")
    p.add_argument("--optim", default="adamw_torch",
                   help="the Trainer's optimizer by name (adamw_torch_8bit: torchao's 8-bit AdamW, whose states "
                        "are tensor subclasses)")
    p.add_argument("--out", default=None, help="torch.save the final weights here")
    p.add_argument("--plain", action="store_true", help="the plain Trainer (its own checkpoints), for comparison")
    a = p.parse_args(argv)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    args = TrainingArguments(output_dir=a.dir, max_steps=a.steps, save_steps=a.save_steps, save_strategy="steps",
                             per_device_train_batch_size=8, learning_rate=1e-3, lr_scheduler_type="linear",
                             warmup_steps=4, logging_steps=4, report_to=[], seed=0, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, optim=a.optim)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    kind = Trainer if a.plain else ResilientTrainer
    extra = {} if a.plain else {"resilient_remote": a.remote}
    trainer = kind(model=model, args=args, train_dataset=TokenData(), callbacks=[Faults(a.kill_at, a.term_at)],
                   **extra)
    result = trainer.train(resume_from_checkpoint=None if a.plain else "auto")
    print(f"trained to step {trainer.state.global_step}, loss {result.training_loss:.4f}", flush=True)
    if a.out and trainer.args.process_index == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
