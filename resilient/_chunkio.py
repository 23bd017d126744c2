"""Data files: a sequence of independently checksummed (and optionally compressed) chunks.

Why chunks: a reader can verify exactly the bytes it reads (a reshard reads part of a
file), checksums and compression run in parallel threads that release the GIL, and a bad
byte is reported with the offset where it sits. Chunks never straddle two blobs (tensor
pieces), so a whole-tensor read lands straight in the destination tensor's memory.

A chunk record is ``[logical_offset, length, stored_offset, stored_length, crc32, codec]``;
``crc32`` covers the stored bytes, so damage is detected before decompression.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import zstandard

try:  # ISA-L's CRC32: zlib's polynomial and values, with carry-less multiply instructions
    from isal.isal_zlib import crc32  # measured here: 16-21 GB/s against zlib's 2.8-3.9, one core
except ImportError:  # pragma: no cover - a platform without isal's wheels
    from zlib import crc32

from ._background import finished
from ._chunk_table import chunks_of, with_footer
from ._errors import CheckpointCorruptError
from ._gc_pause import gc_paused

__all__ = [
    "CODECS", "write_chunked", "ChunkedFile", "ChunkRead", "ChunkRun", "batched", "decode_chunk",
    "fsync_dir", "crc32",
]

RAW, ZSTD = 0, 1
CODECS = {"none": RAW, "zstd": ZSTD}
# Compression that saves less than this fraction is not worth the decode time on restore.
_MIN_SAVING = 0.03
_ZSTD_LEVEL = 1

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    comp = getattr(_local, "zc", None)
    if comp is None:
        comp = _local.zc = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "zd", None)
    if dec is None:
        dec = _local.zd = zstandard.ZstdDecompressor()
    return dec


def _writeback_starter() -> Callable[[int, int, int], None]:
    """``start(fd, offset, nbytes)``: ask the kernel to begin writing that range to disk now.

    Why: dirty pages otherwise wait in the page cache until ``fsync`` (below the kernel's
    background threshold, a whole checkpoint does), so filling the cache and writing it
    out run one after the other. Started chunk by chunk they overlap: measured here,
    1.47-1.81 GB/s became 2.16-2.52 GB/s for 1 GB written then fsync'd. Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` only starts the I/O; ``fsync`` still makes
    it durable. Elsewhere (or without the call) this does nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, nbytes: None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE

    def start(fd: int, offset: int, nbytes: int) -> None:
        call(fd, offset, nbytes, write)  # a failure only loses the head start: fsync decides
    return start


