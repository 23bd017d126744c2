"""Restore merges raw chunks stored back to back into one ``preadv``: the same bytes
land in the same destinations, every chunk is still checked on its own (a bad byte or a
truncation names the chunk it sits in), and what cannot be merged is read as before. The
same holds whether a run is read a piece at a time (as restore reads shared state, so that each
piece's checksum reads bytes still in cache) or in one ``preadv``, with pieces that split
chunks and the scratch around a tensor's wanted bytes anywhere."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from resilient import _chunkio
from resilient._chunkio import ChunkedFile, ChunkRead, ChunkRun, batched, write_chunked
from resilient._errors import CheckpointCorruptError
from resilient._restore import lagged

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 << 10
#: blob sizes as a checkpoint's tensors have them: uneven, some spanning several chunks
SIZES = [3 * CHUNK + 5, 17, CHUNK, 2 * CHUNK - 1, 4096, 5 * CHUNK + 123, 1, 3 * CHUNK]


def blobs() -> list[bytes]:
    return [os.urandom(n) for n in SIZES]


def write(path: str, data: list[bytes], codec: str = "none") -> dict:
    with ThreadPoolExecutor(2) as pool:
        return write_chunked(path, [memoryview(b) for b in data], codec=codec, chunk_bytes=CHUNK, pool=pool)


def reads_into(file: ChunkedFile, dests: list[bytearray]) -> list[ChunkRead]:
    """One read per chunk, each blob into its own buffer (as restore fills one tensor each)."""
    tasks, offset = [], 0
    for dest in dests:
        tasks += file.read_tasks(offset, memoryview(dest))
        offset += len(dest)
    return tasks


#: read in one ``preadv`` a run, or in pieces of 5,000 bytes (neither a chunk's divisor nor
#: a multiple of a page: pieces end inside chunks, padding and scratch)
PIECES = [0, 5000]


def run_all(tasks) -> None:
    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(t) for t in tasks]:
            future.result()


@pytest.mark.parametrize("piece", PIECES)
def test_merged_reads_fill_every_destination_with_its_own_bytes(tmp_path, piece, monkeypatch):
    data = blobs()
    path = str(tmp_path / "f.data")
    record = write(path, data)
    dests = [bytearray(len(b)) for b in data]
    per_chunk = reads_into(ChunkedFile(path, record), dests)
    merged = batched(per_chunk, limit=1 << 30, piece=piece)
    assert len(per_chunk) == len(record["chunks"]) > 1
    assert len(merged) == 1  # the whole file is one run of whole raw chunks
    sizes = []  # of each read, as the kernel is asked for it
    preadv = os.preadv

    def counted(fd, bufs, offset):
        sizes.append(sum(map(len, bufs)))
        return preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counted)
    run_all(merged)
    assert [bytes(d) for d in dests] == data
    assert sum(sizes) == sum(c[3] for c in record["chunks"])
    assert max(sizes) == (piece or sum(sizes))  # one read of the whole run, or pieces


def test_runs_respect_the_byte_limit_the_buffer_cap_and_the_default_split(tmp_path, monkeypatch):
    data = blobs()
    path = str(tmp_path / "f.data")
    record = write(path, data)
    sizes = [c[3] for c in record["chunks"]]
    dests = [bytearray(len(b)) for b in data]
    file = ChunkedFile(path, record)

    limit = 2 * CHUNK
    merged = batched(reads_into(file, dests), limit=limit)
    assert all(sum(r.chunk[3] for r in _run_of(t)) <= limit for t in merged)
    assert sum(len(_run_of(t)) for t in merged) == len(sizes)

    monkeypatch.setattr(_chunkio, "READ_BATCH_BUFFERS", 3)  # whole chunks: one buffer each
    capped = batched(reads_into(file, dests), limit=1 << 30)
    assert max(len(_run_of(t)) for t in capped) == 3
    run_all(capped)
    assert [bytes(d) for d in dests] == data

    monkeypatch.setattr(_chunkio, "READ_BATCH_BUFFERS", 1024)
    default = batched(reads_into(file, dests))  # split READ_BATCH_WAYS ways by bytes
    assert len(default) >= min(_chunkio.READ_BATCH_WAYS, len(sizes)) - 1
    assert len(batched(reads_into(file, dests), limit=0)) == len(sizes)  # 0: nothing merged


def whole(read: ChunkRead) -> bool:
    """The entire chunk, stored raw, lands in the read's destination: no scratch."""
    return read.raw and read.buffer_count() == 1


def _run_of(task) -> list[ChunkRead]:
    """The chunks a task from ``batched`` reads."""
    return task.reads if isinstance(task, ChunkRun) else [task]


