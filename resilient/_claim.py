"""One job per checkpoint root.

Two jobs writing to one root overwrite each other's steps and remove each other's saves in
flight (each cleans what it takes for its own leftovers), while both report success. So the
rank that commits to a root (its leader) claims it first: an exclusive ``flock`` on
``<root>/.lock``, held for the Checkpointer's life and released by the kernel when the
process dies (a killed job's claim does not outlive it; flock works on NFS too, where Linux
maps it to a POSIX lock). ``<root>/.owner`` says who holds it, for the error message.

The ranks of one job share the root: only leaders claim, Checkpointers of one process
share the claim, and a job finding the root claimed *by itself* (the same launcher run id,
e.g. a fenced member still alive after the gang re-formed) goes on.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time

from ._errors import StorageError

__all__ = ["claim_root", "release_root", "live_sessions", "job_id"]

log = logging.getLogger("resilient")

_LOCK, _OWNER = ".lock", ".owner"
_held: dict[str, list] = {}  # root -> [fd or None, job, {sessions}]: this process's claims
_guard = threading.Lock()


def job_id(session: str) -> str:
    """The job a process belongs to: the launcher's run id (the same for every rank and
    every restart of one torchrun / resilient-run), else the Checkpointer's session (shared
    by the ranks of one process group)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"session-{session}"


def claim_root(root: str, job: str, session: str) -> None:
    """Claim ``root`` for ``job`` (a Checkpointer ``session`` of it); StorageError naming the
    root and its holder if another job holds it."""
    with _guard:
        if root in _held:
            _held[root][2].add(session)
            return
        fd = os.open(os.path.join(root, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = _read_owner(root)
            if owner.get("job") == job:
                log.info("resilient: %s is held by another process of this job (%s); sharing it", root, job)
                _held[root] = [None, job, {session}]
                return
            raise StorageError(
                errno.EBUSY,
                f"checkpoint root {root!r} is in use by another job ({owner.get('job', 'unknown job')} on "
                f"{owner.get('host', '?')}, pid {owner.get('pid', '?')}, since {owner.get('since', '?')}); "
                "use another root, or stop that job first",
            ) from None
        except OSError as exc:  # a filesystem without locks: go on, unprotected, and say so
            os.close(fd)
            log.warning("resilient: cannot lock %s (%s): two jobs on this root would not be detected", root, exc)
            _held[root] = [None, job, {session}]
            return
        _write_owner(root, job)
        _held[root] = [fd, job, {session}]


def live_sessions(root: str) -> set[str]:
    """Sessions of this process's Checkpointers on ``root``: their saves in flight are not
    leftovers, whichever of them cleans the root."""
    with _guard:
        return set(_held[root][2]) if root in _held else set()


def release_root(root: str, session: str) -> None:
    with _guard:
        entry = _held.get(root)
        if entry is None:
            return
        entry[2].discard(session)
        if entry[2]:
            return
        del _held[root]
        if entry[0] is not None:
            try:
                os.unlink(os.path.join(root, _OWNER))
            except OSError:
                pass
            os.close(entry[0])  # releases the flock


def _read_owner(root: str) -> dict:
    try:
        with open(os.path.join(root, _OWNER)) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_owner(root: str, job: str) -> None:
    record = {"job": job, "host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = os.path.join(root, f"{_OWNER}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(root, _OWNER))
