"""The few exception types the runtime raises.

All are rooted in :class:`ResilientError` (an ``Exception``, never ``BaseException``) and
also in the built-in a caller would already catch for that kind of trouble, so that
``except ValueError`` or ``except OSError`` around a training loop keeps working.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "ResilientError",
    "StateError",
    "UnsupportedStateError",
    "CheckpointCorruptError",
    "CommitError",
    "StorageError",
]


class ResilientError(Exception):
    """Base of every error raised by resilient."""


class StateError(ResilientError, ValueError):
    """The state given to save/restore does not match the checkpoint (key, shape, dtype)."""


class UnsupportedStateError(ResilientError, TypeError):
    """A value in the state cannot be written without pickling it."""


class CheckpointCorruptError(ResilientError):
    """A checkpoint's files are missing, truncated or fail their checksum."""


class StorageError(ResilientError, OSError):
    """The checkpoint root cannot be used (missing permissions, not a directory, ...)."""


class CommitError(ResilientError):
    """A save did not commit. ``failures`` maps each failing rank to its error message.

    One exception for the whole gang, with per-rank detail, because the cause is usually on
    one rank and the symptom on all of them.
    """

    def __init__(self, step: int, failures: dict[int, str], later: Sequence[int] = ()) -> None:
        self.step = step
        self.failures = dict(failures)
        self.later = list(later)  # steps whose saves failed after this one (``Checkpointer.wait``)
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in sorted(self.failures.items()))
        also = ""
        if self.later:  # at close, "step 1 was not committed" alone hid that every save since had failed
            shown = ", ".join(map(str, self.later[:8])) + (", ..." if len(self.later) > 8 else "")
            also = f"; the saves of {len(self.later)} later step(s) failed too ({shown}), the newest at step " \
                   f"{self.later[-1]}"
        super().__init__(f"checkpoint for step {step} was not committed ({detail}){also}")


class GangChange(ResilientError):
    """Raised by a due ``Checkpointer.save`` under ``@resilient.elastic`` when a process asks to
    join the gang: the step was checkpointed and committed first, so re-forming loses nothing."""
