"""Data loaders as users hold them: torchdata's ``StatefulDataLoader``, and the one
``accelerate`` prepares, in a loop whose steps draw random numbers (dropout). A resumed run
sees the batches and the random numbers the uninterrupted run saw, at an epoch's end, in
its middle and after it; ``examples/accelerate_train.py`` on two ranks under
``resilient-run``, SIGKILLed in its second epoch, ends bit for bit where the uninterrupted
run does, and resumed on one rank goes on from the same point of the epoch."""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from resilient import Checkpointer, UnsupportedStateError

from .launch import REPO, run_ranks

pytest.importorskip("torchdata")
accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(240)

EPOCH = 4  # batches an epoch


def _dataset() -> torch.utils.data.Dataset:
    return torch.utils.data.TensorDataset(torch.arange(4.0 * EPOCH))


def _torchdata_loader():
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    return StatefulDataLoader(_dataset(), batch_size=4, shuffle=True)


def _accelerate_loader(seedable: bool = True, stateful: bool = True):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, use_seedable_sampler=seedable)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(0)
    return accelerator.prepare(torch.utils.data.DataLoader(_dataset(), batch_size=4, shuffle=True))


def _steps(loader, until: int, start: int = 0, save_at: int | None = None, root: str | None = None) -> list:
    """(batch, the step's random number) of each step from ``start`` to ``until``, epoch
    after epoch; with ``save_at``, the loader is checkpointed (generators too) at that step."""
    seen, step = [], start
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(Checkpointer(root)) if root is not None else None
        while step < until:
            for (batch,) in loader:
                step += 1
                seen.append((batch.tolist(), torch.rand(1).item()))  # a dropout mask's draw
                if step == save_at:
                    ckpt.save(step, {"loader": loader}, force=True)
                if step == until:
                    break
    return seen


@pytest.mark.parametrize("kind", ["torchdata", "accelerate"])
@pytest.mark.parametrize("save_at", [2, EPOCH, EPOCH + 1, 2 * EPOCH])
def test_a_restored_loader_gives_the_batches_and_random_numbers_of_the_uninterrupted_run(tmp_path, kind, save_at):
    """Before, the order was right but every random number after a resume was one draw off
    (the resumed iterator drew its seed after the restore had set the generators), and an
    accelerate loader resumed after its first epoch replayed that epoch's order, or, saved
    at an epoch's last batch, began that epoch again."""
    make = _torchdata_loader if kind == "torchdata" else _accelerate_loader
    uninterrupted = _steps(make(), 3 * EPOCH)
    root = str(tmp_path / "ckpt")
    _steps(make(), save_at, save_at=save_at, root=root)
    resumed_loader = make()
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"loader": resumed_loader}) == save_at
    assert _steps(resumed_loader, 3 * EPOCH, start=save_at) == uninterrupted[save_at:]


@pytest.mark.parametrize("world", [1, 3])
def test_a_distributed_samplers_loader_resumed_by_another_number_of_ranks_takes_the_rest_of_the_epoch(
        tmp_path, world):
    """Two ranks take 6 batches each (48 of the epoch's 96 samples) and save; 1 or 3 ranks
    restore and take the rest: every sample once. Before, each restored rank went on 6 of
    its own batches in: 24 samples seen again on one rank, 24 skipped on three."""
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks("distributed_sampler_position", 2, {"root": root, "out": out, "save": True, "batches": 6},
              env={"FORCE_DIST": "1"})
    run_ranks("distributed_sampler_position", world, {"root": root, "out": out, "save": False},
              env={"FORCE_DIST": "1"})
    taken = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                taken += json.load(f)
    assert sorted(taken) == list(range(96)), sorted(taken)


@pytest.mark.parametrize("field, value", [("epoch", -1), ("epoch", "3"), ("processes", 0), ("processes", True)])
def test_a_loaders_saved_epoch_or_process_count_out_of_range_is_refused_by_name(tmp_path, field, value):
    """A checkpoint is input: a loader's state whose epoch or number of processes no run
    could have saved is refused, naming the entry and the field, before the loader is set."""
    from resilient import StateError
    from resilient._loaders import loader_adapter

    loader = _accelerate_loader()
    batches = iter(loader)
    next(batches), next(batches)
    saved = loader_adapter(loader).state_dict()  # what a save holds, with one field changed
    saved[field] = value
    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as ckpt:
        ckpt.save(2, {"loader": saved}, force=True)
    with Checkpointer(root) as ckpt, pytest.raises(StateError) as err:
        ckpt.restore({"loader": _accelerate_loader()})
    assert "'loader'" in str(err.value) and f"saved {field} is {value!r}" in str(err.value), err.value



def _nodes_loader():
    """torchdata.nodes: a shuffled order from the sampler's own generator, mapped on threads."""
    from torchdata.nodes import Batcher, Loader, ParallelMapper, SamplerWrapper

    sampler = torch.utils.data.RandomSampler(range(40), generator=torch.Generator().manual_seed(0))
    mapped = ParallelMapper(SamplerWrapper(sampler), map_fn=lambda i: i * 10, num_workers=2, method="thread")
    return Loader(Batcher(mapped, batch_size=4))


