"""Retention never deletes the last good state: steps known bad do not count, the step just
committed and the step restored from are kept, whatever the step numbers say."""

import os
import shutil
import threading
import time

import torch

from resilient import Checkpointer
from resilient._local import LocalTier
from resilient.ckpt import main as ckpt_main

from .faults import flip_byte


def _state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "meta": {"step": step}}


def _steps(root: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


def _settled(root: str, want: list[int]) -> list[int]:
    """The steps on disk once retention (which runs just after a commit settles) is done."""
    deadline = time.monotonic() + 10
    while _steps(root) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return _steps(root)


def test_corrupt_newest_then_keep_1_keeps_what_restored(root, capsys):
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(200, _state(200))
        ckpt.save(300, _state(300))
    flip_byte(os.path.join(root, "step-0000000300", "rank-00000.data"), 20)
    target = _state(0)
    with Checkpointer(root, keep=1) as ckpt:
        assert ckpt.restore(target) == 200  # 300 fails its checksums
        ckpt.save(210, _state(210))
        ckpt.wait()
        assert _settled(root, [200, 210, 300]) == [200, 210, 300]  # 200 restored cleanly, 210 just committed
        ckpt.save(220, _state(220))
        ckpt.wait()
        assert _settled(root, [200, 220, 300]) == [200, 220, 300]  # 300 is bad: it neither counts nor is deleted
    with Checkpointer(root, keep=1) as ckpt:  # the next restart does not try 300 again
        assert ckpt.latest() == 220 and ckpt.restore(target) == 220 and target["meta"] == {"step": 220}
    assert ckpt_main(["ls", root]) == 1  # a problem to show: exit 1
    listing = capsys.readouterr().out
    assert "failed verification when restored" in listing
    assert ckpt_main(["prune", root, "--keep", "1"]) == 0
    assert _steps(root) == [220, 300]
    # a new commit of step 300 replaces the bad copy and clears the mark
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(300, _state(300))
        ckpt.wait()
        assert ckpt.latest() == 300


def test_higher_steps_from_an_earlier_run_do_not_evict_the_new_ones(root):
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(500, _state(500))
        ckpt.save(600, _state(600))
    with Checkpointer(root, keep=2) as ckpt:  # a new run that starts at 0 on the same root
        ckpt.save(10, _state(10))
        ckpt.wait()
        assert 10 in _steps(root)
        ckpt.save(20, _state(20))
        ckpt.wait()
        assert 20 in _steps(root)


def test_crash_while_a_step_is_replaced_puts_the_old_copy_back(root):
    """install() sets the old copy aside, then renames the new one in; a process that dies
    between the two leaves the old copy in the trash: the next start puts it back."""
    import uuid

    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(5, _state(5))
    trash = os.path.join(root, ".trash")
    os.makedirs(trash, exist_ok=True)
    os.rename(os.path.join(root, "step-0000000005"),
              os.path.join(trash, f"step-0000000005.replaced-{uuid.uuid4().hex[:8]}"))
    target = _state(0)
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target) == 5 and target["meta"] == {"step": 5}


def test_forced_copy_from_a_corrupt_source_keeps_the_good_destination(tmp_path, capsys, s3_server):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    for where, value in ((good, 3), (bad, 33)):
        with Checkpointer(where, keep=None) as ckpt:
            ckpt.save(3, _state(value))
    flip_byte(os.path.join(bad, "step-0000000003", "rank-00000.data"), 40)
    # pull onto a local root that has the step: refused, the old copy untouched
    assert ckpt_main(["pull", bad, good, "--step", "3", "--force"]) == 1
    target = _state(0)
    with Checkpointer(good) as ckpt:
        assert ckpt.restore(target) == 3 and target["meta"] == {"step": 3}
    # push onto an object store that has the step: the source is checked before uncommitting
    import uuid

    from resilient._catalog import Catalog
    from resilient._storage import open_storage
    from resilient._transfer import copy_step

    remote = open_storage(f"s3://{s3_server['bucket']}/keep-{uuid.uuid4().hex[:8]}", s3_server["options"])
    copy_step(Catalog(open_storage(good)), remote, 3)
    try:
        copy_step(Catalog(open_storage(bad)), remote, 3)
    except Exception as exc:  # noqa: BLE001 - the corrupt source's error, whatever its type
        assert "checksum" in str(exc) or "CRC" in str(exc), exc
    else:
        raise AssertionError("a corrupt source was copied")
    assert Catalog(remote).entry(3, deep=True).state == "committed"


def test_old_checkpoints_are_deleted_off_the_writer_thread(root, monkeypatch):
    """Deleting a step's files takes time that grows with its size: it happens on the trash
    thread, so the writer goes straight on to the next save."""
    removed_by: list[str] = []
    real_rmtree = shutil.rmtree

    def recording_rmtree(path, *args, **kwargs):
        if f"{os.sep}.trash{os.sep}" in str(path):
            removed_by.append(threading.current_thread().name)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", recording_rmtree)
    with Checkpointer(root, keep=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).result()
            assert ckpt.latest() == step
    assert _steps(root) == [3]
    assert removed_by and all(name.startswith("resilient-trash") for name in removed_by), removed_by
    assert os.listdir(os.path.join(root, ".trash")) == []  # close() let the deletions finish


def test_the_trash_thread_leaves_a_set_aside_copy_whose_step_is_missing(root):
    """``install`` sets the old copy aside, then renames the new one in: between the two,
    the set-aside copy is the only copy and must survive a pass of the trash thread."""
    tier = LocalTier(root)
    tier.prepare()
    for step in (7, 8):
        os.makedirs(tier.step_dir(step))
    tier._to_trash(tier.step_dir(7), ".replaced")  # step 7 has no directory now: keep its copy
    tier.delete(8)  # a pass starts
    assert tier.close(timeout=10)
    left = os.listdir(os.path.join(root, ".trash"))
    assert len(left) == 1 and left[0].startswith("step-0000000007.replaced-"), left
    os.makedirs(tier.step_dir(7))  # the new copy arrived: the old one is garbage
    tier._empty_trash()
    assert tier.close(timeout=10)
    assert os.listdir(os.path.join(root, ".trash")) == []
