"""Waiting for what a background thread does: the tests poll, with a deadline, for the
state the thread is to reach, rather than sleep a guessed time."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Return once ``predicate()`` is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not met within {timeout} s"
        time.sleep(0.02)
