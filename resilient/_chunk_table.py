"""A data file's chunk table, packed: the part of the manifest that grows with the ranks.

Once a tensor's boxes are runs (``_box_runs``), what is left per rank in a manifest is its
file's chunk table: 64 chunks for a 1 GB file, as JSON lists of six numbers 3.4 kB, parsed
and checked one by one by every restoring rank (1.4 s at 8,192 ranks, where reading the
rank's own 1 GB takes a few tenths). Format 2 writes it as base64 of 13 bytes a chunk
(logical length, stored length, CRC32, as little-endian uint32, and the codec byte; the
offsets are where the previous chunk ended, as format 1 required anyway), checks every
file's table at once with array operations, and turns a table into lists only for the
files a rank opens.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np

__all__ = ["ChunkTable", "pack_chunks", "unpack_tables"]

_ROW = np.dtype([("length", "<u4"), ("stored", "<u4"), ("crc", "<u4"), ("codec", "u1")])
MAX_CHUNK_BYTES = 1 << 30  # a chunk's logical length; the writer uses 16 MiB
CODECS = (0, 1)  # raw, zstd (see _chunkio)


def pack_chunks(chunks: list[list[int]]) -> str:
    """``[[offset, length, stored offset, stored length, crc32, codec], ...]`` (each chunk
    where the last ended), as the manifest's ``table``."""
    rows = np.zeros(len(chunks), dtype=_ROW)
    for row, (_, length, _, stored, crc, codec) in zip(rows, chunks):
        row["length"], row["stored"], row["crc"], row["codec"] = length, stored, crc, codec
    return base64.b64encode(rows.tobytes()).decode()


class ChunkTable(Sequence[list[int]]):
    """One file's checked table, read as format 1's list of chunks, made on first use."""

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows
        self._lists: list[list[int]] | None = None

    def _as_lists(self) -> list[list[int]]:
        if self._lists is None:
            length, stored = self._rows["length"].astype(np.int64), self._rows["stored"].astype(np.int64)
            offset, stored_offset = np.cumsum(length) - length, np.cumsum(stored) - stored
            self._lists = np.column_stack([offset, length, stored_offset, stored, self._rows["crc"].astype(np.int64),
                                           self._rows["codec"].astype(np.int64)]).tolist()
        return self._lists

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: Any) -> Any:
        return self._as_lists()[i]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._as_lists())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def unpack_tables(records: dict[str, dict[str, Any]], fail: Callable[[str, str], None]) -> dict[str, int]:
    """Check every file's packed ``table`` against its ``bytes`` and the format, all files at
    once; set each record's ``chunks`` (a ``ChunkTable``) and return each file's logical
    size. ``fail(field, why)`` raises, naming the file."""
    names, raws = list(records), []
    for name in names:
        table = records[name].get("table")
        try:
            raw = base64.b64decode(table, validate=True) if isinstance(table, str) else None
        except (binascii.Error, ValueError):
            raw = None
        if raw is None or len(raw) % _ROW.itemsize:
            fail(f"files[{name!r}].table", f"must be base64 of {_ROW.itemsize}-byte chunk rows")
        raws.append(raw)
    rows = np.frombuffer(b"".join(raws), dtype=_ROW)
    counts = np.array([len(r) // _ROW.itemsize for r in raws], dtype=np.int64)
    ends = np.cumsum(counts)
    bad = np.flatnonzero((rows["length"] > MAX_CHUNK_BYTES) | ~np.isin(rows["codec"], CODECS)
                         | ((rows["codec"] == 0) & (rows["stored"] != rows["length"])))
    if len(bad):
        f = int(np.searchsorted(ends, bad[0], side="right"))
        fail(f"files[{names[f]!r}].table[{int(bad[0] - (ends[f] - counts[f]))}]",
             "has an unknown codec, a length over 1 GiB, or is raw with stored and logical lengths apart")
    zero = np.zeros(1, dtype=np.int64)
    logical = np.diff(np.concatenate([zero, np.cumsum(rows["length"], dtype=np.int64)])[np.concatenate([zero, ends])])
    stored = np.diff(np.concatenate([zero, np.cumsum(rows["stored"], dtype=np.int64)])[np.concatenate([zero, ends])])
    sizes: dict[str, int] = {}
    for i, name in enumerate(names):
        if stored[i] != records[name]["bytes"]:
            fail(f"files[{name!r}].table", f"covers {int(stored[i])} of the file's {records[name]['bytes']} bytes")
        records[name]["chunks"] = ChunkTable(rows[ends[i] - counts[i]:ends[i]])
        del records[name]["table"]
        sizes[name] = int(logical[i])
    return sizes