@pytest.mark.parametrize("piece", PIECES)
def test_a_flipped_byte_inside_a_merged_run_names_its_chunk(tmp_path, piece):
    data = blobs()
    path = str(tmp_path / "f.data")
    record = write(path, data)
    bad = record["chunks"][5]  # a chunk in the middle of the run
    with open(path, "r+b") as f:
        f.seek(bad[2] + bad[3] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    dests = [bytearray(len(b)) for b in data]
    merged = batched(reads_into(ChunkedFile(path, record), dests), limit=1 << 30, piece=piece)
    with pytest.raises(CheckpointCorruptError, match=f"checksum mismatch in bytes {bad[2]}..{bad[2] + bad[3]}"):
        run_all(merged)


@pytest.mark.parametrize("piece", PIECES)
def test_a_file_truncated_inside_a_merged_run_names_the_chunk_cut(tmp_path, piece):
    data = blobs()
    path = str(tmp_path / "f.data")
    record = write(path, data)
    cut = record["chunks"][4]
    os.truncate(path, cut[2] + 10)
    dests = [bytearray(len(b)) for b in data]
    merged = batched(reads_into(ChunkedFile(path, record), dests), limit=1 << 30, piece=piece)
    with pytest.raises(CheckpointCorruptError, match=f"truncated at byte {cut[2] + 10} \\(chunk at {cut[2]} "):
        run_all(merged)


def test_compressed_chunks_are_read_on_their_own_and_partial_raw_ones_merge(tmp_path):
    data = [bytes(3 * CHUNK), os.urandom(2 * CHUNK)]  # zeros compress; random bytes are stored raw
    path = str(tmp_path / "f.data")
    record = write(path, data, codec="zstd")
    codecs = [c[5] for c in record["chunks"]]
    assert _chunkio.ZSTD in codecs and _chunkio.RAW in codecs
    file = ChunkedFile(path, record)
    dests = [bytearray(len(b)) for b in data]
    tasks = reads_into(file, dests)
    partial = bytearray(CHUNK)  # a range across two raw chunks, not from a chunk's start
    tasks += file.read_tasks(3 * CHUNK + CHUNK // 2, memoryview(partial))
    merged = batched(tasks, limit=1 << 30, piece=0)  # one task per merged run, one per chunk alone
    runs = [t for t in merged if isinstance(t, ChunkRun)]
    # the second blob's two raw chunks are each read twice: whole, and in part for
    # ``partial``. In file order: the first chunk whole, then (one run) its wanted half and
    # the second chunk whole, then the second chunk's wanted half
    assert [[(r.chunk[0], whole(r)) for r in run.reads] for run in runs] == [[(3 * CHUNK, False), (4 * CHUNK, True)]]
    alone = [t for t in merged if isinstance(t, ChunkRead)]
    assert sorted((t.raw, whole(t)) for t in alone) == [(False, False)] * 3 + [(True, False), (True, True)]
    run_all(merged)
    assert [bytes(d) for d in dests] == data
    assert bytes(partial) == data[1][CHUNK // 2 : CHUNK // 2 + CHUNK]


@pytest.mark.parametrize("piece", PIECES)
def test_chunks_holding_padding_merge_and_read_only_the_wanted_bytes(tmp_path, piece):
    """Each tensor's last chunk holds the zeros that put the next tensor on a 64-byte
    offset: its wanted bytes land in the tensor, the padding in scratch, and the chunks of
    consecutive tensors still make one read."""
    data = blobs()
    padded = [b + bytes(-len(b) % 64) for b in data]
    path = str(tmp_path / "f.data")
    record = write(path, padded)
    file = ChunkedFile(path, record)
    dests = [bytearray(len(b)) for b in data]
    tasks, offset = [], 0
    for dest, blob in zip(dests, padded):
        tasks += file.read_tasks(offset, memoryview(dest))
        offset += len(blob)
    assert any(not whole(t) for t in tasks)  # the odd-sized tensors' last chunks
    merged = batched(tasks, limit=1 << 30, piece=piece)
    assert len(merged) == 1 and isinstance(merged[0], ChunkRun)
    run_all(merged)
    assert [bytes(d) for d in dests] == data


@pytest.mark.parametrize("piece", PIECES)
def test_a_flipped_padding_byte_is_caught_though_no_one_asked_for_it(tmp_path, piece):
    data = [os.urandom(100), os.urandom(CHUNK)]
    path = str(tmp_path / "f.data")
    record = write(path, [memoryview(data[0] + bytes(28)), memoryview(data[1])])
    with open(path, "r+b") as f:
        f.seek(110)  # inside the first chunk's padding
        f.write(b"\x01")
    dests = [bytearray(100), bytearray(CHUNK)]
    tasks = ChunkedFile(path, record).read_tasks(0, memoryview(dests[0]))
    tasks += ChunkedFile(path, record).read_tasks(128, memoryview(dests[1]))
    first = record["chunks"][0]
    with pytest.raises(CheckpointCorruptError, match=f"checksum mismatch in bytes 0..{first[3]}"):
        run_all(batched(tasks, limit=1 << 30, piece=piece))


def test_other_ranks_parts_are_queued_a_lag_behind_their_owners():
    """Through the page cache, a rank reads another rank's k-th read once its own k + lag-th
    is queued (the owner has read that far by then), each part in its own order."""
    own, second, third = [f"own{i}" for i in range(5)], [f"b{i}" for i in range(3)], ["c0", "c1"]
    got = lagged([own, second, third], 2)
    assert got == ["own0", "own1", "own2", "b0", "own3", "b1", "own4", "b2", "c0", "c1"]
    assert lagged([own, second], 100) == own + second  # a lag past the own part: all of it first
