"""Data files written with direct I/O from the snapshot buffer: the same bytes and chunk
table as a buffered write, the page cache bypassed (seen with mincore), a buffered
fallback wherever direct I/O is refused, and buffered files on request."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from resilient import Checkpointer
from resilient import _chunkio
from resilient._chunk_table import with_footer
from resilient._chunkio import DIRECT_ALIGN, ChunkedFile, write_chunked
from resilient._errors import CheckpointCorruptError
from resilient._hostmem import page_aligned_empty

pytestmark = pytest.mark.timeout(60)

SIZES = [5 * DIRECT_ALIGN + 3, 1 << 20, 7, 3 * (1 << 20) + 4097]  # blob ends fall mid-page


def resident_pages(path: str) -> list[bool]:
    """Which of the file's pages are in the page cache (mincore on a private mapping)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del address
        return [bool(v & 1) for v in vec]
    finally:
        mapped.close()


def filled(buffer: torch.Tensor) -> list[memoryview]:
    buffer.copy_(torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    base, views, pos = memoryview(buffer.numpy()), [], 0
    for n in SIZES:
        views.append(base[pos : pos + n])
        pos += n
    return views


def write(path: str, views: list[memoryview], contiguous: memoryview | None, codec: str = "none") -> dict:
    with ThreadPoolExecutor(2) as pool:
        return write_chunked(path, views, codec=codec, chunk_bytes=1 << 20, pool=pool, contiguous=contiguous)


def read_back(path: str, record: dict, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    for task in ChunkedFile(path, record).read_tasks(0, memoryview(out)):
        task()
    return bytes(out)


def test_page_aligned_buffer_is_written_past_the_page_cache(tmp_path):
    buffer = page_aligned_empty(sum(SIZES))
    assert buffer.data_ptr() % DIRECT_ALIGN == 0
    views = filled(buffer)
    path = str(tmp_path / "rank.data")
    record = write(path, views, memoryview(buffer.numpy()))
    resident = resident_pages(path)  # before anything reads the file back
    assert not any(resident[:-1]), "the aligned part must not go through the page cache"
    assert open(path, "rb").read() == buffer.numpy().tobytes()
    assert read_back(path, record, sum(SIZES)) == buffer.numpy().tobytes()  # every chunk's CRC checks


def test_unaligned_buffer_falls_back_to_buffered_writes(tmp_path):
    raw = page_aligned_empty(sum(SIZES) + 1)
    buffer = raw[1:]  # one byte off the page boundary: direct I/O cannot take it
    views = filled(buffer)
    path = str(tmp_path / "rank.data")
    record = write(path, views, memoryview(buffer.numpy()))
    assert all(resident_pages(path)), "a buffered write leaves the file in the page cache"
    assert read_back(path, record, sum(SIZES)) == buffer.numpy().tobytes()


def test_a_device_refusing_direct_io_midway_gets_the_rest_buffered(tmp_path, monkeypatch):
    """The kernel's EINVAL (a device with larger blocks) is the one thing stood in for here."""
    buffer = page_aligned_empty(sum(SIZES))
    views = filled(buffer)
    path = str(tmp_path / "rank.data")
    real_pwrite, direct_writes = os.pwrite, []

    def pwrite(fd: int, data, offset: int) -> int:
        if os.get_blocking(fd) and fcntl_flags(fd) & os.O_DIRECT:
            direct_writes.append(offset)
            if len(direct_writes) > 1:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(_chunkio, "DIRECT_WRITE_BYTES", 1 << 20)  # several direct writes for 4 MB
    record = write(path, views, memoryview(buffer.numpy()))
    monkeypatch.undo()
    assert len(direct_writes) == 2, "one direct write went through, the second was refused"
    assert open(path, "rb").read() == buffer.numpy().tobytes()
    assert read_back(path, record, sum(SIZES)) == buffer.numpy().tobytes()


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_compressed_files_keep_the_buffered_path(tmp_path):
    buffer = page_aligned_empty(sum(SIZES))
    views = filled(buffer)
    buffer[: SIZES[0]].zero_()  # one blob that zstd shrinks
    path = str(tmp_path / "rank.data")
    record = write(path, views, memoryview(buffer.numpy()), codec="zstd")
    assert any(c[5] == 1 for c in record["chunks"]), "the zeros were compressed"
    assert read_back(path, record, sum(SIZES)) == buffer.numpy().tobytes()


class _CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.tasks = 0

    def submit(self, *args, **kwargs):
        self.tasks += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize("path_taken", ["direct", "buffered", "zstd"])
def test_many_small_blobs_keep_a_chunk_each_and_go_to_the_pool_in_batches(tmp_path, path_taken):
    """A state of thousands of small tensors: each blob still ends its chunk (the table is
    what it was), but the pool gets a task per ~1 MB of chunks, not one per chunk: one a
    chunk made 20,000 tensors of 1 kB take 0.9 s to write."""
    g = torch.Generator().manual_seed(2)
    sizes = torch.randint(1, 3000, (3000,), generator=g).tolist() + [(5 << 20) + 11] + [17] * 50
    raw = page_aligned_empty(sum(sizes) + 1)
    buffer = raw[1:] if path_taken == "buffered" else raw[: sum(sizes)]  # off the page: buffered
    buffer.copy_(torch.randint(0, 4, (buffer.numel(),), dtype=torch.uint8, generator=g))  # zstd shrinks it
    base, views, pos = memoryview(buffer.numpy()), [], 0
    for n in sizes:
        views.append(base[pos : pos + n])
        pos += n
    path = str(tmp_path / "rank.data")
    with _CountingPool() as pool:
        record = write_chunked(path, views, codec="zstd" if path_taken == "zstd" else "none", chunk_bytes=1 << 20,
                               pool=pool, contiguous=base)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    big_start = ends[2999]
    expected = sorted(set(ends) | {big_start + k * (1 << 20) for k in range(1, 6)})
    assert [c[0] + c[1] for c in record["chunks"]] == expected  # logical ends: blob ends, and the big one cut
    assert pool.tasks <= 16, f"{pool.tasks} pool tasks for {len(record['chunks'])} chunks"
    assert read_back(path, record, sum(sizes)) == buffer.numpy().tobytes()  # every chunk's CRC checks
    if path_taken == "zstd":
        assert sum(c[5] == 1 for c in record["chunks"]) > 2000, "each chunk compressed on its own"


def test_the_chunk_table_in_a_files_footer_is_each_chunks_row_as_the_format_lays_it_out():
    """Format 4's footer (packed a column at a time, not row by row): per chunk its length,
    stored length and CRC as little-endian uint32, then the codec byte, in chunk order, up to
    the largest values a row holds; a row that does not fit is refused, not wrapped."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 1 << 20, (5000,), generator=g).tolist() + [1 << 30] * 5  # offsets past 4 GiB
    crcs = torch.randint(0, 1 << 32, (len(lengths),), generator=g, dtype=torch.int64).tolist()
    crcs[-1] = 0xFFFFFFFF
    chunks, logical, stored = [], 0, 0
    for i, (length, crc) in enumerate(zip(lengths, crcs)):
        kept = length if i % 3 else max(1, length // 2)  # every third compressed
        chunks.append([logical, length, stored, kept, crc, 0 if i % 3 else 1])
        logical, stored = logical + length, stored + kept
    table, record = with_footer(chunks, stored)
    assert table == b"".join(struct.pack("<IIIB", c[1], c[3], c[4], c[5]) for c in chunks)
    assert record["footer"] == [len(chunks), zlib.crc32(table)]
    assert record["bytes"] == stored + len(table) and record["logical"] == logical
    assert with_footer([], 0)[0] == b""
    with pytest.raises(ValueError, match="under 2\\*\\*32"):
        with_footer([[0, 1 << 32, 0, 1 << 32, 0, 0]], 1 << 32)


def test_blobs_that_are_not_the_buffer_are_refused(tmp_path):
    buffer = page_aligned_empty(sum(SIZES))
    views = filled(buffer)
    with pytest.raises(ValueError, match="the blobs hold"):
        write(str(tmp_path / "rank.data"), views[:-1], memoryview(buffer.numpy()))


@pytest.mark.parametrize("path_taken", ["direct", "buffered", "zstd", "recycled"])
def test_a_trailer_is_a_chunk_of_its_own_after_the_blobs(tmp_path, path_taken):
    """A rank's generator states follow its tensors' bytes in its file: one raw chunk whose
    logical offset is where the blobs end, read back alone and checked, on every write path
    (a recycled file, longer than the new one, is cut after the trailer)."""
    raw = page_aligned_empty(sum(SIZES) + 1)
    buffer = raw[1:] if path_taken == "buffered" else raw[:-1]
    views = filled(buffer)
    buffer[: SIZES[0]].zero_()
    path = str(tmp_path / "rank.data")
    if path_taken == "recycled":
        with open(path, "wb") as f:
            f.write(b"\xff" * (sum(SIZES) + 100_000))
    trailer = b'{"torch":"z:' + b"x" * 10_000 + b'"}'
    with ThreadPoolExecutor(2) as pool:
        record = write_chunked(path, views, codec="zstd" if path_taken == "zstd" else "none", chunk_bytes=1 << 20,
                               pool=pool, contiguous=memoryview(buffer.numpy()), trailer=trailer)
    last = record["chunks"][-1]
    assert last[:2] == [sum(SIZES), len(trailer)] and last[5] == 0
    assert last[2] + last[3] == record["bytes"] == os.path.getsize(path)
    assert read_back(path, record, sum(SIZES)) == buffer.numpy().tobytes()
    got = bytearray(len(trailer))
    tasks = ChunkedFile(path, record).read_tasks(sum(SIZES), memoryview(got))
    assert len(tasks) == 1
    tasks[0]()
    assert bytes(got) == trailer
    with open(path, "r+b") as f:  # a flipped byte in it is caught by its own checksum
        f.seek(last[2] + 5)
        f.write(b"!")
    with pytest.raises(CheckpointCorruptError, match="rank.data"):
        for task in ChunkedFile(path, record).read_tasks(sum(SIZES), memoryview(got)):
            task()


def tensor_bytes(data_file: str) -> int:
    """Where the tensors' bytes end in a one-rank checkpoint's file: the generator states
    (written through the page cache: they are small) follow."""
    with open(os.path.join(os.path.dirname(data_file), "manifest.json")) as f:
        return json.load(f)["ranks"][0][1][0]


def data_files(root) -> list[str]:
    return [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".data")]


@pytest.mark.parametrize("env, arg, cached", [(None, None, False), ("0", None, True), ("off", True, False),
                                              ("1", False, True)])
def test_checkpoint_direct_or_buffered_restores_exactly(tmp_path, monkeypatch, env, arg, cached):
    """Direct by default; ``direct_io=False`` or RESILIENT_DIRECT_IO=0 leaves the files in the
    page cache (for a restart on this node); the argument wins over the variable."""
    if env is None:
        monkeypatch.delenv("RESILIENT_DIRECT_IO", raising=False)
    else:
        monkeypatch.setenv("RESILIENT_DIRECT_IO", env)
    state = {"w": torch.randn(1000, 333), "b": torch.arange(17, dtype=torch.int16)}
    with Checkpointer(str(tmp_path / "ckpt"), keep=1, direct_io=arg) as ckpt:
        ckpt.save(1, state).result()
        data = data_files(tmp_path / "ckpt")
        assert len(data) == 1
        resident = resident_pages(data[0])[:tensor_bytes(data[0]) // mmap.PAGESIZE]  # not the RNG states after
        assert all(resident) if cached else not any(resident), resident.count(True)
        got = {"w": torch.zeros(1000, 333), "b": torch.zeros(17, dtype=torch.int16)}
        assert ckpt.restore(got) == 1
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_a_bad_direct_io_variable_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_DIRECT_IO", "sometimes")
    with pytest.raises(ValueError, match="RESILIENT_DIRECT_IO='sometimes' is not a flag"):
        Checkpointer(str(tmp_path / "ckpt"))
