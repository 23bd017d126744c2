"""Leaving a command-line process without the interpreter's module teardown.

Why: once ``import torch`` (and torch's elastic agent) is loaded, the interpreter's final
teardown, which clears every module and garbage-collects what they held, takes 0.4-1 s of
CPU here, after everything the command had to say is said. The launcher pays it at the end
of every job step (a Slurm step, a restart loop, a test waiting for the agent), and
``resilient-ckpt ls`` pays it on every call. Exit handlers still run and every stream is
flushed first; only the teardown is skipped, which frees nothing the OS does not free.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback
from typing import Callable

__all__ = ["run_and_exit"]


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with for ``SystemExit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


def run_and_exit(command: Callable[[], int | None]) -> None:
    """Run ``command`` (its return value is the exit status, None meaning 0), then exit at once.

    An exception is reported as the interpreter would (traceback, status 1; 130 for Ctrl-C).
    """
    try:
        code = command() or 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - reported below, as an uncaught exception would be
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say there
            pass
    os._exit(code)
