"""Lightning's ``ModelParallelStrategy`` (FSDP2 on two gloo ranks) with resilient's
checkpoints: ``ResilientModelParallelStrategy``, run as a Lightning user runs it."""

import os
import subprocess
import sys

import pytest
import torch

from .launch import REPO

pytest.importorskip("pytorch_lightning")

pytestmark = pytest.mark.timeout(300)

_SCRIPT = '''
import os, sys, time, torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from resilient.lightning import ResilientDDPStrategy, ResilientModelParallelStrategy

class Sharded(pl.LightningModule):
    def __init__(self, width=16):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def configure_model(self):
        if os.environ.get("STRATEGY") == "ddp":  # replicated: the model as it is on every rank
            return
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, index):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)  # each rank its own (no sync_dist): a monitor's score differs by rank
        return loss

    def configure_optimizers(self):
        if os.environ.get("ZERO"):  # torch's ZeRO-1, which no save here may consolidate
            from torch.distributed.optim import ZeroRedundancyOptimizer
            def refused(*args, **kwargs):
                raise AssertionError("a save consolidated the ZeRO optimizer's state onto one rank")
            ZeroRedundancyOptimizer.consolidate_state_dict = refused
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

def local_optimizer(trainer):  # ZeRO's state is its local optimizer's
    optimizer = trainer.optimizers[0]
    return getattr(optimizer, "optim", optimizer)

def whole(module):  # every rank takes part: full_tensor gathers the shards
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}

class Record(Callback):
    """The whole weights at each checkpoint's step, and at the start of training."""
    def on_train_start(self, trainer, module):
        weights = whole(module)
        if trainer.global_rank == 0:
            torch.save({"step": trainer.global_step, "weights": weights,
                        "adam_steps": sorted({float(s["step"]) for s in local_optimizer(trainer).state.values()})},
                       os.path.join(out, "start.pt"))
    def on_train_batch_end(self, trainer, module, *rest):
        weights = whole(module)
        if trainer.global_rank == 0:
            torch.save(weights, os.path.join(out, f"weights-{trainer.global_step}.pt"))

class Kept(Callback):
    """Which of each rank's checkpointers of last.ckpt is open as each save begins (0: none),
    last.ckpt being saved as a copy (save_last=True)."""
    numbered = 0
    def on_save_checkpoint(self, trainer, module, checkpoint):
        ckpt = trainer.strategy._saving.get(os.path.join(os.path.realpath(ckpts), "last.ckpt"))
        if ckpt is not None and not hasattr(ckpt, "number"):
            Kept.numbered += 1
            ckpt.number = Kept.numbered
        with open(os.path.join(out, f"kept-{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {getattr(ckpt, 'number', 0)}\\n")

class Buffers(Callback):
    """The staging buffers: made at the first optimizer step (before any save), tagged at the
    end of that step; whether they are the ones the saves use, at each checkpoint's step and
    the step after it; and where the first save's shards are (their device)."""
    def on_train_batch_end(self, trainer, module, *rest):
        slots, step = trainer.strategy._files._buffers._slots, trainer.global_step
        if step == 1:
            for slot in slots:
                for _ in range(1000):  # mapped at once where the kernel populates; else by the thread
                    if slot.staging._memory is not None:
                        break
                    time.sleep(0.01)
                slot.staging._memory.tagged = True
        tagged = [getattr(slot.staging._memory, "tagged", False) for slot in slots]
        with open(os.path.join(out, f"buffers-{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{step} {len(slots)} {sum(tagged)}\\n")
    def on_save_checkpoint(self, trainer, module, checkpoint):
        with open(os.path.join(out, f"devices-{trainer.global_rank}.txt"), "a") as f:
            f.write(" ".join(sorted({v.device.type for v in checkpoint["state_dict"].values()})) + "\\n")

if os.environ.get("FAIL_ALONE") and os.environ.get("LOCAL_RANK") == "1":  # a failure rank 1 alone meets
    import resilient._lightning_parallel as strategy_module
    looked = []
    def done_with(saving, saves, now, _real=strategy_module.done_with):
        looked.append(1)
        if len(looked) == 2:  # at the second checkpoint's save
            raise OSError("rank 1 alone")
        return _real(saving, saves, now)
    strategy_module.done_with = done_with

ckpts, out, steps, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resume = sys.argv[5] if len(sys.argv) > 5 else None
os.makedirs(out, exist_ok=True)
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
if os.environ.get("SAVE_LAST") == "copy":  # last.ckpt saved again at every checkpoint, the step's own file removed
    saving = [ModelCheckpoint(dirpath=ckpts, every_n_train_steps=4, save_top_k=1, save_last=True), Kept()]
else:
    saving = [ModelCheckpoint(dirpath=ckpts, every_n_train_steps=int(os.environ.get("EVERY", 4)), save_top_k=-1,
                              save_last="link", monitor=os.environ.get("MONITOR"))]
if os.environ.get("STRATEGY") == "ddp":
    strategy = ResilientDDPStrategy(remote=os.environ.get("REMOTE"))
else:
    strategy = ResilientModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1,
                                              remote=os.environ.get("REMOTE"))
trainer = pl.Trainer(max_steps=steps, accelerator=os.environ.get("ACCELERATOR", "cpu"), devices=ranks, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
                     callbacks=[*saving, Record(), Buffers()])
torch.manual_seed(0)
trainer.fit(Sharded(), data, ckpt_path=resume)
print(f"rank {trainer.global_rank}: trained to step {trainer.global_step}", flush=True)
'''


