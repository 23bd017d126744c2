"""The background half of a save: write this rank's file, then commit with the others.

Sequence for one save (``seq`` counts saves; every rank issues them in the same order):

1. every rank: write ``rank-NNNNN.data`` from the staged buffer (and its generator states
   after it) into the shared pending directory, fsync it, publish a JSON report (file
   record, what it holds, its tree).
2. together, over the store (``_commit``): rank 0 assembles the manifest from every rank's
   report, each leader (one per storage location) commits it on its tier (see ``_local``),
   and every rank learns the outcome and settles the save's handle;
3. each leader: apply retention.

No step waits for the training loop, and a rank that never reports (killed) leaves the
save uncommitted: the previous checkpoint stays the newest.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ._background import YieldingPool, someone_waits, waiting, yield_limit
from ._chunkio import fsync_dir, write_chunked
from ._commit import commit_together
from ._compiled import eager_under_compile
from ._coord import Coordinator
from ._errors import CommitError
from ._format import data_file_name
from ._gc_pause import gc_paused
from ._local import LocalTier
from ._report_memo import HeldPieces, SentPieces
from ._rng import encode_rng
from ._fence import SnapshotDone
from ._snapshot import RankPlan

__all__ = ["SaveHandle", "SaveJob", "BackgroundWriter"]

log = logging.getLogger("resilient")


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or this user's quota on it


class SaveHandle:
    """Two-phase view of one save: staged when ``save`` returns, then committed (or failed)."""

    def __init__(self, step: int, on_settle: Callable[["SaveHandle"], None] | None = None) -> None:
        self.step = step
        self.started = time.perf_counter()
        self.staged_at: float | None = None
        self.committed_at: float | None = None
        self.nbytes = 0
        self.deferred_bytes = 0  # of nbytes, copied after save returned (overlapped staging)
        # what this rank's report to rank 0 weighed, as it travelled through the store (set
        # once the save committed): after a job's first save, only what changed since the last
        self.report_bytes = 0
        # seconds from the call to the end of each background phase ("copied": the copy made
        # inside save, "written", on rank 0 "reports", and on a leader "manifest"): which part of a
        # slow save was slow. A copy that runs on after save (overlapped staging, a GPU) is
        # written as it comes, so it ends within "written".
        self.phases: dict[str, float] = {}
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._on_settle = on_settle

    @property
    def committed(self) -> bool:
        return self._done.is_set() and self._error is None

    def done(self) -> bool:
        return self._done.is_set()

    @eager_under_compile
    def settled(self, timeout: float | None = None) -> bool:
        """Wait until committed or failed, without raising for a failure (a caller that
        only needs the save's buffer back); whether it is. Background work does not yield
        to training meanwhile (``_background.waiting``)."""
        if self._done.is_set():
            return True
        with waiting():
            return self._done.wait(timeout)

    @eager_under_compile
    def result(self, timeout: float | None = None) -> None:
        """Block until committed; raise ``CommitError`` if it failed, ``TimeoutError`` if late."""
        if not self.settled(timeout):
            raise TimeoutError(f"save of step {self.step} not committed within {timeout} s")
        if self._error is not None:
            raise self._error

    def _mark(self, phase: str) -> None:
        self.phases[phase] = round(time.perf_counter() - self.started, 6)

    def _settle(self, error: BaseException | None) -> None:
        self._error = error
        self.committed_at = time.perf_counter()
        self._done.set()
        if self._on_settle is not None:
            self._on_settle(self)


@dataclass
class SaveJob:
    seq: int
    step: int
    buffer: torch.Tensor
    plan: RankPlan
    tree: dict[str, Any]
    rng: dict[str, Any] | None
    handle: SaveHandle
    snapshot: SnapshotDone  # when ``buffer`` is final: the copy may still be running


class BackgroundWriter:
    """One daemon thread per Checkpointer; saves are processed strictly in order."""

    def __init__(
        self,
        tier: LocalTier,
        coord: Coordinator,
        *,
        codec: str,
        chunk_bytes: int,
        commit_timeout: float,
        after_commit: Callable[[int], None],
        authorize: Callable[[int], None] | None = None,
        direct_io: bool = True,
        written: Callable[[int, str | None], None] | None = None,
    ) -> None:
        self.tier = tier
        # told the step and this rank's file once it is written (RESILIENT_FAULT's phase=write)
        self.written = written
        self.direct_io = direct_io
        self.authorize = authorize  # raises when this process may no longer commit (fenced)
        self.coord = coord
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.commit_timeout = commit_timeout
        self.after_commit = after_commit
        # what rank 0 holds of this rank's report, and on rank 0 what it holds of everyone's:
        # a rank sends again only what changed since the last committed save
        self._sent, self._held = SentPieces(), (HeldPieces() if coord.rank == coord.leaders[0] else None)
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        # CRC32 (ISA-L's) runs at 16-21 GB/s on one core, far faster than the disks we write
        # to: one thread keeps up and leaves the other cores to training; zstd needs two.
        # What yields to training (``_background``), until the save is late: the work that
        # costs cores, zstd's threads and writes through the page cache (``write_chunked``'s
        # ``yielding``). Not this thread, nor CRCs: a direct write of raw chunks is too
        # little CPU to slow a step, and yielding made it 12x slower to become durable on
        # cores that other processes keep busy (data-loader workers, say; bench_busy_cores).
        self._pool: Executor = YieldingPool(2, "resilient-encode", pure=True) if codec == "zstd" else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="resilient-encode")
        self._yielding = YieldingPool(1, "resilient-pagecache")
        self._yield_limit = yield_limit()
        self._thread = threading.Thread(target=self._loop, name="resilient-writer", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        self._jobs.put(job)

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the thread to finish its queue and stop; False if it is still busy after
        ``timeout`` (it is a daemon, so it never keeps the process alive)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        self._pool.shutdown(wait=not alive)
        self._yielding.shutdown(wait=not alive)
        return not alive

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            error: BaseException | None = None
            try:
                self._process(job)
            except BaseException as exc:  # settle the handle whatever happens
                error = exc if isinstance(exc, CommitError) else CommitError(
                    job.step, {self.coord.rank: f"{type(exc).__name__}: {exc}"}
                )
            job.handle._settle(error)
            if error is not None:
                log.warning("resilient: %s", error)
            elif self.coord.is_leader:
                # Housekeeping after the handle settles: deleting old checkpoints is not
                # part of committing this one, and must not delay whoever waits for it.
                try:
                    self.after_commit(job.step)
                except Exception as exc:
                    log.warning("resilient: retention after step %d failed: %s", job.step, exc)

    def _write_rank_file(self, job: SaveJob, pending: str) -> dict[str, Any]:
        rank = self.coord.rank
        job.snapshot.ready(0)  # the copy made in save is over; raises if it failed
        job.handle._mark("copied")
        name = data_file_name(rank) if job.buffer.numel() else None
        record = None
        rng: Any = job.rng  # kept in the manifest only by a rank without a file
        if name is not None:
            trailer = b"" if job.rng is None else encode_rng(job.rng)
            base = memoryview(job.buffer.numpy())
            with gc_paused():  # a view a blob: see _gc_pause
                views = [base[start:end] for start, end in job.plan.extents()]
            path = os.path.join(pending, name)
            self.tier.reuse(path)  # a deleted step's file of this rank, overwritten in place if there is one
            record = write_chunked(
                path,
                views,
                codec=self.codec,
                chunk_bytes=self.chunk_bytes,
                pool=self._pool,
                contiguous=base[: job.plan.nbytes],
                direct=self.direct_io,
                ready=job.snapshot.ready,  # a copy still running after save: written as it comes
                trailer=trailer,
                footer=True,
                yielding=self._yielding,
                late=lambda: someone_waits() or time.perf_counter() - job.handle.started > self._yield_limit,
            )
            if trailer:
                rng = [job.plan.nbytes, len(trailer)]  # where in the file: its logical bytes
            fsync_dir(pending)
        job.snapshot.wait()  # raises if the snapshot was torn: this rank's report is then an error
        job.handle._mark("written")
        return {
            "rank": rank,
            "file": name,
            "record": record,
            "signature": job.plan.signature,
            "chunk_bytes": self.chunk_bytes,
            "meta": job.plan.meta,
            "replicated": job.plan.replicated,
            "shards": job.plan.shards,
            "tree": job.tree,
            "rng": rng,
        }

    def _process(self, job: SaveJob) -> None:
        pending = self.tier.pending_dir(self.coord.session, job.seq)
        try:
            report = self._write_rank_file(job, pending)
            if self.written is not None:
                self.written(job.step, None if report["file"] is None else os.path.join(pending, report["file"]))
        except Exception as exc:
            full = isinstance(exc, OSError) and exc.errno in NO_SPACE
            why = self.tier.no_space(exc, job.plan.nbytes, pending) if full else f"{type(exc).__name__}: {exc}"
            report = {"rank": self.coord.rank, "error": why}

        def commit(manifest: bytes) -> None:
            if self.authorize is not None:
                self.authorize(job.step)
            self.tier.commit(pending, job.step, manifest)

        job.handle.report_bytes = commit_together(
            self.coord, job.seq, job.step, report, codec=self.codec, timeout=self.commit_timeout,
            commit=commit, discard=lambda: self.tier.discard(pending), mark=job.handle._mark,
            sent=self._sent, held=self._held)
