"""Background work that costs cores (zstd, writes through the page cache, uploads) runs at a
lower CPU priority than the training thread (its own nice value), so a busy step is served
first; the rest of a save (the writer, direct writes and their CRCs) and the staging
buffer's first touch do not, and work that is late (a thread waits for it, its save is
older than RESILIENT_BACKGROUND_YIELD_S, a newer step waits behind an upload) is done at the
job's priority by the thread that needs it, after the piece a yielding thread has in hand."""

import os
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from resilient import Checkpointer
from resilient._background import Handover, YieldingPool, in_pieces, someone_waits, waiting
from resilient import _transfer
from resilient._snapshot import Staging
from resilient._writer import SaveHandle

pytestmark = pytest.mark.timeout(60)


def _nice(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def _settle_unwatched(handle, limit: float = 30.0) -> None:
    """Until the save is done, without waiting for it (a waiter stops the yielding)."""
    deadline = time.monotonic() + limit
    while not handle.done():
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)


class PriorityOfWrites:
    """The nice value of every thread that writes to a data file, as it writes."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, int]] = []
        pwrite = os.pwrite

        def recording(fd, data, offset):
            self.seen.append((threading.current_thread().name, _nice(threading.get_native_id())))
            return pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", recording)


@pytest.mark.parametrize("setting, raised_by", [(None, 19), ("3", 3), ("0", 0)])
def test_only_the_work_that_costs_cores_runs_niced(tmp_path, monkeypatch, setting, raised_by):
    if setting is None:
        monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    else:
        monkeypatch.setenv("RESILIENT_BACKGROUND_NICE", setting)
    monkeypatch.delenv("RESILIENT_BACKGROUND_YIELD_S", raising=False)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    niced = min(19, base + raised_by)
    earlier = set(threading.enumerate())  # another test's checkpointer, left open, is not this one's
    state = {"w": torch.randn(1 << 20)}
    with Checkpointer(str(tmp_path / "zstd"), remote=f"file://{tmp_path / 'remote'}", compress="zstd",
                      direct_io=False) as ckpt:
        _settle_unwatched(ckpt.save(1, state))
        ckpt.flush(timeout=30)  # the uploader has run
        mine = {t.name: t for t in threading.enumerate() if t not in earlier and t.name.startswith("resilient-")}
        for prefix in ("resilient-encode", "resilient-pagecache", "resilient-upload_"):
            found = [t for name, t in mine.items() if name.startswith(prefix)]
            assert found, (prefix, sorted(mine))
            assert all(_nice(t.native_id) == niced for t in found), prefix
        # the threads that mostly wait: the writer, and the uploader, which hands its
        # checksums and copies to the yielding ``resilient-upload_`` threads
        assert _nice(mine["resilient-writer"].native_id) == base
        assert _nice(mine["resilient-uploader"].native_id) == base
    with Checkpointer(str(tmp_path / "direct"), direct_io=True) as ckpt:  # raw chunks, written direct
        earlier = set(threading.enumerate())
        _settle_unwatched(ckpt.save(1, state))
        fresh = [t for t in threading.enumerate() if t not in earlier and t.name.startswith("resilient-encode")]
        assert fresh and all(_nice(t.native_id) == base for t in fresh + _threads("resilient-writer"))
    assert _nice(threading.get_native_id()) == base  # the training thread is untouched


def test_a_save_that_is_late_is_written_at_the_jobs_priority(tmp_path, monkeypatch):
    """Past RESILIENT_BACKGROUND_YIELD_S (here 0), nothing of the save yields: the writer
    makes the page-cache writes itself (with the default, the page-cache thread makes them
    niced, checked first)."""
    monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    state = {"w": torch.randn(1 << 20)}
    writes = PriorityOfWrites(monkeypatch)
    with Checkpointer(str(tmp_path / "yielding"), direct_io=False, rng=False) as ckpt:
        _settle_unwatched(ckpt.save(1, state))
    assert {(name.split("_")[0], nice) for name, nice in writes.seen if name.startswith("resilient-")} >= {
        ("resilient-pagecache", min(19, base + 19))}
    monkeypatch.setenv("RESILIENT_BACKGROUND_YIELD_S", "0")
    writes.seen.clear()
    with Checkpointer(str(tmp_path / "late"), direct_io=False, rng=False) as ckpt:
        _settle_unwatched(ckpt.save(1, state))
    assert writes.seen and {nice for name, nice in writes.seen} == {base}, writes.seen
    assert not any(name.startswith("resilient-pagecache") for name, _ in writes.seen)


def test_a_waiter_runs_the_queued_tasks_itself_once_late():
    pool = YieldingPool(1, "test-yielding")
    release = threading.Event()
    try:
        busy = pool.submit(release.wait, 30)  # the one worker, held
        queued = pool.submit(lambda: threading.current_thread().name)
        time.sleep(0.2)
        assert not queued.done()  # not late: left to the worker
        assert pool.result(queued, late=lambda: True) == threading.current_thread().name
        assert not busy.done()  # the worker's task stays with it
        later = pool.submit(lambda: threading.current_thread().name)
        release.set()
        assert pool.result(later, late=lambda: False).startswith("test-yielding")
    finally:
        release.set()
        pool.shutdown()


def test_a_waiter_runs_a_pure_task_a_worker_has_begun_and_the_first_outcome_stands():
    pool = YieldingPool(1, "test-pure", pure=True)
    release, begun = threading.Event(), threading.Event()

    def encode():
        if threading.current_thread().name.startswith("test-pure"):
            begun.set()
            release.wait(30)  # a worker yielding to a busy core, as slow as that
        return threading.current_thread().name

    try:
        task = pool.submit(encode)
        assert begun.wait(10)
        assert pool.result(task, late=lambda: True) == threading.current_thread().name
    finally:
        release.set()
        pool.shutdown()
    assert task.result() == threading.current_thread().name  # the worker's later outcome is dropped


def test_a_thread_waiting_for_a_save_stops_the_yielding_until_it_is_settled():
    handle = SaveHandle(1)
    assert not someone_waits()
    waiter = threading.Thread(target=handle.result, args=(30,))
    waiter.start()
    deadline = time.monotonic() + 10
    while not someone_waits():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle._settle(None)
    waiter.join(10)
    assert not waiter.is_alive() and not someone_waits()
    with waiting():
        assert someone_waits()
    assert not someone_waits()


def _noting(pieces, seen: list, hold: threading.Event | None = None):
    """``pieces``, each noting the thread that runs it and that thread's nice value; the
    first held (its thread waits) until ``hold`` is set."""
    for i, piece in enumerate(pieces):
        seen.append((threading.current_thread().name, _nice(threading.get_native_id())))
        if i == 0 and hold is not None:
            assert hold.wait(30), "never released"
        yield piece


def _recorded(n: int, seen: list, hold: threading.Event | None = None):
    return _noting(range(n), seen, hold)


class Stops:
    """An event set once a ``Handover`` has been told to stop (by ``take``): a piece held
    until then is the piece in hand when its yielding thread was stopped."""

    def __init__(self, monkeypatch):
        self.event = threading.Event()
        stop = Handover.stop

        def noting(handover):
            stop(handover)
            self.event.set()

        monkeypatch.setattr(Handover, "stop", noting)


def _niced() -> tuple[int, int]:
    """(the job's nice value, a yielding thread's) with the default setting."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return base, min(19, base + 19)


