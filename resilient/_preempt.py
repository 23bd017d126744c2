"""Preemption: the platform's notice that the process will be killed soon.

Kubernetes evictions and cloud spot reclaims send SIGTERM, then SIGKILL after a grace period
(``terminationGracePeriodSeconds``); Slurm sends the signal chosen by ``--signal`` (SIGUSR1
here) some seconds before the end. Either way the work since the last checkpoint is lost
unless the next step is saved, committed and drained to the remote tier within that grace.

The handler only records the signal: the training loop is in the middle of a step, and a
checkpoint needs every rank at the same step. ``Checkpointer.save`` then agrees with the
other ranks (one small all-reduce per call) to save that step whatever ``every`` says,
commits it, flushes it, and exits the process with status 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

__all__ = ["Preemption", "watch", "grace_seconds", "GRACE_ENV"]

log = logging.getLogger("resilient")

GRACE_ENV = "RESILIENT_PREEMPT_GRACE"
DEFAULT_GRACE = 25.0  # Kubernetes' default grace is 30 s; leave room for the exit itself
_SIGNALS = ("SIGTERM", "SIGUSR1")


def grace_seconds() -> float:
    """Seconds a preempted save may take to commit and drain (``RESILIENT_PREEMPT_GRACE``;
    ``resilient-run`` sets it from its ``--shutdown-timeout``)."""
    try:
        return max(1.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE)))
    except ValueError:
        return DEFAULT_GRACE


class Preemption:
    """The signals this process received that ask it to stop (the first one counts)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal, self.at = signal.Signals(signum).name, time.monotonic()
            log.warning("resilient: %s received: the next save() checkpoints that step, drains it and exits",
                        self.signal)
        previous = self._previous.get(signum)
        if callable(previous):  # a handler the program had installed still runs
            previous(signum, frame)

    def install(self) -> bool:
        """Handle SIGTERM and SIGUSR1 from now on; False where this is not possible (not the
        main thread) or not wanted (``RESILIENT_PREEMPT=0``)."""
        if os.environ.get("RESILIENT_PREEMPT", "1") == "0" or threading.current_thread() is not threading.main_thread():
            return False
        for name in _SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                continue  # the program chose to ignore it: so do we
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return True


_WATCH: Preemption | None = None


def watch() -> Preemption | None:
    """The process's one preemption watch (installed by the first Checkpointer), or None
    when signals cannot be handled here."""
    global _WATCH
    if _WATCH is None:
        candidate = Preemption()
        if not candidate.install():
            return None
        _WATCH = candidate
    return _WATCH
