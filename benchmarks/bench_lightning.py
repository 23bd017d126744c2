"""PyTorch Lightning's checkpoint plugins and strategies against resilient's: how long each
save holds training up, with a real ``Trainer`` and ``ModelCheckpoint``.

    python -m benchmarks.bench_lightning --gb 1 --saves 4 --rounds 2 --out benchmarks/results-lightning.json

A stack of 4096-wide linear layers sized so that the model and its Adam moments weigh
``--gb``; ``ModelCheckpoint(every_n_train_steps=2, save_top_k=1, save_last=True)``
(``--every`` sets the steps between checkpoints), so each checkpoint is two saves at one
step (the step's file and ``last.ckpt``), as a user who keeps the newest and a "last" copy
gets. The methods, each in the same run, in turn by round:

* ``TorchCheckpointIO``: Lightning's default plugin, ``torch.save`` inside the step (not
  fsync'd);
* ``AsyncCheckpointIO``: Lightning's, which clones every tensor in the step and pickles the
  clones in a thread (not fsync'd either);
* ``ResilientCheckpointIO``: copied into a host buffer in the step, written, checksummed,
  fsync'd and committed in the background;
* ``ModelParallelStrategy``: Lightning's FSDP2 strategy (``fully_shard`` per layer) on 2
  gloo ranks, which saves each rank's shards with DCP inside the step;
* ``ResilientModelParallelStrategy``: the same with resilient's checkpoints;
* ``DDPStrategy+ResilientCheckpointIO``: DDP on 2 gloo ranks with the plugin, which
  Lightning calls from rank 0 alone (the other rank waits at a barrier);
* ``ResilientDDPStrategy``: DDP on 2 ranks, each saving its slice of the replicated state.

The plugins run in this process; each strategy's run in a process of its own, from which
Lightning starts its second rank. For each save: the seconds spent in the plugin's or the
strategy's ``save_checkpoint`` (the loop waits for all of it); for the run, ``fit``'s wall
time including the teardown (every save written). A memcpy of the state's bytes, measured
in the same run, is the floor of any stall (of a rank's share, for the strategies).
``--render`` prints the table of a results file again.

``--remote`` drains resilient's checkpoints to an object store as well (``remote=``): moto's
S3 server, started here on loopback in a process of its own (on the same cores). Lightning's
own plugins still write to the local disk alone; what is compared there is resilient with
and without a remote tier.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import torch

from benchmarks.common import in_rounds, memcpy_seconds, rendered, reported, stall_cell

PLUGINS = ("TorchCheckpointIO", "AsyncCheckpointIO", "ResilientCheckpointIO")
SHARDED = ("ModelParallelStrategy", "ResilientModelParallelStrategy")  # FSDP2 on 2 ranks
REPLICATED = ("DDPStrategy+ResilientCheckpointIO", "ResilientDDPStrategy")  # DDP on 2 ranks
STRATEGIES = SHARDED + REPLICATED
METHODS = PLUGINS + STRATEGIES
WIDTH = 4096


def _timed(base: type, **kwargs: Any) -> Any:
    """An instance of ``base`` whose ``save_checkpoint`` and ``remove_checkpoint`` (top-k's
    removal of the previous file, also inside the step) time themselves into
    ``save_seconds`` and ``remove_seconds``."""

    class Timed(base):  # type: ignore[misc, valid-type]
        def save_checkpoint(self, *args: Any, **kw: Any) -> None:
            started = time.perf_counter()
            super().save_checkpoint(*args, **kw)
            self.save_seconds.append(time.perf_counter() - started)

        def remove_checkpoint(self, *args: Any, **kw: Any) -> None:
            started = time.perf_counter()
            super().remove_checkpoint(*args, **kw)
            self.remove_seconds.append(time.perf_counter() - started)

    timed = Timed(**kwargs)
    timed.save_seconds, timed.remove_seconds = [], []
    return timed


def _saver(method: str) -> tuple[dict[str, Any], Any]:
    """The Trainer's arguments for ``method`` and the object whose saves are timed."""
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy

    from resilient.lightning import ResilientCheckpointIO, ResilientDDPStrategy, ResilientModelParallelStrategy

    remote = json.loads(os.environ.get(_REMOTE, "null"))  # --remote: resilient's methods drain there
    ours = {"remote": f"{remote['url']}/{method}", "storage_options": remote["options"]} \
        if remote and "Resilient" in method else {}
    if method in PLUGINS:
        plugin = _timed({"TorchCheckpointIO": TorchCheckpointIO, "AsyncCheckpointIO": AsyncCheckpointIO,
                         "ResilientCheckpointIO": ResilientCheckpointIO}[method], **ours)
        return {"devices": 1, "plugins": [plugin]}, plugin
    if method == "DDPStrategy+ResilientCheckpointIO":  # the plugin, called by rank 0 alone
        strategy = _timed(DDPStrategy)
        return {"devices": 2, "strategy": strategy, "plugins": [ResilientCheckpointIO(**ours)]}, strategy
    if method == "ResilientDDPStrategy":
        strategy = _timed(ResilientDDPStrategy, **ours)
        return {"devices": 2, "strategy": strategy}, strategy
    base = ResilientModelParallelStrategy if method.startswith("Resilient") else ModelParallelStrategy
    strategy = _timed(base, data_parallel_size=2, tensor_parallel_size=1, **ours)
    return {"devices": 2, "strategy": strategy}, strategy


