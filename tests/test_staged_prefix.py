"""The writer starts on a save's data file while the snapshot copy is still filling the
buffer (``StagedPrefix``): it writes and checksums only bytes already staged, the file and
its checksums are those of the finished buffer, and a copy that fails fails the save
without hanging the writer or committing anything."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from resilient import Checkpointer, CommitError
from resilient import _chunkio
from resilient._chunkio import ChunkedFile, write_chunked
from resilient._fence import StagedPrefix, StagingTornError
from resilient._snapshot import Staging, page_aligned_empty

pytestmark = pytest.mark.timeout(60)

MB = 1 << 20
TOTAL = 6 * MB + 4097  # the last write is partial and ends mid-page
PIECE = 2 * MB


def final_bytes() -> torch.Tensor:
    return torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


def start_writer(path: str, buffer: torch.Tensor, staged: StagedPrefix, *, codec: str, direct: bool) -> dict:
    """write_chunked on a thread of its own, as the background writer runs it."""
    result: dict = {}
    base = memoryview(buffer.numpy())
    views = [base[: 3 * MB + 5], base[3 * MB + 5 :]]  # two blobs; the first ends mid-page

    def run() -> None:
        try:
            with ThreadPoolExecutor(1) as pool:
                result["record"] = write_chunked(path, views, codec=codec, chunk_bytes=MB, pool=pool,
                                                 contiguous=base, direct=direct, ready=staged.wait_for)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc

    result["thread"] = threading.Thread(target=run)
    result["thread"].start()
    return result


def written_prefix(path: str, expected: bytes, timeout: float = 20.0) -> bool:
    """Whether the file's first ``len(expected)`` bytes become ``expected`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, "rb") as f:
                if f.read(len(expected)) == expected:
                    return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("codec,direct", [("none", True), ("none", False), ("zstd", False)])
def test_the_file_is_written_as_pieces_are_staged_and_checks_against_the_final_bytes(tmp_path, monkeypatch, codec,
                                                                                      direct):
    monkeypatch.setattr(_chunkio, "DIRECT_WRITE_BYTES", MB)
    source = final_bytes()
    buffer = page_aligned_empty(TOTAL, pin=False)
    buffer.zero_()
    staged = StagedPrefix()
    path = str(tmp_path / "rank.data")
    writer = start_writer(path, buffer, staged, codec=codec, direct=direct)
    buffer[:PIECE].copy_(source[:PIECE])
    staged.advance(PIECE)
    if codec == "none":  # stored as is: the staged piece reaches the file before the rest is copied
        assert written_prefix(path, source[:MB].numpy().tobytes()), "nothing was written before the copy finished"
    assert writer["thread"].is_alive(), "the writer must wait for the bytes not yet staged"
    for lo in range(PIECE, TOTAL, PIECE):
        hi = min(TOTAL, lo + PIECE)
        buffer[lo:hi].copy_(source[lo:hi])
        staged.advance(hi)
    staged.complete()
    writer["thread"].join(30)
    assert "error" not in writer, writer.get("error")
    out = bytearray(TOTAL)
    for task in ChunkedFile(path, writer["record"]).read_tasks(0, memoryview(out)):
        task()  # verifies every chunk's CRC: none was computed over bytes not yet staged
    assert bytes(out) == source.numpy().tobytes()


def test_a_copy_that_fails_midway_fails_the_write_without_hanging(tmp_path, monkeypatch):
    monkeypatch.setattr(_chunkio, "DIRECT_WRITE_BYTES", MB)
    buffer = page_aligned_empty(TOTAL, pin=False)
    buffer.zero_()
    staged = StagedPrefix()
    writer = start_writer(str(tmp_path / "rank.data"), buffer, staged, codec="none", direct=True)
    staged.advance(PIECE)
    staged.complete(error=RuntimeError("tensor 'w' went away"))
    writer["thread"].join(30)
    assert not writer["thread"].is_alive()
    assert isinstance(writer.get("error"), StagingTornError)
    assert "tensor 'w' went away" in str(writer["error"])


def test_a_save_whose_snapshot_copy_fails_is_not_committed_and_the_next_one_is(tmp_path, monkeypatch):
    state = {"w": torch.randn(256, 1024), "b": torch.randn(1024)}
    with Checkpointer(str(tmp_path / "ckpt"), state=state, every=1) as ckpt:
        ckpt.save(1).result(30)
        real_copy = Staging._copy
        calls = {"n": 0}

        def copy_then_fail(*args, **kwargs):
            calls["n"] += 1
            raise KeyboardInterrupt("interrupted during the snapshot")  # what Ctrl-C does mid-copy

        monkeypatch.setattr(Staging, "_copy", staticmethod(copy_then_fail))
        state["w"].add_(1)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(2)
        assert calls["n"] == 1
        failed = ckpt._inflight
        assert failed is not None and failed.step == 2
        with pytest.raises(CommitError, match="snapshot copy failed"):
            failed.result(30)  # settled, not left waiting for bytes that never come
        assert ckpt.latest() == 1
        monkeypatch.setattr(Staging, "_copy", staticmethod(real_copy))
        ckpt.save(3).result(30)
        assert ckpt.latest() == 3
        saved_w = state["w"].clone()
        state["w"].zero_()
        ckpt.restore()
        assert torch.equal(state["w"], saved_w)
