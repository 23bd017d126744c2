"""The Checkpointer: the one object a training loop talks to."""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, MutableMapping, TypeVar

import torch

from ._background import jitter
from ._catalog import Catalog
from ._claim import claim_root, job_id, live_sessions, release_root
from ._coord import Coordinator, make_coordinator
from ._compiled import eager_under_compile
from ._chunk_table import MAX_CHUNK_BYTES
from ._env import env_flag, env_float
from ._errors import CheckpointCorruptError, CommitError, GangChange, ResilientError, StateError, StorageError
from ._events import EventLog
from ._format import MANIFEST, REMOTE_RECORD, NewerFormatError, data_file_name, decode_manifest, step_dir_name
from ._gc_pause import gc_paused
from ._local import LocalTier
from ._peer_memory import PeerMemory
from ._preempt import grace_seconds
from ._preempt import wanted as preemption_wanted
from ._preempt import watch as watch_preemption
from ._policy import RetentionPolicy, retention_policy, save_policy, to_delete
from ._restore import OtherRankFailed, load_checkpoint
from ._rng import apply_rng, capture_rng, parse_rng
from ._plan import plan_layout
from ._snapshot import RankPlan, Staging, layout_key
from ._storage import (LocalStorage, Storage, missing_bucket, open_storage, refuse_a_mistyped_url,
                       refuse_a_root_that_is_no_directory)
from ._transfer import ProgressLog, copy_step, missing_files
from ._tree import Flattened, flatten_state
from ._uploader import Holdings, Uploader, files_held
from ._faults import from_env as faults_from_env
from ._fence import STAGING_MODES, SnapshotDone, deferred_sources, open_all, optimizer_storages
from ._watchdog import from_env as watchdog_from_env
from ._metrics import enabled as metrics_enabled
from ._metrics import metrics
from ._writer import NO_SPACE, BackgroundWriter, SaveHandle, SaveJob
from .launch.gang import Gang

__all__ = ["Checkpointer"]

log = logging.getLogger("resilient")

# Checkpointers not closed yet: a script that ends without close() (or an exception that
# skips it) still commits its save in flight at a normal interpreter exit, within the flush
# timeout. The writer is a daemon thread and would otherwise die with the interpreter.
_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def _close_at_exit() -> None:
    # An uncaught exception (Python keeps it in sys.last_value) usually means the gang broke:
    # a commit would wait for peers that are gone, so what is in flight is dropped, as before.
    crashed = getattr(sys, "last_value", None) is not None
    for ckpt in list(_OPEN):
        if ckpt._closed:
            continue
        if crashed:
            log.warning("resilient: exit after an uncaught exception: abandoning what %r has in flight", ckpt)
            ckpt.abandon()
        else:
            log.info("resilient: interpreter exit: committing what %r has in flight", ckpt)
            ckpt.close(timeout=ckpt.flush_timeout)


# Before ``atexit``: thread pools refuse work once threading's shutdown hooks have run
# (concurrent.futures registers one), and the writer encodes on a pool. Hooks run last
# registered first, and concurrent.futures is imported (and registered) before this line.
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_close_at_exit)

_CODECS = {None: "none", "none": "none", "zstd": "zstd"}
DEFAULT_CHUNK_BYTES = 16 << 20
# Leaving the ``with`` block on an exception: a save in flight usually needs a peer that is
# gone, and a launcher decides on recovery only once this process has exited.
_EXIT_ON_ERROR_TIMEOUT = 5.0
#: the longest a preempted first rank waits for the others to say they are leaving
#: (``_depart_together``): they say it right after reading the step's outcome
DEPART_WAIT_S = 10.0


T = TypeVar("T")

#: errors of a store that another try will not mend: a missing object, no permission, this
#: disk full or read-only
_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def _transient(exc: BaseException) -> bool:
    """A store failure worth another try (refused or reset connections, timeouts, 5xx)."""
    return (isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, PermissionError, ResilientError))
            and exc.errno not in _PERMANENT_ERRNOS)


def _retried(what: str, action: Callable[[], T], wait_s: float, transient: Callable[[BaseException], bool]) -> T:
    """``action()``, tried again with exponential backoff (0.5 s doubling, at most 10 s)
    while it fails with a ``transient`` error and ``wait_s`` seconds have not passed. Why:
    restore runs once, at a start, and one refused connection then must not mean "no
    checkpoint" (a run started from scratch) or an older one."""
    deadline, delay = time.monotonic() + wait_s, 0.5
    while True:
        try:
            return action()
        except Exception as exc:
            left = deadline - time.monotonic()
            if not transient(exc) or left <= 0:
                raise
            log.warning("resilient: %s failed (%s: %s); retrying in %.1f s, for up to %.0f s more",
                        what, type(exc).__name__, exc, min(delay, left), left)
        time.sleep(min(delay, max(left, 0.0)))
        delay = min(delay * 2, 10.0)


def _refuse_different_remotes(urls: list[object]) -> None:
    """Raise on every rank when ranks were given different remote tiers. Why: only a node's
    leader uploads, and every rank's ``flush`` waits for the commit record at its own URL, so
    a rank whose URL differs (built per rank from a clock or a uuid) would wait forever and
    restore from a tier nobody writes."""
    ranks: dict[object, list[int]] = {}
    for rank, url in enumerate(urls):
        ranks.setdefault(url, []).append(rank)
    if len(ranks) > 1:
        groups = "; ".join(f"remote={url!r} on rank{'s' if len(rs) > 1 else ''} "
                           f"{', '.join(map(str, rs[:4]))}{f' and {len(rs) - 4} more' if len(rs) > 4 else ''}"
                           for url, rs in ranks.items())
        raise ValueError(f"the ranks were given different remote tiers ({groups}): pass the same URL on every "
                         "rank, made once (e.g. by the launcher, in an environment variable), not per rank")


def _same_url(a: str, b: str) -> bool:
    """Whether two remote URLs name one place (a trailing slash aside)."""
    return a.rstrip("/") == b.rstrip("/")


def _refuse_another_runs_steps(root: str, remote: str | None, found: list[str | None]) -> None:
    """Raise on every rank when a node's local root holds checkpoints saved for another
    remote tier. Why: a job on a node reused with the same local path (``/nvme/ckpt``)
    restored the previous run's newest step as its own, and uploaded that run's checkpoints
    into its own remote prefix; nothing said so."""
    ranks = [rank for rank, url in enumerate(found) if url is not None]
    if not ranks:
        return
    other = found[ranks[0]]
    raise StorageError(
        errno.EEXIST,
        f"the local root {root} (on rank {ranks[0]}'s node{' and others' if len(ranks) > 1 else ''}) holds "
        f"checkpoints saved for the remote tier {other}, not for this run's {remote}: they are another run's. "
        "Give this run a local root of its own (the run's name in the path), or remove them "
        f"(resilient-ckpt prune {root} --after -1); if they are this run's and only its remote moved, remove "
        f"{os.path.join(root, REMOTE_RECORD)}")


