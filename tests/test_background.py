"""Background work that costs cores (zstd, writes through the page cache, uploads) runs at a
lower CPU priority than the training thread (its own nice value), so a busy step is served
first; the rest of a save (the writer, direct writes and their CRCs) does not, and work that
is late (a thread waits for it, or its save is older than RESILIENT_BACKGROUND_YIELD_S) is
done at the job's priority by the thread that waits for it."""

import os
import threading
import time

import pytest
import torch

from resilient import Checkpointer
from resilient._background import YieldingPool, someone_waits, waiting
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
        for prefix in ("resilient-encode", "resilient-pagecache", "resilient-uploader"):
            found = [t for name, t in mine.items() if name.startswith(prefix)]
            assert found, (prefix, sorted(mine))
            assert all(_nice(t.native_id) == niced for t in found), prefix
        assert _nice(mine["resilient-writer"].native_id) == base
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
