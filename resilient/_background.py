"""Background work yields the CPU to training.

The writer, its encode threads and the uploader run while the training loop computes. On
a machine whose cores training keeps busy (a CPU step, data-loader workers, the GPU
driver's threads), they would take cycles from the step: measured here (a 1024² matmul
on both cores), a step ran 1.6-1.9x slower while a save was written, 1.2-1.45x with this
module's default. Linux gives every thread its own nice value: raising ours by
``RESILIENT_BACKGROUND_NICE`` (default 19, the most; 0 turns it off; 10 measured no
better than 0) makes the scheduler serve the training thread first, while idle cores
still run the background work at full speed, so a save written between steps, or while
the GPU computes, is not slower. Threads a background thread starts inherit its value.
What remains is the kernel's own writeback work and memory bandwidth, which no nice value
reaches.
"""

from __future__ import annotations

import logging
import os
import random
import threading

__all__ = ["jitter", "spread", "yield_to_training", "NICE_ENV"]

log = logging.getLogger("resilient")

NICE_ENV = "RESILIENT_BACKGROUND_NICE"
DEFAULT_NICE = 19

# Python's global generator is the training's: its state is saved with every checkpoint and
# restored with it, so that a resumed run draws what an uninterrupted one does. A backoff
# drawn from it at times the network decides would make the two differ.
_own = random.Random()


def jitter(low: float, high: float) -> float:
    """A number for spreading retries and polls, drawn from a generator of our own."""
    return _own.uniform(low, high)


def spread(n: int) -> int:
    """A start index in ``range(n)`` for spreading clients over servers (own generator)."""
    return _own.randrange(n)


def yield_to_training() -> None:
    """Lower the calling thread's CPU priority; call first thing in a background thread."""
    raw = os.environ.get(NICE_ENV, str(DEFAULT_NICE))
    try:
        nice = int(raw)
    except ValueError:
        log.warning("resilient: %s=%r is not an integer; using %d", NICE_ENV, raw, DEFAULT_NICE)
        nice = DEFAULT_NICE
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted or not Linux: run at the process's priority
        pass