#: where ``--remote``'s object store is, for this process and the strategies' (JSON: bucket,
#: options, and the url of the run going on)
_REMOTE = "RESILIENT_BENCH_REMOTE"


def one_run(method: str, layers: int, saves: int, root: str, every: int) -> dict[str, Any]:
    """A plugin's run here; a strategy's in a process of its own, which Lightning starts its
    second rank from (rank 0 prints the result). Each run drains to a prefix of its own
    (``--remote``): a later round must not find the names an earlier one left there."""
    if _REMOTE in os.environ:
        spec = json.loads(os.environ[_REMOTE])
        os.environ[_REMOTE] = json.dumps({**spec, "url": f"{spec['bucket']}/{uuid.uuid4().hex[:8]}"})
    if method in PLUGINS:
        return trained(method, layers, saves, root, every)
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_lightning", "--child", method,
                          "--child-layers", str(layers), "--saves", str(saves), "--every", str(every), "--root", root],
                         capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not said:
        raise RuntimeError(f"{method} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-3000:]}")
    return json.loads(said[-1].removeprefix("RESULT "))


def trained(method: str, layers: int, saves: int, root: str, every: int = 2) -> dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))

        def configure_model(self) -> None:
            if method in SHARDED:  # FSDP2: each layer sharded over the ranks
                from torch.distributed.fsdp import fully_shard

                for layer in self.net:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    x = torch.randn(8 * every * saves * 2, WIDTH)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    arguments, saver = _saver(method)
    trainer = pl.Trainer(max_steps=every * saves, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, **arguments,
                         callbacks=[ModelCheckpoint(dirpath=f"{root}/{method}", every_n_train_steps=every, save_top_k=1,
                                                    save_last=True)])
    module = Stack()
    started = time.perf_counter()
    trainer.fit(module, loader)
    total = time.perf_counter() - started
    nbytes = 3 * layers * WIDTH * (WIDTH + 1) * 4  # weights and two Adam moments, all ranks together
    if trainer.global_rank == 0:
        shutil.rmtree(f"{root}/{method}", ignore_errors=True)
    return {"method": method, "save_s": saver.save_seconds, "remove_s": saver.remove_seconds, "fit_s": total,
            "bytes": nbytes, "ranks": arguments["devices"]}