def test_a_handover_leaves_the_rest_to_whoever_takes_it_after_the_piece_in_hand(monkeypatch):
    monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    base, niced = _niced()
    stops = Stops(monkeypatch)
    seen: list = []
    work = Handover(_recorded(5, seen, hold=stops.event))
    pool = YieldingPool(1, "test-handover")
    try:
        pool.submit(work.run)
        deadline = time.monotonic() + 10
        while not seen:  # the worker is in its first piece, held
            assert time.monotonic() < deadline
            time.sleep(0.01)
        work.take()  # stops the worker, waits for its piece, does the rest here
    finally:
        pool.shutdown()
    me = threading.current_thread().name
    assert seen[0][0].startswith("test-handover") and seen[0][1] == niced
    assert seen[1:] == [(me, base)] * 4


def test_in_pieces_runs_what_is_late_in_the_caller_and_raises_the_workers_error(monkeypatch):
    monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    base, niced = _niced()
    pool = YieldingPool(1, "test-pieces")
    release = threading.Event()
    try:
        seen: list = []
        in_pieces(_recorded(3, seen), pool, late=lambda: False)  # not late: the yielding thread does all
        assert [nice for _, nice in seen] == [niced] * 3 and all(n.startswith("test-pieces") for n, _ in seen)

        def failing():
            yield
            raise OSError("disk gone")

        with pytest.raises(OSError, match="disk gone"):  # raised on the worker, given to the caller
            in_pieces(failing(), pool, late=lambda: False)
        pool.submit(release.wait, 30)  # the one worker, held: the work is queued behind it
        seen.clear()
        in_pieces(_recorded(3, seen), pool, late=lambda: True)
        assert seen == [(threading.current_thread().name, base)] * 3
    finally:
        release.set()
        pool.shutdown()