class Checkpointer:
    """Asynchronous, sharded, crash-consistent checkpoints of a training job.

    ``save`` stalls only for a copy of this rank's share of the state into a reusable host
    buffer; a background thread writes and checksums it, and the checkpoint is committed by
    itself once every rank's files are durable. ``restore`` loads the newest checkpoint
    that commits and verifies, at any world size.

    Every rank calls ``save`` and ``restore`` (they are collective under
    torch.distributed). Plain tensors are taken to be identical on every rank (as under
    DDP) and written once in total, split evenly across ranks; DTensors are written shard by
    shard. A save issued while the previous one is still being written first waits for it,
    so host memory stays at one copy of this rank's share.

    Args:
        root: local directory (node-local disk) for checkpoints.
        remote: fsspec URL (``s3://bucket/run``, ``memory://``, ...) that committed
            checkpoints are drained to in the background; the remote commit record is
            written last. ``flush`` waits for it; ``close`` flushes within
            ``RESILIENT_FLUSH_TIMEOUT`` (default 300 s) and logs what is left.
        state: default state for ``save`` and ``restore``.
        every: save only at steps divisible by this.
        every_seconds: save when this many seconds passed since the last save.
        keep: committed checkpoints kept locally (int, a retention policy, or None for all).
        keep_remote: the same for the remote tier (None keeps all). A local checkpoint not
            yet on the remote tier is never deleted; the newest is never deleted anywhere.
            A queued step this would delete once the newer queued ones are up is not
            uploaded, so a store outage keeps only what it keeps on the local disk.
        compress: None or "zstd" (per chunk; chunks that do not shrink are stored raw).
        process_group: the group whose ranks save together (default: the world).
        storage_options: options for the remote filesystem (credentials, endpoint).
        rng: save and restore the torch / CUDA / Python / numpy generator states.
        strict: raise a failed save's ``CommitError`` from the next ``save`` (default: log
            it, count it in ``stats``, keep training; ``wait`` always raises it).
        events: a JSON-lines file that every rank appends its events to (save started,
            staged, committed or failed, uploaded, restored); default
            ``RESILIENT_EVENT_LOG``, or off.
        commit_timeout: seconds to wait for the other ranks when committing
            (default ``RESILIENT_COMMIT_TIMEOUT`` or 600).
        staging: ``"overlap"`` copies the tensors of the optimizers in ``state`` (their
            parameters and state) while training goes on, and makes their next ``step()``
            wait for the copy; ``"sync"`` copies everything inside ``save``; ``"auto"``
            (default, or ``RESILIENT_STAGING``) overlaps when the state is on a GPU.
        chunk_bytes: bytes per checksummed chunk of a data file.
        direct_io: write data files past the page cache (default ``RESILIENT_DIRECT_IO``
            or on): the commit comes at the disk's speed without a core copying into the
            cache. Off, the files go through the page cache and stay there, so a restart
            on this node restores from memory, at the price of a slower commit that
            competes with training for a core.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        remote: str | os.PathLike[str] | None = None,
        state: Mapping[str, Any] | None = None,
        every: int | None = None,
        every_seconds: float | None = None,
        keep: int | RetentionPolicy | None = 2,
        keep_remote: int | RetentionPolicy | None = None,
        compress: str | None = None,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        rng: bool = True,
        strict: bool = False,
        events: str | None = None,
        commit_timeout: float | None = None,
        staging: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        direct_io: bool | None = None,
        _memory: PeerMemory | None = None,
        _on_hang: Callable[[float, float], None] | None = None,
        _generation: int | None = None,
        _join_pending: Callable[[], bool] | None = None,
        _coordinator: Coordinator | None = None,
        _signals: bool = True,
        _staging: Staging | None = None,
    ) -> None:
        if compress not in _CODECS:
            raise ValueError(f"compress must be None or 'zstd', got {compress!r}")
        remote = os.fspath(remote) if isinstance(remote, os.PathLike) else remote  # a shared directory
        if remote is not None and not isinstance(remote, str):
            raise ValueError(f"remote must be a URL or a directory, got {type(remote).__name__}")
        if remote is not None:
            refuse_a_mistyped_url(remote)
        # above the format's limit, every checkpoint was written, then refused as damaged
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) \
                or not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be an integer from 4096 to {MAX_CHUNK_BYTES}, got {chunk_bytes!r}")
        for name, value in (("rng", rng), ("strict", strict)):
            if not isinstance(value, bool):  # strict="no" was taken as true
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if state is not None and not isinstance(state, Mapping):
            raise ValueError(f"state must be a mapping of names to objects, got {type(state).__name__}")
        staging = staging if staging is not None else os.environ.get("RESILIENT_STAGING", "auto")
        if staging not in STAGING_MODES:
            raise ValueError(f"staging must be one of {', '.join(STAGING_MODES)} (argument or RESILIENT_STAGING), "
                             f"got {staging!r}")
        self.staging = staging
        if direct_io is not None and not isinstance(direct_io, bool):
            raise ValueError(f"direct_io must be True, False or None, got {direct_io!r}")
        self.direct_io = direct_io if direct_io is not None else env_flag("RESILIENT_DIRECT_IO", True)
        preemption_wanted()  # its settings, checked before anything is made
        self.root = os.fspath(root)
        if not isinstance(self.root, str):
            raise ValueError(f"root must be a directory path, got {type(root).__name__}")
        refuse_a_root_that_is_no_directory(self.root)
        self.remote = remote
        self.storage_options = dict(storage_options or {})
        self.state = state
        self.rng = rng
        self.strict = strict
        # counters an operator (or a metrics exporter) reads; updated by background threads
        self.stats = {"saves_committed": 0, "saves_failed": 0, "bytes_staged": 0,
                      "staging_wait_s": 0.0,  # how long optimizer steps waited for overlapped copies
                      "bytes_restored": 0}  # saved tensors' bytes restores loaded into this rank's state
        self._save_policy = save_policy(every, every_seconds)
        self._keep = retention_policy(keep)
        self._keep_remote = retention_policy(keep_remote, "keep_remote")
        self._codec = _CODECS[compress]
        self.commit_timeout = (
            commit_timeout if commit_timeout is not None else env_float("RESILIENT_COMMIT_TIMEOUT", 600.0)
        )
        if not isinstance(self.commit_timeout, (int, float)) or isinstance(self.commit_timeout, bool) \
                or not self.commit_timeout > 0:
            raise ValueError(f"commit_timeout (argument or RESILIENT_COMMIT_TIMEOUT) must be a number of seconds "
                             f"> 0, got {self.commit_timeout!r}")
        self.flush_timeout = env_float("RESILIENT_FLUSH_TIMEOUT", 300.0)
        self._remote: Storage | None = open_storage(remote, self.storage_options) if remote else None

        self._tier = LocalTier(self.root, recycle=env_flag("RESILIENT_RECYCLE_FILES", True))
        self._local_storage = LocalStorage(self.root)  # the same directory, seen through the storage seam
        self._tier.prepare()
        # ``_coordinator``: a caller that saves from one rank only (Lightning's CheckpointIO)
        # passes a solo one, so that no collective waits for ranks that never call
        self._coord: Coordinator = _coordinator or make_coordinator(process_group, self._tier)
        self._claimed: bool | None = None  # None: not yet asked (see _claim_root, at the first save)
        # rank 0 asks the store once whether the remote tier's bucket exists (``missing_bucket``);
        # an in-process recovery's Checkpointer (a later generation) does not ask again
        asks = self._remote is not None and self._coord.rank == 0 and not _generation
        missing = missing_bucket(self._remote) if asks else None
        stale = self._saved_for_another_remote(remote) if self._coord.is_leader else None
        gathered = self._coord.all_gather([remote, missing, stale])
        _refuse_different_remotes([url for url, _, _ in gathered])
        if gathered[0][1] is not None:
            raise StorageError(errno.ENOENT, gathered[0][1])
        _refuse_another_runs_steps(self.root, remote, [found for _, _, found in gathered])
        if self._coord.is_leader:
            if remote is not None:  # so that resilient-ckpt can show both tiers (no credentials)
                self._local_storage.write(REMOTE_RECORD, [json.dumps({"url": remote}).encode()])
            for path in self._tier.put_back_replaced():
                log.warning("resilient: %s was being replaced when a process died; the previous copy is back", path)
        self._local_catalog = Catalog(self._local_storage)
        # once every leader has put its files back (the gather is the barrier): which files
        # of the steps on the local tiers the gang's nodes hold, and their uploaders will send,
        # so that the uploaders wait for those and give up only files whose node was lost
        if remote is None:
            self._coord.barrier()
            holdings = Holdings()
        else:  # every rank passed the same remote (refused above otherwise): all take this branch
            holdings = Holdings.gathered(self._coord.all_gather(
                files_held(self._local_catalog) if self._coord.is_leader else None))

        # in-process recoveries (see ``_elastic``) keep the process: the generation tells
        # one incarnation of the gang from the next in the event log
        extra = {} if _generation is None else {"gen": _generation}
        self._events = EventLog(events or os.environ.get("RESILIENT_EVENT_LOG") or None, self._coord.rank, **extra)
        self._memory = _memory
        self._join_pending = _join_pending  # under @resilient.elastic: a process waits to join
        # ``_staging``: a buffer lent by a caller that makes a Checkpointer per save (the
        # Lightning plugin), so that saves share one buffer; the lender closes it
        self._staging = _staging or Staging()
        self._owns_staging = _staging is None
        self._plan: tuple[tuple, RankPlan] | None = None
        self._seq = 0
        self._reported_first_step = False
        self._order_checked = False  # whether the first save looked for newer steps (``_warn_if_newer``)
        self._last_saved_step: int | None = None  # of the last save issued here (``_decide``)
        self._skip_said: int | None = None  # the step whose repeated saves were last reported
        self._preempted_step: int | None = None  # saved here since a preemption signal
        self._staging_prepared = False  # see prepare (again after each restore)
        self._saves_called = False  # save() was called, due or not: it saves (``_others_to_save``)
        self._watchdog = watchdog_from_env(self._coord.rank, self._events.emit, _on_hang)
        self._faults = faults_from_env(self._coord.rank, self._coord.world_size, str(self.root),
                                       on_fire=lambda kind, step: self._events.emit("fault", kind=kind, step=step))
        self._inflight: SaveHandle | None = None
        self._handles: list[SaveHandle] = []
        self._bad_steps: set[int] = set()
        self._restored_step: int | None = None
        self._newest_committed: int | None = None
        self._lock = threading.Lock()
        # Cold reads reach the disk's sequential bandwidth only with several requests in
        # flight (measured: 4 threads ~80%, 8 threads ~90% of one sequential reader). Ranks
        # of one node share the disk, but a thread waiting on it costs nothing: 2 ranks
        # restoring 1 GB took 0.65-0.77 s with 8 threads each against 0.70-0.89 s with 4
        # (medians of 6-7 interleaved rounds, sharded and replicated).
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        self._read_pool = ThreadPoolExecutor(max_workers=max(4, min(8, 16 // local_ranks)),
                                             thread_name_prefix="resilient-read")
        # Under the etcd-v3 launcher, commits are fenced by the gang's round (see launch.gang).
        self._gang = Gang.from_env()
        self._writer = BackgroundWriter(
            self._tier,
            self._coord,
            codec=self._codec,
            chunk_bytes=chunk_bytes,
            commit_timeout=self.commit_timeout,
            after_commit=self._after_commit,
            authorize=self._gang.authorize_commit if self._gang is not None else None,
            direct_io=self.direct_io,
            written=self._faults.check_write if self._faults is not None else None,
        )
        self._retention_lock = threading.Lock()
        self._uploaded_bytes_seen = 0
        self._closed = False
        # last: the uploader's thread calls back into this object (``_on_uploaded``) as soon
        # as it has drained a step an earlier run left behind, maybe before __init__ returns
        self._uploader: Uploader | None = None
        if self._remote is not None and self._coord.is_leader:
            self._uploader = Uploader(
                self._local_catalog,
                self._remote,
                rank=self._coord.rank,
                keep_remote=self._keep_remote,
                on_uploaded=self._on_uploaded,
                protect=self._protected,
                holdings=holdings,
            )
            if metrics_enabled():
                uploader, m = self._uploader, metrics()
                m.upload_lag_steps.set_function(lambda: len(uploader.pending()))
                m.upload_lag_seconds.set_function(uploader.lag_seconds)
        _OPEN.add(self)
        # SIGTERM / SIGUSR1: the next save() checkpoints that step and exits (see _preempt).
        # ``_signals=False``: a caller whose framework answers the signals itself (Lightning's
        # CheckpointIO: it saves on them with save_on_exception, tears down, then exits)
        self._preemption = watch_preemption() if _signals else None

    def _saved_for_another_remote(self, remote: str | None) -> str | None:
        """(leader) The remote tier this local root's checkpoints were saved for, when it is
        not ``remote``: they are another run's (a node reused with the same local path). None
        when they are this run's, or when the root records no remote (a run that adds one
        uploads what it saved before)."""
        if remote is None or not self._local_storage.exists(REMOTE_RECORD):
            return None
        try:
            recorded = json.loads(self._local_storage.read(REMOTE_RECORD))["url"]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: as if unrecorded
        if not isinstance(recorded, str) or _same_url(recorded, remote) or not self._tier.committed_steps():
            return None
        return recorded

    def _claim_root(self) -> None:
        """Before the first save writes anything: leaders claim the root for this job (see
        ``_claim``), then remove what abandoned saves left; every rank raises together when a
        leader cannot claim. Reading (``latest``, ``restore``) claims nothing, so inspecting a
        root that a job is writing is harmless."""
        refused: StorageError | None = None
        claimed = False
        if self._coord.is_leader:
            try:
                claim_root(self._tier.root, job_id(self._coord.session), self._coord.session)
                claimed = True
                live = live_sessions(self._tier.root)  # this process's saves in flight are not leftovers
                for path in self._tier.clean_leftovers(keep_sessions=live, writers=self._coord.sharing):
                    log.info("resilient: removed what an earlier run left (an uncommitted save, a deletion, a "
                             "recycled file, a download stopped part-way): %s", path)
            except StorageError as exc:
                refused = exc
        self._claimed = claimed
        if self._coord.agree_max(int(refused is not None)):  # also: nobody writes before the cleanup
            self._release_root()
            self._claimed = None
            raise refused or StorageError(errno.EBUSY, "another rank's checkpoint root is in use by another job "
                                                       "(see that rank's error)")

    # -- properties -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._coord.rank

    @property
    def world_size(self) -> int:
        return self._coord.world_size

    # -- saving -----------------------------------------------------------------------------
    def _state(self, state: Mapping[str, Any] | None, call: str) -> Any:
        state = state if state is not None else self.state
        if state is None:
            raise ValueError(f"{call}() needs a state: pass it, or bind one with Checkpointer(state=...)")
        return state

    @eager_under_compile
    def save(self, step: int, state: Mapping[str, Any] | None = None, *, force: bool = False) -> SaveHandle | None:
        """Snapshot ``state`` for ``step`` if due (or ``force``); return its handle, else None.
        The step saved last is not saved again unless ``force`` (see ``_say_skipped``).

        Returns once the snapshot is in host memory; writing and committing go on in the
        background. Waits first for the previous save's write, if still running.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        state = self._state(state, "save")
        self._saves_called = True
        if self._faults is not None:
            self._faults.check(step)  # RESILIENT_FAULT: demos and tests
        if self._watchdog is not None:
            self._watchdog.step()
        if self._coord.rank == 0:
            if not self._reported_first_step:  # after start or restore: recovery is over
                self._reported_first_step = True
                self._events.emit("first_step", step=step)
            self._events.emit("step", step=step)  # progress, for timelines and goodput
        due, preempted = self._decide(step, force)
        if not due:
            self.prepare(state)
            return None
        if not self._order_checked:
            self._order_checked = True
            if self._coord.rank == 0:
                self._warn_if_newer(step)
        elif self._last_saved_step is not None and step < self._last_saved_step and self._coord.rank == 0:
            self._warn_backwards(step, self._last_saved_step)
        # under @resilient.elastic, a process waiting to join: every rank agrees (at a save
        # that is due anyway, so steps pay nothing) to commit this step and re-form
        joining = self._join_pending is not None and bool(self._coord.agree_max(int(self._join_pending())))
        if self._claimed is None:
            self._claim_root()
        handle = SaveHandle(step, on_settle=self._count)
        self._events.emit("save_started", step=step)
        with gc_paused():  # a node for each tensor: see _gc_pause
            flat = flatten_state(state, self._coord.rank)  # raises on unsupported values before anything is written
        previous = self._inflight
        if previous is not None:
            previous.settled()  # the staging buffer is still being written from
            if self.strict and previous._error is not None:
                raise previous._error
        # the stall's bookkeeping and copy, a key, a blob and a copy for each tensor: with the
        # collector on, its collections walked the training's heap (the layout key of 26,800
        # tensors: 0.17-0.20 s instead of 0.02-0.03 s)
        with gc_paused():
            plan = self._layout_plan(flat)
            deferred = self._deferred(state, flat.tensors)
            buffer = self._staging.buffer_for(plan, flat.tensors)
            handle.nbytes = buffer.numel()
            handle.deferred_bytes = sum(blob.length for blob in plan.blobs if blob.name in deferred)
            snapshot = SnapshotDone()
            self._seq += 1
            with self._lock:
                self._inflight = handle
                # what wait() has still to report: committed saves are dropped here, since a
                # loop that never waits kept every handle (2 kB each: 2 GB after a million saves)
                self._handles = [h for h in self._handles if not h.committed]
                self._handles.append(handle)
            # handed to the writer before the copy, which it waits for: a copy that fails then
            # becomes this rank's report (an error), and the save fails on every rank at once
            self._writer.submit(SaveJob(seq=self._seq, step=step, buffer=buffer, plan=plan, tree=flat.tree,
                                        rng=capture_rng() if self.rng else None, handle=handle, snapshot=snapshot))
            try:
                fence = self._staging.stage(plan, flat.tensors, deferred, on_wait=self._count_staging_wait)
            except BaseException as exc:
                snapshot.complete(error=exc)
                raise
        snapshot.complete(fence)
        self._last_saved_step = step  # a save that raised before here is not one: its retry saves
        self.stats["bytes_staged"] += handle.nbytes
        handle.staged_at = time.perf_counter()
        self._events.emit("save_staged", step=step, stall_s=round(handle.staged_at - handle.started, 6),
                          bytes=handle.nbytes, deferred_bytes=handle.deferred_bytes)
        if preempted:
            again = self._preempted_step is not None
            self._preempted_step = step
            waiting_for = [] if again else self._others_to_save()
            if not waiting_for:
                self._exit_preempted()
            if self._coord.rank == 0:
                log.warning("resilient: preempted: step %d of %s is saved; exiting once %s saved too (or at the "
                            "next save() of this one)", step, self.root, " and ".join(c.root for c in waiting_for))
        if joining:
            self.wait()
            raise GangChange(f"a process joins the gang: step {step} is committed, re-forming")
        return handle

    def _warn_backwards(self, step: int, last: int) -> None:
        """Say so when a save's step is lower than the one this Checkpointer saved before it
        (with no restore between): most often the batch index of an epoch passed where the
        global step belongs, which restarts at every epoch. Each step then overwrites the
        previous epoch's checkpoint of that number; retention, which keeps the newest, deletes
        the new saves first, and a restart resumes from the highest step, an older epoch's."""
        log.warning("resilient: save(step=%d) after this Checkpointer saved step %d: a run's steps must grow "
                    "(pass the global step, not the batch index within an epoch). Checkpoints are ordered by step: "
                    "a restart resumes from the highest one, step %d, not from this save, and retention deletes "
                    "this save first", step, last, last)

    def _warn_if_newer(self, step: int) -> None:
        """Say so when the first save of this Checkpointer is older than checkpoints already
        on its local tier: another run's (restore() was not called, or the root is reused),
        or the steps a rollback (``restore(step=...)``) abandoned. The newest step wins every
        restore, so a restart would silently resume from those, and retention, which keeps
        the newest, deletes this run's saves first."""
        newer = self._tier.committed_steps(after=step)  # in the first save's stall: one listing, as a rule
        if not newer:
            return
        restored = self._restored_step
        after = min(restored, step - 1) if restored is not None else step - 1
        shown = ", ".join(map(str, newer[:3])) + (f" ... {newer[-1]}" if len(newer) > 3 else "")
        log.warning("resilient: saving step %d into %s, which holds newer checkpoints (steps %s): another run's, "
                    "or the steps a rollback abandoned. A restart resumes from the newest, step %d, not from this "
                    "run's saves, and retention deletes this run's older saves first. Delete them "
                    "(resilient-ckpt prune %s --after %d) or save under another root", step, self.root, shown,
                    newer[-1], self.root, after)

    def _deferred(self, state: Mapping[str, Any], tensors: dict[str, torch.Tensor]) -> set[str]:
        """The tensors whose copy may run on while training does (see ``_fence``)."""
        if self.staging == "sync" or (self.staging == "auto" and not Staging.on_device(tensors)):
            return set()
        return deferred_sources(tensors, optimizer_storages(state))

    def _count_staging_wait(self, seconds: float) -> None:
        self.stats["staging_wait_s"] += seconds

    @eager_under_compile
    def prepare(self, state: Mapping[str, Any] | None = None) -> None:
        """Plan the layout of ``state`` (the constructor's when None) and have the staging
        buffer made and touched in the background (``Staging.prewarm``), so that the first
        save pays neither in its stall; nothing once done, until the next restore. Collective:
        every rank calls it at the same points. ``save()`` calls it at its first call that is
        not due (a loop's first step, or the first after a restore); a loop that calls
        ``save()`` only when a save is due (a Trainer's) calls it at its first step. A state
        that cannot be saved is left to the save to refuse, every rank agreeing so."""
        if self._staging_prepared:
            return
        self._check_open()
        state = self._state(state, "prepare")
        self._staging_prepared = True
        try:
            with gc_paused():
                flat = flatten_state(state, self._coord.rank)
            ok = 1
        except Exception:  # noqa: BLE001 - the due save raises it, naming the key
            ok = 0
        if not self._coord.agree_min(ok):
            return
        try:
            with gc_paused():
                plan = self._layout_plan(flat)
        except ResilientError:  # the same on every rank (from what every rank gathered)
            return
        writing = self._inflight
        if writing is not None and not writing.done():
            return  # its writer reads the buffer still: a larger one would replace it under it
        self._staging.prewarm(plan.nbytes, self._staging.on_device(flat.tensors))

    def _decide(self, step: int, force: bool) -> tuple[bool, bool]:
        """(is this step saved, is the job being preempted), the same on every rank.

        A time-based policy (rank 0's clock decides) is agreed in the call, with preemption
        beside it in the same small all-reduce, and so is preemption at a save that happens
        anyway (``force``). Otherwise preemption alone is agreed one call late
        (``_preempted_by_any``): waiting for it in every call cost a round trip over the
        ranks at every step (and a host sync on an accelerator)."""
        time_based = bool(getattr(self._save_policy, "time_based", False)) and not force
        due = force or self._save_policy.due(step, time.monotonic())
        if due and not force and step == self._last_saved_step:
            due = False  # every rank makes the same calls, so every rank skips it
            self._say_skipped(step)
        preempt = self._preemption is not None and self._preemption.requested
        if self._coord.world_size > 1 and (time_based or (force and self._preemption is not None)):
            vote = int(due) if (not time_based or self._coord.rank == 0) else 0
            due_max, preempt_max = self._coord.agree_max_many([vote, int(preempt)])
            due, preempt = bool(due_max), bool(preempt_max)
        elif self._coord.world_size > 1 and self._preemption is not None:
            preempt = self._preempted_by_any(preempt)
        return due or preempt, preempt

    def _preempted_by_any(self, here: bool) -> bool:
        """Whether any rank had seen a preemption signal at the previous call of this (or of
        ``preempted``), the same answer on every rank; this rank's ``here`` is sent for the
        next call's answer. A signal is acted on at the first or second call after it."""
        agreed = self._coord.agree_max_later([int(here)])
        return bool(agreed and agreed[0])

    @eager_under_compile
    def preempted(self) -> bool:
        """Whether the job is being preempted (SIGTERM or SIGUSR1 seen by any rank), the
        same answer on every rank, so every rank calls it at the same points (when there are
        several, the answer is that of the previous call, agreed without waiting: see
        ``_preempted_by_any``). For a loop whose saves someone else schedules (a Trainer's
        ``save_steps``): asked once a step, it says to save now, and that ``save()`` commits
        the step, drains it and ends the process (see Preemption). A loop calling ``save()``
        every step needs none of this: ``save()`` asks itself."""
        self._check_open()
        wanted = self._preemption is not None and self._preemption.requested
        if self._coord.world_size > 1 and self._preemption is not None:
            wanted = self._preempted_by_any(wanted)
        return wanted

    def _say_skipped(self, step: int) -> None:
        """A save of the step this Checkpointer saved last is skipped: a loop that calls
        ``save`` once per micro-batch (gradient accumulation) or from a hook that fires
        several times a step saved the same step again and again, each a stall and a full
        write (as Lightning's ModelCheckpoint, it saves a step once). Said once a step; as a
        warning when that step's save failed here, since ``force=True`` is then the retry."""
        if self._skip_said == step:
            return
        self._skip_said = step
        last = self._inflight
        if last is not None and last.step == step and last.done() and not last.committed:
            log.warning("resilient: save(step=%d) skipped: it is the step saved last, and that save failed; "
                        "save(step, force=True) saves it again", step)
        else:
            log.info("resilient: save(step=%d) skipped: this step was saved already (a save per micro-batch?); "
                     "force=True saves it again", step)

    def _others_to_save(self) -> list["Checkpointer"]:
        """This process's other open Checkpointers that have not saved since the signal (an
        EMA model's, an export's): the process exits once they have, or at this one's next
        save. Before, the first one's preempted save exited the process, and the others'
        newest steps were those before the signal."""
        return [c for c in list(_OPEN) if c is not self and not c._closed and c._preemption is not None
                and c._saves_called  # one whose save() was never called only reads (a base model's)
                and c._preempted_step is None]

    def _exit_preempted(self) -> None:
        """Commit the preempted steps of every Checkpointer of this process, drain them to
        the remote tier within the grace, then end the process with status 0: the platform
        kills it soon anyway, and nothing is lost."""
        watch = self._preemption
        started = watch.at if watch is not None and watch.at is not None else time.monotonic()
        deadline = started + grace_seconds()
        for ckpt in [c for c in list(_OPEN) if not c._closed and c._preempted_step is not None]:
            ckpt._drain_preempted(started, deadline)
        self._depart_together(f"departing/{self._preempted_step}", deadline)
        if watch is not None:
            watch.settled()
        for ckpt in list(_OPEN):  # the others' saves in flight, within what is left of the grace
            ckpt.close()
        raise SystemExit(0)

    def _depart_together(self, key: str, deadline: float, *, wait: bool = True) -> None:
        """The first rank leaves last, once every rank has said it is leaving (by
        ``deadline``, and ``DEPART_WAIT_S`` at most): at a preempted exit and at ``close``.
        Why: where the program made the process group itself (Lightning's DDP, ``mp.spawn``:
        ``MASTER_PORT``), the store lives in rank 0's process, and every rank reads the last
        step's outcome from it after rank 0 has written it. Rank 0 leaving at once took the
        store with it while a slower rank was still reading: "Connection reset by peer", a
        step committed everywhere reported failed there (a preempted rank exited 1; at the
        end of a run, "closing with unfinished saves"). A rank leaving on an error says so
        without waiting (``wait=False``), so that the first rank is not held for it."""
        coord = self._coord
        if coord.world_size == 1:
            return
        try:
            coord.publish(f"{key}/{coord.rank}", b"")
            if wait and coord.rank == coord.leaders[0]:
                left = max(0.0, min(DEPART_WAIT_S, deadline - time.monotonic()))
                coord.collect([f"{key}/{rank}" for rank in range(coord.world_size)], left)
        except Exception as exc:  # noqa: BLE001 - a rank that is gone does not hold the others
            log.info("resilient: leaving without every rank's word (%s)", exc)

    def _drain_preempted(self, started: float, deadline: float) -> None:
        """Commit this Checkpointer's preempted step and drain it, by ``deadline``."""
        step = self._preempted_step
        watch = self._preemption
        self.wait(max(0.0, deadline - time.monotonic()))
        local_s = time.monotonic() - started
        remote_s = None
        if self._remote is not None:
            try:  # a store that is slow or down must not keep the process past its grace
                self.flush(max(0.0, deadline - time.monotonic()))
                remote_s = time.monotonic() - started
            except (TimeoutError, RuntimeError) as exc:
                log.warning("resilient: preempted: step %d is committed on this node's disk, not on %s within the "
                            "grace (%s); a Checkpointer started on this node uploads it", step, self._remote.url, exc)
        self._events.emit("preempted", step=step, signal=watch.signal if watch else None,
                          local_s=round(local_s, 3), remote_s=None if remote_s is None else round(remote_s, 3))
        log.warning("resilient: preempted: step %d of %s committed %.2f s after the signal%s; exiting", step,
                    self.root, local_s, "" if remote_s is None else f", on the remote tier after {remote_s:.2f} s")

    def _layout_plan(self, flat: Flattened) -> RankPlan:
        """This rank's plan, made again (together: it is collective) when any rank's layout
        changed; otherwise the cost of a save is one small all-reduce."""
        key = layout_key(flat.tensors)
        changed = self._plan is None or self._plan[0] != key
        if self._coord.agree_max(int(changed)):
            self._plan = (key, plan_layout(flat.tensors, flat.per_rank, self._coord.rank, self._coord.world_size,
                                           self._coord.all_gather))
        return self._plan[1]

    def _count(self, handle: SaveHandle) -> None:
        self.stats["saves_committed" if handle.committed else "saves_failed"] += 1
        if handle.committed and self._memory is not None:
            self._replicate(handle.step)
        took = round((handle.committed_at or 0.0) - handle.started, 6)
        if handle.committed:
            self._events.emit("save_committed", step=handle.step, tier="local", seconds=took, bytes=handle.nbytes,
                              phases=handle.phases, report_bytes=handle.report_bytes)
        else:
            self._events.emit("save_failed", step=handle.step, seconds=took, error=str(handle._error))
            self._explain_full_disk(handle._error)

    def _explain_full_disk(self, error: BaseException | None) -> None:
        """A save that failed for a full local disk while steps wait there for the store: say
        so, since "No space left on device" alone points at the wrong cause. Every save
        waits on the local disk until it is uploaded (retention never deletes it first), so
        a store down for hours fills the disk, unless ``keep_remote`` bounds the backlog."""
        uploader = self._uploader
        full = any(os.strerror(code) in str(error) for code in NO_SPACE)
        waiting = uploader.pending() if uploader is not None and full else []
        if uploader is None or self._remote is None or not waiting:
            return
        log.warning("resilient: the local disk at %s is full with %d step(s) waiting to be uploaded to %s (%s, "
                    "oldest %.0f s ago)%s; each stays there until it is uploaded%s", self.root, len(waiting),
                    self._remote.url, waiting if len(waiting) <= 8 else f"{waiting[:8]}...",
                    uploader.lag_seconds(), f", last error: {uploader.last_error}" if uploader.last_error else "",
                    "" if self._keep_remote is not None else
                    ": pass keep_remote= to upload (and keep) only the steps the remote tier keeps")

    def _replicate(self, step: int) -> None:
        """Send this rank's file of ``step`` (and the manifest) to a peer's memory."""
        sdir = self._tier.step_dir(step)
        files = {name: os.path.join(sdir, name) for name in (data_file_name(self.rank), MANIFEST)}
        if self._coord.rank == 0 and os.path.exists(files[MANIFEST]):
            with open(files[MANIFEST], "rb") as f:
                self._memory.record_manifest(step, f.read())
        self._memory.replicate(step, {n: p for n, p in files.items() if os.path.exists(p)})

    def _on_uploaded(self, step: int, seconds: float | None) -> None:
        if seconds is not None and self._coord.rank == 0:  # rank 0 writes the remote commit record
            moved = self._uploader.uploaded_bytes - self._uploaded_bytes_seen if self._uploader else 0
            self._uploaded_bytes_seen += moved
            self._events.emit("save_committed", step=step, tier="remote", url_scheme=self._remote.url.split("://")[0],
                              seconds=round(seconds, 6), bytes=moved)
        self._apply_retention()

    def _protected(self) -> set[int]:
        """Steps retention never deletes: the newest this job committed and the one it
        restored from (the last known good state, even when newer steps proved bad)."""
        return {s for s in (self._restored_step, self._newest_committed) if s is not None}

    def _after_commit(self, step: int) -> None:
        # leader, writer thread, right after a local commit
        self._newest_committed = max(step, self._newest_committed or step)
        if self._uploader is not None:
            self._uploader.enqueue(step)
        self._apply_retention()

    def _apply_retention(self) -> None:
        # leader; writer thread after a commit, uploader thread after an upload. A local
        # checkpoint that is not yet on the remote tier is never deleted to make room.
        with self._retention_lock:
            for step in to_delete(self._keep, self._tier.committed_steps(), self._protected()):
                if self._uploader is not None and not self._uploader.uploaded(step):
                    continue
                self._tier.delete(step)
                log.info("resilient: deleted checkpoint step %d (retention %r)", step, self._keep)

    @eager_under_compile
    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed on the local tier.

        Raises ``CommitError`` for the first save that failed (after waiting for all; it names
        the later ones that failed too), and
        ``TimeoutError`` when ``timeout`` seconds pass first.
        """
        self._pause_watchdog()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            handles, self._handles = self._handles, []
        failed: list[CommitError] = []
        for handle in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.result(left)
            except CommitError as exc:
                failed.append(exc)
            except TimeoutError:
                with self._lock:
                    self._handles = [h for h in handles if not h.done()] + self._handles
                raise
        if len(failed) == 1:
            raise failed[0]
        if failed:
            raise CommitError(failed[0].step, failed[0].failures, [e.step for e in failed[1:]]) from failed[0]

    @eager_under_compile
    def flush(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed on the remote tier too.

        Raises ``TimeoutError`` naming what is still pending when ``timeout`` runs out.
        Without a remote tier this is ``wait``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        if self._remote is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._uploader is not None:
            self._uploader.flush(left)
        newest = self._tier.committed_steps()
        if not newest:
            return
        # every rank returns only once the remote commit record of the newest step exists.
        # Every rank asks the store, so the asking slows down (0.2 s growing to about 1 s,
        # jittered): a thousand ranks at a fixed 0.2 s would be 5,000 requests a second for
        # as long as the upload takes, which a bucket throttles (and bills); at 1 s, 1,000.
        remote, pause = Catalog(self._remote), 0.2
        while not remote.is_committed(newest[-1]):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step {newest[-1]} not committed on {self._remote.url} after {timeout} s")
            time.sleep(pause * jitter(0.8, 1.2))
            pause = min(pause * 1.5, 1.0)

    # -- reading ----------------------------------------------------------------------------
    def _remote_steps(self) -> list[int]:
        """Steps committed on the remote tier; empty (with a warning) when it is unreachable."""
        if self._remote is None:
            return []
        steps, error = self._list_remote(0.0)  # one try: latest() answers at once
        if error is not None:
            log.warning("resilient: remote tier %s unreachable: %s", self._remote.url, error)
        return steps

    def _agreed_remote_steps(self) -> tuple[list[int], str | None]:
        """(steps committed on the remote tier, why it could not be listed): listed by rank
        0 alone and given to every rank, so that all take one decision from one answer, and
        a job of a thousand ranks asks the store once, not a thousand times (a store
        throttling some of them would have left those ranks with no steps, and ``agree_min``
        would then have restored nothing). An unreachable store is retried with backoff for
        up to ``RESILIENT_REMOTE_WAIT`` seconds (default 60)."""
        if self._remote is None:
            return [], None
        answer: tuple[list[int], str | None] | None = None
        if self._coord.rank == 0:
            answer = self._list_remote(env_float("RESILIENT_REMOTE_WAIT", 60.0))
        got = self._coord.all_gather(answer)[0]
        assert isinstance(got, tuple)
        return got

    def _list_remote(self, wait_s: float) -> tuple[list[int], str | None]:
        assert self._remote is not None
        remote = Catalog(self._remote)
        try:
            return _retried(f"listing {self._remote.url}", remote.committed_steps, wait_s, lambda exc: True), None
        except Exception as exc:  # noqa: BLE001 - any store failure, reported to every rank
            return [], f"{type(exc).__name__}: {exc}"  # never the storage options

    def _remote_bad_steps(self) -> set[int]:
        """Steps the remote tier has marked bad, as rank 0 lists them (one request; an
        unreachable store counts as none). Asked only when no step is left to restore: a
        fresh node whose remote tier holds nothing but damaged steps would start afresh."""
        if self._remote is None or self._coord.rank != 0:
            return set()
        try:
            return set(Catalog(self._remote).bad_steps())
        except Exception:  # noqa: BLE001 - the store's answer is only a reason to refuse
            return set()

    def _memory_steps(self) -> set[int]:
        return self._memory.steps() if self._memory is not None else set()

    @eager_under_compile
    def latest(self) -> int | None:
        """Step of the newest committed checkpoint on any tier (None when there is none).
        Commit records are checked here; data checksums are checked by restore."""
        return self._latest(remote=True)

    def _latest(self, remote: bool) -> int | None:
        """``latest()``, the remote tier left unasked unless ``remote``: where one rank
        lists it for all (a thousand ranks listing a bucket at once is throttled)."""
        steps = set(self._tier.committed_steps()) | (set(self._remote_steps()) if remote else set())
        steps -= self._bad_steps
        return max(steps) if steps else None

    def _from_memory(self, step: int) -> bool:
        """Leader: fill in files of ``step`` missing locally from peers' memory (manifest
        last, when the step is not committed here); True when the step is then complete.

        What peers send is written aside and checked against the manifest's checksums
        before it takes any file's place: a bad copy never replaces a good one, and an
        uncommitted step appears only complete."""
        sdir = step_dir_name(step)
        committed = step in self._tier.committed_steps()
        if committed:
            manifest, raw = self._tier.read_manifest(step), None
        else:
            raw = self._memory.fetch(step, [MANIFEST]).get(MANIFEST)
            if raw is None:
                return False
            self._memory.check_manifest(step, raw, f"peer memory: {sdir}/{MANIFEST}")
            manifest = decode_manifest(raw, f"peer memory: {sdir}/{MANIFEST}")
        storage = self._local_storage
        missing = [name for name, record in manifest["files"].items()
                   if not (storage.exists(f"{sdir}/{name}") and storage.size(f"{sdir}/{name}") == record["bytes"])]
        found = self._memory.fetch(step, missing)
        if len(found) < len(missing):
            return False
        aside = LocalStorage(self._tier.pending_dir(f"{self._coord.session}-memory", step))
        try:
            aside_catalog = Catalog(aside)
            for name, data in found.items():
                if len(data) != manifest["files"][name]["bytes"]:
                    raise CheckpointCorruptError(f"peer memory: {sdir}/{name} has {len(data)} bytes, the "
                                                 f"manifest says {manifest['files'][name]['bytes']}")
                aside.write(f"{sdir}/{name}", [data])
                aside_catalog.verify_file(manifest, step, name)  # CheckpointCorruptError if not
            if committed:  # files of a committed step: each moved in once verified
                for name in found:
                    os.replace(aside.local_path(f"{sdir}/{name}"), storage.local_path(f"{sdir}/{name}"))
                return True
            for name in set(manifest["files"]) - set(found):  # present here: moved aside too
                os.replace(storage.local_path(f"{sdir}/{name}"), aside.local_path(f"{sdir}/{name}"))
            aside.write(f"{sdir}/{MANIFEST}", [raw])
            self._tier.install(aside.local_path(sdir), step)
            return True
        finally:
            shutil.rmtree(aside.root, ignore_errors=True)

    def _fetch(self, step: int, fetched: dict[int, str]) -> Exception | None:
        """Leader: make every file of ``step`` present locally, taking what is missing from
        peers' memory, then from the remote tier. Returns the failure, if any."""
        if (self._remote is None and self._memory is None) or not self._coord.is_leader:
            return None
        try:
            local_has = step in self._tier.committed_steps()
            if local_has and not missing_files(self._local_catalog, self._tier.read_manifest(step)):
                return None
            try:
                if self._memory is not None and self._from_memory(step):
                    fetched[step] = "memory"
                    return None
            except CheckpointCorruptError as exc:  # a bad copy in a peer's memory: try the remote tier
                log.warning("resilient: %s", exc)
            if self._remote is None:
                raise CheckpointCorruptError(f"files of step {step} are neither here nor in a peer's memory")
            t0 = time.perf_counter()
            what = f"fetching step {step} from {self._remote.url}"
            remote, local = Catalog(self._remote), self._local_catalog.storage
            # a retry keeps the files already complete (skip_present)
            moved = _retried(what, lambda: copy_step(remote, local, step, ProgressLog(what), skip_present=True,
                                                     workers=8),
                             env_float("RESILIENT_REMOTE_WAIT", 60.0), _transient)
            fetched[step] = "remote"
            log.info("resilient: fetched step %d from %s (%d bytes in %.2f s)", step, self._remote.url, moved,
                     time.perf_counter() - t0)
            return None
        except Exception as exc:
            return exc

    @eager_under_compile
    def restore(self, state: MutableMapping[str, Any] | None = None, *, step: int | None = None,
                strict: bool = True) -> int:
        """Load the newest checkpoint every rank can read and verify; return its step (0: none).

        Entries of ``state`` are loaded in place (``load_state_dict``, tensor copies), plain
        values into the state's own dicts and lists (``_restore._into``). A checkpoint with a
        missing or corrupt file is skipped with a warning naming it, and the next older one is
        tried; when committed checkpoints exist and none loads, ``CheckpointCorruptError``
        (never 0: a fresh start would throw the run away).

        ``step=N`` loads that step or raises (never another one). ``strict=False`` loads what
        the state and the checkpoint share (e.g. only the model, for evaluation): entries and
        module tensors the checkpoint lacks are left as they are, saved entries the state does
        not ask for are not read.
        """
        self._check_open()
        open_all()  # a copy still reading the live tensors finishes before they are overwritten
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        wanted = step
        self._pause_watchdog()
        state = self._state(state, "restore")
        try:
            self.wait()
        except CommitError as exc:
            log.warning("resilient: %s", exc)
        coord = self._coord
        ceiling: int | None = None
        started = time.perf_counter()
        fetched_steps: dict[int, str] = {}  # step -> tier it was completed from
        touched = False  # a failed load may have written into the state already
        refetched: set[int] = set()  # steps whose damaged local copy was replaced from remote
        remote_steps, remote_error = self._agreed_remote_steps()
        if remote_error is not None:
            log.warning("resilient: remote tier %s unreachable: %s; restoring from what this node and its "
                        "peers hold", self._remote.url if self._remote else None, remote_error)
        while True:
            steps = sorted((set(self._tier.committed_steps()) | set(remote_steps) | self._memory_steps())
                           - self._bad_steps)
            if ceiling is not None:
                steps = [s for s in steps if s < ceiling]
            if wanted is not None:
                steps = [s for s in steps if s == wanted]
            step = coord.agree_min(steps[-1] if steps else -1)
            if step < 0 and remote_error is not None and not touched:
                # nothing here, and the remote tier, which may hold the run's checkpoints, did
                # not answer: starting from scratch would silently throw the run away
                raise StorageError(
                    errno.EHOSTUNREACH,
                    f"no checkpoint{'' if wanted is None else f' of step {wanted}'} on the local tier of "
                    f"{self.root!r}, and the remote tier {self._remote.url} "
                    f"could not be listed for RESILIENT_REMOTE_WAIT seconds ({remote_error}): not starting "
                    "from scratch. Restore once the store answers, or without remote= to start afresh"
                )
            if step < 0 and wanted is not None:
                if wanted in self._bad_steps:
                    raise CheckpointCorruptError(
                        f"step {wanted} in {self.root!r} cannot be loaded (see the warning above); "
                        "restore(step=...) does not fall back to another step"
                    )
                raise StateError(f"step {wanted} is not a committed checkpoint in {self.root!r} "
                                 f"(newest: {self.latest()})")
            if step < 0:
                if touched:
                    raise CheckpointCorruptError(
                        f"no loadable checkpoint in {self.root!r}: every committed one failed to "
                        "load, and the state may be partially overwritten (see warnings above)"
                    )
                # committed checkpoints that cannot be loaded (here, or marked so by an earlier
                # attempt): starting from scratch would silently throw the run away, and its
                # new saves would then replace them
                unloadable = sorted(self._bad_steps | set(self._tier.markers.bad_steps()) | self._remote_bad_steps())
                if coord.agree_max(int(bool(unloadable))):
                    raise CheckpointCorruptError(
                        f"no loadable checkpoint in {self.root!r}: "
                        + (f"step(s) {', '.join(map(str, unloadable))} are committed but cannot be loaded"
                           if unloadable else "another rank's committed checkpoints cannot be loaded")
                        + f" (why: the warnings above, or resilient-ckpt ls {self.root}); not starting from scratch. "
                        f"To start afresh on purpose, remove them (resilient-ckpt prune {self.root} --after 0) "
                        "or use another root"
                    )
                return 0
            refused: ResilientError | None = None
            rng = None
            failure = self._fetch(step, fetched_steps)
            if coord.agree_max(int(failure is not None)):  # also: nobody reads before the fetch is done
                failure = failure or CheckpointCorruptError(f"another node could not fetch step {step}")
            loaded_here = False  # a failure below is then this copy's, not a fetch's
            proven_bad = False  # its bytes or manifest failed a check (not, say, the program's load_state_dict)
            try:
                if failure is not None:
                    raise failure
                # one pause from the manifest to the rebuilt state, which the training waits
                # for anyway: the manifest's and the plan's objects are gone again when the
                # collector comes back, so no collection walks them (26,800 tensors: a
                # restore of 1.3-1.7 s instead of 2.1-2.7 s paused phase by phase)
                with gc_paused():
                    manifest = self._tier.read_manifest(step)
                    touched = loaded_here = True
                    saved_rng, loaded = load_checkpoint(state, manifest, self._tier.step_dir(step), coord.rank,
                                                coord.world_size, self._read_pool, strict=strict, coord=coord,
                                                rng=self.rng)
                    manifest = None
                    rng = parse_rng(saved_rng) if saved_rng else None
            except OtherRankFailed as exc:  # that rank says why; this copy is not shown bad
                failure = exc
            except NewerFormatError as exc:  # not damage: an older step would be a silent step back
                refused = exc
            except (CheckpointCorruptError, OSError) as exc:
                failure = exc
                proven_bad = loaded_here and isinstance(exc, CheckpointCorruptError)
            except ResilientError as exc:  # the state does not fit: no older step will help
                refused = exc
            except (KeyError, TypeError, ValueError, IndexError, RecursionError, MemoryError, OverflowError) as exc:
                # what validation did not foresee: this checkpoint is unusable, and every rank
                # must still reach the vote below (a rank that raised here would leave the
                # others waiting in the collective)
                failure = CheckpointCorruptError(f"step {step} cannot be loaded: {type(exc).__name__}: {exc}")
            # 0: loaded, 1: this checkpoint is unusable here, 2: the state was refused
            verdict = coord.agree_max(2 if refused else 1 if failure else 0)
            if verdict == 2:
                raise refused or StateError(
                    f"another rank refused to load step {step} into its state (see its error)"
                )
            if verdict == 1:
                where = self._tier.step_dir(step)
                if step not in refetched and step in remote_steps:  # the same on every rank
                    # the local copy is damaged but the remote tier has the step: replace the
                    # local copy from there and try the same step again
                    log.warning("resilient: local checkpoint %s unusable (%s); fetching it again from %s",
                                where, failure or "another rank could not load it", self._remote.url)
                    refetched.add(step)
                    if coord.is_leader and step in self._tier.committed_steps():
                        self._tier.delete(step)
                    coord.barrier()
                    continue
                log.warning(
                    "resilient: skipping checkpoint %s: %s", where, failure or "another rank could not load it"
                )
                if proven_bad:
                    self._mark_bad(step, str(failure), remote_too=step in refetched)
                self._bad_steps.add(step)
                ceiling = step
                continue
            if rng is not None:
                apply_rng(rng)
            self.stats["bytes_restored"] += loaded
            self._restored_step = step
            self._staging_prepared = False  # the restored state's layout, at the next save() not due
            self._reported_first_step = False
            self._order_checked = False  # a rollback's first save looks again
            self._events.emit("restored", step=step, seconds=round(time.perf_counter() - started, 6),
                              source=fetched_steps.get(step, "local"), bytes=loaded)
            return step

    def _mark_bad(self, step: int, reason: str, *, remote_too: bool) -> None:
        """Record that ``step`` failed verification here, so that no later restore, retention
        or ``resilient-ckpt prune`` takes it for a good checkpoint (a new commit of the same
        step clears the mark). ``remote_too``: this copy came from the remote tier."""
        tiers = [self._tier.markers] + ([Catalog(self._remote)] if remote_too and self._remote is not None else [])
        for catalog in tiers:
            try:
                catalog.mark_bad(step, reason)
            except OSError as exc:
                log.warning("resilient: could not mark step %d bad on %s: %s", step, catalog.storage.url, exc)

    # -- lifecycle ----------------------------------------------------------------------------
    @eager_under_compile
    def close(self, timeout: float | None = None) -> None:
        """Wait for in-flight saves and stop the background thread.

        ``timeout`` defaults to the commit timeout; past it, what is unfinished is logged
        and abandoned (it can never be mistaken for a committed checkpoint). Under several
        ranks the first one returns once every rank has closed (``_depart_together``).
        """
        self._close(timeout, together=True)

    def _close(self, timeout: float | None, *, together: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()
        timeout = self.commit_timeout if timeout is None else timeout
        left = self._preemption.seconds_left() if self._preemption is not None else None
        if left is not None:  # asked to stop: what is unfinished when the grace is over stays so
            timeout = min(timeout, left)
        until, settled = time.monotonic() + timeout, False
        try:
            self.wait(timeout)
            if self._remote is not None:
                self.flush(min(timeout, self.flush_timeout))
            settled = True
        except (CommitError, TimeoutError) as exc:
            log.warning("resilient: closing with unfinished saves or uploads: %s", exc)
        finally:  # a failed save may mean a rank is gone: the first rank does not wait for it then
            self._depart_together("closing", until, wait=together and settled)
            if self._uploader is not None:
                self._uploader.close()
            self._events.close()
            if not self._writer.stop(timeout=max(timeout, 1.0)):  # an idle writer needs a moment to join
                log.warning("resilient: background writer still busy at close; abandoning it")
            if self._owns_staging:
                self._staging.close()
            self._read_pool.shutdown()
            if not self._tier.close(timeout):
                log.warning("resilient: old checkpoints still being deleted at close; the next start finishes it")
            self._release_root()

    @eager_under_compile
    def abandon(self, wait: float = 0.0) -> None:
        """Stop at once after a failure of the gang: in-flight saves need peers that may be
        gone and are left uncommitted (the next Checkpointer on this root removes their
        leftovers); the background threads are daemons and wind down on their own.
        ``wait``: seconds to let the writer finish the save in hand first (a caller about
        to delete the root must not race it)."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()
        if self._uploader is not None:
            self._uploader.close(wait=False)
        self._events.close()
        self._writer.stop(timeout=wait)
        self._read_pool.shutdown(wait=False)
        self._release_root()

    def _release_root(self) -> None:
        if self._claimed:
            self._claimed = False
            release_root(self._tier.root, self._coord.session)

    def _pause_watchdog(self) -> None:
        # restoring and waiting for commits are not steps: a long one is not a hang
        if self._watchdog is not None:
            self._watchdog.pause()

    def _check_open(self) -> None:
        if self._closed:
            raise ResilientError(f"Checkpointer for {self.root!r} is closed")

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # Leaving on an exception (often a dead peer): do not hold the process for the
        # full commit timeout waiting for ranks that may be gone.
        if exc_type is None:
            self.close()
        else:
            self._close(min(self.commit_timeout, _EXIT_ON_ERROR_TIMEOUT), together=False)

    def __repr__(self) -> str:
        return (
            f"Checkpointer(root={self.root!r}, rank={self.rank}, world_size={self.world_size}, "
            f"codec={self._codec!r}, keep={self._keep!r})"
        )