def test_a_torchdata_nodes_loader_resumes_with_the_rest_of_its_epoch(tmp_path):
    """A restore asked the loader for its state before loading it, which made it an
    iterator that its next ``iter()`` then took as it was: the resumed run began the epoch
    again (10 batches where 7 were left), and drew its order once too often."""
    pytest.importorskip("torchdata.nodes")
    whole = list(_nodes_loader())
    loader = _nodes_loader()
    batches = iter(loader)
    seen = [next(batches) for _ in range(3)]
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(3, {"data": loader}).result()
    resumed = _nodes_loader()  # fresh, as after a restart: torchdata's own load_state_dict gives the same
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore({"data": resumed}) == 3
    assert seen + list(resumed) == whole

def test_a_plain_dataloader_is_refused_naming_what_keeps_a_position(tmp_path):
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, shuffle=True)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt, pytest.raises(UnsupportedStateError) as err:
        ckpt.save(1, {"loader": loader}, force=True)
    assert "state['loader']" in str(err.value) and "StatefulDataLoader" in str(err.value), err.value


def test_an_accelerate_loader_without_its_state_is_refused_naming_the_setting(tmp_path):
    loader = _accelerate_loader(stateful=False)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt, pytest.raises(UnsupportedStateError) as err:
        ckpt.save(1, {"loader": loader}, force=True)
    assert "use_stateful_dataloader=True" in str(err.value)
    assert "state['loader']" in "".join(getattr(err.value, "__notes__", [])), err.value.__notes__


def test_a_shuffle_whose_order_cannot_come_back_is_warned_of_once(tmp_path, caplog):
    loader = _accelerate_loader(seedable=False)
    with caplog.at_level(logging.WARNING, logger="resilient"), Checkpointer(str(tmp_path / "ckpt"), keep=None) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"loader": loader}, force=True)
    warnings = [r for r in caplog.records if "RandomSampler" in r.getMessage()]
    assert len(warnings) == 1 and "use_seedable_sampler=True" in warnings[0].getMessage()
    seedable = _accelerate_loader(seedable=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="resilient"), Checkpointer(str(tmp_path / "ckpt2")) as ckpt:
        ckpt.save(1, {"loader": seedable}, force=True)
    assert "RandomSampler" not in caplog.text


def test_a_position_restored_by_another_number_of_processes_is_the_same_point_of_the_epoch(caplog):
    from resilient._loaders import _rescaled

    position = {"_sampler_iter_yielded": 8, "_num_yielded": 8, "_index_sampler_state": None, "other": 1}
    assert _rescaled(position, 2, 1) == {**position, "_sampler_iter_yielded": 16, "_num_yielded": 16}
    assert _rescaled(position, 2, 4) == {**position, "_sampler_iter_yielded": 4, "_num_yielded": 4}
    counted = {**position, "_sampler_iter_state": {"samples_yielded": 32}}  # torchdata's batch sampler's own count
    assert _rescaled(counted, 2, 1)["_sampler_iter_state"] == {"samples_yielded": 64}
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="resilient"):
        assert _rescaled(position, 2, 3)["_sampler_iter_yielded"] == 5  # 16 batches: the step before, 15
    assert "1 batch(es) seen again, none skipped" in caplog.text


def _example(*args: str, processes: int = 2) -> str:
    cmd = [sys.executable, "-m", "resilient.launch.run", "--standalone", "--nproc-per-node", str(processes),
           "--max-restarts", "0", "examples/accelerate_train.py", *args]
    # one intra-op thread: a CPU reduction's rounding depends on how it is split (test_hf_example)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    return out.stdout + out.stderr


def test_the_accelerate_example_killed_in_its_second_epoch_resumes_bit_for_bit_and_at_one_process(tmp_path):
    """Two ranks, 16 steps an epoch, a save every 8: killed at step 29, resumed from 24 on
    two ranks (bit for bit), and on one, where the 16 batches of the epoch left take 16
    steps: before, it resumed 8 batches into the epoch and ended it at step 48."""
    full, resumed, one = tmp_path / "full", tmp_path / "resumed", tmp_path / "one"
    out = _example("--dir", str(full), "--steps", "40", "--out", str(tmp_path / "full.pt"))
    assert "epoch 1 ended at step 32" in out and "trained to step 40" in out, out[-3000:]
    assert "killed at step 29" in _example("--dir", str(resumed), "--steps", "40", "--kill-at", "29")
    shutil.copytree(resumed, one)
    out = _example("--dir", str(one), "--steps", "44", processes=1)
    assert "resumed at step 24 on 1 process(es)" in out and "epoch 1 ended at step 40" in out, out[-3000:]
    out = _example("--dir", str(resumed), "--steps", "40", "--out", str(tmp_path / "resumed.pt"))
    assert "resumed at step 24 on 2 process(es)" in out and "trained to step 40" in out, out[-3000:]
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), out[-3000:]
