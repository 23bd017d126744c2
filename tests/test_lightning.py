"""The PyTorch Lightning plugin, run as a Lightning user runs it (examples/lightning_train.py)."""

import dataclasses
import os
import subprocess
import sys
import threading

import fsspec
import numpy as np
import pytest
import torch

from .faults import flip_byte
from .launch import REPO

pl = pytest.importorskip("pytorch_lightning")

pytestmark = pytest.mark.timeout(240)

EXAMPLE = os.path.join(REPO, "examples", "lightning_train.py")


def run_example(*args: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=180,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout + out.stderr


def _tiny(base: type) -> type:
    """A one-layer regression module derived from ``base`` (either package's LightningModule)."""

    class Tiny(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny


def _tiny_loader() -> torch.utils.data.DataLoader:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_interrupted_lightning_run_resumes_bitwise_equal(tmp_path):
    run_example("--dir", str(tmp_path / "full"), "--epochs", "4", "--out", str(tmp_path / "full.pt"))
    run_example("--dir", str(tmp_path / "ck"), "--epochs", "2")
    out = run_example("--dir", str(tmp_path / "ck"), "--epochs", "4", "--resume", "--out", str(tmp_path / "resumed.pt"))
    assert "Restored all states from the checkpoint" in out and "trained to epoch 4, step 32" in out
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    # Lightning's top-k and last.ckpt work on the plugin's checkpoints (directories)
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt", "last.ckpt"]


@dataclasses.dataclass
class _OptimConfig:
    lr: float
    momentum: float


def _checkpoint(epoch: int) -> dict:
    torch.manual_seed(epoch)
    model = torch.nn.Linear(4, 2)
    return {"epoch": epoch, "global_step": 10 * epoch, "state_dict": model.state_dict(),
            "optimizer_states": [torch.optim.SGD(model.parameters(), lr=0.1).state_dict()],
            "hyper_parameters": {"width": 4, "activation": torch.nn.GELU, "dtype": torch.bfloat16,
                                 "optim": _OptimConfig(0.5, 0.9)},
            "callbacks": {"EarlyStopping": {"best_score": np.float32(0.25), "wait_count": np.int64(epoch),
                                            "history": np.arange(3.0) * epoch},
                          "Tokens": {"seen": {epoch, 10}, "blob": b"\x00ab"}}}


def test_plugin_round_trip_corruption_and_hyper_parameters(tmp_path, caplog):
    from resilient import CheckpointCorruptError
    from resilient.lightning import ResilientCheckpointIO

    io = ResilientCheckpointIO()
    path = tmp_path / "epoch=1.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    io.save_checkpoint(_checkpoint(2), path)  # the same path again (last.ckpt): replaced
    loaded = io.load_checkpoint(path, weights_only=True)  # waits for the save in flight
    want = _checkpoint(2)
    assert loaded["epoch"] == 2 and loaded["global_step"] == 20
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in want["state_dict"].items())
    assert loaded["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1
    # objects JSON cannot hold are kept as text, with a warning naming them; nothing pickled
    assert loaded["hyper_parameters"]["width"] == 4
    assert loaded["hyper_parameters"]["optim"] == {"lr": 0.5, "momentum": 0.9}  # a dataclass's fields; was its repr
    assert loaded["hyper_parameters"]["dtype"] is torch.bfloat16  # a dtype is saved (as text); was its repr
    assert "hyper_parameters/activation" in caplog.text
    # numpy's numbers are stored, not as text: arrays come back as arrays, scalars as numbers
    early = loaded["callbacks"]["EarlyStopping"]
    assert early["best_score"] == 0.25 and early["wait_count"] == 2
    assert type(early["history"]) is np.ndarray and np.array_equal(early["history"], np.arange(3.0) * 2)
    assert loaded["callbacks"]["Tokens"] == {"seen": {2, 10}, "blob": b"\x00ab"}
    assert "callbacks" not in caplog.text
    steps = [n for n in os.listdir(path) if n.startswith("step-")]
    assert len(steps) == 1  # the older save at this path was retired after the new commit
    io.teardown()
    flip_byte(os.path.join(path, steps[0], "rank-00000.data"), 3)
    with pytest.raises(CheckpointCorruptError, match="checksum|CRC|crc"):
        io.load_checkpoint(path)
    io.remove_checkpoint(path)
    assert not path.exists()
    with pytest.raises(FileNotFoundError, match="not a resilient checkpoint"):
        io.load_checkpoint(path)


def test_the_plugins_saves_share_two_buffers_and_each_keeps_its_own_bytes(tmp_path, monkeypatch):
    """Lightning names a new path for each save; the plugin's saves share two staging
    buffers instead of making (and touching, inside the stall) one each. A save never
    reuses a buffer whose save is still being written from: each checkpoint holds the
    values it was given, though the training overwrote them as soon as save returned."""
    from resilient import _hostmem
    from resilient.lightning import ResilientCheckpointIO

    made = []
    real = _hostmem.HostBuffer.__init__

    def counted(self, nbytes, pin):
        made.append(nbytes)
        real(self, nbytes, pin)

    monkeypatch.setattr(_hostmem.HostBuffer, "__init__", counted)
    io = ResilientCheckpointIO()
    weights = torch.zeros(8 << 20)  # 32 MB: its file is still being written when the next save comes
    for step in range(1, 7):
        weights.fill_(step)
        # at each step a top-k file and last.ckpt, as ModelCheckpoint(save_last=True) saves
        io.save_checkpoint({"global_step": step, "state_dict": {"w": weights}}, tmp_path / f"step={step}.ckpt")
        io.save_checkpoint({"global_step": step, "state_dict": {"w": weights}}, tmp_path / "last.ckpt")
        weights.fill_(-1)  # the next step's update, at once
    for step in range(1, 7):
        loaded = io.load_checkpoint(tmp_path / f"step={step}.ckpt")
        assert loaded["global_step"] == step and torch.equal(loaded["state_dict"]["w"], torch.full_like(weights, step))
    last = io.load_checkpoint(tmp_path / "last.ckpt")
    assert last["global_step"] == 6 and torch.equal(last["state_dict"]["w"], torch.full_like(weights, 6))
    assert len(made) == 2, f"{len(made)} buffers made for 12 saves"
    io.teardown()


def test_the_plugins_buffers_are_made_at_the_first_optimizer_step(tmp_path, monkeypatch):
    """Lightning calls nothing of the plugin before its first save, which made its buffers
    in its stall. Now they are made once every optimizer has made its first step (its
    state exists then), as many as the checkpoint callbacks save at one step: two with
    ``save_last=True`` (a top-k file and last.ckpt), one with a link; no save makes one."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from resilient import _hostmem
    from resilient.lightning import ResilientCheckpointIO

    class Adam(_tiny(pl.LightningModule)):
        def configure_optimizers(self):  # two: the buffers wait for the second's first step
            return [torch.optim.AdamW([self.net.weight], lr=0.1), torch.optim.AdamW([self.net.bias], lr=0.1)]

        def training_step(self, batch, index):  # manual: each optimizer stepped in turn
            for optimizer in self.optimizers():
                optimizer.zero_grad()
                self.manual_backward(super().training_step(batch, index))
                optimizer.step()
                steps.append(len(made))  # buffers made by the time this optimizer's step returned

        automatic_optimization = False

    made, steps = [], []
    real = _hostmem.HostBuffer.__init__

    def counted(self, nbytes, pin):
        made.append(nbytes)
        real(self, nbytes, pin)

    monkeypatch.setattr(_hostmem.HostBuffer, "__init__", counted)
    for last, buffers in ((True, 2), ("link", 1)):
        made.clear(), steps.clear()
        trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, plugins=[ResilientCheckpointIO()],
                             callbacks=[ModelCheckpoint(dirpath=tmp_path / str(last), every_n_train_steps=2,
                                                        save_top_k=1, save_last=last)])
        module = Adam()
        trainer.fit(module, _tiny_loader())
        # made at the second optimizer's first step, large enough for the state (weights
        # and two moments); the first checkpoint's saves (at the end of that batch: a step
        # is an optimizer's) made none. A later save may make the second buffer when it
        # finds the first still being written, as before (the link's case); with two, none
        # is made (8 saves)
        assert len(steps) == 8 and steps[:3] == [0, buffers, buffers], (last, steps)
        assert made[0] >= 5 * 4 * 3 and made[:buffers] == [made[0]] * buffers, made
        assert len(made) == 2 if buffers == 2 else len(made) <= 2, made
        loaded = ResilientCheckpointIO().load_checkpoint(tmp_path / str(last) / "last.ckpt")
        assert torch.equal(loaded["state_dict"]["net.weight"], module.net.weight.detach())


def test_the_plugin_wrapped_in_lightnings_async_plugin_is_taken_out_of_it(tmp_path, caplog):
    """``AsyncCheckpointIO(ResilientCheckpointIO())``, written by a user who wants saves off
    the step, cloned every tensor inside the step and saved in a thread while Lightning
    removed the files it was saving: the run failed. The plugin is taken out of it, with a
    warning, and the run saves, removes and loads as with the plugin alone."""
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    from resilient.lightning import ResilientCheckpointIO

    plugin = ResilientCheckpointIO()
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[AsyncCheckpointIO(plugin)],
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=1,
                                                    save_last=True)])
    assert trainer.strategy.checkpoint_io is plugin
    assert "AsyncCheckpointIO(ResilientCheckpointIO()) is ResilientCheckpointIO alone" in caplog.text
    module = _tiny(pl.LightningModule)()
    trainer.fit(module, _tiny_loader())
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    loaded = ResilientCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 8 and torch.equal(loaded["state_dict"]["net.weight"], module.net.weight.detach())


def test_the_plugin_and_the_strategies_travel_to_the_processes_ddp_spawn_starts(tmp_path):
    """``ddp_spawn`` pickles the Trainer, its strategy and plugin to each process it starts:
    that failed ("cannot pickle '_thread.lock'"). What travels is the plugin's arguments; the
    copy's checkpointers, buffers and threads are its own, and it saves and loads."""
    import pickle

    from resilient.lightning import ResilientCheckpointIO, ResilientDDPStrategy

    plugin = ResilientCheckpointIO(remote=f"file://{tmp_path / 'bucket'}", compress="zstd")
    plugin.save_checkpoint(_checkpoint(1), tmp_path / "a.ckpt")  # a save in flight: its threads stay here
    copy = pickle.loads(pickle.dumps(plugin))
    assert (copy.remote, copy.compress, copy._open) == (plugin.remote, "zstd", {})
    copy.save_checkpoint(_checkpoint(2), tmp_path / "b.ckpt")
    copy.teardown()
    plugin.teardown()
    assert copy.load_checkpoint(tmp_path / "a.ckpt")["epoch"] == 1
    assert plugin.load_checkpoint(tmp_path / "b.ckpt")["epoch"] == 2
    strategy = pickle.loads(pickle.dumps(ResilientDDPStrategy(start_method="spawn", remote="file:///x")))
    assert isinstance(strategy, ResilientDDPStrategy) and strategy._files.remote == "file:///x"


def test_fabric_saves_and_loads_through_the_plugin(tmp_path):
    """Lightning Fabric (``Fabric(plugins=[ResilientCheckpointIO()])``, as litgpt-style loops
    use it): ``fabric.save`` of a module, an optimizer and plain values is written by the
    plugin, and ``fabric.load`` puts them back into new objects exactly, returning what it
    did not put anywhere."""
    from lightning_fabric import Fabric

    from resilient.lightning import ResilientCheckpointIO

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[ResilientCheckpointIO()])

    def made():
        torch.manual_seed(0)
        module = torch.nn.Linear(4, 1)
        return fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=0.1))

    module, optimizer = made()
    for _ in range(3):
        fabric.backward(module(torch.randn(8, 4)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp_path / "step-3", {"model": module, "optimizer": optimizer, "step": 3, "extra": {"lr": 0.1}})
    assert (tmp_path / "step-3").is_dir()
    again, again_optimizer = made()
    state = {"model": again, "optimizer": again_optimizer, "step": 0}
    assert fabric.load(tmp_path / "step-3", state) == {"extra": {"lr": 0.1}} and state["step"] == 3
    assert torch.equal(again.weight, module.weight) and torch.equal(again.bias, module.bias)
    mine, theirs = optimizer.state_dict()["state"], again_optimizer.state_dict()["state"]
    assert all(torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in mine[i])
    fabric.strategy.checkpoint_io.teardown()


def test_removed_checkpoints_are_deleted_off_the_step_and_leftovers_swept(tmp_path):
    """Lightning removes checkpoints (``save_top_k``) inside the training step: the path is
    gone when ``remove_checkpoint`` returns and its files are deleted by a thread; what a
    process that died before deleting left behind is swept at the next save there."""
    from resilient.lightning import ResilientCheckpointIO

    dead = tmp_path / ".epoch=0.ckpt.deleted-0badc0de"  # renamed, then its process was killed
    (dead / "step-0000000001").mkdir(parents=True)
    (dead / "step-0000000001" / "rank-00000.data").write_bytes(b"x" * 4096)
    io = ResilientCheckpointIO()
    io.save_checkpoint(_checkpoint(1), tmp_path / "epoch=1.ckpt")
    io.save_checkpoint(_checkpoint(2), tmp_path / "epoch=2.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=1.ckpt")
    assert not (tmp_path / "epoch=1.ckpt").exists()
    io.teardown()  # the deletions asked for are finished
    assert sorted(os.listdir(tmp_path)) == ["epoch=2.ckpt"]
    assert io.load_checkpoint(tmp_path / "epoch=2.ckpt")["epoch"] == 2


def test_last_ckpt_as_a_link_to_a_save_still_being_written(tmp_path):
    """``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to the file just saved,
    which the plugin is still writing: a load through the link waits for that save (it
    found no committed checkpoint before), removing the link leaves its target alone, and
    a Trainer resumes from ``ckpt_path="last"``. ``Model.load_from_checkpoint`` reads the
    plugin's checkpoints, a save still in flight included."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from resilient.lightning import ResilientCheckpointIO

    io = ResilientCheckpointIO()
    weights = torch.arange(8 << 20, dtype=torch.float32)  # 32 MB: still being written below
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": weights}}, tmp_path / "epoch=0.ckpt")
    os.symlink("epoch=0.ckpt", tmp_path / "last.ckpt")
    loaded = io.load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], weights)
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["epoch=0.ckpt"]
    io.teardown()

    Tiny, loader = _tiny(pl.LightningModule), _tiny_loader()

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, plugins=[ResilientCheckpointIO()],
                          callbacks=[ModelCheckpoint(dirpath=tmp_path / "run", every_n_train_steps=2, save_top_k=1,
                                                     save_last="link")])

    first = Tiny()
    trainer(6).fit(first, loader)
    assert os.readlink(tmp_path / "run" / "last.ckpt") == "epoch=1-step=6.ckpt"
    # a trained module loaded for inference, as Lightning users do: not through the plugin,
    # through Lightning's loader (which opened the directory as a file before)
    loaded = Tiny.load_from_checkpoint(tmp_path / "run" / "last.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), first.state_dict().values()))
    io = ResilientCheckpointIO()
    io.save_checkpoint({"state_dict": {"net.weight": torch.ones(1, 4), "net.bias": torch.zeros(1)},
                        "pytorch-lightning_version": pl.__version__}, tmp_path / "now.ckpt")
    assert torch.equal(Tiny.load_from_checkpoint(tmp_path / "now.ckpt").net.weight, torch.ones(1, 4))  # in flight
    io.teardown()
    started_at = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer, module):  # after the restore, before any step
            started_at.append(trainer.global_step)

    resumed = trainer(8)
    resumed.callbacks.append(Spy())
    resumed.fit(Tiny(), loader, ckpt_path="last")
    assert started_at == [6] and resumed.global_step == 8


def test_plugin_drains_to_an_object_store(tmp_path, s3_server):
    from resilient import Checkpointer
    from resilient.lightning import ResilientCheckpointIO

    remote = f"s3://{s3_server['bucket']}/lightning-{os.getpid()}"
    io = ResilientCheckpointIO(remote=remote, storage_options=s3_server["options"])
    io.save_checkpoint(_checkpoint(1), tmp_path / "epoch=1.ckpt")
    io.save_checkpoint(_checkpoint(1), tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(2), tmp_path / "epoch=2.ckpt")
    io.save_checkpoint(_checkpoint(2), tmp_path / "last.ckpt")  # saved again: one checkpoint there, not two
    io.remove_checkpoint(tmp_path / "epoch=1.ckpt")  # top-k: on the object store too, as with Lightning's own
    io.teardown()  # end of fit: every save committed and drained, every removal done
    fs = fsspec.filesystem("s3", **s3_server["options"])
    fs.invalidate_cache()
    listed = sorted(p.rsplit("/", 1)[1] for p in fs.ls(remote.removeprefix("s3://")))
    assert listed == ["epoch=2.ckpt", "last.ckpt"]
    steps = [p.rsplit("/", 1)[1] for p in fs.ls(f"{remote.removeprefix('s3://')}/last.ckpt")]
    assert [n for n in steps if n.startswith("step-")] == ["step-0000000002"]
    # a new machine, its checkpoint directory empty: ckpt_path names the file, read from the bucket
    fresh = ResilientCheckpointIO(remote=remote, storage_options=s3_server["options"])
    loaded = fresh.load_checkpoint(tmp_path / "elsewhere" / "last.ckpt")
    assert loaded["epoch"] == 2 and torch.equal(loaded["state_dict"]["weight"], _checkpoint(2)["state_dict"]["weight"])
    with pytest.raises(FileNotFoundError, match=r"epoch=9.ckpt does not exist here, and s3://.*/epoch=9.ckpt holds no"):
        fresh.load_checkpoint(tmp_path / "elsewhere" / "epoch=9.ckpt")
    # a URL for a path: refused, naming it and what to pass instead (nothing written to ./s3:/)
    with pytest.raises(ValueError, match=r"cannot save s3://b/run/last.ckpt: .*remote='s3://b/run'"):
        io.save_checkpoint(_checkpoint(3), "s3://b/run/last.ckpt")
    assert not os.path.exists("s3:")


def test_the_plugin_serves_a_trainer_of_the_lightning_package_too(tmp_path):
    """``import lightning as L`` ships its own CheckpointIO class, and its Trainer refuses a
    plugin not derived from it: the same plugin saves under that Trainer, and a second
    Trainer resumes from its last.ckpt (``ckpt_path="last"``) with the weights it saved."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from resilient.lightning import ResilientCheckpointIO

    Tiny, loader = _tiny(L.LightningModule), _tiny_loader()

    def trainer(epochs: int):
        return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[ResilientCheckpointIO()],
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])

    first = Tiny()
    trainer(2).fit(first, loader)
    assert os.path.isdir(tmp_path / "last.ckpt")  # a resilient root, not a pickle
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    assert all(torch.equal(v, saved[k]) for k, v in Tiny.load_from_checkpoint(tmp_path / "last.ckpt").state_dict().items())
    second, restored = Tiny(), {}

    class Spy(L.Callback):
        def on_train_start(self, trainer, module):  # after the restore, before any step
            restored.update({k: v.clone() for k, v in module.state_dict().items()} | {"step": trainer.global_step})

    resumed = trainer(3)
    resumed.callbacks.append(Spy())
    resumed.fit(second, loader, ckpt_path="last")
    assert restored.pop("step") == 8 and resumed.global_step == 12
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    # one class serves both packages' Trainers
    assert isinstance(ResilientCheckpointIO(), pl.plugins.io.CheckpointIO)