def _run(tmp_path, *args: str, env: dict | None = None, fails: bool = False) -> str:
    script = tmp_path / "sharded.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=240,
                         cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **(env or {})})
    assert (out.returncode != 0) == fails, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout + out.stderr


def _made_at_the_first_step(out, rank: int) -> None:
    """The buffer of a checkpoint's one save (a step's file; last.ckpt a link to it) was made
    at the first optimizer step, and every save used it: it was never made again (a second
    one is made only for a save that finds the first still being written)."""
    lines = [line.split() for line in (out / f"buffers-{rank}.txt").read_text().splitlines()]
    assert [step for step, _, _ in lines] == [str(step) for step in range(1, 9)], lines
    assert lines[0] == ["1", "1", "1"] and all(slots in "12" and tagged == "1" for _, slots, tagged in lines), lines


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp2_under_lightning_saves_shards_and_resumes_exactly_at_another_world_size(tmp_path):
    """Two ranks train 8 steps, a checkpoint every 4 (an epoch: the data position is
    Lightning's to restore), each rank writing its own shards. Resumed from step 4 on two
    ranks, the run ends bit for bit where the uninterrupted one did; on one rank (the shards
    cut again), from ``last.ckpt`` (a link to step 8's), training starts from step 8's
    weights and Adam's step count."""
    from resilient._catalog import Catalog
    from resilient._storage import LocalStorage

    ckpts = tmp_path / "ckpts"
    said = _run(tmp_path, str(ckpts), str(tmp_path / "full"), "8", "2")
    assert "rank 0: trained to step 8" in said
    for rank in (0, 1):
        _made_at_the_first_step(tmp_path / "full", rank)
        # the shards given to the save where the model is (not copied to the CPU first)
        assert (tmp_path / "full" / f"devices-{rank}.txt").read_text() == "cpu\ncpu\n"
    step4 = ckpts / "epoch=0-step=4.ckpt"
    manifest = Catalog(LocalStorage(str(step4))).manifest(1)
    assert sorted(manifest["files"]) == ["rank-00000.data", "rank-00001.data"]  # a shard file per rank
    assert any(len(meta["boxes"]) == 2 for meta in manifest["tensors"].values() if "boxes" in meta), manifest["tensors"]

    _run(tmp_path, str(tmp_path / "again"), str(tmp_path / "resumed"), "8", "2", str(step4))
    assert _same(torch.load(tmp_path / "resumed" / "weights-8.pt"), torch.load(tmp_path / "full" / "weights-8.pt"))

    # last.ckpt is a link to step 8's directory (save_last="link"), made on rank 0's node
    assert os.readlink(ckpts / "last.ckpt") == "epoch=1-step=8.ckpt"
    _run(tmp_path, str(tmp_path / "alone"), str(tmp_path / "one"), "9", "1", str(ckpts / "last.ckpt"))
    start = torch.load(tmp_path / "one" / "start.pt")
    assert start["step"] == 8 and start["adam_steps"] == [8.0]
    assert _same(start["weights"], torch.load(tmp_path / "full" / "weights-8.pt"))


