"""The uploader: drains committed local checkpoints to the remote tier in the background.

One thread per storage leader. Steps are uploaded strictly in commit order; each file is
streamed and CRC-checked chunk by chunk (``copy_step``), its size verified once written,
and the remote manifest (the remote commit record) written last, by rank 0 only, once
every rank's files are there. Failures (5xx, throttling, refused connections, a server
that vanished) are retried with exponential backoff and jitter for as long as it takes:
training never waits, and when the store comes back the backlog drains in order.

What no retry mends is given up instead, so that it never holds later steps back: a step
whose local copy fails its checksums (the node says so on the remote tier, and rank 0 stops
waiting for that node's files), and on rank 0 a step an earlier gang left whose other files
never came. What the nodes uploaded of a step given up is deleted once a later step is
committed, since commit order means no node still uploads to it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ._background import jitter, yield_to_training
from ._catalog import COMMITTED, Catalog
from ._errors import CheckpointCorruptError
from ._metrics import record
from ._policy import RetentionPolicy, to_delete
from ._storage import Storage
from ._transfer import commit_step, copy_step, has_all_files

__all__ = ["Uploader"]

log = logging.getLogger("resilient")


class _GivenUpElsewhere(Exception):
    """Another node gave the step up (its local copy failed its checksums): its files will
    never come, so rank 0 does not commit the step and goes on to the next."""


def _given_up_mark(manifest: dict) -> str:
    """What a node that gives a step up writes in the step's bad marker on the remote tier.

    It names the save by its commit record's creation time, which every node's copy shares:
    a marker left by an earlier save of the same step number (one that failed verification
    once committed, before the job fell back and saved that step again) is not this one."""
    return f"given up by a node, save created {manifest.get('created')!r}"


class Uploader:
    def __init__(
        self,
        local: Catalog,
        remote: Storage,
        *,
        commits: bool,
        keep_remote: RetentionPolicy | None,
        on_uploaded: Callable[[int, float | None], None],
        protect: Callable[[], set[int]] = set,
        base_delay: float = 0.2,
        max_delay: float = 10.0,
    ) -> None:
        self.local = local
        self.remote = Catalog(remote)
        self.commits = commits
        self.keep_remote = keep_remote
        self.on_uploaded = on_uploaded
        self.protect = protect  # steps remote retention never deletes (see Checkpointer._protected)
        self.base_delay, self.max_delay = base_delay, max_delay
        self.retries = 0
        self.uploaded_bytes = 0
        self.last_error: str | None = None
        self._queue: list[int] = []
        self._queued_at: dict[int, float] = {}
        self._done: set[int] = set()
        # steps found on the local tier at start, written by an earlier gang: other nodes'
        # files may never come (that node is gone), so they are not waited for. Listed here,
        # before this process can save: a step committed while the thread below still lists
        # the remote tier is this gang's, and was taken for an earlier gang's (rank 0 then
        # gave it up when the other nodes' files were not up yet)
        self._found_at_start = self._local_steps()
        self._inherited: set[int] = set()
        # rank 0: steps given up, whose uploaded files go once a later step is committed
        self._abandoned: set[int] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._caught_up = False
        self._thread = threading.Thread(target=self._loop, name="resilient-uploader", daemon=True)
        self._thread.start()

    def _local_steps(self) -> list[int]:
        try:
            return self.local.steps()
        except FileNotFoundError:  # the root is made by the first save
            return []

    # -- called by the Checkpointer ----------------------------------------------------------
    def enqueue(self, step: int) -> None:
        with self._cond:
            if step not in self._queue and step not in self._done:
                self._queue.append(step)
                self._queued_at[step] = time.monotonic()
                self._cond.notify_all()

    def uploaded(self, step: int) -> bool:
        with self._cond:
            return step in self._done

    def pending(self) -> list[int]:
        with self._cond:
            return list(self._queue)

    def lag_seconds(self) -> float:
        """How long the oldest step still to upload has been waiting (0: none)."""
        with self._cond:
            waiting = [self._queued_at.get(step) for step in self._queue]
        started = [t for t in waiting if t is not None]
        return time.monotonic() - min(started) if started else 0.0

    def flush(self, timeout: float | None) -> None:
        """Block until the queue is empty; TimeoutError naming the steps still pending."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or not self._caught_up:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"upload to {self.remote.storage.url} not finished after {timeout} s: "
                        f"steps {self._queue or 'being listed'} still pending"
                        + (f" (last error: {self.last_error})" if self.last_error else "")
                    )
                if not self._thread.is_alive() and not self._closed:
                    raise RuntimeError(f"the upload thread to {self.remote.storage.url} died: steps "
                                       f"{self._queue or 'being listed'} will not be uploaded by this process")
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def close(self, wait: bool = True) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            self._thread.join(timeout=5)

    # -- the thread ---------------------------------------------------------------------------
    def _retrying(self, what: str, fn: Callable[[], object], fatal: tuple[type[Exception], ...] = ()) -> bool:
        """Run ``fn`` until it succeeds (True) or the uploader is closed (False); an error of
        a ``fatal`` type is raised at once (no retry can mend it)."""
        attempt = 0
        while True:
            try:
                fn()
                self.last_error = None
                return True
            except fatal:
                raise
            except Exception as exc:  # every store failure is worth another try
                self.retries += 1
                record("upload_retry", {})
                # only the exception's type and message: never the storage options
                self.last_error = f"{type(exc).__name__}: {exc}"
                delay = min(self.max_delay, self.base_delay * 2**attempt) * jitter(0.5, 1.0)
                attempt += 1
                log.warning("resilient: %s failed (attempt %d, retrying in %.1f s): %s",
                            what, attempt, delay, self.last_error)
                with self._cond:
                    if self._closed:
                        return False
                    self._cond.wait(delay)
                    if self._closed:
                        return False

    def _catch_up(self) -> None:
        """Queue every local checkpoint the remote tier lacks (after a restart, say)."""
        committed_remote = set(self.remote.committed_steps())
        bad_here = self.local.bad_steps()  # given up already (or failed a restore): no upload mends it
        with self._cond:
            self._done |= committed_remote | set(bad_here)  # settled, as a step given up now is
            for step in self._found_at_start:
                if step not in committed_remote and step not in bad_here and step not in self._queue:
                    self._queue.append(step)
                    self._inherited.add(step)
            self._queue.sort()
            self._caught_up = True
            self._cond.notify_all()
        for step in committed_remote:
            self.on_uploaded(step, None)  # found there, not uploaded now

    def _loop(self) -> None:
        yield_to_training()
        if not self._retrying(f"listing {self.remote.storage.url}", self._catch_up):
            return
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step = self._queue[0]
            started = time.perf_counter()
            outcome = self._process(step)
            if outcome is None:
                return  # closed
            if self.commits and not outcome:
                self._abandoned.add(step)
            elif self.commits and not self._retrying("removing given-up steps", lambda: self._remove_abandoned(step)):
                return  # closed
            self._finish(step, time.perf_counter() - started if outcome else None)
            if outcome and self.commits:
                self._retrying("remote retention", self._retention)

    def _remove_abandoned(self, committed: int) -> None:
        """Rank 0, once ``committed`` is committed remotely: delete what the nodes uploaded
        of the steps before it that were given up (a node's bad copy, a node lost before it
        uploaded). Every node uploads in commit order and ``committed`` needed every node's
        files, so no node uploads to those steps any more; left alone, each failure would
        leave its share of a checkpoint in the bucket for good."""
        earlier = sorted(s for s in self._abandoned if s < committed)
        if not earlier or not self.remote.is_committed(committed):  # (not when it was deleted locally first)
            return
        for step in earlier:
            if not self.remote.is_committed(step):  # committed meanwhile (by hand, say): kept
                self.remote.delete_step(step)
                log.info("resilient: removed step %d's uploaded files from %s (the step was given up)",
                         step, self.remote.storage.url)
            self._abandoned.discard(step)

    def _process(self, step: int) -> bool | None:
        """Upload (and, on rank 0, commit) one step: True done, False given up, None closed."""
        if not self.local.is_committed(step):
            return True  # deleted locally before it could be uploaded (only without a remote)
        where = f"upload of step {step} to {self.remote.storage.url}"
        try:
            if step not in self._inherited:
                return True if self._retrying(where, lambda: self._upload(step),
                                              (CheckpointCorruptError, _GivenUpElsewhere)) else None
            if not self._retrying(where, lambda: self._upload_own(step), (CheckpointCorruptError,)):
                return None
        except CheckpointCorruptError as exc:
            return self._corrupt_here(step, exc)
        except _GivenUpElsewhere:
            log.warning("resilient: step %d is not committed on %s: another node's copy of it failed its "
                        "checksums and was given up there; going on with the next step", step, self.remote.storage.url)
            return False
        if not self.commits:
            return True
        complete: list[bool] = []
        if not self._retrying(f"remote commit of step {step}", lambda: complete.append(self._complete_remotely(step))):
            return None
        return complete[-1]

    def _corrupt_here(self, step: int, exc: CheckpointCorruptError) -> bool:
        """Give ``step`` up: its local copy fails its checksums, which no retry mends. It is
        marked bad here, so that no restore, ``latest()`` or retention takes it for good (a
        remote copy, if another node uploaded one, is still found there); what was uploaded
        of it was deleted again (``_transfer._put_checked``)."""
        log.error("resilient: step %d is not uploaded to %s: its local copy fails its checksums (%s); "
                  "marked bad here", step, self.remote.storage.url, exc)
        try:
            self.local.mark_bad(step, f"upload: {exc}")
        except OSError as mark_exc:
            log.warning("resilient: could not mark step %d bad on %s: %s", step, self.local.storage.url, mark_exc)
        # and there: rank 0 waits for every node's files before it commits, and would wait
        # for this node's forever, holding every later step back (``_upload``)
        try:
            mark = f"{_given_up_mark(self.local.manifest(step))}: its local copy failed its checksums: {exc}"
        except (OSError, ValueError) as read_exc:  # no commit record to name the save by
            log.warning("resilient: step %d: cannot read its commit record on %s (%s); rank 0 is not told",
                        step, self.local.storage.url, read_exc)
            return False
        self._retrying(f"marking step {step} given up on {self.remote.storage.url}",
                       lambda: self.remote.mark_bad(step, mark))
        return False

    def _finish(self, step: int, seconds: float | None) -> None:
        """Take ``step`` off the queue; ``seconds`` None: given up (never committed remotely),
        which, like an upload, settles it: local retention may then delete it."""
        with self._cond:
            self._queue.remove(step)
            self._queued_at.pop(step, None)
            self._done.add(step)
            self._cond.notify_all()
        if seconds is not None:
            try:
                self.on_uploaded(step, seconds)
            except Exception:  # noqa: BLE001 - the step is uploaded; later steps must still be
                log.exception("after uploading step %d to %s: the callback failed; uploading goes on",
                              step, self.remote.storage.url)

    def _upload_own(self, step: int) -> None:
        self.uploaded_bytes += copy_step(self.local, self.remote.storage, step, skip_present=True,
                                         only_present=True, commit=False, mark_checked=True)

    def _complete_remotely(self, step: int) -> bool:
        """Commit an inherited step remotely if every node's files are there; else give it up."""
        if has_all_files(self.remote, self.local.manifest(step), checked=True):
            commit_step(self.local, self.remote.storage, step)
            return True
        log.warning("resilient: step %d, written by an earlier gang, cannot be completed on %s: "
                    "other nodes' files are missing there (node lost?); leaving it uncommitted",
                    step, self.remote.storage.url)
        return False

    def _upload(self, step: int) -> None:
        if not self.commits:
            self._upload_own(step)
            return
        manifest = self.local.manifest(step)
        mark = _given_up_mark(manifest)
        self._upload_own(step)
        # rank 0 commits once every node's files are up (other leaders upload their own),
        # unless a node gives the step up (``_corrupt_here``): asked only while files are
        # missing, so a step whose files are all up costs no request for it
        while not has_all_files(self.remote, manifest, checked=True):
            if (self.remote.bad_reason(step) or "").startswith(mark):
                raise _GivenUpElsewhere(step)
            with self._cond:
                if self._closed:
                    raise RuntimeError("closed while waiting for other nodes' files")
                self._cond.wait(0.2)
        commit_step(self.local, self.remote.storage, step)

    def _retention(self) -> None:
        if self.keep_remote is None:
            return
        consistent = [e.step for e in self.remote.entries() if e.state == COMMITTED]
        for step in to_delete(self.keep_remote, consistent, self.protect()):
            self.remote.delete_step(step)
            log.info("resilient: deleted step %d from %s (retention %r)", step, self.remote.storage.url,
                     self.keep_remote)
