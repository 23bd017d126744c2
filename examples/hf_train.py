"""A Hugging Face transformers model trained with resilient checkpoints, then exported so
that ``from_pretrained`` loads it: the round trip people do when they publish a model.

    python examples/hf_train.py --dir runs/gpt2 --steps 40           # train (resumes if it can)
    resilient-ckpt export runs/gpt2/ckpt runs/gpt2/hf/model.safetensors --format safetensors --key model

GPT-2 ties its output layer to the token embedding; the checkpoint writes that tensor once
and the export gives both names. The model is built from a small config (no download).
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from resilient import Checkpointer


def build() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(step: int) -> torch.Tensor:
    """Token ids of one step's batch (a different, fixed batch per step)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 512, (8, 32), generator=g)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="run directory: ckpt/ and hf/ go there")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--stop-at", type=int, default=None, help="exit after this step (an interruption)")
    args = p.parse_args(argv)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    state = {"model": model, "optim": optim, "sched": sched}
    with Checkpointer(os.path.join(args.dir, "ckpt"), every=args.every) as ckpt:
        start = ckpt.restore(state)
        print(f"{'resumed at step ' + str(start) if start else 'starting fresh'}", flush=True)
        for step in range(start, args.steps):
            ids = batch(step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            sched.step()
            ckpt.save(step + 1, state)
            if (step + 1) % 10 == 0:
                print(f"step {step + 1}  loss {loss.item():.4f}", flush=True)
            if args.stop_at == step + 1:
                return
    model.config.save_pretrained(os.path.join(args.dir, "hf"))  # config.json, for from_pretrained
    print(f"done at step {args.steps}; export with: resilient-ckpt export {os.path.join(args.dir, 'ckpt')} "
          f"{os.path.join(args.dir, 'hf', 'model.safetensors')} --format safetensors --key model", flush=True)


if __name__ == "__main__":
    main()
