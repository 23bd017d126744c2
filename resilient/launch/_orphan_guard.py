"""Run a worker command so that it dies with its agent (started with ``python -S``).

torch's agent starts every worker in a session of its own, so when the agent is killed
(node lost, OOM killer, SIGKILL) nothing reaches the workers: they would keep talking to
the new gang's peers, hold ports and GPU memory, and could even write checkpoints. Linux's
parent-death signal fixes that at the source: armed here, it survives the ``exec`` below.
Kept free of imports beyond the standard library so it costs milliseconds, not an import
of torch.

Usage: python -S _orphan_guard.py AGENT_PID COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: run unguarded rather than not at all
        return None


def die_with(parent_pid: int, prctl: Callable[..., int] | None = None) -> bool:
    """Arm the parent-death signal (SIGKILL) in this process; False if the parent
    ``parent_pid`` is already gone (it died before the signal was armed)."""
    prctl = prctl or _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent_pid


def dies_with_this_thread() -> Callable[[], None] | None:
    """A ``subprocess`` ``preexec_fn`` that makes the child die with its starter (the
    development etcd servers: a script that exits with ``os._exit``, or is killed, must not
    leave one serving, as 14 left behind once skewed a benchmark). The signal follows the
    *thread* that started the child, so it is armed only from the main thread, whose end is
    the process's; None elsewhere. libc is looked up here, before the fork."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = _prctl(), os.getpid()

    def arm() -> None:
        if not die_with(parent, prctl):
            os._exit(1)

    return arm if prctl is not None else None


def main() -> None:
    agent_pid = int(sys.argv[1])
    command = sys.argv[2:]
    if not die_with(agent_pid):
        os._exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
