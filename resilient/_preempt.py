"""Preemption: the platform's notice that the process will be killed soon.

Kubernetes evictions and cloud spot reclaims send SIGTERM, then SIGKILL after a grace period
(``terminationGracePeriodSeconds``); Slurm sends the signal chosen by ``--signal`` (SIGUSR1
here) some seconds before the end. Either way the work since the last checkpoint is lost
unless the next step is saved, committed and drained to the remote tier within that grace.

The handler only records the signal: the training loop is in the middle of a step, and a
checkpoint needs every rank at the same step. ``Checkpointer.save`` then agrees with the
other ranks (one small all-reduce per call, whose answer the next call reads: see
``Checkpointer._preempted_by_any``) to save a step whatever ``every`` says, the same on
every rank, commits it, flushes it, and exits the process with status 0.

A signal whose default action the program had left in place (termination) still ends the
process when no ``save`` comes to do it: a second one ends it at once, and the first one
the grace (plus ``FALLBACK_SLACK``) after it arrived. Before, a process that was asked to
stop while in a long evaluation, or past its last save (waiting in ``close`` for an upload),
went on until the next save or the platform's SIGKILL, and ``kill`` or ``timeout`` did not
stop it at all.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

from ._env import env_flag, env_seconds

__all__ = ["Preemption", "watch", "grace_seconds", "GRACE_ENV"]

log = logging.getLogger("resilient")

GRACE_ENV = "RESILIENT_PREEMPT_GRACE"
DEFAULT_GRACE = 25.0  # Kubernetes' default grace is 30 s; leave room for the exit itself
_SIGNALS = ("SIGTERM", "SIGUSR1")
#: seconds past the grace before the first signal ends a process that no save ended: the
#: preempted save's own exit, which the grace bounds, comes first
FALLBACK_SLACK = 2.0


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
        self._fallback: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def seconds_left(self) -> float | None:
        """Of the grace since the signal (None: no signal yet)."""
        return None if self.at is None else max(0.0, self.at + grace_seconds() - time.monotonic())

    def settled(self) -> None:
        """The preempted step is saved: what is left is the program's exit, not the fallback's."""
        if self._fallback is not None:
            self._fallback.cancel()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signal is None
        previous = self._previous.get(signum)
        if first:
            self.signal, self.at = signal.Signals(signum).name, time.monotonic()
            if not callable(previous):
                # before anything else: a second signal that comes while this one is still
                # being handled (logged, say) is the default action, not swallowed by this
                self._fall_back_to_default(signum)
            log.warning("resilient: %s received: the next save() checkpoints that step, drains it and exits",
                        self.signal)
        if callable(previous):  # a handler the program had installed still runs, and decides
            previous(signum, frame)

    def _fall_back_to_default(self, signum: int) -> None:
        """(Main thread, in the handler.) The default action from now on, and this signal
        delivered again if the process is still alive once the grace is over."""
        signal.signal(signum, signal.SIG_DFL)
        timer = threading.Timer(grace_seconds() + FALLBACK_SLACK, self._end, (signum,))
        timer.daemon = True
        timer.start()
        self._fallback = timer

    def _end(self, signum: int) -> None:
        log.warning("resilient: %s received %.0f s ago and no save() has ended the process since; ending it as "
                    "the signal's default action does", self.signal, time.monotonic() - (self.at or 0.0))
        os.kill(os.getpid(), signum)

    def install(self) -> bool:
        """Handle SIGTERM and SIGUSR1 from now on; False where this is not possible (not the
        main thread)."""
        if threading.current_thread() is not threading.main_thread():
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


def wanted() -> bool:
    """Whether signals are to be handled (``RESILIENT_PREEMPT``), the settings checked: a
    malformed one is refused by name when a Checkpointer is made, not found out at the
    signal (a grace of "2m" fell back to 25 s, and only "0" turned handling off)."""
    env_seconds(GRACE_ENV, DEFAULT_GRACE)
    return env_flag("RESILIENT_PREEMPT", True)


def watch() -> Preemption | None:
    """The process's one preemption watch (installed by the first Checkpointer), or None
    when signals cannot be handled here."""
    global _WATCH
    if _WATCH is None:
        if not wanted():
            return None
        candidate = Preemption()
        if not candidate.install():
            return None
        _WATCH = candidate
    return _WATCH
