"""The writer reads nothing from a save's staging buffer before the snapshot copy is
complete (``SnapshotDone``): no data file is started while the training thread copies, the
file holds the finished snapshot, and a copy that fails fails the save without hanging the
writer or committing anything."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from resilient import Checkpointer, CommitError
from resilient._fence import SnapshotDone, StagingTornError
from resilient._snapshot import Staging

pytestmark = pytest.mark.timeout(60)


def data_files(root: str) -> list[str]:
    """Every data file under ``root``, the pending (hidden) directories' included."""
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".data")]


def test_no_data_file_is_started_while_the_snapshot_is_copied(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    state = {"w": torch.randn(512, 1024), "b": torch.randn(1024)}
    copied_half, go_on = threading.Event(), threading.Event()
    real_copy = Staging._copy

    def slow_copy(buffer, tensors, blobs, non_blocking):
        real_copy(buffer, tensors, blobs[:1], non_blocking)
        copied_half.set()
        assert go_on.wait(30), "the test never let the copy finish"
        real_copy(buffer, tensors, blobs[1:], non_blocking)

    monkeypatch.setattr(Staging, "_copy", staticmethod(slow_copy))
    with Checkpointer(root, state=state, every=1, rng=False) as ckpt:
        saver = threading.Thread(target=ckpt.save, args=(1,))
        saver.start()
        assert copied_half.wait(30)
        threading.Event().wait(0.5)  # time enough for a writer that did not wait to start
        assert data_files(root) == [], "the writer started before the snapshot was complete"
        go_on.set()
        saver.join(30)
        ckpt.wait()
        assert ckpt.latest() == 1
        expected = {k: v.clone() for k, v in state.items()}
        for t in state.values():
            t.zero_()
        ckpt.restore()
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_a_failed_copy_wakes_the_waiting_writer_with_the_cause():
    done = SnapshotDone()
    caught: list[BaseException] = []

    def writer() -> None:
        try:
            done.wait()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            caught.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    done.complete(error=RuntimeError("tensor 'w' went away"))
    thread.join(30)
    assert not thread.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], StagingTornError)
    assert "tensor 'w' went away" in str(caught[0])


def test_a_save_whose_snapshot_copy_fails_is_not_committed_and_the_next_one_is(tmp_path, monkeypatch):
    state = {"w": torch.randn(256, 1024), "b": torch.randn(1024)}
    with Checkpointer(str(tmp_path / "ckpt"), state=state, every=1) as ckpt:
        ckpt.save(1).result(30)
        real_copy = Staging._copy
        calls = {"n": 0}

        def copy_then_fail(*args, **kwargs):
            calls["n"] += 1
            raise KeyboardInterrupt("interrupted during the snapshot")  # what Ctrl-C does mid-copy

        monkeypatch.setattr(Staging, "_copy", staticmethod(copy_then_fail))
        state["w"].add_(1)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(2)
        assert calls["n"] == 1
        failed = ckpt._inflight
        assert failed is not None and failed.step == 2
        with pytest.raises(CommitError, match="snapshot copy failed"):
            failed.result(30)  # settled, not left waiting for bytes that never come
        assert ckpt.latest() == 1
        monkeypatch.setattr(Staging, "_copy", staticmethod(real_copy))
        ckpt.save(3).result(30)
        assert ckpt.latest() == 3
        saved_w = state["w"].clone()
        state["w"].zero_()
        ckpt.restore()
        assert torch.equal(state["w"], saved_w)
