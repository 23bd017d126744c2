"""PyTorch Lightning's checkpoint plugins against ``ResilientCheckpointIO``: how long each
save holds training up, with a real ``Trainer`` and ``ModelCheckpoint``.

    python -m benchmarks.bench_lightning --gb 1 --saves 4 --rounds 2 --out benchmarks/results-lightning.json

A stack of 4096-wide linear layers sized so that the model and its Adam moments weigh
``--gb``; one process on the CPU; ``ModelCheckpoint(every_n_train_steps=2, save_top_k=1,
save_last=True)``, so each checkpoint is two saves at one step (the step's file and
``last.ckpt``), as a user who keeps the newest and a "last" link gets. The plugins, each in
the same run, in turn by round:

* ``TorchCheckpointIO``: Lightning's default, ``torch.save`` inside the step (not fsync'd);
* ``AsyncCheckpointIO``: Lightning's, which clones every tensor in the step and pickles the
  clones in a thread (not fsync'd either);
* ``ResilientCheckpointIO``: copied into a host buffer in the step, written, checksummed,
  fsync'd and committed in the background.

For each save: the seconds spent in the plugin's ``save_checkpoint`` (the loop waits for
all of it); for the run, ``fit``'s wall time including the plugin's teardown (every save
written). A memcpy of the state's bytes, measured in the same run, is the floor of any
stall. ``--render`` prints the table of a results file again.
"""

from __future__ import annotations

import argparse
import shutil
import time
from typing import Any

import torch

from benchmarks.common import in_rounds, memcpy_seconds, rendered, reported, stall_cell

METHODS = ("TorchCheckpointIO", "AsyncCheckpointIO", "ResilientCheckpointIO")
WIDTH = 4096


def _plugin(method: str) -> Any:
    """The plugin ``method`` names, its ``save_checkpoint`` timed into ``save_seconds``."""
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from resilient.lightning import ResilientCheckpointIO

    base = {"TorchCheckpointIO": TorchCheckpointIO, "AsyncCheckpointIO": AsyncCheckpointIO,
            "ResilientCheckpointIO": ResilientCheckpointIO}[method]

    class Timed(base):  # type: ignore[misc, valid-type]
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            super().save_checkpoint(*args, **kwargs)
            self.save_seconds.append(time.perf_counter() - started)

    plugin = Timed()
    plugin.save_seconds = []
    return plugin


def one_run(method: str, layers: int, saves: int, root: str) -> dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    x = torch.randn(8 * 2 * saves, WIDTH)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    plugin = _plugin(method)
    trainer = pl.Trainer(max_steps=2 * saves, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[plugin],
                         callbacks=[ModelCheckpoint(dirpath=f"{root}/{method}", every_n_train_steps=2, save_top_k=1,
                                                    save_last=True)])
    module = Stack()
    started = time.perf_counter()
    trainer.fit(module, loader)
    total = time.perf_counter() - started
    nbytes = 3 * sum(p.numel() * p.element_size() for p in module.parameters())  # weights and two Adam moments
    shutil.rmtree(f"{root}/{method}", ignore_errors=True)
    return {"method": method, "save_s": plugin.save_seconds, "fit_s": total, "bytes": nbytes}


def table(results: dict[str, Any]) -> str:
    memcpy = results["memcpy_s"]
    rows = ["| plugin | state | first checkpoint's two saves | later saves (median, range) | "
            f"`fit` of {2 * results['saves']} steps, all written |", "|---|---|---|---|---|"]
    for method in METHODS:
        runs = [r for r in results["runs"] if r["method"] == method]
        if not runs:
            continue
        first = [f"{r['save_s'][0]:.2f}+{r['save_s'][1]:.2f}" for r in runs]
        later = stall_cell([s for r in runs for s in r["save_s"][2:]], memcpy)
        fits = ", ".join(f"{r['fit_s']:.1f}" for r in runs)
        rows.append(f"| {method} | {runs[0]['bytes'] / 1e9:.2f} GB | {', '.join(first)} s | {later} | {fits} s |")
    return "\n".join(rows) + f"\n\nmemcpy of the state's bytes: {memcpy:.3f} s"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="model and Adam moments together")
    p.add_argument("--saves", type=int, default=4, help="checkpoints per run (each is two saves)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS), help="which plugins, comma-separated")
    p.add_argument("--root", default=None, help="where the checkpoints go (a temporary directory by default)")
    p.add_argument("--out", default=None, help="keep the samples as JSON here")
    p.add_argument("--render", default=None, help="print the table of a results file and exit")
    a = p.parse_args(argv)
    if rendered(a.render, table):
        return
    layers = max(1, round(a.gb * 1e9 / (3 * 4 * WIDTH * (WIDTH + 1))))
    methods = tuple(m for m in a.methods.split(",") if m)
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"--methods: unknown {', '.join(sorted(unknown))} (known: {', '.join(METHODS)})")
    runs = in_rounds(methods, a.rounds, lambda method, root: one_run(method, layers, a.saves, root),
                     lambda run: f"saves {[round(s, 3) for s in run['save_s']]} s, fit {run['fit_s']:.1f} s",
                     "bench-lightning-", a.root)
    results = {"gb": a.gb, "layers": layers, "saves": a.saves, "rounds": a.rounds, "runs": runs,
               "memcpy_s": memcpy_seconds(runs[0]["bytes"])}
    reported(results, a.out, table)


if __name__ == "__main__":
    main()