_TERM_AT = '''
import os, signal, sys
sys.path.insert(0, os.path.join(sys.argv[2], "examples"))
import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from lightning_train import Regressor, data
from resilient.lightning import ResilientCheckpointIO

class TermAt(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 12:
            os.kill(os.getpid(), signal.SIGTERM)

pl.seed_everything(0, verbose=False)
trainer = pl.Trainer(max_epochs=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, plugins=[ResilientCheckpointIO()],
                     callbacks=[ModelCheckpoint(dirpath=sys.argv[1], save_on_exception=True), TermAt()])
try:
    trainer.fit(Regressor(), data())
except BaseException as exc:
    print(f"fit ended by {type(exc).__name__}, status {trainer.state.status.value}", flush=True)
    raise
'''


def test_sigterm_is_lightnings_to_answer_and_its_exception_checkpoint_is_committed(tmp_path):
    """Lightning answers SIGTERM itself: it stops at the step (``SIGTERMException``), saves
    ``save_on_exception``'s checkpoint through the plugin and tears down. The plugin's
    Checkpointers leave the signal alone: before, the first of them heard it too, and its
    save of the exception checkpoint ended the process from inside Lightning's exception
    hook (a SystemExit of its own, Lightning's teardown and re-raise skipped)."""
    from resilient._catalog import Catalog
    from resilient._storage import LocalStorage

    script = tmp_path / "term_at.py"
    script.write_text(_TERM_AT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), REPO], capture_output=True, text=True,
                         timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    said = out.stdout + out.stderr
    assert "fit ended by SIGTERMException, status interrupted" in said and "preempted" not in said, said[-3000:]
    saved = tmp_path / "ck" / "epoch=1-step=12.ckpt"
    assert f"saved checkpoint to {saved}" in said.replace("\n", " "), said[-3000:]
    assert Catalog(LocalStorage(str(saved))).committed_steps() == [1]


