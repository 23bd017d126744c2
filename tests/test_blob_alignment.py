"""Every tensor's bytes start on a cache line in the data file (``BLOB_ALIGN``), the padding
between them is zeros, and the staging copy is cut so torch's threads start on one too."""

import json
import os

import pytest
import torch

from resilient import Checkpointer
from resilient._snapshot import BLOB_ALIGN, copy_ranges

pytestmark = pytest.mark.timeout(60)


def _odd_state(seed: int) -> dict:
    """Sizes that pack off the cache lines: a 4-byte step, 7 floats, 3 bytes, 5 halves."""
    g = torch.Generator().manual_seed(seed)
    return {
        "step": torch.tensor(3.0),
        "small": torch.randn(7, generator=g),
        "bytes": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "big": torch.randn(1000, 33, generator=g),
        "half": torch.randn(5, generator=g).half(),
        "last": torch.randn(129, generator=g),
    }


def _pieces(root: str, step: int) -> tuple[str, list[tuple[int, int]], int]:
    """(rank 0's file, its pieces, the size of its chunk table: the file's last bytes)."""
    step_dir = os.path.join(root, f"step-{step:010d}")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    pieces = [(offset, nbytes) for t in manifest["tensors"].values() for box in t["boxes"]
              for _file, offset, nbytes in box["pieces"]]
    return (os.path.join(step_dir, "rank-00000.data"), sorted(pieces),
            13 * manifest["files"]["rank-00000.data"]["footer"][0])


def _assert_aligned_with_zero_gaps(root: str, step: int) -> None:
    data_file, pieces, table = _pieces(root, step)
    assert pieces and all(offset % BLOB_ALIGN == 0 for offset, _ in pieces), pieces
    with open(data_file, "rb") as f:
        data = f.read()
    pos = 0
    for offset, nbytes in pieces:
        assert offset >= pos, "blobs overlap"
        assert data[pos:offset] == bytes(offset - pos), f"padding {pos}..{offset} is not zeros"
        pos = offset + nbytes
    assert len(data) == pos + table, "the file ends with its last blob, then its chunk table"


@pytest.mark.parametrize("direct_io", [True, False])
def test_odd_sized_tensors_start_on_cache_lines_and_restore_exactly(root, direct_io):
    saved = _odd_state(1)
    with Checkpointer(root, rng=False, direct_io=direct_io) as ckpt:
        ckpt.save(1, saved).result()
    _assert_aligned_with_zero_gaps(root, 1)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(target) == 1
    for name, tensor in saved.items():
        assert torch.equal(target[name], tensor), name


def test_padding_is_zeros_after_the_layout_changes_in_a_reused_buffer(root):
    """The staging buffer is reused across layouts: the new gaps must not keep old bytes."""
    wide = {"a": torch.full((100_000,), 7.0), "b": torch.full((100_000,), -3.0)}  # a larger buffer, all non-zeros
    with Checkpointer(root, rng=False, keep=None) as ckpt:
        ckpt.save(1, wide).result()
        ckpt.save(2, _odd_state(2)).result()
    _assert_aligned_with_zero_gaps(root, 2)


def test_copy_ranges_cover_the_blob_with_a_thread_aligned_bulk_and_a_short_tail():
    threads = torch.get_num_threads()
    grain = BLOB_ALIGN * threads
    for length in (0, 1, grain - 1, grain, grain + 3, 10 * grain + 17, (1 << 20) + 5):
        ranges = copy_ranges(length)
        if length == 0:
            assert ranges == []
            continue
        assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]], length
        assert ranges[-1][1] == length
        assert all(hi > lo for lo, hi in ranges)
        assert len(ranges) <= 2
        bulk = [hi - lo for lo, hi in ranges if (hi - lo) % grain == 0]
        tail = [hi - lo for lo, hi in ranges if (hi - lo) % grain]
        assert len(tail) <= 1 and all(n < grain for n in tail), (length, ranges)
        assert sum(bulk) == length - length % grain, (length, ranges)
