"""Host buffers that the writer hands to the device with direct I/O.

Two properties matter for how fast a write from them goes:

- a page-aligned start, or direct I/O refuses them (``_chunkio.DIRECT_ALIGN``);
- for large unpinned buffers, transparent huge pages. Direct I/O goes out in segments of
  physically contiguous memory; a buffer of 4 KiB pages scattered by the memory's history
  goes out in many small ones. Measured on this project's VM (2 ranks writing 0.5 GB each
  with direct I/O, the staging buffer allocated right after 2 GB had been freed and handed
  back to the host): 0.30-0.35 s per save with 4 KiB pages, 0.15-0.16 s with huge pages;
  without the freeing before, 0.17-0.29 s depending on where the buffer landed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap

import torch

from ._chunkio import DIRECT_ALIGN

__all__ = ["HUGE_PAGE", "page_aligned_empty", "advise_huge_pages"]

log = logging.getLogger("resilient")

#: the size of a transparent huge page with 4 KiB base pages (x86-64, arm64)
HUGE_PAGE = 2 << 20


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask the kernel to back ``buffer``'s whole huge pages with huge pages when they are
    first touched (``MADV_HUGEPAGE``); False where that cannot be asked (not Linux, THP
    off). Advice only: nothing fails without it."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    libc = _libc()
    start = buffer.data_ptr() + (-buffer.data_ptr() % HUGE_PAGE)
    length = (buffer.data_ptr() + buffer.numel() * buffer.element_size() - start) // HUGE_PAGE * HUGE_PAGE
    if advice is None or libc is None or length <= 0:
        return False
    if libc.madvise(start, length, advice) != 0:
        log.debug("resilient: madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def page_aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` that starts on a page boundary; unpinned
    and at least a huge page long, it starts on a huge-page boundary and is advised as huge
    pages before anything touches it. (Pinned buffers come from the device driver's own
    allocator, which decides their pages.)"""
    align = HUGE_PAGE if not pin and nbytes >= HUGE_PAGE else DIRECT_ALIGN
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % align
    buffer = raw[skip : skip + nbytes]
    if align == HUGE_PAGE:
        advise_huge_pages(buffer)
    return buffer
