"""A snapshot copy that runs on after ``save`` (overlapped staging, a GPU) is written as it
comes: the writer asks for each part of the buffer (``ready``) before it reads it, gets it
once that part is final, and the file it leaves holds the final bytes, checksums verified,
whether written direct, buffered or compressed."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from resilient import _chunkio
from resilient._chunkio import ChunkedFile, write_chunked
from resilient._fence import CopyProgress
from resilient._hostmem import page_aligned_empty

pytestmark = pytest.mark.timeout(60)

PIECE = 1 << 20


def test_which_copies_each_prefix_of_the_buffer_needs():
    # blobs at 0 and 200 were final before save returned; 100 is copied first, 300 second
    progress = CopyProgress([(300, 1), (0, -1), (100, 0), (200, -1)])
    assert [progress.needed(end) for end in (0, 100, 101, 200, 300, 301, 10_000)] == [0, 0, 1, 1, 1, 2, 2]


def test_a_writer_waiting_for_bytes_is_released_by_the_copy_or_by_its_end():
    progress = CopyProgress([(0, 0), (PIECE, 1)])
    released: list[int] = []
    waiter = threading.Thread(target=lambda: (progress.wait_through(PIECE + 1), released.append(1)))
    waiter.start()
    progress.copied(1)
    waiter.join(0.3)
    assert waiter.is_alive() and not released, "released before the second copy"
    progress.finished()  # a failed copy ends the wait too; the fence then reports the failure
    waiter.join(10)
    assert released == [1]


@pytest.mark.parametrize("codec,direct", [("none", True), ("none", False), ("zstd", False)])
def test_the_file_holds_the_final_bytes_of_a_buffer_filled_while_it_is_written(tmp_path, monkeypatch, codec, direct):
    monkeypatch.setattr(_chunkio, "DIRECT_WRITE_BYTES", PIECE)  # several writes, one per piece
    pieces = 6
    final = torch.randint(0, 255, (pieces * PIECE,), dtype=torch.uint8)
    buffer = page_aligned_empty(pieces * PIECE)
    buffer.zero_()
    progress = CopyProgress([(i * PIECE, i) for i in range(pieces)])
    granted: list[int] = []  # ends of the prefixes the writer was let read
    granted_more = threading.Condition()

    def ready(end: int) -> None:
        progress.wait_through(end)
        with granted_more:
            granted.append(end)
            granted_more.notify_all()

    def fill() -> None:
        """One piece at a time, the next only once the writer was let read part of this one:
        a writer that waited for the whole buffer would leave this thread stuck."""
        for i in range(pieces):
            buffer[i * PIECE:(i + 1) * PIECE].copy_(final[i * PIECE:(i + 1) * PIECE])
            progress.copied(i + 1)
            if i + 1 < pieces:
                with granted_more:
                    assert granted_more.wait_for(lambda: max(granted, default=0) > i * PIECE, timeout=20), \
                        f"the writer did not start on piece {i} while it was the last one copied"

    filler_errors: list[BaseException] = []

    def run_filler() -> None:
        try:
            fill()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            filler_errors.append(exc)
            progress.finished()

    filler = threading.Thread(target=run_filler)
    filler.start()
    base = memoryview(buffer.numpy())
    views = [base[i * PIECE:(i + 1) * PIECE] for i in range(pieces)]
    path = str(tmp_path / "rank-00000.data")
    with ThreadPoolExecutor(2) as pool:
        record = write_chunked(path, views, codec=codec, chunk_bytes=PIECE // 2, pool=pool,
                               contiguous=base, direct=direct, ready=ready)
    filler.join(30)
    assert not filler_errors, filler_errors[0]
    assert os.path.getsize(path) == record["bytes"]
    restored = bytearray(pieces * PIECE)
    file = ChunkedFile(path, record)
    try:
        for task in file.read_tasks(0, memoryview(restored)):
            task()  # each chunk's checksum is verified as it is read
    finally:
        file.close()
    assert bytes(restored) == final.numpy().tobytes()
