"""A training loop of one's own with Hugging Face ``accelerate``: ``accelerator.save_state``
and ``load_state`` against a ``Checkpointer`` given the same prepared objects.

    python -m benchmarks.bench_accelerate --layers 12 --saves 3 --rounds 2 --out benchmarks/results-accelerate.json

GPT-2 built from a config (768 wide, ``--layers`` blocks: 124M parameters at 12), AdamW, a
scheduler and a stateful, seedable data loader, prepared by an ``Accelerator`` on the CPU,
one process; a save every 2 steps (resilient's ``save`` called at every step, as a loop
calls it, due every 2), both methods in the same run, alternating by round. For each save:
the time the loop waits in the save call; for resilient also the time from
that call until the step is committed (every file fsync'd, the commit record written),
from its event log (``save_state`` returns with its files in the page cache: its durable
time is not known). Then the newest checkpoint is restored into freshly prepared objects
from a cold page cache: ``load_state`` against ``restore``. A memcpy of the saved tensors'
bytes, measured in the same run, is the floor of any stall. ``--render`` prints the table of
a results file again.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from benchmarks.common import TokenIds, committed_seconds, drop_cache, gpt2_saves_main, save_cells, state_bytes

METHODS = ("accelerator.save_state", "resilient")


def _prepared(layers: int, saves: int) -> tuple[Any, dict[str, Any]]:
    """(the Accelerator, the state: model, optimizer, scheduler, loader), all prepared."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from transformers import GPT2Config, GPT2LMHeadModel

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                                  use_seedable_sampler=True))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=64))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    loader = torch.utils.data.DataLoader(TokenIds(4 * saves, 32), batch_size=1, shuffle=True)
    model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)
    return accelerator, {"model": model, "optim": optim, "sched": sched, "loader": loader}


def one_run(method: str, layers: int, saves: int, root: str) -> dict[str, Any]:
    from resilient import Checkpointer

    accelerator, state = _prepared(layers, saves)
    folder = os.path.join(root, method)
    events = os.path.join(root, f"{method}-events.jsonl")
    ckpt = Checkpointer(folder, every=2, keep=1, events=events) if method == "resilient" else None
    save_s, step = [], 0
    started = time.perf_counter()
    for batch in state["loader"]:
        loss = state["model"](**batch).loss
        accelerator.backward(loss)
        state["optim"].step()
        state["sched"].step()
        state["optim"].zero_grad()
        step += 1
        began = time.perf_counter()
        if ckpt is not None:  # called at every step, as a loop calls it: due every 2
            saved = ckpt.save(step, state) is not None
        else:
            saved = step % 2 == 0
            if saved:
                accelerator.save_state(os.path.join(folder, "newest"))
        if saved:
            save_s.append(time.perf_counter() - began)
        if step == 2 * saves:
            break
    if ckpt is not None:
        ckpt.close()  # every save committed
    train_s = time.perf_counter() - started
    nbytes, committed = state_bytes(state["model"], state["optim"]), committed_seconds(events)
    accelerator, fresh = _prepared(layers, saves)
    drop_cache(folder)
    began = time.perf_counter()
    if method == "resilient":
        with Checkpointer(folder) as reader:
            assert reader.restore(fresh) == step
    else:
        accelerator.load_state(os.path.join(folder, "newest"))
    restore_s = time.perf_counter() - began
    shutil.rmtree(folder, ignore_errors=True)  # the next round's run starts from nothing, as this one did
    if os.path.exists(events):
        os.remove(events)
    return {"method": method, "save_s": save_s, "committed_s": committed, "train_s": train_s,
            "restore_s": restore_s, "bytes": nbytes}


def table(results: dict[str, Any]) -> str:
    memcpy = results["memcpy_s"]
    rows = ["| method | saved bytes | first save's stall | later saves' stall (median, range) | committed (fsync'd) "
            f"after | restore (cold) | run of {2 * results['saves']} steps |", "|---|---|---|---|---|---|---|"]
    for method in METHODS:
        runs = [r for r in results["runs"] if r["method"] == method]
        firsts, later, durable, trains = save_cells(runs, memcpy)
        restores = ", ".join(f"{r['restore_s']:.2f}" for r in runs)
        rows.append(f"| {method} | {runs[0]['bytes'] / 1e9:.2f} GB | {firsts} | {later} | {durable} | "
                    f"{restores} s | {trains} |")
    return "\n".join(rows) + f"\n\nmemcpy of the saved bytes: {memcpy:.3f} s"


def main(argv: list[str] | None = None) -> None:
    gpt2_saves_main(argv, __doc__, METHODS, one_run, table,
                    lambda run: f"saves {[round(s, 3) for s in run['save_s']]} s, restore {run['restore_s']:.2f} s",
                    "bench-accelerate-")


if __name__ == "__main__":
    main()