start_writeback = _writeback_starter()


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: what direct I/O needs aligned: memory addresses, file offsets and lengths (the page size,
#: a multiple of every common device's logical block)
DIRECT_ALIGN = 4096


def _address(view: memoryview) -> int | None:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only or not contiguous: no direct I/O from it
        return None


class _DirectWriter:
    """Writes a raw data file's page-aligned part straight from the snapshot buffer to the
    device (``O_DIRECT``), the last partial page through the page cache.

    Why: a buffered write copies every byte into the page cache first, which costs a core
    at the disk's speed, so it yields to training (``write_chunked``'s ``yielding``), and
    when the cores are busy it is slow. Measured here (2 GB, fsync'd): 0.3-1.0 GB/s buffered
    against 2.5 GB/s direct, and 4 GB written under a training loop on both cores took 8 s
    direct while the buffered writer, yielding throughout as all writes did then, had not
    finished after 120 s. Where the file system refuses direct I/O (older tmpfs, some network
    file systems) the writer falls back to buffered writes from where it is.
    """

    def __init__(self, path: str, source: memoryview) -> None:
        self.source = source
        self.done = 0  # bytes of the file written so far, from the start
        self.fd: int | None = None
        flag = getattr(os, "O_DIRECT", 0)
        address = _address(source)
        if flag and address is not None and address % DIRECT_ALIGN == 0:
            try:
                self.fd = os.open(path, os.O_WRONLY | flag)
            except OSError:
                self.fd = None

    def advance(self, end: int, buffered_fd: int, *, final: bool = False) -> None:
        """Write bytes ``[0, end)`` (the page-aligned part direct); ``final``: they are all."""
        if self.fd is not None:
            upto = end - end % DIRECT_ALIGN
            try:
                while self.done < upto:
                    self.done += os.pwrite(self.fd, self.source[self.done : upto], self.done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.close()  # the device wants another alignment: buffered from here on
        if self.fd is None or final:
            start = self.done
            while self.done < end:
                self.done += os.pwrite(buffered_fd, self.source[self.done : end], self.done)
            if self.fd is None:
                start_writeback(buffered_fd, start, end - start)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _encode(data: memoryview, codec: int) -> tuple[memoryview | bytes, int]:
    if codec == ZSTD:
        packed = _compressor().compress(data)
        if len(packed) <= len(data) * (1 - _MIN_SAVING):
            return packed, ZSTD
    return data, RAW


def _split(blobs: Iterable[memoryview], chunk_bytes: int) -> Iterable[memoryview]:
    """The chunks: each blob cut into pieces of ``chunk_bytes`` (the last one shorter)."""
    for blob in blobs:
        for start in range(0, len(blob), chunk_bytes):
            yield blob[start : start + chunk_bytes]


#: the least bytes of chunks one task of the encoding pool takes. Why: a chunk never spans
#: two tensors, so a state of many small tensors is as many small chunks, and one pool task
#: each cost ~40 µs of queueing, more than a 1 kB chunk's checksum: 20,000 tensors of 1 kB
#: took 0.9 s to write, almost all of it handing chunks to the pool.
BATCH_BYTES = 1 << 20


def _batches(blobs: Iterable[memoryview], chunk_bytes: int) -> Iterable[list[tuple[memoryview, int]]]:
    """``_split``'s chunks, each with where it ends in the blobs' bytes back to back, in
    runs of at least ``BATCH_BYTES`` (a full-size chunk alone; the last run shorter)."""
    batch: list[tuple[memoryview, int]] = []
    end = held = 0
    for piece in _split(blobs, chunk_bytes):
        end += len(piece)
        batch.append((piece, end))
        held += len(piece)
        if held >= BATCH_BYTES:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def write_chunked(
    path: str,
    blobs: Sequence[memoryview],
    *,
    codec: str,
    chunk_bytes: int,
    pool: Executor,
    lookahead: int = 4,
    contiguous: memoryview | None = None,
    direct: bool = True,
    ready: Callable[[int], None] | None = None,
    trailer: bytes = b"",
    footer: bool = False,
    yielding: Executor | None = None,
    late: Callable[[], bool] | None = None,
) -> dict:
    """Write ``blobs`` back to back into the file at ``path`` (whatever it held before is
    overwritten and cut off), then ``trailer`` as a chunk of its own, fsync it, return its record.

    Encoding (checksum, compression) of up to ``lookahead`` chunks runs on ``pool`` while
    this thread writes, so memory stays bounded by ``lookahead`` encoded chunks.
    ``contiguous``: the blobs are consecutive slices of this one buffer; an uncompressed
    file is then written from it with direct I/O in large writes, checksummed meanwhile
    (see ``_DirectWriter`` and ``DIRECT_WRITE_BYTES``), unless ``direct`` is False: a
    buffered write leaves the file in the page cache, for a restart on this node.
    ``ready(end)``: called before any of the first ``end`` bytes of the blobs (back to back)
    is read, and returns once they are final: the blobs may still be being filled.
    ``trailer``: a few bytes that are not a tensor's (the rank's generator states), kept in
    its file so that the manifest, which every node receives, need not carry them; a chunk of
    its own, so that reading them reads nothing else. ``footer``: the chunk table is written
    after the chunks (format 4), the record gives its length and CRC (``footer``) and the
    file's logical size instead of needing the table itself in the manifest.
    ``yielding``: a thread that yields to training (``_background``), which then makes the
    writes that go through the page cache: the kernel copies every byte there, a core's
    work at the disk's speed, which made a matmul step 2-3x slower beside the calling
    thread (measured). A direct write costs the CPU little, and is the caller's. ``late()``:
    the work has yielded long enough (``_background``): the caller then makes those writes,
    and runs the queued tasks of a ``YieldingPool`` ``pool`` it waits for, itself.
    """
    await_bytes = ready or (lambda end: None)
    codec_id = CODECS[codec]
    if contiguous is not None and sum(len(b) for b in blobs) != len(contiguous):
        raise ValueError(f"{path}: the blobs hold {sum(len(b) for b in blobs)} bytes, the buffer {len(contiguous)}")
    # not truncated on open: a file already at ``path`` (a recycled one, see
    # ``LocalTier.reuse``) is overwritten in place, then cut to the new length
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    writer: _DirectWriter | None = None
    try:
        if direct and codec_id == RAW and contiguous is not None:
            writer = _DirectWriter(path, contiguous)
        if writer is not None and writer.fd is not None:
            chunks = _write_raw_direct(writer, fd, blobs, chunk_bytes, pool, await_bytes)
            return _finish(fd, chunks, len(writer.source), len(writer.source), trailer, footer)
        return _BufferedWrite(fd, writer, blobs, codec_id, chunk_bytes, pool, lookahead, await_bytes,
                              yielding, late).run(trailer, footer)
    finally:
        if writer is not None:
            writer.close()
        os.close(fd)


@dataclass
class _BufferedWrite:
    """``write_chunked``'s path through the page cache (a codec, no direct I/O, or a
    direct writer fallen back): each run of chunks encoded on ``pool``, up to ``lookahead``
    runs ahead, and written in order as it comes back, by ``yielding`` if given and the
    work is not ``late``."""

    fd: int
    writer: _DirectWriter | None  # fallen back to buffered writes from where it is
    blobs: Iterable[memoryview]
    codec_id: int
    chunk_bytes: int
    pool: Executor
    lookahead: int
    await_bytes: Callable[[int], None]
    yielding: Executor | None
    late: Callable[[], bool] | None

    def _encode(self, batch: list[tuple[memoryview, int]]) -> list[tuple[int, memoryview | bytes, int, int]]:
        self.await_bytes(batch[-1][1])
        encoded = []
        for data, _ in batch:
            payload, used = _encode(data, self.codec_id)
            encoded.append((len(data), payload, used, crc32(payload)))
        return encoded

    def _write(self, views: list[tuple[memoryview, int]], last: bool) -> None:
        """Each view at its offset, in order; ``last``: the file's last chunk is among them."""
        for place, (view, at) in enumerate(views):
            if self.writer is not None:
                self.writer.advance(at + len(view), self.fd, final=last and place == len(views) - 1)
            else:
                pwrite_all(self.fd, view, at)
                start_writeback(self.fd, at, len(view))

    def run(self, trailer: bytes, footer: bool) -> dict:
        """Every chunk written, then ``_finish``: the file's record."""
        chunks: list[list[int]] = []
        logical = stored = 0
        pending: list = []
        batches = iter(_batches(self.blobs, self.chunk_bytes))

        def refill() -> None:
            while len(pending) < self.lookahead:
                batch = next(batches, None)
                if batch is None:
                    return
                pending.append(self.pool.submit(self._encode, batch))

        refill()
        while pending:
            future = pending.pop(0)
            refill()
            views = []
            for length, payload, used, crc in finished(future, self.pool, self.late):
                view = memoryview(payload)
                views.append((view, stored))
                chunks.append([logical, length, stored, len(view), crc, used])
                logical += length
                stored += len(view)
            if self.yielding is None or (self.late is not None and self.late()):
                self._write(views, not pending)
            else:
                finished(self.yielding.submit(self._write, views, not pending), self.yielding, self.late)
        return _finish(self.fd, chunks, logical, stored, trailer, footer)


#: bytes per direct write. Why large: a direct write returns only once the device has the
#: bytes, so its queue drains between two writes. Measured here (1 GB, fsync'd, medians of
#: 6 interleaved): 0.42 s in 64 MB writes, checksums computed meanwhile, against 0.86 s
#: written chunk by chunk as each chunk's checksum came back (16 MB writes: 0.38-0.61 s).
DIRECT_WRITE_BYTES = 64 << 20


def _finish(fd: int, chunks: list[list[int]], logical: int, stored: int, trailer: bytes, footer: bool) -> dict:
    """After the chunks (``logical`` and ``stored`` bytes): ``trailer`` as a raw chunk, then
    with ``footer`` the chunk table, both through the page cache (they are small); the file
    cut there and fsync'd. Returns its record."""
    if trailer:
        pwrite_all(fd, memoryview(trailer), stored)
        chunks.append([logical, len(trailer), stored, len(trailer), crc32(trailer), RAW])
        logical, stored = logical + len(trailer), stored + len(trailer)
    record: dict = {"bytes": stored, "chunks": chunks}
    if footer:
        table, record = with_footer(chunks, stored)
        pwrite_all(fd, memoryview(table), stored)
    os.ftruncate(fd, record["bytes"])
    os.fsync(fd)
    return record


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte is written (one call writes at most ~2 GiB on Linux)."""
    data = data.cast("B")
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _write_raw_direct(writer: _DirectWriter, fd: int, blobs: Sequence[memoryview], chunk_bytes: int,
                      pool: Executor, await_bytes: Callable[[int], None]) -> list[list[int]]:
    """Raw chunks, written from the buffer in large direct writes while ``pool`` checksums
    them: what is stored is the buffer's own bytes, so the checksum need not come first."""

    def checksums(batch: list[tuple[memoryview, int]]) -> list[int]:
        await_bytes(batch[-1][1])
        return [crc32(piece) for piece, _ in batch]

    with gc_paused():  # a piece and a row a chunk, around the writes, not over them: see _gc_pause
        batches = list(_batches(blobs, chunk_bytes))
        crcs = [pool.submit(checksums, batch) for batch in batches]
    total = len(writer.source)
    for end in range(DIRECT_WRITE_BYTES, total + DIRECT_WRITE_BYTES, DIRECT_WRITE_BYTES):
        await_bytes(min(end, total))
        writer.advance(min(end, total), fd, final=end >= total)
    with gc_paused():
        return [[end - len(piece), len(piece), end - len(piece), len(piece), crc, RAW]
                for batch, batch_crcs in zip(batches, crcs) for (piece, end), crc in zip(batch, batch_crcs.result())]


class ChunkedFile:
    """Reads logical byte ranges of one data file, verifying every chunk it touches."""

    def __init__(self, path: str, record: dict) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._rows = list(chunks_of(record, self._read_range, path))  # plain lists: indexed per tensor read
        self._starts = [c[0] for c in self._rows]

    def _read_range(self, start: int, end: int) -> bytes:
        return os.pread(self._open(), end - start, start)

    def _open(self) -> int:
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, os.O_RDONLY)
                except FileNotFoundError as exc:
                    raise CheckpointCorruptError(f"{self.path}: file is missing") from exc
            return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def read_tasks(self, offset: int, dest: memoryview) -> list["ChunkRead"]:
        """Reads (one per chunk, to run in any order/thread, or to merge with ``batched``)
        filling ``dest`` with the logical bytes ``[offset, offset + len(dest))``."""
        tasks: list[ChunkRead] = []
        base, end = offset, offset + len(dest)
        rows = self._rows
        i = bisect.bisect_right(self._starts, offset) - 1
        while offset < end:
            if i < 0 or i >= len(rows) or rows[i][0] + rows[i][1] <= offset:
                raise CheckpointCorruptError(
                    f"{self.path}: bytes {offset}..{end} are not in the file's chunk table"
                )
            chunk = rows[i]
            hi = min(end, chunk[0] + chunk[1])
            tasks.append(ChunkRead(self, chunk, offset, dest[offset - base : hi - base]))
            offset = hi
            i += 1
        return tasks

    def _truncated(self, chunk: list[int], got: int) -> CheckpointCorruptError:
        stored_off, stored_len = chunk[2], chunk[3]
        return CheckpointCorruptError(f"{self.path}: truncated at byte {stored_off + got} (chunk at {stored_off} "
                                      f"needs {stored_len} bytes)")

    def _read_chunk(self, read: "ChunkRead") -> None:
        if read.raw:
            self._read_run([read])
            return
        chunk, lo, part = read.chunk, read.lo, read.part
        logical, stored_off, stored_len = chunk[0], chunk[2], chunk[3]
        buf = memoryview(bytearray(stored_len))
        got = os.preadv(self._open(), [buf], stored_off)
        if got != stored_len:
            raise self._truncated(chunk, got)
        data = decode_chunk(chunk, buf, self.path)
        part[:] = data[lo - logical : lo - logical + len(part)]

    def _read_run(self, run: list["ChunkRead"], piece: int = 0) -> None:
        """Raw chunks stored back to back, read straight into their destinations (the bytes
        no one asked for into scratch) and each verified: ``piece`` bytes at a time, each
        checksummed as soon as it is read, or (``piece`` 0) by one ``preadv``, then verified."""
        buffers = [read.buffers() for read in run]
        if piece:
            self._read_run_in_pieces(run, buffers, piece)
            return
        got = os.preadv(self._open(), [b for bufs in buffers for b in bufs], run[0].chunk[2])
        for read, bufs in zip(run, buffers):
            if got < read.chunk[3]:
                raise self._truncated(read.chunk, max(got, 0))
            got -= read.chunk[3]
            verify_stored(read.chunk, bufs, self.path)

    def _read_run_in_pieces(self, run: list["ChunkRead"], buffers: list[list[memoryview]], piece: int) -> None:
        """Why pieces: a piece's CRC then reads bytes still in the core's cache, where after
        one large read it reads them back from memory (see ``SHARED_PIECE_BYTES`` in
        ``_restore``, where it pays)."""
        fd, offset = self._open(), run[0].chunk[2]
        for read, bufs in zip(run, buffers):
            crc = done = 0
            for buf in bufs:
                for lo in range(0, len(buf), piece):
                    view = buf[lo : lo + piece]
                    got = os.preadv(fd, [view], offset)
                    if got != len(view):
                        raise self._truncated(read.chunk, done + max(got, 0))
                    crc = crc32(view, crc)
                    offset += got
                    done += got
            check_crc(read.chunk, crc, self.path)


class ChunkRead:
    """One chunk's bytes from ``lo`` into ``part``: a task on its own (it reads and verifies
    that chunk), or, stored raw, merged by ``batched`` with the chunks stored next to it."""

    __slots__ = ("file", "chunk", "lo", "part")

    def __init__(self, file: ChunkedFile, chunk: list[int], lo: int, part: memoryview) -> None:
        self.file, self.chunk, self.lo, self.part = file, chunk, lo, part

    def __call__(self) -> None:
        self.file._read_chunk(self)

    @property
    def raw(self) -> bool:
        """Stored uncompressed: read straight into ``part``, with no bounce buffer and no copy."""
        return self.chunk[5] == RAW

    def _spare(self) -> tuple[int, int]:
        """The chunk's bytes before and after ``part``: the 64-byte alignment padding after
        a tensor's last bytes, or a neighbouring rank's share when resharding."""
        logical, length = self.chunk[0], self.chunk[1]
        return self.lo - logical, logical + length - self.lo - len(self.part)

    def buffer_count(self) -> int:
        """How many buffers ``buffers`` gives, without allocating the scratch."""
        head, tail = self._spare()
        return 1 + (head > 0) + (tail > 0)

    def buffers(self) -> list[memoryview]:
        """Where a raw chunk's stored bytes go, in order: scratch for the bytes before
        ``part``, ``part``, scratch for the bytes after it. Why not a bounce buffer for the
        whole chunk: the wanted bytes then land in place, and the chunk still merges with
        its neighbours into one read (a tensor's last chunk holds its padding)."""
        head, tail = self._spare()
        out = [memoryview(bytearray(head))] if head else []
        out.append(self.part)
        if tail:
            out.append(memoryview(bytearray(tail)))
        return out


#: the most bytes one merged read asks for. Why merge: a checkpoint's chunks are as small
#: as its tensors (often a few MB), and this disk serves fewer, larger requests faster.
#: Measured here (1 GB of 104 tensors, cold, rounds interleaved): merged reads were faster
#: in all seven A/B runs at 1 and 2 ranks, by 1-28% in the medians (0.63 s against 0.88 s
#: in the widest); capped at 64 MB they were no better than unmerged in two runs.
READ_BATCH_BYTES = 128 << 20
#: a call's reads are merged into at least this many runs where the bytes allow, so that
#: every read thread still has work (8: the most threads a rank's read pool has)
READ_BATCH_WAYS = 8
#: and at most this many buffers go in one run's ``preadv`` (Linux takes 1024): a chunk
#: needs one, or up to three when only part of it is wanted
READ_BATCH_BUFFERS = 1024


def batched(tasks: Iterable[Callable[[], None]], limit: int | None = None, piece: int = 0
            ) -> list[Callable[[], None]]:
    """The same reads as fewer tasks: raw chunks stored back to back in one file
    (consecutive tensors, usually) become one read, in file order; every other task is kept
    as it is. Each chunk is still verified on its own. A run holds at most ``limit`` bytes:
    by default the bytes split ``READ_BATCH_WAYS`` ways, at most ``READ_BATCH_BYTES``;
    0 merges nothing. A run is read ``piece`` bytes at a time, each checksummed while still
    in cache, or (0) in one ``preadv``."""
    out: list[Callable[[], None]] = []
    by_file: dict[int, list[ChunkRead]] = {}
    for task in tasks:
        if isinstance(task, ChunkRead) and task.raw and limit != 0:
            by_file.setdefault(id(task.file), []).append(task)
        else:
            out.append(task)
    if limit is None:
        total = sum(r.chunk[3] for reads in by_file.values() for r in reads)
        limit = min(READ_BATCH_BYTES, -(-total // READ_BATCH_WAYS))
    for reads in by_file.values():
        reads.sort(key=lambda r: r.chunk[2])
        run: list[ChunkRead] = []
        size = buffers = 0
        for r in reads:
            stored_off, stored_len = r.chunk[2], r.chunk[3]
            if run and (stored_off != run[-1].chunk[2] + run[-1].chunk[3] or size + stored_len > limit
                        or buffers + r.buffer_count() > READ_BATCH_BUFFERS):
                out.append(_run_task(run, piece))
                run, size, buffers = [], 0, 0
            run.append(r)
            size += stored_len
            buffers += r.buffer_count()
        if run:
            out.append(_run_task(run, piece))
    return out


class ChunkRun:
    """Whole raw chunks stored back to back in one file: one task, reading them in order
    ``piece`` bytes at a time (0: in one ``preadv``)."""

    __slots__ = ("reads", "piece")

    def __init__(self, reads: list[ChunkRead], piece: int = 0) -> None:
        self.reads, self.piece = reads, piece

    def __call__(self) -> None:
        self.reads[0].file._read_run(self.reads, self.piece)


def _run_task(run: list[ChunkRead], piece: int) -> Callable[[], None]:
    return run[0] if len(run) == 1 and not piece else ChunkRun(run, piece)


def verify_stored(chunk: list[int], stored: list[memoryview | bytes], where: str) -> None:
    """Check a chunk's stored bytes, in one piece or several in order, against its CRC."""
    crc = 0
    for piece in stored:
        crc = crc32(piece, crc)
    check_crc(chunk, crc, where)


def check_crc(chunk: list[int], crc: int, where: str) -> None:
    """Raise unless ``crc`` is the chunk's recorded CRC."""
    if crc != chunk[4]:
        stored_off, stored_len = chunk[2], chunk[3]
        raise CheckpointCorruptError(f"{where}: checksum mismatch in bytes {stored_off}..{stored_off + stored_len}")


def decode_chunk(chunk: list[int], stored: memoryview | bytes, where: str, *, decode: bool = True) -> memoryview:
    """Check a chunk's stored bytes against its CRC; return its logical bytes (or, with
    ``decode=False``, the checked stored bytes)."""
    logical, length, stored_off, stored_len, _, codec = chunk
    if len(stored) != stored_len:
        raise CheckpointCorruptError(
            f"{where}: truncated at byte {stored_off + len(stored)} (chunk at {stored_off} "
            f"needs {stored_len} bytes)"
        )
    verify_stored(chunk, [stored], where)
    if codec == ZSTD and decode:
        try:
            return memoryview(_decompressor().decompress(stored, max_output_size=length))
        except zstandard.ZstdError as exc:
            raise CheckpointCorruptError(f"{where}: chunk at {stored_off}: {exc}") from exc
    return memoryview(stored)
