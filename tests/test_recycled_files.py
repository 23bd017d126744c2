"""A deleted checkpoint's data files are overwritten in place by the next save of the same
rank (``LocalTier.reuse``): what the new save holds must be exactly its own bytes, whether
the old file was longer or shorter, written direct, buffered or compressed."""

import json
import os
import time

import pytest
import torch

from resilient import Checkpointer
from resilient.ckpt import main as ckpt_main

from .launch import run_ranks
from .waiting import wait_until

pytestmark = pytest.mark.timeout(120)


ROWS = {1: 256, 2: 640, 3: 640, 4: 256, 5: 256}  # step 3 grows step 1's file, step 4 shrinks step 2's


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS[step], 1000, generator=g), "meta": {"step": step}}


def _save(ckpt: Checkpointer, step: int, before: int | None, recycled: bool = True) -> None:
    """Save ``step`` and wait until retention has deleted ``before`` (it runs just after the
    commit) and, ``recycled``, set its data file aside."""
    ckpt.save(step, _state(step), force=True)
    ckpt.wait()
    deadline = time.monotonic() + 10
    while before is not None and (os.path.exists(os.path.join(ckpt.root, f"step-{before:010d}"))
                                  or recycled and not os.path.exists(_recycled(ckpt.root))):
        assert time.monotonic() < deadline, f"step {before} never deleted"
        time.sleep(0.01)


def _data_file(root, step: int) -> str:
    return os.path.join(root, f"step-{step:010d}", "rank-00000.data")


def _recycled(root) -> str:
    return os.path.join(root, ".recycle", "rank-00000.data")


@pytest.mark.parametrize("options", [{}, {"direct_io": False}, {"compress": "zstd"}], ids=["direct", "buffered", "zstd"])
def test_the_next_save_overwrites_the_deleted_steps_file_and_restores_exactly(root, options):
    inodes = {}
    with Checkpointer(root, keep=1, **options) as ckpt:
        for step in (1, 2, 3, 4):
            _save(ckpt, step, step - 1 if step > 1 else None)
            inodes[step] = os.stat(_data_file(root, step)).st_ino
            if step > 1:
                assert not os.path.exists(_data_file(root, step - 1))
                assert os.stat(_recycled(root)).st_ino == inodes[step - 1]  # kept, not freed
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2]  # overwritten in place
    assert ckpt_main(["verify", root, "--step", "4"]) == 0
    expected = _state(4)
    target = {"w": torch.zeros_like(expected["w"]), "meta": {}}
    with Checkpointer(root) as reader:
        assert reader.restore(target) == 4
    assert torch.equal(target["w"], expected["w"]) and target["meta"] == {"step": 4}


def test_a_shorter_save_over_a_longer_file_leaves_none_of_the_old_bytes(root):
    with Checkpointer(root, keep=1) as ckpt:
        for step, before in ((2, None), (3, 2), (5, 3)):  # step 5's 256 rows over step 2's 640
            _save(ckpt, step, before)
    record = json.load(open(os.path.join(root, "step-0000000005", "manifest.json")))["files"]["rank-00000.data"]
    assert os.path.getsize(_data_file(root, 5)) == record["bytes"] < 640 * 1000 * 4


def test_recycling_can_be_turned_off(root, monkeypatch):
    monkeypatch.setenv("RESILIENT_RECYCLE_FILES", "0")
    with Checkpointer(root, keep=1) as ckpt:
        for step in (1, 2, 3):
            _save(ckpt, step, step - 1 if step > 1 else None, recycled=False)
    assert not os.path.exists(os.path.join(root, ".recycle"))
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000003"]


def test_the_next_run_overwrites_its_ranks_files_and_removes_the_others(root):
    """A root opened again (a restarted job, the Lightning plugin's ``last.ckpt``): the
    files kept for the ranks that write now are overwritten in place by their next save, as
    within a run; those of ranks that no longer write here (a larger world before) are
    removed, off the save's stall, by the trash's thread."""
    with Checkpointer(root, keep=1) as ckpt:
        for step in (1, 2):
            _save(ckpt, step, step - 1 if step > 1 else None)
    held = open(_recycled(root), "rb")  # its inode number cannot go to a new file while open
    kept = os.fstat(held.fileno()).st_ino
    other = os.path.join(root, ".recycle", "rank-00007.data")  # left by a run of 8 ranks
    with open(other, "wb") as f:
        f.write(b"x" * 4096)
    abandoned = os.path.join(root, ".pending", "0123456789ab-00000001")  # a save killed mid-write
    os.makedirs(abandoned)
    with Checkpointer(root, keep=None) as ckpt:
        _save(ckpt, 3, None, recycled=False)
        assert os.stat(_data_file(root, 3)).st_ino == kept
        assert not os.path.exists(other) and not os.path.exists(abandoned)
        wait_until(lambda: not os.listdir(os.path.join(root, ".trash")), timeout=10, what="the trash emptied")
    held.close()
    assert os.listdir(os.path.join(root, ".recycle")) == []
    assert ckpt_main(["verify", root, "--step", "3"]) == 0


def test_two_ranks_each_overwrite_their_own_files(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks("recycled_saves", 2, {"root": root}, timeout=90)
    for r in results:
        inodes = json.loads(next(ln for ln in r.output.splitlines() if ln.startswith("INODES "))[7:])
        assert inodes["3"] == inodes["1"] and inodes["4"] == inodes["2"], (r.rank, inodes)
    firsts = [json.loads(next(ln for ln in r.output.splitlines() if ln.startswith("INODES "))[7:])["1"]
              for r in results]
    assert firsts[0] != firsts[1]  # each rank its own file
