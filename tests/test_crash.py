"""Crash consistency and integrity in one process: SIGKILL at any moment, flipped bytes."""

import json
import logging
import os
import pickle

import pytest
import torch

from resilient import Checkpointer, CheckpointCorruptError
from resilient._snapshot import byte_view
from resilient._tree import flatten_state

from .faults import flip_byte
from .launch import run_ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.0, 0.03, 0.15])
def test_sigkill_at_any_moment_leaves_a_consistent_latest(tmp_path, delay):
    root = str(tmp_path / "run")
    [result] = run_ranks("kill_during_write", 1, {"root": root, "mbytes": 96, "victim": 0, "delay": delay},
                         expect_ok=False)
    assert result.returncode == -9
    with Checkpointer(root) as ckpt:
        step = ckpt.latest()
        assert step in (1, 2)
        state = {"w": torch.empty(96 * (1 << 20) // 4), "v": torch.empty(1000, dtype=torch.float64)}
        assert ckpt.restore(state) == step
    assert torch.equal(state["w"], torch.full_like(state["w"], float(step)))
    assert torch.equal(state["v"], torch.arange(1000, dtype=torch.float64))


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_flipped_byte_is_skipped_with_a_warning_naming_the_file(root, caplog, compress):
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    with Checkpointer(root, keep=None, compress=compress) as ckpt:
        ckpt.save(1, state)
        state["w"].add_(1)
        ckpt.save(2, state)
    bad = os.path.join(root, "step-0000000002", "rank-00000.data")
    flip_byte(bad, os.path.getsize(bad) // 2)
    target = {"w": torch.zeros(100_000)}
    with caplog.at_level(logging.WARNING, logger="resilient"):
        with Checkpointer(root) as ckpt:
            assert ckpt.restore(target) == 1
            assert ckpt.latest() == 1  # restore learned step 2 is bad
    assert torch.equal(target["w"], torch.arange(100_000, dtype=torch.float32))
    assert any(bad in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)


def test_when_no_committed_checkpoint_loads_the_restore_refuses_to_start_from_scratch(root, capsys):
    """Before, a run whose only checkpoints could not be loaded (a manifest refused, a file
    flipped before any tensor was touched) started from step 0 with a warning, and its new
    saves then replaced them; a restart after a flipped byte had marked the step bad did the
    same without even the warning. Now every attempt refuses, naming the steps and the way
    to start afresh on purpose."""
    from resilient.ckpt import main as ckpt_main

    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000), "meta": {"epoch": 3}})
    manifest = os.path.join(root, "step-0000000001", "manifest.json")
    with open(manifest) as f:
        record = json.load(f)
    record["chunk_bytes"] = 2**31  # refused before anything is read
    with open(manifest, "w") as f:
        json.dump(record, f)
    for attempt in range(2):
        with Checkpointer(root) as ckpt:
            with pytest.raises(CheckpointCorruptError, match=r"step\(s\) 1 are committed but cannot be loaded .* "
                                                             r"not starting from scratch.* --after 0"):
                ckpt.restore({"w": torch.zeros(1000), "meta": {"epoch": 0}})
    assert ckpt_main(["prune", root, "--after", "0"]) == 0 and "deleted step 1" in capsys.readouterr().out
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"w": torch.zeros(1000)}) == 0  # afresh, on purpose

    # a flipped byte is proven damage: the step is marked bad, and the next attempt, which no
    # longer offers it, still refuses
    with Checkpointer(root) as ckpt:
        ckpt.save(2, {"w": torch.ones(1000)})
    flip_byte(os.path.join(root, "step-0000000002", "rank-00000.data"), 100)
    for attempt in range(2):
        with Checkpointer(root) as ckpt:
            with pytest.raises(CheckpointCorruptError, match="no loadable checkpoint"):
                ckpt.restore({"w": torch.zeros(1000)})
    assert os.listdir(os.path.join(root, ".bad"))  # the second attempt found it marked


def test_missing_or_truncated_file_is_skipped(root, caplog):
    state = {"w": torch.ones(1000)}
    with Checkpointer(root, keep=None) as ckpt:
        for step in (1, 2, 3):
            state["w"].fill_(step)
            ckpt.save(step, state)
    os.unlink(os.path.join(root, "step-0000000003", "rank-00000.data"))
    with open(os.path.join(root, "step-0000000002", "rank-00000.data"), "r+b") as f:
        f.truncate(100)
    target = {"w": torch.zeros(1000)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["w"], torch.ones(1000))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "missing" in messages and "truncated" in messages


def test_only_checkpoint_corrupt_raises_rather_than_return_half_loaded(root):
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)})
    flip_byte(os.path.join(root, "step-0000000001", "rank-00000.data"), 5)
    # With nothing older to fall back to, a restore that may have touched the state says so.
    with Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="partially"):
            ckpt.restore({"w": torch.zeros(1000)})


def test_checkpoints_hold_no_pickle_and_load_without_it(root, monkeypatch):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "opt": opt, "meta": {"a": [1, "b"]}})
    step_dir = os.path.join(root, "step-0000000001")
    assert sorted(os.listdir(step_dir)) == ["manifest.json", "rank-00000.data"]
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)  # plain JSON
    with open(os.path.join(step_dir, "rank-00000.data"), "rb") as f:
        data = f.read()
    # every byte of the data file accounted for: the tensors' own bytes where the manifest
    # says, zeros between them (alignment), the generator states as JSON, the chunk table
    # (before, this checked only that the file did not start with pickle's 0x80, which a
    # random first weight does one time in 256)
    saved = flatten_state({"model": model, "opt": opt}).tensors
    tensor_bytes = bytearray(len(data))
    for name, meta in manifest["tensors"].items():
        (box,) = meta["boxes"]
        ((fname, offset, nbytes),) = box["pieces"]
        assert fname == "rank-00000.data" and data[offset : offset + nbytes] == byte_view(saved[name]).numpy().tobytes()
        tensor_bytes[offset : offset + nbytes] = data[offset : offset + nbytes]
    (_, (rng_at, rng_len)), = manifest["ranks"]
    assert bytes(tensor_bytes[:rng_at]) == data[:rng_at], "only tensors' bytes and zeros before the generator states"
    json.loads(data[rng_at : rng_at + rng_len])
    record = manifest["files"]["rank-00000.data"]
    assert rng_at + rng_len == record["logical"] and len(data) == record["logical"] + 13 * record["footer"][0]

    def refuse(*args, **kwargs):
        raise AssertionError("restore tried to unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"model": model2, "opt": opt2, "meta": None}) == 1
    assert torch.equal(model2.weight, model.weight)


def test_normal_exit_without_close_commits_the_save_in_flight(tmp_path):
    import subprocess
    import sys

    from .launch import REPO

    root = str(tmp_path / "ckpt")
    script = (
        "import sys, torch\n"
        "from resilient import Checkpointer\n"
        "ckpt = Checkpointer(sys.argv[1])\n"
        "ckpt.save(1, {'w': torch.randn(1 << 22)})  # 16 MiB, still being written at the end\n"
    )
    out = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert Checkpointer(root).latest() == 1, out.stderr[-3000:]
