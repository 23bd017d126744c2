"""A tensor whose bytes must move after they are read (into device memory; on this CPU
machine, into a tensor that is not contiguous) is finished by the read that completes it,
while the other reads go on, and the restored state is exact."""

import pytest
import torch

from resilient import Checkpointer
from resilient._restore import _Destination, _FinishWhenRead

pytestmark = pytest.mark.timeout(120)


def _strided(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A live tensor the reads cannot land in: the transpose of a contiguous one (uint4's
    zeros made as bytes: torch cannot fill it)."""
    if dtype == torch.uint4:
        return torch.zeros(cols, rows, dtype=torch.uint8).view(dtype).t()
    return torch.zeros(cols, rows, dtype=dtype).t()


def test_each_destination_is_finished_by_its_last_read():
    want = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(100.0, 106.0).reshape(2, 3)}
    live = {name: _strided(*t.shape) for name, t in want.items()}
    dests = {name: _Destination.into(t, name) for name, t in live.items()}
    assert all(d.moves_at_finish for d in dests.values())

    def fill(name: str, lo: int, hi: int):  # one read: a part of the tensor's bytes
        return lambda: dests[name].buffer.view(-1)[lo:hi].copy_(want[name].reshape(-1)[lo:hi])

    reads = {"a": [fill("a", 0, 5), fill("a", 5, 12)], "b": [fill("b", 0, 6)]}
    finisher = _FinishWhenRead({name: (r, []) for name, r in reads.items()}, dests)
    a_first, b_only, a_last = (finisher.wrap(t) for t in (reads["a"][0], reads["b"][0], reads["a"][1]))

    a_first()
    assert finisher.finished == set() and not live["a"].any(), "finished before its last read"
    b_only()
    assert finisher.finished == {"b"} and torch.equal(live["b"], want["b"])
    assert not live["a"].any()
    a_last()
    assert finisher.finished == {"a", "b"} and torch.equal(live["a"], want["a"])
    # a read no destination waits on is not wrapped
    plain = lambda: None  # noqa: E731
    assert finisher.wrap(plain) is plain


def test_restore_into_strided_tensors_is_exact(tmp_path):
    g = torch.Generator().manual_seed(5)
    saved = {f"w{i}": torch.randn(300 + i, 257, generator=g) for i in range(12)}
    saved["empty"] = torch.zeros(0, 4)
    with Checkpointer(tmp_path / "run", chunk_bytes=64 << 10) as ckpt:
        ckpt.save(1, {"model": saved})
        ckpt.wait()
    target = {name: _strided(*t.shape) for name, t in saved.items()}
    backing = {name: t.t() for name, t in target.items()}  # the contiguous storage under each
    with Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.restore({"model": target}) == 1
    for name, t in saved.items():
        assert torch.equal(target[name], t), name
        assert torch.equal(backing[name], t.t()), name  # written through, into the live memory


def test_strided_tensors_restored_from_shards_of_another_world(tmp_path):
    """Saved as DTensor shards by 2 ranks, restored in one process into plain strided
    tensors: each is assembled from both ranks' boxes (reads into scratch, then copies)
    before its finish."""
    from .launch import run_ranks
    from .workers import dtensor_box_tensors_full, same_values

    root = str(tmp_path / "run")
    run_ranks("dtensor_save", 2, {"root": root}, env={"FORCE_DIST": "1"})
    full = dtensor_box_tensors_full()
    target = {name: _strided(*t.shape, t.dtype) if t.dim() == 2 else torch.zeros(2 * t.numel(), dtype=t.dtype)[::2]
              for name, t in full.items()}
    assert not any(t.is_contiguous() for t in target.values())
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"t": target}) == 5
    for name, t in full.items():
        assert same_values(target[name], t), name
