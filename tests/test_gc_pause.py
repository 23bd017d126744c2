"""The collector held off while a checkpoint builds many small objects (``_gc_pause``):
back on when the last pause ends, across nesting, threads and errors; left off when the
program had turned it off."""

import gc
import threading

import pytest

from resilient._errors import CheckpointCorruptError
from resilient._format import decode_manifest
from resilient._gc_pause import gc_paused

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()


def test_nested_pauses_turn_the_collector_back_on_at_the_last_one():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds it
    assert gc.isenabled()


def test_pauses_overlapping_in_two_threads_end_with_the_collector_on():
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with gc_paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # this thread's pause ended first: the other's still holds
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_program_that_turned_the_collector_off_keeps_it_off():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_a_pause_ended_by_an_error_turns_the_collector_back_on():
    with pytest.raises(CheckpointCorruptError):
        decode_manifest(b'{"format": "something else"}', "a hostile manifest")
    assert gc.isenabled()


def test_a_save_and_a_restore_of_many_small_tensors_run_no_collection_from_call_to_return(tmp_path):
    """The stall builds a key, a blob and a copy for each tensor, a restore a manifest, a
    plan and reads; a collection there walks the training's whole heap (the layout key of
    26,800 tensors took 0.17-0.20 s with the collector on, 0.02-0.03 s without), and one
    just after a pause walks what it made (a restore paused phase by phase took 2.1-2.7 s,
    paused whole 1.3-1.7 s). With a threshold that makes one every 100 allocations, the
    code before these pauses ran dozens in each call at 3,000 tensors."""
    import torch

    from resilient import Checkpointer

    state = {"model": {f"w{i}": torch.full((4,), float(i)) for i in range(3000)}}
    restored = {"model": {f"w{i}": torch.zeros(4) for i in range(3000)}}
    collections: dict[str, list[int]] = {"save": [], "restore": []}
    during = ["save"]

    def count(phase: str, info: dict) -> None:
        if phase == "start" and threading.current_thread() is threading.main_thread():
            collections[during[0]].append(info["generation"])

    thresholds = gc.get_threshold()
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state)  # the first save makes the plan and the buffer
        ckpt.wait()
        gc.set_threshold(100, 10, 10)
        gc.callbacks.append(count)
        try:
            ckpt.save(2, state)
            ckpt.wait()
            during[0] = "restore"
            gc.collect()  # what the save left
            collections["restore"].clear()
            assert ckpt.restore(restored) == 2
        finally:
            gc.callbacks.remove(count)
            gc.set_threshold(*thresholds)
    assert len(collections["save"]) <= 2, f"{len(collections['save'])} collections during the save's stall"
    assert len(collections["restore"]) <= 2, f"{len(collections['restore'])} collections during the restore"
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())
