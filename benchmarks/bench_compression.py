"""zstd on real training state: is compression worth turning on by default?

    python -m benchmarks.bench_compression [--steps 30]

Trains a small transformer encoder with AdamW on synthetic tokens, then compresses its
parameters (fp32 and a bf16 copy) and Adam moments chunk by chunk (16 MiB, as the writer
does) with zstd at levels 1 and 3, single-threaded, and compares the throughput with the
disk's fsync'd write bandwidth measured in the same run. Compression pays only when it
shrinks the bytes by more than it slows the writer.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import zstandard

from benchmarks.common import GB, disk_seconds

CHUNK = 16 << 20


def trained_state(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    vocab, width = 8192, 512
    embed = torch.nn.Embedding(vocab, width)
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 4)
    head = torch.nn.Linear(width, vocab)
    model = torch.nn.ModuleList([embed, encoder, head])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (8, 64))
        logits = head(encoder(embed(tokens)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.roll(1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    moments = opt.state_dict()["state"]
    return {
        "params fp32": params,
        "params bf16": params.bfloat16(),
        "exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in moments.values()]),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in moments.values()]),
        "exp_avg (step 0, zeros)": torch.zeros_like(params),
    }


def measure(t: torch.Tensor, level: int) -> tuple[float, float]:
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    comp = zstandard.ZstdCompressor(level=level)
    out = 0
    start = time.perf_counter()
    for off in range(0, len(data), CHUNK):
        out += len(comp.compress(data[off : off + CHUNK]))
    took = time.perf_counter() - start
    return len(data) / out, len(data) / took / GB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps before measuring (default: %(default)s)")
    a = p.parse_args()
    state = trained_state(a.steps)
    with tempfile.TemporaryDirectory() as d:
        write_s, _ = disk_seconds(d, int(0.5 * GB))
    disk = 0.5 / write_s
    print(f"fsync'd write bandwidth in this run: {disk:.2f} GB/s\n")
    print("| tensor | size | zstd-1 ratio | zstd-1 GB/s (1 thread) | zstd-3 ratio | zstd-3 GB/s |")
    print("|---|---|---|---|---|---|")
    for name, t in state.items():
        r1, s1 = measure(t, 1)
        r3, s3 = measure(t, 3)
        print(f"| {name} | {t.numel() * t.element_size() / 1e6:.0f} MB | {r1:.2f} | {s1:.2f} | {r3:.2f} | {s3:.2f} |")


if __name__ == "__main__":
    main()
