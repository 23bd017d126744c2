"""The uploader: drains committed local checkpoints to the remote tier in the background.

One thread per storage leader. Steps are uploaded strictly in commit order; each file is
streamed and CRC-checked chunk by chunk (``copy_step``), its size verified once written,
and the remote manifest (the remote commit record) written last, by rank 0 only, once
every rank's files are there. Failures (5xx, throttling, refused connections, a server
that vanished) are retried with exponential backoff and jitter for as long as it takes:
training never waits, and when the store comes back the backlog drains in order.

What no retry mends is given up instead, so that it never holds later steps back: a step
whose local copy fails its checksums (the node says so on the remote tier, and rank 0 stops
waiting for that node's files); a step an earlier gang left whose missing files no node of
this gang holds (their node was lost: the Checkpointer gathers every node's ``files_held``
when it is made, so a slow surviving node's upload is waited for as any other); and a step
that remote retention would delete once the steps queued behind it are up, so that a store
outage queues, and keeps on the local disk, only what ``keep_remote`` keeps. What the
nodes uploaded of a step given up is deleted once a later step is committed, since commit
order means no node still uploads to it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ._background import YieldingPool, in_pieces, jitter, someone_waits, waiting
from ._catalog import Catalog
from ._errors import CheckpointCorruptError
from ._format import BAD_DIR
from ._metrics import record
from ._names import data_file_name, parse_data_file, step_dir_name
from ._policy import RetentionPolicy, to_delete
from ._storage import Storage
from ._transfer import commit_step, copy_step, missing_files

__all__ = ["Uploader", "Holdings", "files_held"]

log = logging.getLogger("resilient")


class _GivenUp(Exception):
    """The step is not to be committed remotely, for a reason no retry mends (some node's
    files of it will never come, say). The uploader goes on with the next step."""

    level = logging.WARNING


class _GivenUpElsewhere(_GivenUp):
    def __init__(self, step: int) -> None:
        super().__init__(f"another node's copy of step {step} failed its checksums and was given up there")


class _LostWithItsNode(_GivenUp):
    def __init__(self, step: int, lost: list[str]) -> None:
        shown = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
        super().__init__(f"step {step} was written by an earlier gang, and no node of this gang holds {shown} "
                         "(their node was lost?)")


class _Superseded(_GivenUp):
    """Remote retention would delete the step as soon as the newer steps queued behind it
    are up: after an outage, or with a store slower than the saves, the backlog holds only
    what ``keep_remote`` keeps. Otherwise an outage of hours queued every save for upload,
    and kept each on the local disk until then, until that disk was full and no save fit."""

    level = logging.INFO

    def __init__(self, newer: int, policy: RetentionPolicy) -> None:
        super().__init__(f"{newer} newer step(s) wait to be uploaded, and remote retention {policy!r} "
                         "deletes it once they are up")


class _MarkedBadThere(_GivenUp):
    def __init__(self, step: int, exc: PermissionError) -> None:
        super().__init__(f"the store refuses to delete the bad marker an earlier save of step {step} left ({exc}), "
                         f"so readers skip the commit record just written; delete {BAD_DIR}/{step_dir_name(step)} "
                         "by hand to offer it")


def files_held(local: Catalog) -> dict[int, list[int]]:
    """The ranks whose data files this node's local tier holds, for each step committed there
    and not marked bad: what this node's uploader sends of the steps an earlier gang left.
    Every node's, gathered (``Holdings``), tell the uploaders which files will come, where
    they could not tell a slow surviving node from a lost one."""
    held: dict[int, list[int]] = {}
    for step in local.committed_steps():
        try:
            names = local.storage.sizes(step_dir_name(step))
        except FileNotFoundError:  # deleted since it was listed
            continue
        held[step] = sorted(r for r in map(parse_data_file, names) if r is not None)
    return held


@dataclass(frozen=True)
class Holdings:
    """What the gang's nodes hold of the steps on their local tiers when the Checkpointer is
    made: of each step, the data files some node will upload, and the rank that commits it
    remotely. That is the lowest rank holding it, not rank 0 as for the gang's own steps:
    a spare that took a lost node's ranks (rank 0's too) holds none of the steps an earlier
    gang left, and its commit record is on the surviving nodes' disks only."""

    files: dict[int, set[str]] = field(default_factory=dict)
    committer: dict[int, int] = field(default_factory=dict)

    @classmethod
    def gathered(cls, per_rank: Sequence[Mapping[int, list[int]] | None]) -> Holdings:
        """From every rank's ``files_held``, in rank order (None: a rank that is not its
        node's leader)."""
        holdings = cls()
        for rank, held in enumerate(per_rank):
            for step, ranks in (held or {}).items():
                holdings.files.setdefault(step, set()).update(map(data_file_name, ranks))
                holdings.committer.setdefault(step, rank)
        return holdings


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
        rank: int,
        keep_remote: RetentionPolicy | None,
        on_uploaded: Callable[[int, float | None], None],
        protect: Callable[[], set[int]] = set,
        holdings: Holdings | None = None,
        base_delay: float = 0.2,
        max_delay: float = 10.0,
    ) -> None:
        self.local = local
        self.remote = Catalog(remote)
        self.rank = rank
        self.commits = rank == 0  # the gang's own steps, and remote retention
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
        # steps found on the local tier at start, written by an earlier gang: some nodes'
        # files may never come (that node is gone), so only those ``holdings`` names are
        # waited for. Listed here, before this process can save: a step committed while the
        # thread below still lists the remote tier is this gang's, and was taken for an
        # earlier gang's (rank 0 then gave it up when the other nodes' files were not up yet)
        self._found_at_start = self._local_steps()
        self._inherited: set[int] = set()
        # which files of those steps this gang's nodes hold and will upload, and who commits
        # each (``Holdings``); a missing file no node holds is given up at once
        self._holdings = holdings or Holdings()
        # rank 0: steps given up, whose uploaded files go once a later step is committed
        self._abandoned: set[int] = set()
        self._current: int | None = None  # the step the thread is uploading or retrying, then its retention
        self._cond = threading.Condition()
        self._closed = False
        self._caught_up = False
        # the work that costs cores (checksums, copies to a local directory) runs on these
        # yielding threads until it is late (``_late``); this thread, which mostly waits, not
        self._yielding = YieldingPool(4, "resilient-upload")
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
                self._drop_superseded()
                self._cond.notify_all()

    def uploaded(self, step: int) -> bool:
        with self._cond:
            return step in self._done

    def busy(self) -> bool:
        """Whether a step is being uploaded or waits to be."""
        with self._cond:
            return self._current is not None or bool(self._queue)

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
        """Block until the queue is empty; TimeoutError naming the steps still pending.
        Until the remote tier is listed, the steps found on the local tier at the start may be
        missing there; when none was found, there is nothing to wait for (a process that
        saved nothing, with the store unreachable, waited out the whole flush timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with waiting(), self._cond:  # waited for: the upload stops yielding (``_late``)
            while self._queue or (not self._caught_up and self._found_at_start):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"upload to {self.remote.storage.url} not finished after {timeout:.1f} s: "
                        f"steps {self._queue or 'being listed'} still pending"
                        + (f" (last error: {self.last_error})" if self.last_error else "")
                    )
                if not self._thread.is_alive() and not self._closed:
                    raise RuntimeError(f"the upload thread to {self.remote.storage.url} died: steps "
                                       f"{self._queue or 'being listed'} will not be uploaded by this process")
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def close(self, wait: bool = True, timeout: float | None = 5) -> None:
        """Stop after the file in hand; ``wait``: join the thread (at most ``timeout`` s)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            self._thread.join(timeout=timeout)
        self._yielding.shutdown(wait=False)

    def _late(self) -> bool:
        """Whether the upload in hand is to stop yielding to training: a thread waits for it
        (``flush``, a preemption's drain, ``close``), or a newer step is queued behind it.
        Yielding throughout, beside busy cores, an upload fell ever further behind the saves,
        and retention let each step go before it was up: the remote tier got none. Not after
        some seconds, as a save's own work: an upload to a store takes minutes by nature."""
        if someone_waits():
            return True
        with self._cond:
            return len(self._queue) > 1

    # -- the thread ---------------------------------------------------------------------------
    def _retrying(self, what: str, fn: Callable[[], object], fatal: tuple[type[Exception], ...] = (),
                  attempts: int | None = None) -> bool:
        """Run ``fn`` until it succeeds (True) or the uploader is closed (False); an error of
        a ``fatal`` type is raised at once (no retry can mend it), and the last error once
        ``attempts`` tries (if given) have failed."""
        attempt = 0
        while True:
            try:
                fn()
                self.last_error = None
                return True
            except fatal:
                raise
            except Exception as exc:  # every store failure is worth another try
                with self._cond:
                    if self._closed:  # told to stop (its files may be going: a removed checkpoint's)
                        return False
                if attempts is not None and attempt + 1 >= attempts:
                    raise
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
            if self.commits:  # steps an earlier gang left that another node commits: if that
                # node gives one up, what was uploaded of it goes as if rank 0 had (kept if committed)
                self._abandoned |= {step for step, rank in self._holdings.committer.items()
                                    if rank != self.rank and step not in committed_remote}
            for step in self._found_at_start:
                if step not in committed_remote and step not in bad_here and step not in self._queue:
                    self._queue.append(step)
                    self._inherited.add(step)
            self._queue.sort()
            self._drop_superseded()
            self._caught_up = True
            self._cond.notify_all()
        for step in committed_remote:
            self.on_uploaded(step, None)  # found there, not uploaded now

    def _loop(self) -> None:
        if not self._retrying(f"listing {self.remote.storage.url}", self._catch_up):
            return
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step = self._current = self._queue[0]
            started = time.perf_counter()
            outcome = self._process(step)
            if outcome is None:
                return  # closed
            if self.commits and not outcome:
                with self._cond:
                    self._abandoned.add(step)
            elif self.commits and not self._housekeeping("removing given-up steps", lambda: self._remove_abandoned(step)):
                return  # closed
            self._finish(step, time.perf_counter() - started if outcome else None)
            if outcome and self.commits and not self._housekeeping("remote retention", self._retention):
                return  # closed
            with self._cond:
                self._current = None  # idle until the next step (a retention left behind counts as busy)

    def _housekeeping(self, what: str, fn: Callable[[], object]) -> bool:
        """Rank 0's deletions after a step (retention, given-up uploads): a few tries, then
        a warning, and the uploads go on (False only when closed). When they were retried
        for as long as it took, as an upload is, a store that refuses deletes (write-only
        credentials, an object lock) stopped every upload after the first deletion. Each
        runs again after the next step, so a blip costs nothing."""
        try:
            return self._retrying(what, fn, fatal=(PermissionError,), attempts=3)
        except Exception as exc:  # noqa: BLE001 - any store failure; the next step tries again
            log.warning("resilient: %s on %s failed (%s: %s); uploads go on, and it is tried again after the "
                        "next step", what, self.remote.storage.url, type(exc).__name__, exc)
            return True

    def _commits(self, step: int) -> bool:
        """Whether this uploader commits ``step`` remotely: rank 0 the gang's own steps; a
        step an earlier gang left, the lowest rank holding it (``Holdings``)."""
        if step in self._inherited and step in self._holdings.committer:
            return self._holdings.committer[step] == self.rank
        return self.commits

    def _remove_abandoned(self, committed: int) -> None:
        """Rank 0, once ``committed`` is committed remotely: delete what the nodes uploaded
        of the steps before it that were given up (a node's bad copy, a node lost before it
        uploaded). Every node uploads in commit order and ``committed`` needed every node's
        files, so no node uploads to those steps any more, nor still commits one an earlier
        gang left; left alone, each failure would leave its share of a checkpoint in the
        bucket for good."""
        with self._cond:  # (the writer's thread adds to it, ``_drop_superseded``)
            earlier = sorted(s for s in self._abandoned if s < committed)
        if not earlier or not self.remote.is_committed(committed):  # (not when it was deleted locally first)
            return
        for step in earlier:
            if not self.remote.is_committed(step):  # committed (by its committer, by hand): kept
                self.remote.delete_step(step)
                log.info("resilient: removed step %d's uploaded files from %s (the step was given up)",
                         step, self.remote.storage.url)
            with self._cond:
                self._abandoned.discard(step)

    def _process(self, step: int) -> bool | None:
        """Upload (and, if this uploader is its committer, commit) one step: True done,
        False given up, None closed."""
        if not self.local.is_committed(step):
            return True  # deleted locally before it could be uploaded (only without a remote)
        where = f"upload of step {step} to {self.remote.storage.url}"
        try:
            if not self._retrying(where, lambda: self._upload(step), (CheckpointCorruptError, _GivenUp)):
                return None
        except CheckpointCorruptError as exc:
            return self._corrupt_here(step, exc)
        except _GivenUp as exc:
            log.log(exc.level, "resilient: step %d is not committed on %s: %s; going on with the next step",
                    step, self.remote.storage.url, exc)
            return False
        return True

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
        """Take ``step`` off the queue and tell the Checkpointer; ``seconds`` None: given up
        (never committed remotely), which, like an upload, settles it: local retention may
        then delete it."""
        with self._cond:
            self._queue.remove(step)
            self._queued_at.pop(step, None)
            self._done.add(step)
            self._cond.notify_all()
        try:
            self.on_uploaded(step, seconds)
        except Exception:  # noqa: BLE001 - the step is settled; later steps must still be uploaded
            log.exception("after uploading step %d to %s: the callback failed; uploading goes on",
                          step, self.remote.storage.url)

    def _upload_own(self, step: int) -> None:
        self.uploaded_bytes += copy_step(self.local, self.remote.storage, step, skip_present=True,
                                         only_present=True, commit=False, mark_checked=True,
                                         run_pieces=lambda pieces: in_pieces(pieces, self._yielding, self._late))

    def _let_go(self) -> list[int]:
        """(Holding the lock.) The queued steps remote retention lets go among the queue:
        those it would delete once the newer ones queued behind them are up."""
        if self.keep_remote is None:
            return []
        return to_delete(self.keep_remote, sorted(self._queue), self.protect())

    def _drop_superseded(self) -> None:
        """(Holding the lock.) Settle, without uploading them, the queued steps that remote
        retention lets go (``_Superseded``): the Checkpointer applies local retention right
        after it queues a step, so during an outage the local disk holds only what is to be
        uploaded. The step being uploaded is left to its thread, which asks ``_superseded``
        before each try."""
        for step in [s for s in self._let_go() if s != self._current]:
            self._queue.remove(step)
            self._queued_at.pop(step, None)
            self._done.add(step)
            if self.commits:  # another node may have sent its files of it already
                self._abandoned.add(step)
            log.info("resilient: step %d is not uploaded to %s: %s", step, self.remote.storage.url,
                     _Superseded(sum(s > step for s in self._queue), self.keep_remote))

    def _superseded(self, step: int) -> None:
        """Raise ``_Superseded`` when remote retention lets ``step`` go among the steps
        queued here. Asked before each try and while waiting for other nodes' files: a store
        that is down keeps the step at the queue's head, as the saves behind it come. Each
        node decides from its own queue; those hold the same steps a moment apart, so a
        committer waiting for files a node no longer sends soon decides the same (and what
        a node sent of a step its committer gave up is removed, ``_remove_abandoned``)."""
        with self._cond:
            if step in self._let_go():
                raise _Superseded(sum(s > step for s in self._queue), self.keep_remote)

    def _upload(self, step: int) -> None:
        self._superseded(step)
        self._upload_own(step)
        if not self._commits(step):
            return
        # the committer commits once every node's files are up (other leaders upload their own)
        manifest = self.local.manifest(step)
        mark = _given_up_mark(manifest)
        while missing := missing_files(self.remote, manifest, checked=True):
            if step in self._inherited:
                lost = sorted(missing - self._holdings.files.get(step, set()))
                if lost:
                    raise _LostWithItsNode(step, lost)
            # a node that gives the step up says so (``_corrupt_here``): asked only while
            # files are missing, so a step whose files are all up costs no request for it
            if (self.remote.bad_reason(step) or "").startswith(mark):
                raise _GivenUpElsewhere(step)
            self._superseded(step)
            with self._cond:
                if self._closed:
                    raise RuntimeError("closed while waiting for other nodes' files")
                self._cond.wait(0.2)
        try:
            commit_step(self.local, self.remote.storage, step)
        except PermissionError as exc:  # write-only credentials: retrying would hold every later step back
            if self.remote.is_committed(step):
                raise _MarkedBadThere(step, exc) from exc
            raise

    def _retention(self) -> None:
        if self.keep_remote is None:
            return
        # the commit records (and bad markers) only: every step committed there was checked
        # file by file on its way up. Reading each step's manifest and sizing each file, as
        # this did, cost a run keeping 100 steps of 1,000 ranks 100,000 requests per upload
        for step in to_delete(self.keep_remote, self.remote.committed_steps(), self.protect()):
            self.remote.delete_step(step)
            log.info("resilient: deleted step %d from %s (retention %r)", step, self.remote.storage.url,
                     self.keep_remote)