def test_a_strategy_that_saves_without_the_plugin_is_named_when_the_trainer_is_made(caplog):
    """Lightning's sharded strategies write their checkpoints with DCP and never call the
    Trainer's CheckpointIO: the plugin says so, naming the strategy and what to use, when the
    Trainer hands it over (resilient's strategies too: they need no plugin); strategies
    whose saves go through it pass without a word."""
    from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy

    from resilient.lightning import ResilientCheckpointIO, ResilientModelParallelStrategy

    def warned(strategy) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="resilient"):
            trainer = pl.Trainer(strategy=strategy, plugins=[ResilientCheckpointIO()], accelerator="cpu", devices=1,
                                 logger=False, enable_progress_bar=False, enable_model_summary=False)
        assert isinstance(trainer.strategy.checkpoint_io, ResilientCheckpointIO)
        return [r.getMessage() for r in caplog.records if "will write nothing" in r.getMessage()]

    [message] = warned(ModelParallelStrategy())
    assert "ModelParallelStrategy writes its checkpoints with torch.distributed.checkpoint" in message
    assert "strategy=resilient.lightning.ResilientModelParallelStrategy(...)" in message
    assert warned(ModelParallelStrategy(save_distributed_checkpoint=False)) == []  # one file, through the plugin
    assert warned("ddp") == []
    [message] = warned(ResilientModelParallelStrategy())  # given the plugin too: it is not needed
    assert "ResilientModelParallelStrategy saves its checkpoints itself, resilient's way" in message

    # FSDPStrategy wants a GPU in a Trainer: the plugin is handed over as the Trainer does it
    def handed(strategy) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="resilient"):
            strategy.checkpoint_io = ResilientCheckpointIO()
        return [r.getMessage() for r in caplog.records if "will write nothing" in r.getMessage()]

    [message] = handed(FSDPStrategy(state_dict_type="sharded"))
    assert "FSDPStrategy(state_dict_type='sharded')" in message and "state_dict_type='full'" in message
    assert handed(FSDPStrategy()) == []  # Lightning's default, "full": rank 0 saves through the plugin

    L = pytest.importorskip("lightning")  # the other package's strategies are watched too
    [message] = handed(L.pytorch.strategies.ModelParallelStrategy())
    assert "pytorch_lightning's Trainer with strategy=resilient.lightning.ResilientModelParallelStrategy" in message


