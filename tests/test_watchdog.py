"""RESILIENT_HANG_TIMEOUT: a rank stuck in a step is treated as failed."""

from __future__ import annotations

import threading
import time

import pytest

from resilient._watchdog import HangWatchdog, from_env

pytestmark = pytest.mark.timeout(60)


def test_fires_after_the_floor_once_armed_and_not_while_steps_go_on():
    fired = threading.Event()
    seen = []
    dog = HangWatchdog(1.0, lambda idle, limit: (seen.append((idle, limit)), fired.set()), poll_s=0.05)
    try:
        for _ in range(20):  # 20 quick steps: armed, limit = the floor
            dog.step()
            time.sleep(0.02)
        assert not fired.is_set()
        t0 = time.monotonic()
        assert fired.wait(5)
        idle, limit = seen[0]
        assert limit == 1.0 and 1.0 < idle < 1.6 and time.monotonic() - t0 < 1.6
    finally:
        dog.close()


def test_the_limit_follows_the_job_and_pauses_disarm():
    fired = threading.Event()
    dog = HangWatchdog(0.2, lambda idle, limit: fired.set(), factor=3, poll_s=0.05)
    try:
        for _ in range(6):  # 0.15 s steps: limit max(0.2, 3 x 0.15) = 0.45 s
            dog.step()
            time.sleep(0.15)
        assert dog.limit() == pytest.approx(0.45, abs=0.08)
        dog.pause()  # restoring / waiting for commits: not a hang, however long
        time.sleep(1.0)
        assert not fired.is_set()
        dog.step()
        assert fired.wait(3)
    finally:
        dog.close()


def test_warm_up_steps_never_count():
    fired = threading.Event()
    dog = HangWatchdog(0.2, lambda idle, limit: fired.set(), poll_s=0.05)
    try:
        dog.step()  # a first, slow step (compilation, data loading)
        assert not fired.wait(1.0)
    finally:
        dog.close()


def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RESILIENT_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RESILIENT_HANG_TIMEOUT"):
        from_env(0, lambda *a, **k: None)
    monkeypatch.setenv("RESILIENT_HANG_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="positive"):
        from_env(0, lambda *a, **k: None)
