"""A data file's chunk table, packed: the part of the manifest that grew with the ranks.

Once a tensor's boxes are runs (``_box_runs``), what was left per rank in a manifest was its
file's chunk table: 13 bytes a chunk (logical length, stored length, CRC32, as little-endian
uint32, and the codec byte; the offsets are where the previous chunk ended). A chunk holds
at most one tensor, so a rank of 300 tensors has 300 chunks: 5 kB a rank, 43 MB of a manifest
at 8,192 ranks, received by every node's leader at every save and decoded by every
restoring rank, which opens a few of the files.

Formats 2 and 3 keep each table in the manifest, base64 (``unpack_tables`` checks every
file's at once with array operations). Format 4 writes it at the end of the data file, its
*footer* (``with_footer``); the manifest keeps its length and CRC32 and the file's logical
size, and the table is read, checked and kept the first time the file is (``chunks_of``).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np

from ._errors import CheckpointCorruptError

__all__ = ["ChunkTable", "chunks_of", "footer_bytes", "pack_footer", "unpack_tables", "with_footer"]

_ROW = np.dtype([("length", "<u4"), ("stored", "<u4"), ("crc", "<u4"), ("codec", "u1")])
FOOTER_ROW_BYTES = _ROW.itemsize  # a chunk's row in a format 4 file's footer
MAX_CHUNK_BYTES = 1 << 30  # a chunk's logical length; the writer uses 16 MiB
CODECS = (0, 1)  # raw, zstd (see _chunkio)


def _rows(chunks: Sequence[list[int]]) -> bytes:
    """Why columns and not a loop over rows: a numpy row's fields set one by one cost ~3 µs a
    chunk, 0.08 s of every save of a state of 26,800 small tensors (a chunk each)."""
    rows = np.zeros(len(chunks), dtype=_ROW)
    if not chunks:
        return rows.tobytes()
    table = np.array(chunks, dtype=np.int64)
    # the offsets (columns 0 and 2) are not in a row, and pass 4 GiB in a large rank's file
    if table.ndim != 2 or table.shape[1] != 6 or int(table.min()) < 0 or int(table[:, [1, 3, 4]].max()) >> 32:
        raise ValueError("chunk rows must be 6 non-negative integers, lengths and CRC under 2**32")
    rows["length"], rows["stored"], rows["crc"], rows["codec"] = table[:, 1], table[:, 3], table[:, 4], table[:, 5]
    return rows.tobytes()


def pack_footer(chunks: Sequence[list[int]]) -> bytes:
    """``[[offset, length, stored offset, stored length, crc32, codec], ...]`` (each chunk
    where the last ended) as format 4 writes them at the end of the data file (its footer)."""
    return _rows(chunks)


def with_footer(chunks: list[list[int]], stored: int) -> tuple[bytes, dict[str, Any]]:
    """(the footer of a file whose ``chunks`` end at byte ``stored``, the file's record with
    it: its size with the footer, its logical size, ``footer: [count, crc32]``, its chunks)."""
    table = _rows(chunks)
    logical = chunks[-1][0] + chunks[-1][1] if chunks else 0
    return table, {"bytes": stored + len(table), "logical": logical,
                   "footer": [len(chunks), zlib.crc32(table)], "chunks": chunks}


def footer_bytes(record: dict[str, Any]) -> int:
    """How many bytes at the end of a data file are its chunk table (0 before format 4)."""
    footer = record.get("footer")
    return footer[0] * FOOTER_ROW_BYTES if footer else 0


def chunks_of(record: dict[str, Any], read: Callable[[int, int], bytes], where: str) -> "ChunkTable | list[list[int]]":
    """A data file's chunks: from the manifest (formats 1 to 3) or, in format 4, read from
    the file's footer once (``read(start, end)``: those bytes of the file), checked against
    the manifest's CRC of it and against the file's sizes, and kept in ``record``.

    Why the footer: a rank's table is 13 bytes a chunk and a chunk holds at most one tensor,
    so with hundreds of tensors a rank it was 5 kB a rank in the manifest (43 MB at 8,192
    ranks), received by every node's leader at every save and decoded by every restoring
    rank, which reads a few of the files. ``CheckpointCorruptError`` when it does not check."""
    table = record.get("chunks")
    if table is not None:
        return table
    count, crc = record["footer"]
    end, size = record["bytes"], count * FOOTER_ROW_BYTES
    raw = read(end - size, end)
    if len(raw) != size or zlib.crc32(raw) != crc:
        raise CheckpointCorruptError(f"{where}: its chunk table (the last {size} bytes) "
                                     "does not match the manifest's checksum of it")
    rows = np.frombuffer(raw, dtype=_ROW)
    bad = _bad_rows(rows)
    why = f"row {int(bad[0])} {_BAD_ROW}" if len(bad) else None
    stored, logical = int(rows["stored"].sum(dtype=np.int64)), int(rows["length"].sum(dtype=np.int64))
    if why is None and (stored != end - len(raw) or logical != record["logical"]):
        why = f"covers {stored} stored and {logical} logical bytes, the manifest says {end - len(raw)} and {record['logical']}"
    if why is not None:
        raise CheckpointCorruptError(f"{where}: its chunk table {why}")
    table = record["chunks"] = ChunkTable(rows)
    return table


_BAD_ROW = "has an unknown codec, a length over 1 GiB, or is raw with stored and logical lengths apart"


def _bad_rows(rows: np.ndarray) -> np.ndarray:
    """The indexes of rows the format forbids (see ``_BAD_ROW``)."""
    return np.flatnonzero((rows["length"] > MAX_CHUNK_BYTES) | ~np.isin(rows["codec"], CODECS)
                          | ((rows["codec"] == 0) & (rows["stored"] != rows["length"])))


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
    bad = _bad_rows(rows)
    if len(bad):
        f = int(np.searchsorted(ends, bad[0], side="right"))
        fail(f"files[{names[f]!r}].table[{int(bad[0] - (ends[f] - counts[f]))}]", _BAD_ROW)
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
