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
