"""Run a worker command so that it dies with its agent (started with ``python -S``).

torch's agent starts every worker in a session of its own, so when the agent is killed
(node lost, OOM killer, SIGKILL) nothing reaches the workers: they would keep talking to
the new gang's peers, hold ports and GPU memory, and could even write checkpoints. Linux's
parent-death signal fixes that at the source: armed here, it survives the ``exec`` below.
Kept free of imports beyond the standard library so it costs milliseconds, not an import
of torch.

Usage: python -S _orphan_guard.py AGENT_PID COMMAND [ARGS...]
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    agent_pid = int(sys.argv[1])
    command = sys.argv[2:]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: run unguarded rather than not at all
        pass
    if os.getppid() != agent_pid:  # the agent died before the signal was armed
        os._exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
