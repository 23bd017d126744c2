"""Staging buffers for direct I/O: page-aligned always, huge-page aligned and advised when large."""

import sys

import pytest
import torch

from resilient._chunkio import DIRECT_ALIGN
from resilient._hostmem import HUGE_PAGE, page_aligned_empty
from resilient._snapshot import Staging

pytestmark = pytest.mark.timeout(60)

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address`` (Linux's smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def thp_possible() -> bool:
    try:
        with open(THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_small_buffers_are_page_aligned_and_exact():
    for nbytes in (1, 4095, 4096, 100_000, HUGE_PAGE - 1):
        buffer = page_aligned_empty(nbytes)
        assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
        assert buffer.data_ptr() % DIRECT_ALIGN == 0


def test_large_buffers_start_on_a_huge_page_and_hold_every_byte():
    nbytes = 3 * HUGE_PAGE + 12345
    buffer = page_aligned_empty(nbytes)
    assert buffer.numel() == nbytes and buffer.data_ptr() % HUGE_PAGE == 0
    buffer.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
    assert int(buffer[-1]) == (nbytes - 1) % 251 and int(buffer[HUGE_PAGE]) == HUGE_PAGE % 251


@pytest.mark.skipif(not sys.platform.startswith("linux") or not thp_possible(), reason="needs Linux with THP")
def test_large_buffers_are_advised_as_huge_pages_before_first_touch():
    large = page_aligned_empty(64 << 20)
    assert "hg" in vm_flags(large.data_ptr()), "the staging buffer was not advised as huge pages"
    assert "hg" in vm_flags(large.data_ptr() + large.numel() - 1)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not thp_possible(), reason="needs Linux with THP")
def test_the_checkpointer_stages_into_an_advised_buffer(tmp_path):
    from resilient import Checkpointer

    state = {"w": torch.randn(4 << 20), "b": torch.randn(1000)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state).result(timeout=30)
        buffer = ckpt._staging.buffer
        assert isinstance(ckpt._staging, Staging)
        assert buffer.data_ptr() % HUGE_PAGE == 0 and "hg" in vm_flags(buffer.data_ptr())
    restored = {"w": torch.zeros(4 << 20), "b": torch.zeros(1000)}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(restored) == 1
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