def table(results: dict[str, Any]) -> str:
    memcpy = results["memcpy_s"]
    removals = any("remove_s" in r for r in results["runs"])  # runs before December 7's lack them
    rows = ["| method | ranks | state (all ranks) | first checkpoint's two saves | later saves (median, range; "
            f"x memcpy of a rank's share) |{' removals of the previous file (median, max) |' if removals else ''} "
            f"`fit` of {results.get('every', 2) * results['saves']} steps, all written |",
            "|---|---|---|---|---|---|" + ("---|" if removals else "")]
    for method in METHODS:
        runs = [r for r in results["runs"] if r["method"] == method]
        if not runs:
            continue
        ranks = runs[0].get("ranks", 1)
        first = [f"{r['save_s'][0]:.2f}+{r['save_s'][1]:.2f}" for r in runs]
        later = stall_cell([s for r in runs for s in r["save_s"][2:]], memcpy / ranks)
        removed = [s for r in runs for s in r.get("remove_s", [])]
        removal = f" {statistics.median(removed):.3f} s, {max(removed):.3f} s |" if removed else " – |"
        fits = ", ".join(f"{r['fit_s']:.1f}" for r in runs)
        name = f"{method}, `remote=`" if results.get("remote") and "Resilient" in method else method
        rows.append(f"| {name} | {ranks} | {runs[0]['bytes'] / 1e9:.2f} GB | {', '.join(first)} s | {later} |"
                    f"{removal if removals else ''} {fits} s |")
    return "\n".join(rows) + f"\n\nmemcpy of the whole state's bytes: {memcpy:.3f} s"


@contextlib.contextmanager
def _object_store(wanted: bool) -> Iterator[None]:
    """moto's S3 server on loopback for ``--remote``, named in ``_REMOTE`` while it runs. In a
    process of its own: in this one its threads would take the interpreter's lock from the
    training thread that the plugin's saves are timed in."""
    if not wanted:
        yield
        return
    from resilient.devservices import S3Server

    server = subprocess.Popen([sys.executable, "-m", "resilient.devservices", "--s3"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        said = next((line for line in iter(server.stdout.readline, "") if "AWS_ENDPOINT_URL=" in line), None)
        if said is None:
            raise RuntimeError(f"python -m resilient.devservices --s3 exited ({server.wait()}) before it served")
        endpoint = next(word.split("=", 1)[1] for word in said.split() if word.startswith("AWS_ENDPOINT_URL="))
        bucket = said.split("s3://", 1)[1].split("/", 1)[0]
        options = {"key": S3Server.KEY, "secret": S3Server.SECRET, "client_kwargs": {"endpoint_url": endpoint}}
        os.environ[_REMOTE] = json.dumps({"bucket": f"s3://{bucket}", "options": options})  # a url per run: one_run
        yield
    finally:
        os.environ.pop(_REMOTE, None)
        server.send_signal(signal.SIGINT)
        server.wait(30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="model and Adam moments together")
    p.add_argument("--saves", type=int, default=4, help="checkpoints per run (each is two saves)")
    p.add_argument("--every", type=int, default=2, help="training steps from one checkpoint to the next")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS), help="which plugins and strategies, comma-separated")
    p.add_argument("--root", default=None, help="where the checkpoints go (a temporary directory by default)")
    p.add_argument("--out", default=None, help="keep the samples as JSON here")
    p.add_argument("--render", default=None, help="print the table of a results file and exit")
    p.add_argument("--remote", action="store_true",
                   help="drain resilient's checkpoints to moto's S3 server on loopback too (remote=)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a strategy's run (one_run)
    p.add_argument("--child-layers", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if rendered(a.render, table):
        return
    if a.child:
        result = trained(a.child, a.child_layers, a.saves, a.root, a.every)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    layers = max(1, round(a.gb * 1e9 / (3 * 4 * WIDTH * (WIDTH + 1))))
    methods = tuple(m for m in a.methods.split(",") if m)
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"--methods: unknown {', '.join(sorted(unknown))} (known: {', '.join(METHODS)})")
    with _object_store(a.remote):
        runs = in_rounds(methods, a.rounds, lambda method, root: one_run(method, layers, a.saves, root, a.every),
                         lambda run: f"saves {[round(s, 3) for s in run['save_s']]} s, fit {run['fit_s']:.1f} s",
                         "bench-lightning-", a.root)
    results = {"gb": a.gb, "layers": layers, "saves": a.saves, "every": a.every, "rounds": a.rounds, "runs": runs,
               "remote": a.remote, "memcpy_s": memcpy_seconds(runs[0]["bytes"])}
    reported(results, a.out, table)


if __name__ == "__main__":
    main()
