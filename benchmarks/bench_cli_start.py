"""How long ``resilient-ckpt`` takes to answer, against the interpreter and ``import torch``.

    python -m benchmarks.bench_cli_start [--rounds 7] [--json PATH]

Why: an inspection command is typed by a person (``ls`` after a crash, ``show`` before a
resume) and run by scripts in loops; its time is mostly its start. The limits, measured in
the same run and interleaved with the commands round by round: a bare interpreter
(``python -c pass``, the floor any Python CLI pays) and ``import torch`` (what a command that
loads torch pays at least). The commands run on a checkpoint of 3 steps made here (an MLP
with Adam, 0.4 MB a step); ``diff`` compares tensors and so loads torch, as the contrast.
Medians of the rounds, wall time of the whole process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from resilient import Checkpointer


def make_root(path: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optim = torch.optim.Adam(model.parameters())
    with Checkpointer(path, keep=None) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(4, 256)).sum().backward()
            optim.step()
            ckpt.save(step, {"model": model, "optim": optim, "meta": {"step": step}})
    return path


def commands(root: str) -> dict[str, list[str]]:
    py, cli = sys.executable, [sys.executable, "-m", "resilient.ckpt"]
    return {
        "python -c pass (floor)": [py, "-c", "pass"],
        "python -c 'import torch' (limit for a torch CLI)": [py, "-c", "import torch"],
        "resilient-ckpt --help": [*cli, "--help"],
        "resilient-ckpt ls ROOT": [*cli, "ls", root],
        "resilient-ckpt show ROOT": [*cli, "show", root],
        "resilient-ckpt verify ROOT --all": [*cli, "verify", root, "--all"],
        "resilient-ckpt diff ROOT 1 3 (loads torch)": [*cli, "diff", root, "1", "3"],
    }


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the samples and medians here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        cmds = commands(make_root(f"{tmp}/ckpt"))
        samples: dict[str, list[float]] = {name: [] for name in cmds}
        for name, argv in cmds.items():  # one warm-up each: the page cache holds the modules after
            timed(argv)
        for _ in range(args.rounds):
            for name, argv in cmds.items():
                samples[name].append(timed(argv))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    floor = medians["python -c pass (floor)"]
    torch_limit = medians["python -c 'import torch' (limit for a torch CLI)"]
    print(f"medians of {args.rounds} rounds, wall time per process\n")
    print("| command | time | ÷ bare interpreter | ÷ import torch |")
    print("|---|---|---|---|")
    for name, m in medians.items():
        print(f"| `{name}` | {m:.3f} s | {m / floor:.1f}× | {m / torch_limit:.2f}× |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "samples": samples, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