def _held_upload(monkeypatch, root: str | None = None) -> tuple[threading.Event, threading.Event, list]:
    """(held, release, copied): the first upload to a directory (of the checkpoint named
    ``root``, if given) waits in its first piece, ``held`` set, until ``release`` is set;
    ``copied`` gets (checkpoint name, step) for every piece that goes up."""
    from resilient import _transfer

    held, release, copied = threading.Event(), threading.Event(), []
    copying = _transfer._copying

    def holding(src, dst, step, fname, manifest, progress):
        name = os.path.basename(src.storage.root)
        for piece in copying(src, dst, step, fname, manifest, progress):
            if root in (None, name) and not held.is_set():
                held.set()
                assert release.wait(60), "never released"
            copied.append((name, step))
            yield piece

    monkeypatch.setattr(_transfer, "_copying", holding)
    return held, release, copied


def test_a_path_saved_again_does_not_wait_for_its_upload(tmp_path, monkeypatch):
    """``last.ckpt`` is saved at every checkpoint. Each save there used to wait, inside the
    step, for the previous one to be drained to the object store: now the path keeps its
    checkpointer, the save waits only for the previous local write, and the upload queue
    takes the newest. A top-k path, saved once, has its checkpointer closed once drained."""
    from resilient import Checkpointer
    from resilient.lightning import ResilientCheckpointIO

    held, release, copied = _held_upload(monkeypatch, "last.ckpt")
    closed_on: dict[str, str] = {}  # root -> the thread that closed its checkpointer
    closing = Checkpointer.close

    def noted(ckpt, *args, **kwargs):
        closed_on.setdefault(os.path.basename(ckpt.root), threading.current_thread().name)
        return closing(ckpt, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "close", noted)
    remote = tmp_path / "bucket"
    io = ResilientCheckpointIO(remote=f"file://{remote}")
    io.save_checkpoint(_checkpoint(1), tmp_path / "epoch=1.ckpt")
    io.save_checkpoint(_checkpoint(1), tmp_path / "last.ckpt")
    assert held.wait(30)
    kept = io._open[str(tmp_path / "last.ckpt")]
    io.save_checkpoint(_checkpoint(2), tmp_path / "last.ckpt")  # waited here for the held upload
    assert not release.is_set() and io._open[str(tmp_path / "last.ckpt")] is kept
    io.save_checkpoint(_checkpoint(3), tmp_path / "last.ckpt")
    assert ("last.ckpt", 1) not in copied and not kept._uploader.uploaded(1)  # its first upload is still held
    release.set()
    kept.flush(timeout=60)
    # epoch=1.ckpt's upload drained, if it was not already (under load it was not, and its
    # checkpointer was still open at the next save)
    first = io._open.get(str(tmp_path / "epoch=1.ckpt"))
    if first is not None:
        first.flush(timeout=60)
    io.save_checkpoint(_checkpoint(4), tmp_path / "epoch=4.ckpt")  # epoch=1.ckpt's, drained, is closed
    assert sorted(io._open) == [str(tmp_path / p) for p in ("epoch=4.ckpt", "last.ckpt")]
    assert io._open[str(tmp_path / "last.ckpt")] is kept  # saved more than once: kept open
    io.teardown()
    # closed off the step (on every rank but 0 a close waits for rank 0's commit on the store)
    assert closed_on["epoch=1.ckpt"].startswith("resilient-housekeeping"), closed_on
    # the newest save at each path is the one on the object store, and the one loaded
    fresh = ResilientCheckpointIO(remote=f"file://{remote}")
    for path, epoch in (("last.ckpt", 3), ("epoch=1.ckpt", 1), ("epoch=4.ckpt", 4)):
        loaded = fresh.load_checkpoint(tmp_path / "new-node" / path)
        assert loaded["epoch"] == epoch
        assert torch.equal(loaded["state_dict"]["weight"], _checkpoint(epoch)["state_dict"]["weight"])
        assert torch.equal(io.load_checkpoint(tmp_path / path)["state_dict"]["bias"], _checkpoint(epoch)["state_dict"]["bias"])
    assert sorted(n for n in os.listdir(remote / "last.ckpt") if n.startswith("step-")) == ["step-0000000003"]
    # a new node, its disk empty, saves last.ckpt again: numbered after what the store holds
    # there (the names on the store are listed once), so the store keeps the new one
    node = ResilientCheckpointIO(remote=f"file://{remote}")
    node.save_checkpoint(_checkpoint(5), tmp_path / "node" / "last.ckpt")
    node.save_checkpoint(_checkpoint(5), tmp_path / "node" / "epoch=5.ckpt")
    node.teardown()
    assert sorted(n for n in os.listdir(remote / "last.ckpt") if n.startswith("step-")) == ["step-0000000004"]
    assert fresh.load_checkpoint(tmp_path / "another-node" / "last.ckpt")["epoch"] == 5


