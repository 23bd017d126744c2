"""A rank stuck in a step is a failed rank: ``RESILIENT_HANG_TIMEOUT``.

A hung collective (a peer frozen, a deadlocked NCCL kernel, a stuck data loader) never
raises: gloo waits 30 minutes, NCCL forever. With ``RESILIENT_HANG_TIMEOUT=FLOOR`` (seconds)
every rank watches its own progress — each ``Checkpointer.save(step)`` call is a step — and
when no step has finished for ``max(FLOOR, FACTOR x the median of recent step times)`` it
logs why and exits, so that the launcher restarts the gang from the last consistent step.
The limit adapts to the job (a 20-minute step is not a hang) and is armed only after a few
steps, so start-up, restore and the first compilation never count.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from typing import Callable

from ._env import env_seconds

log = logging.getLogger("resilient")

#: Exit status of a process that gave up on a hung step (EX_TEMPFAIL: try again).
HANG_EXIT_CODE = 75
WARMUP_STEPS = 3
FACTOR = 10.0


class HangWatchdog:
    def __init__(self, floor_s: float, on_hang: Callable[[float, float], None], *,
                 factor: float = FACTOR, warmup_steps: int = WARMUP_STEPS, poll_s: float = 0.25) -> None:
        if floor_s <= 0:
            raise ValueError(f"RESILIENT_HANG_TIMEOUT must be a positive number of seconds, got {floor_s}")
        self.floor_s, self.factor, self.warmup_steps = floor_s, factor, warmup_steps
        self.on_hang = on_hang
        self._durations: deque[float] = deque(maxlen=20)
        self._last: float | None = None
        self._steps = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(poll_s,), name="resilient-hang-watchdog",
                                        daemon=True)
        self._thread.start()

    def step(self) -> None:
        """A step finished."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None:
                self._durations.append(now - self._last)
            self._last = now
            self._steps += 1

    def pause(self) -> None:
        """Not in a step (restoring, closing): disarm until the next step."""
        with self._lock:
            self._last = None

    def limit(self) -> float:
        with self._lock:
            typical = statistics.median(self._durations) if self._durations else 0.0
        return max(self.floor_s, self.factor * typical)

    def _loop(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            with self._lock:
                armed = self._last is not None and self._steps > self.warmup_steps
                idle = time.monotonic() - self._last if self._last is not None else 0.0
            if armed and idle > self.limit():
                self.on_hang(idle, self.limit())
                return

    def close(self) -> None:
        self._stop.set()


def exit_on_hang(rank: int, emit: Callable[..., None]) -> Callable[[float, float], None]:
    """The default reaction: say why, then leave so that the launcher re-forms the gang."""
    def react(idle: float, limit: float) -> None:
        log.error("resilient: rank %d made no progress for %.1f s (limit %.1f s: RESILIENT_HANG_TIMEOUT or "
                  "%g x the median step); exiting with status %d so that the gang restarts", rank, idle, limit,
                  FACTOR, HANG_EXIT_CODE)
        emit("hang_detected", idle_s=round(idle, 3), limit_s=round(limit, 3))
        logging.shutdown()
        os._exit(HANG_EXIT_CODE)
    return react


def from_env(rank: int, emit: Callable[..., None],
             on_hang: Callable[[float, float], None] | None = None) -> HangWatchdog | None:
    """The watchdog ``RESILIENT_HANG_TIMEOUT`` asks for; ``on_hang`` replaces exiting (an
    in-process recovery interrupts the step instead)."""
    floor = env_seconds("RESILIENT_HANG_TIMEOUT", None)
    if floor is None:
        return None
    return HangWatchdog(floor, on_hang or exit_on_hang(rank, emit))
