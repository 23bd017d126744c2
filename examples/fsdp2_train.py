"""A torchtitan-style FSDP2 loop with resilient checkpoints: a small decoder-only
transformer, ``fully_shard`` per block and at the root, AdamW, a warm-up schedule, and a
data stream whose position differs by rank.

    resilient-run --standalone --nproc-per-node 2 examples/fsdp2_train.py --dir runs/fsdp2
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py --dir runs/fsdp2   # the same

Run it again with another ``--nproc-per-node`` and it resumes, resharded: the model and the
optimizer state (built fresh, before ``restore``, as here) take the new world's shards. The
data stream's state is per rank (``resilient.PerRank``); on a world-size change the
``reshard`` rule below decides what each new rank starts from.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resilient import Checkpointer, PerRank

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 64, 4, 2, 32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.up = torch.nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = torch.nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(DIM)
        self.out = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class TokenStream:
    """This rank's data: batches drawn from a generator seeded by rank, and a position.
    Its state is what a ``StatefulDataLoader`` would hold: different on every rank."""

    def __init__(self, rank: int) -> None:
        self.position = 0
        self.generator = torch.Generator().manual_seed(1000 + rank)

    def next_batch(self) -> torch.Tensor:
        self.position += 1
        return torch.randint(0, VOCAB, (4, SEQ + 1), generator=self.generator)

    def state_dict(self) -> dict:
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        self.generator.set_state(state["generator"])


def restart_streams(saved: list[dict], rank: int, world_size: int) -> dict:
    """On a world-size change: new rank r continues old rank r's stream where there is one;
    extra ranks start a fresh stream of their own at the furthest position reached."""
    if rank < len(saved):
        return saved[rank]
    return {"position": max(s["position"] for s in saved),
            "generator": torch.Generator().manual_seed(1000 + rank).get_state()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="checkpoint root")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--stop-at", type=int, default=None, help="exit after this step (an interruption)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere, before sharding
    model = Decoder()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 5))
    stream = TokenStream(rank)
    state = {"model": model, "optim": optim, "sched": sched, "data": PerRank(stream, reshard=restart_streams)}
    with Checkpointer(args.dir, every=args.every) as ckpt:
        start = ckpt.restore(state)
        if rank == 0:
            print(f"{'resumed at step ' + str(start) if start else 'starting fresh'} at world size {world}",
                  flush=True)
        for step in range(start, args.steps):
            ids = stream.next_batch()
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            optim.step()
            optim.zero_grad()
            sched.step()
            ckpt.save(step + 1, state)
            if rank == 0 and (step + 1) % 10 == 0:
                print(f"step {step + 1}  loss {loss.item():.4f}", flush=True)
            if args.stop_at == step + 1:
                break
    print(f"rank {rank} data position {stream.position}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