def test_a_path_saved_again_after_its_upload_drained_keeps_its_checkpointer(tmp_path):
    """The second save of ``last.ckpt``, its first one committed and drained: the path was
    then saved once, and the save closed its checkpointer just before saving there again
    with a new one, which waited for the old one's upload and listed the store (seen in
    ``test_lightning_parallel``'s run under a loaded CI, where the upload drained between
    the two saves of one checkpoint). The path about to be saved keeps its checkpointer."""
    from resilient.lightning import ResilientCheckpointIO

    io = ResilientCheckpointIO(remote=f"file://{tmp_path / 'bucket'}")
    io.save_checkpoint(_checkpoint(1), tmp_path / "last.ckpt")
    first = io._open[str(tmp_path / "last.ckpt")]
    first.flush(timeout=60)
    io.save_checkpoint(_checkpoint(2), tmp_path / "last.ckpt")
    assert io._open[str(tmp_path / "last.ckpt")] is first
    io.teardown()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["epoch"] == 2


def test_a_failed_save_is_raised_at_the_next_save_once(tmp_path, monkeypatch):
    """A save whose write fails in the background is raised from the plugin's next save (as
    Lightning's AsyncCheckpointIO raises it), once: the save after it goes on, and what is
    loaded is the newest save that committed."""
    from resilient import CommitError
    from resilient.lightning import ResilientCheckpointIO

    monkeypatch.setenv("RESILIENT_FAULT", "raise:rank=0,step=2,phase=write")  # last.ckpt's second save
    monkeypatch.setenv("RESILIENT_FAULT_DIR", str(tmp_path / "faults"))
    io = ResilientCheckpointIO()
    for epoch in (1, 2):
        io.save_checkpoint(_checkpoint(epoch), tmp_path / "last.ckpt")
    io._open[str(tmp_path / "last.ckpt")]._inflight.settled()
    with pytest.raises(CommitError, match="step 2"):
        io.save_checkpoint(_checkpoint(3), tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["epoch"] == 1
    io.save_checkpoint(_checkpoint(4), tmp_path / "last.ckpt")
    io.teardown()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["epoch"] == 4
    # failed in the last save before the end of fit: raised by teardown, once every other
    # save is committed. (The failing save is the last one: after it, any save would raise
    # it, and whether the save after it came before its failure was a race; it lost under
    # load in one full run.)
    monkeypatch.setenv("RESILIENT_FAULT", "raise:rank=0,step=3,phase=write")  # a.ckpt's third save
    monkeypatch.setenv("RESILIENT_FAULT_DIR", str(tmp_path / "faults-again"))
    io = ResilientCheckpointIO()
    for epoch in (5, 6):
        io.save_checkpoint(_checkpoint(epoch), tmp_path / "a.ckpt")
        io.save_checkpoint(_checkpoint(epoch), tmp_path / "b.ckpt")
    io.save_checkpoint(_checkpoint(7), tmp_path / "a.ckpt")  # fails
    with pytest.raises(CommitError, match="step 3"):
        io.teardown()
    assert io._open == {} and io.load_checkpoint(tmp_path / "b.ckpt")["epoch"] == 6
    assert io.load_checkpoint(tmp_path / "a.ckpt")["epoch"] == 6


def test_a_checkpoint_removed_while_it_goes_up_stops_quietly(tmp_path, monkeypatch, caplog):
    """Lightning removes a top-k checkpoint whose upload may still be running: the upload
    stops with its files (no "failed, retrying" warnings about files it was told to drop),
    and nothing of it is left on the object store."""
    from resilient import _transfer
    from resilient.lightning import ResilientCheckpointIO

    held, release, _ = _held_upload(monkeypatch)
    monkeypatch.setattr(_transfer, "LOCAL_SPAN", 1 << 20)
    io = ResilientCheckpointIO(remote=f"file://{tmp_path / 'bucket'}")
    big = {"epoch": 1, "state_dict": {"w": torch.randn(4 << 20)}}  # 16 MB: pieces left after the first
    io.save_checkpoint(big, tmp_path / "epoch=1.ckpt")
    assert held.wait(30)
    with caplog.at_level("WARNING", logger="resilient"):
        io.remove_checkpoint(tmp_path / "epoch=1.ckpt")  # renamed away under the upload
        release.set()
        io.save_checkpoint(_checkpoint(2), tmp_path / "epoch=2.ckpt")
        io.teardown()
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert sorted(os.listdir(tmp_path / "bucket")) == ["epoch=2.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["bucket", "epoch=2.ckpt"]
