"""Copying committed checkpoints between storages, verified, commit record last.

Used by ``resilient-ckpt pull/push``. The copy streams each data file chunk-span by
chunk-span, checking every chunk's CRC on the way, so a bad source byte stops the copy
instead of spreading; the destination's manifest is written only after every data file is
complete, so a reader of the destination never sees a half-copied step as committed.
"""

from __future__ import annotations

from typing import Callable, Iterator

from ._catalog import Catalog
from ._format import MANIFEST, step_dir_name
from ._storage import Storage

__all__ = ["copy_step"]


def copy_step(src: Catalog, dst: Storage, step: int, progress: Callable[[int], None] | None = None) -> int:
    """Copy committed ``step`` from ``src`` to ``dst``; return the bytes copied."""
    manifest = src.manifest(step)
    sdir = step_dir_name(step)
    dst.delete(f"{sdir}/{MANIFEST}")  # re-copying a step: uncommit the old copy first
    total = 0
    for fname, record in manifest["files"].items():

        def stream(fname: str = fname, record: dict = record) -> Iterator[memoryview]:
            for _, stored in src.chunks(step, fname, record["chunks"], decode=False):
                if progress:
                    progress(len(stored))
                yield stored

        dst.write(f"{sdir}/{fname}", stream())
        size = dst.size(f"{sdir}/{fname}")
        if size != record["bytes"]:
            raise OSError(f"{dst.url}/{sdir}/{fname}: wrote {size} bytes, expected {record['bytes']}")
        total += size
    dst.write(f"{sdir}/{MANIFEST}", [src.storage.read(f"{sdir}/{MANIFEST}")])
    return total
