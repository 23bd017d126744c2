"""The staging buffer is made and touched in the background at the first ``save()`` that is
not due (after a restore, again), so the first due save's stall is a copy into memory
already touched: the same buffer, and the same checkpoint as without it."""

from __future__ import annotations

import pytest
import torch

from resilient import Checkpointer, UnsupportedStateError

pytestmark = pytest.mark.timeout(120)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(3, 5, generator=g)}


def _prepared(ckpt: Checkpointer) -> torch.Tensor | None:
    ckpt._staging._join_warming()  # the background thread's work, done
    return ckpt._staging.buffer


def test_the_first_save_not_due_prepares_the_buffer_the_first_due_save_fills(tmp_path):
    state = _state(0)
    with Checkpointer(str(tmp_path / "ckpt"), every=5) as ckpt:
        assert ckpt.save(1, state) is None
        buffer = _prepared(ckpt)
        assert buffer is not None and buffer.numel() >= 4 * ((1 << 20) + 15)
        address = buffer.data_ptr()
        ckpt.save(5, state).result()
        assert ckpt._staging.buffer.data_ptr() == address  # filled, not replaced
    fresh = _state(1)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        assert ckpt.restore(fresh) == 5
        assert all(torch.equal(fresh[k], state[k]) for k in state)
        assert ckpt._staging.buffer is None
        ckpt.save(6, fresh)  # every=1 by default: due; a restore's next call not due prepares
    with Checkpointer(str(tmp_path / "ckpt"), every=100) as ckpt:
        assert ckpt.restore(fresh) == 6
        ckpt.save(7, fresh)
        assert _prepared(ckpt) is not None


def test_a_state_that_cannot_be_saved_is_left_to_the_due_save_to_refuse(tmp_path):
    state = {"w": torch.ones(4), "hook": lambda: 0}
    with Checkpointer(str(tmp_path / "ckpt"), every=5) as ckpt:
        assert ckpt.save(1, state) is None  # not due: nothing said yet
        assert _prepared(ckpt) is None
        with pytest.raises(UnsupportedStateError, match="hook"):
            ckpt.save(5, state)


def test_no_buffer_is_prepared_under_a_save_still_being_written(tmp_path):
    """The buffer a save in flight is written from is never replaced by a larger one made
    ahead: its file would hold the new buffer's bytes."""
    from resilient._writer import SaveHandle

    with Checkpointer(str(tmp_path / "ckpt"), every=100) as ckpt:
        ckpt.save(1, _state(0), force=True).result()
        ckpt._inflight = SaveHandle(2, on_settle=lambda handle: None)  # a save whose writer is not done
        ckpt._staging_prepared = False
        ckpt.save(3, {**_state(0), "more": torch.ones(1 << 20)})
        assert ckpt._staging._warming is None and ckpt._staging.buffer.numel() < 8 << 20
        ckpt._inflight._done.set()


def test_a_loop_that_saves_only_when_due_prepares_the_buffer_itself(tmp_path):
    """``prepare(state)``: what a loop whose saves another library schedules calls at its
    first step (the HF integration does), once; ``save()`` then fills that buffer."""
    state = _state(0)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.prepare(state)
        buffer = _prepared(ckpt)
        assert buffer is not None
        ckpt.prepare(state)  # done already: nothing made again
        assert ckpt._staging._warming is None
        ckpt.save(4, state, force=True).result()
        assert ckpt._staging.buffer.data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("populates", [True, False])
def test_a_buffer_that_cannot_be_made_ahead_is_left_to_the_save(monkeypatch, caplog, populates):
    """Out of memory ahead of the first save: a warning, no error from ``prepare`` (nor from
    the save that is not due which calls it); the due save allocates again, and says so if
    it fails too. The buffer is mapped in the calling thread where the kernel can populate
    its pages, and in the prewarm thread otherwise: both are caught."""
    from resilient import _snapshot
    from resilient._snapshot import Staging

    monkeypatch.setattr(_snapshot, "can_populate", lambda: populates)
    real = _snapshot.HostBuffer
    calls = []

    def host_buffer(nbytes, pin):  # the first allocation (the prewarm's, in whichever thread) fails
        calls.append(nbytes)
        if len(calls) == 1:
            raise RuntimeError(f"out of memory allocating {nbytes} bytes")
        return real(nbytes, pin)

    monkeypatch.setattr(_snapshot, "HostBuffer", host_buffer)
    staging = Staging()
    try:
        with caplog.at_level("WARNING", logger="resilient"):
            staging.prewarm(1 << 20, pin=False)
            buffer = staging._ensure(1 << 20, False)  # ends the prewarm, then allocates
        assert buffer.numel() >= 1 << 20 and len(calls) == 2
        assert "could not prepare the staging buffer ahead of the first save (RuntimeError: out of memory" in caplog.text
    finally:
        staging.close()