def test_ddp_saves_each_ranks_slice_and_resumes_at_another_world_size(tmp_path):
    """``ResilientDDPStrategy``: the model and Adam's state, the same on both ranks, are
    saved by both, each writing its slice of the bytes (under the plugin rank 0 copies and
    writes all of it while the other waits); the buffers are made at the first optimizer
    step; the rest of Lightning's checkpoint is rank 0's, a monitored score that differs by
    rank included. Resumed on one rank from step 4, training starts from step 4's weights and Adam's
    step count."""
    ddp = {"STRATEGY": "ddp", "MONITOR": "loss"}  # each rank's callback scores its own loss
    said = _run(tmp_path, str(tmp_path / "ckpts"), str(tmp_path / "full"), "8", "2", env=ddp)
    assert "rank 0: trained to step 8" in said
    step4 = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    [step] = [name for name in os.listdir(step4) if name.startswith("step-")]
    sizes = [os.path.getsize(step4 / step / f"rank-0000{rank}.data") for rank in (0, 1)]
    assert min(sizes) > 0.3 * sum(sizes), sizes  # each rank wrote about half
    for rank in (0, 1):
        _made_at_the_first_step(tmp_path / "full", rank)
    # read by the plugin (and so by Model.load_from_checkpoint) as Lightning saved it
    from resilient.lightning import ResilientCheckpointIO

    saved = ResilientCheckpointIO().load_checkpoint(step4)
    assert saved["global_step"] == 4 and saved["hyper_parameters"] == {"width": 16} and saved["optimizer_states"]
    # the callbacks' state is rank 0's, as Lightning saves it (a score that differed by rank
    # failed the save: a plain tensor every rank must hold alike)
    [scored] = [v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert scored["monitor"] == "loss" and scored["best_model_score"].numel() == 1
    assert _same(saved["state_dict"], torch.load(tmp_path / "full" / "weights-4.pt"))
    _run(tmp_path, str(tmp_path / "alone"), str(tmp_path / "one"), "5", "1", str(step4), env=ddp)
    start = torch.load(tmp_path / "one" / "start.pt")
    assert start["step"] == 4 and start["adam_steps"] == [4.0]
    assert _same(start["weights"], torch.load(tmp_path / "full" / "weights-4.pt"))


def test_ddp_with_a_zero_optimizer_saves_each_ranks_part_without_consolidating(tmp_path):
    """``ResilientDDPStrategy`` with torch's ``ZeroRedundancyOptimizer``: each rank saves its
    partition's state (Lightning's own ``optimizer_state`` consolidates it onto rank 0 inside
    the step, which the run here refuses); resumed on one rank, where one ZeRO holds every
    parameter, from step 4's weights and Adam's step count."""
    ddp = {"STRATEGY": "ddp", "ZERO": "1"}
    said = _run(tmp_path, str(tmp_path / "ckpts"), str(tmp_path / "full"), "8", "2", env=ddp)
    assert "rank 0: trained to step 8" in said
    step4 = str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")
    _run(tmp_path, str(tmp_path / "alone"), str(tmp_path / "one"), "5", "1", step4, env=ddp)
    start = torch.load(tmp_path / "one" / "start.pt")
    assert start["step"] == 4 and start["adam_steps"] == [4.0]
    assert _same(start["weights"], torch.load(tmp_path / "full" / "weights-4.pt"))


def test_a_failure_on_one_rank_stops_every_rank_at_the_next_save_naming_it(tmp_path):
    """At the next save, a save that failed in the background is raised (``done_with``).
    Where one rank alone learns of a failure (here one made on rank 1 as it looks at its
    finished saves, as a disk error closing its checkpointer would), that rank raises it
    and every other rank raises an error naming that rank and the failure. Before, rank 1
    raised before a collective rank 0 had entered, and rank 0 died of gloo's "Connection
    closed by peer"."""
    said = _run(tmp_path, str(tmp_path / "ckpts"), str(tmp_path / "out"), "6", "2",
                env={"EVERY": "2", "FAIL_ALONE": "1"}, fails=True)
    assert "trained to step" not in said and "[rank1]: OSError: rank 1 alone" in said, said[-3000:]
    assert ("[rank0]: resilient._errors.ResilientError: a save that ResilientModelParallelStrategy wrote in the "
            "background failed on rank 1: OSError: rank 1 alone") in said, said[-3000:]


def test_last_ckpt_saved_again_keeps_each_ranks_checkpointer(tmp_path):
    """``save_last=True`` saves last.ckpt again at every checkpoint (every 4 steps, an epoch,
    here), drained to an object store (a directory). From its third save on, every rank goes
    on with the checkpointer it has for that path (a new one for each save waited in the
    step for the last one's upload, and listed the remote tier on every rank); resumed from
    last.ckpt, training starts from the last save's weights and Adam's step count."""
    ckpts, bucket = tmp_path / "ckpts", tmp_path / "bucket"
    _run(tmp_path, str(ckpts), str(tmp_path / "full"), "16", "2", env={"SAVE_LAST": "copy", "REMOTE": f"file://{bucket}"})
    for rank in (0, 1):
        kept = [line.split() for line in (tmp_path / "full" / f"kept-{rank}.txt").read_text().splitlines()]
        # each checkpoint saves the step's file, then last.ckpt: the second's view is the one that counts
        assert [int(step) for step, _ in kept[1::2]] == [4, 8, 12, 16], kept
        at_last = [int(number) for _, number in kept[1::2]]
        # the first save's checkpointer may be closed once idle (a path saved once is not
        # kept), the second's is kept for every later save
        assert at_last[0] == 0 and at_last[1] in (0, at_last[2]) and at_last[2] == at_last[3] > 0, kept
    [newest, last] = sorted(os.listdir(ckpts))  # top-1: the others removed
    assert newest.endswith("-step=16.ckpt") and last == "last.ckpt"
    # on the object store too: the removed files' copies deleted once each rank's upload
    # stopped, off the step, with nothing of theirs landed after
    assert sorted(os.listdir(bucket)) == [newest, last]
    for name in (newest, last):
        [step] = [n for n in os.listdir(bucket / name) if n.startswith("step-")]
        uploaded = sorted(n for n in os.listdir(bucket / name / step) if ".checked-" not in n)  # (check markers)
        assert uploaded == sorted(os.listdir(ckpts / name / step))
    _run(tmp_path, str(tmp_path / "again"), str(tmp_path / "resumed"), "17", "2", str(ckpts / "last.ckpt"),
         env={"SAVE_LAST": "copy"})
    start = torch.load(tmp_path / "resumed" / "start.pt")
    assert start["step"] == 16 and start["adam_steps"] == [16.0]
    assert _same(start["weights"], torch.load(tmp_path / "full" / "weights-16.pt"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_staging.sh runs it)")
def test_on_a_gpu_the_shards_reach_the_save_on_the_device_and_come_back_exact(tmp_path):
    """On an accelerator the strategy hands the save the shards where they are, for its own
    pinned staging to copy (Lightning's ``ModelParallelStrategy`` copied each into new
    pageable host memory first, inside the step); the buffers are made at the first
    optimizer step and pinned; resumed, training starts from step 4's weights exactly."""
    gpu = {"ACCELERATOR": "cuda"}
    _run(tmp_path, str(tmp_path / "ckpts"), str(tmp_path / "full"), "8", "1", env=gpu)
    assert (tmp_path / "full" / "devices-0.txt").read_text() == "cuda\ncuda\n"
    _made_at_the_first_step(tmp_path / "full", 0)
    _run(tmp_path, str(tmp_path / "again"), str(tmp_path / "resumed"), "8", "1",
         str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"), env=gpu)
    assert _same(torch.load(tmp_path / "resumed" / "weights-8.pt"), torch.load(tmp_path / "full" / "weights-8.pt"))