class HeldCopies:
    """The nice value of each piece of the uploader's copies of data files to a local
    directory, the first piece of the first copy held until its yielding thread is stopped."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[int, int]] = []
        self.held = threading.Event()
        stops = Stops(monkeypatch)
        copying = _transfer._copying

        def recording(src, dst, step, fname, manifest, progress):
            for piece in copying(src, dst, step, fname, manifest, progress):
                self.seen.append((step, _nice(threading.get_native_id())))
                if not self.held.is_set():
                    self.held.set()
                    assert stops.event.wait(30), "the copy was never taken over"
                yield piece

        monkeypatch.setattr(_transfer, "_copying", recording)
        monkeypatch.setattr(_transfer, "LOCAL_SPAN", 1 << 20)  # (a piece is a chunk; this reads one at a time)

    def of(self, step: int) -> list[int]:
        return [nice for at, nice in self.seen if at == step]


@contextmanager
def _held_upload(tmp_path, monkeypatch):
    """(a Checkpointer whose remote tier is a directory, its copies seen): step 1 saved, and
    its upload held in its first piece until its yielding thread is stopped."""
    monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    copies = HeldCopies(monkeypatch)
    state = {"w": torch.randn(1 << 20)}
    with Checkpointer(str(tmp_path / "local"), remote=f"file://{tmp_path / 'remote'}", rng=False,
                      chunk_bytes=1 << 20) as ckpt:  # 4 MB: four chunks, a piece each
        _settle_unwatched(ckpt.save(1, state))
        assert copies.held.wait(30)  # the upload's first piece, yielding, held
        yield ckpt, copies, state


def test_a_flush_takes_over_the_upload_at_the_jobs_priority(tmp_path, monkeypatch):
    """A flush (a preemption's drain, a close) is a thread waiting for the upload: beside
    busy cores, a yielding copy took 128 s where one at the job's priority took 3.8 s."""
    base, niced = _niced()
    with _held_upload(tmp_path, monkeypatch) as (ckpt, copies, _):
        ckpt.flush(timeout=60)
        assert ckpt._uploader.uploaded(1)
    pieces = copies.of(1)
    assert len(pieces) >= 4 and pieces[0] == niced and set(pieces[1:]) == {base}, pieces


def test_an_upload_a_newer_step_waits_behind_stops_yielding(tmp_path, monkeypatch):
    """Yielding throughout beside busy cores, uploads fell behind the saves, and retention
    let every step go before it was up. The next step's upload, with none behind it, yields."""
    base, niced = _niced()
    with _held_upload(tmp_path, monkeypatch) as (ckpt, copies, state):
        _settle_unwatched(ckpt.save(2, state))  # committed here, queued behind step 1
        deadline = time.monotonic() + 60
        while not ckpt._uploader.uploaded(2):  # watched, not waited for (a flush would end the yielding)
            assert time.monotonic() < deadline, "the uploads did not finish"
            time.sleep(0.02)
    first, second = copies.of(1), copies.of(2)
    assert first[0] == niced and len(first) >= 4 and set(first[1:]) == {base}, first
    assert len(second) >= 4 and set(second) == {niced}, second


def test_the_first_save_takes_over_a_zeroing_prewarm(monkeypatch):
    """Where the kernel cannot populate pages (before Linux 5.14), the prewarm zeroes them,
    and the save that needs its buffer zeroes the rest itself, after the piece in hand. The
    prewarm runs at the job's priority: a thread at nice 19 inside the kernel (populating,
    registering with CUDA) can hold the memory-map lock the training thread's faults need."""
    monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    base, _ = _niced()
    monkeypatch.setattr("resilient._snapshot._TOUCH_PIECE", 1 << 20)
    monkeypatch.setattr("resilient._snapshot.can_populate", lambda: False)
    stops = Stops(monkeypatch)
    seen: list = []
    allocating = Staging._allocating

    def recording(staging, nbytes, pin, touch=True):
        return _noting(allocating(staging, nbytes, pin, touch), seen, stops.event)

    monkeypatch.setattr(Staging, "_allocating", recording)
    staging = Staging()
    try:
        staging.prewarm(8 << 20, pin=False)
        deadline = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        buffer = staging._ensure(8 << 20, False)
    finally:
        staging.close()
    me = threading.current_thread().name
    assert buffer.numel() >= 8 << 20 and not bool(buffer[: 8 << 20].any())
    assert seen[0] == ("resilient-prewarm", base)
    assert len(seen) >= 8 and set(seen[1:]) == {(me, base)}, seen


def test_the_first_save_does_not_wait_for_a_populating_prewarm_which_changes_no_byte(monkeypatch):
    """Populating pages changes none of their bytes, so the save that needs the buffer stops
    the prewarm and goes on at once, its piece in hand running on beside the save's copy.
    Even one piece of a thread at nice 19 is slow to wait for beside busy cores."""
    from resilient import _snapshot
    from resilient._hostmem import can_populate

    if not can_populate():
        pytest.skip("the kernel cannot populate pages (MADV_POPULATE_WRITE, Linux 5.14+)")
    populate = _snapshot.populate
    held, release, finished = threading.Event(), threading.Event(), threading.Event()
    calls: list[str] = []

    def holding(buffer):
        calls.append((threading.current_thread().name, _nice(threading.get_native_id())))
        if len(calls) == 1:
            held.set()
            assert release.wait(30)
            try:
                return populate(buffer)
            finally:
                finished.set()
        return populate(buffer)

    monkeypatch.setattr(_snapshot, "populate", holding)
    staging = Staging()
    try:
        staging.prewarm(8 << 20, pin=False)
        made = staging.buffer  # mapped at once, populated in the background
        assert made is not None and made.numel() >= 8 << 20
        assert held.wait(10)  # the prewarm, in its first piece
        buffer = staging._ensure(8 << 20, False)
        assert not finished.is_set()  # not waited for
        assert buffer.data_ptr() == made.data_ptr()  # the prewarmed buffer
        pattern = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)
        buffer[: 8 << 20].copy_(pattern)  # the save's copy, beside the piece in hand
        release.set()
        assert finished.wait(10)
        assert torch.equal(buffer[: 8 << 20], pattern)  # populating changed no byte
    finally:
        release.set()
        staging.close()
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert calls == [("resilient-prewarm", base)]  # the job's priority; stopped after its piece in hand
