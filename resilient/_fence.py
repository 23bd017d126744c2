"""Overlapped staging: the optimizer's tensors are copied while training goes on.

Why: a save stalls training for the copy of the rank's state into host memory, and most
of those bytes (parameters and optimizer state) are written by nothing but
``optimizer.step()``; forward and backward only read them. So their copy can run while the
next forward and backward do, and only the next optimizer step has to wait for it (when it
is still running), as DCP's asynchronous staging does. On CUDA the copy goes on a side
stream into pinned memory and the optimizer step makes its stream wait on the copy's event:
the training thread is not held at all. On the CPU a copy thread does it, and the
optimizer step waits for that thread.

A write to one of those tensors other than by an optimizer step (``p.copy_()``,
``load_state_dict``) before its copy is complete could tear the snapshot. The version
counter of every deferred source is read at the save and again when its copy is complete
or the optimizer gate opens, whichever comes first: a change fails the save with an error
naming the tensor, never commits a mixed state. (Writes through ``.data`` bypass version
counters; a loop that does them should use ``staging="sync"``.)
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._compiled import eager_under_compile
from ._per_rank import PerRank
from ._zero import is_zero

__all__ = ["CopyProgress", "SnapshotDone", "StagingFence", "StagingTornError", "optimizer_storages", "open_all", "STAGING_MODES"]

STAGING_MODES = ("auto", "sync", "overlap")


class StagingTornError(RuntimeError):
    """A tensor whose copy was deferred was written before the copy was complete."""


def _storages_of(t: torch.Tensor) -> list[int]:
    """The storage of ``t`` (a DTensor's local one), or of each tensor a wrapper subclass
    holds (torchao's 8-bit optimizer states: codes, scales), which are what a save copies.
    Asked of every parameter, optimizer state and saved tensor at each overlapped save: a
    plain tensor is answered before anything else: 1.5 us a tensor went to the imports and
    checks, 125 ms of every save of 10,000 parameters with Adam (40,000 tensors, asked here
    twice), 46 ms now."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return [t.untyped_storage().data_ptr()]
    from ._snapshot import local_tensor  # _snapshot stages through this module
    from ._subclasses import wrapper_parts

    local = local_tensor(t)
    parts = wrapper_parts(local)
    if parts is None:
        return [local.untyped_storage().data_ptr()]
    return [storage for name in parts[0] for storage in _storages_of(getattr(local, name))]


def optimizer_storages(state: Mapping[str, Any]) -> set[int]:
    """Storages that only an optimizer of ``state`` writes: its parameters and their state.

    Only optimizers found in ``state`` (top level, or wrapped in ``PerRank``) count: the gate
    opens at their step, so a tensor another optimizer writes is never deferred."""
    storages: set[int] = set()
    for value in state.values():
        inner = value.value if isinstance(value, PerRank) else value
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        _add_storages(storages, (param for group in inner.param_groups for param in group["params"]))
        # a ZeRO optimizer's state is its local optimizer's, whose step runs inside its own
        states = [inner.state] + ([inner.optim.state] if is_zero(inner) else [])
        _add_storages(storages, (tensor for state_ in states for per_param in state_.values()
                                 if isinstance(per_param, dict) for tensor in per_param.values()
                                 if isinstance(tensor, torch.Tensor)))
    return storages


def _add_storages(storages: set[int], tensors: Iterable[torch.Tensor]) -> None:
    """The storages of ``tensors`` added to ``storages``, a plain tensor's inline: a call
    and a list for each of 80,000 tensors (10,000 parameters with Adam, and the saved
    tensors in ``deferred_sources``) were 63 ms of every overlapped save, 46 ms now (medians
    of 10; the save's stall, 0.26 s, is mostly its walk of the 40,000 tensors)."""
    add = storages.add
    for tensor in tensors:
        if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
            add(tensor.untyped_storage().data_ptr())
        else:
            storages.update(_storages_of(tensor))


class CopyProgress:
    """How far a snapshot copy that outlives ``save`` has come, so the writer writes each
    part of the buffer as soon as it is final instead of waiting for all of it.

    Why: with overlapped staging (and on a GPU) the copy is not the stall, so nothing is
    gained by holding the write back, and the save is durable about a write's time after
    the copy began rather than a copy's plus a write's. Copies complete in the order given
    (one copy thread; one CUDA stream).

    ``blobs``: (offset in the buffer, place in copy order) for every blob; a place of -1
    means final before ``save`` returned."""

    #: bytes copied between two CUDA events: a few events per GB, each a sync point the
    #: writer can wait on, recorded by the training thread at a cost of microseconds each
    EVENT_BYTES = 64 << 20

    def __init__(self, blobs: list[tuple[int, int]]) -> None:
        ordered = sorted(blobs)
        self._starts = [offset for offset, _ in ordered]
        self._needed: list[int] = []  # copies that must be complete before the bytes below each start+1
        latest = -1
        for _, place in ordered:
            latest = max(latest, place)
            self._needed.append(latest + 1)
        self._complete = 0
        self._cond = threading.Condition()
        self._events: list[tuple[int, Any]] = []  # CUDA: (copies complete once it fires, event)

    def needed(self, end: int) -> int:
        """How many copies (in copy order) must be complete before bytes ``[0, end)`` are final."""
        i = bisect.bisect_left(self._starts, end)
        return self._needed[i - 1] if i else 0

    # -- copy side ---------------------------------------------------------------------------
    def copied(self, count: int) -> None:
        """CPU: the first ``count`` copies are complete."""
        with self._cond:
            self._complete = max(self._complete, count)
            self._cond.notify_all()

    def recorded(self, count: int, event: Any) -> None:
        """CUDA: ``event`` fires once the first ``count`` copies are complete."""
        self._events.append((count, event))

    def finished(self) -> None:
        """Every copy is over, done or failed (the writer's final wait then raises)."""
        self.copied(len(self._needed) + 1)

    # -- writer thread -----------------------------------------------------------------------
    def wait_through(self, end: int) -> None:
        """Return once bytes ``[0, end)`` of the buffer hold their final values."""
        count = self.needed(end)
        if count == 0:
            return
        for recorded, event in self._events:
            if recorded >= count:
                event.synchronize()
                return
        with self._cond:
            self._cond.wait_for(lambda: self._complete >= count)


class StagingFence:
    """The deferred part of one snapshot: done when its bytes are in the host buffer.

    ``open_for_writes`` (training thread, before an optimizer step) lets the step write the
    sources once their copy no longer needs them; ``wait`` (writer thread) returns once the
    buffer is complete, or raises ``StagingTornError``."""

    def __init__(self, sources: list[tuple[str, torch.Tensor]], on_wait: Callable[[float], None],
                 progress: CopyProgress) -> None:
        self.progress = progress
        self._sources = [(name, t, t._version) for name, t in sources]
        self._lock = threading.Lock()
        self._opened = False
        self._error: StagingTornError | None = None
        self._copied = threading.Event()  # CPU: the copy thread finished
        self._event: Any = None  # CUDA: recorded on the copy stream after the last copy
        self._on_wait = on_wait

    def _check(self, when: str) -> None:
        """Record a tear if a source changed since the save; under ``_lock``, before opening."""
        if self._opened or self._error is not None:
            return
        for name, tensor, version in self._sources:
            if tensor._version != version:
                self._error = StagingTornError(
                    f"state tensor {name!r} was written in place {when} before its snapshot was complete, not by an "
                    "optimizer step; this save is not committed. Write it after the optimizer step, or use "
                    "Checkpointer(staging='sync')")
                return

    # -- copy side ---------------------------------------------------------------------------
    def cuda_recorded(self, event: Any) -> None:
        self._event = event

    def cpu_copied(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._check("during the copy")
            if error is not None and self._error is None:
                self._error = StagingTornError(f"the deferred copy failed: {type(error).__name__}: {error}")
        self._copied.set()
        self.progress.finished()

    # -- training thread ---------------------------------------------------------------------
    def open_for_writes(self) -> None:
        started = time.perf_counter()
        with self._lock:
            if self._opened:
                return
            copying = not self._copied.is_set() if self._event is None else not self._event.query()
            if copying:  # a write after the copy is complete is harmless
                self._check("after the save")
            self._opened = True  # the caller writes only once this returns, after the copy
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)  # the GPU waits, not this thread
        else:
            self._copied.wait()
        self._on_wait(time.perf_counter() - started)

    # -- writer thread -----------------------------------------------------------------------
    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            with self._lock:
                self._check("during the copy")
        else:
            self._copied.wait()
        if self._error is not None:
            raise self._error
        _forget(self)


class SnapshotDone:
    """When one save's staging buffer is final: the writer reads no byte of it before.

    Why the writer waits for the whole copy made in ``save`` instead of writing each piece as
    soon as it is copied: that copy is the stall, and a direct write beside it competes for the memory
    bandwidth and the cores the copy runs on (the host's DMA, the kernel's page pinning).
    Measured here (4 GB on one rank, 2 interleaved runs of 8 saves each, memcpy 0.33-0.34 s):
    stalls of 0.34-0.43 s when the writes waited, 0.38-0.53 s when they overlapped the copy,
    which made the save durable only 0.05-0.15 s sooner (1.91-2.40 s against 2.01-2.61 s).
    The checksums already waited (1 GB: stalls of 0.27-0.60 s checksummed beside the copy,
    0.21-0.27 s after it). A copy that finishes after ``save`` returns (deferred blobs,
    device state) is not the stall: it completes this with the ``StagingFence`` whose
    ``CopyProgress`` lets the writer write each part as soon as it is final. A copy that
    fails completes it with the error, so a waiting writer never hangs.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._fence: StagingFence | None = None
        self._error: BaseException | None = None

    def complete(self, fence: "StagingFence | None" = None, error: BaseException | None = None) -> None:
        """The copy in ``save`` is over: all bytes are final once ``fence`` (if any) is."""
        self._fence, self._error = fence, error
        self._event.set()

    def _copied_in_save(self) -> StagingFence | None:
        self._event.wait()
        if self._error is not None:
            raise StagingTornError(f"the snapshot copy failed: {type(self._error).__name__}: {self._error}") \
                from self._error
        return self._fence

    def ready(self, end: int) -> None:
        """Return once bytes ``[0, end)`` of the buffer are final: the copy in ``save`` is
        over and the later copy has come that far. Their values may still prove torn, which
        only ``wait`` tells, so the writer calls it before it reports the file."""
        fence = self._copied_in_save()
        if fence is not None:
            fence.progress.wait_through(end)

    def wait(self) -> None:
        """Return once every byte is final; raise if the snapshot failed or was torn."""
        fence = self._copied_in_save()
        if fence is not None:
            fence.wait()


_pending: list[StagingFence] = []
_pending_lock = threading.Lock()
_hook: Any = None


def _forget(fence: StagingFence) -> None:
    with _pending_lock:
        if fence in _pending:
            _pending.remove(fence)


@eager_under_compile
def open_all(*_: Any) -> None:
    """Open every pending fence: before any optimizer step, and before a restore writes.

    Run as it is, not traced, when a compiled ``optimizer.step()`` (PyTorch's recipe for a
    faster optimizer) calls it among its pre-hooks: Dynamo traced into it and warned in the
    user's run of a ``time.perf_counter`` it cannot trace. It is a lock and an event, with
    nothing to compile."""
    with _pending_lock:
        fences = list(_pending)
        _pending.clear()
    for fence in fences:
        fence.open_for_writes()


def register(fence: StagingFence) -> None:
    """Gate every optimizer step on ``fence`` (the hook is global and installed once)."""
    global _hook
    with _pending_lock:
        _pending.append(fence)
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(open_all)


class CopyThread:
    """One thread copying deferred CPU blobs, started on first use."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def run(self, work: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-stage")
        self._pool.submit(work)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def deferred_sources(tensors: Mapping[str, torch.Tensor], storages: set[int]) -> set[str]:
    """The names of the tensors that live in one of ``storages`` (a plain tensor's looked up
    inline, as in ``_add_storages``)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    return {name for name, tensor in tensors.items()
            if (tensor.untyped_storage().data_ptr() in storages if type(tensor) in plain
                else not storages.isdisjoint(_storages_of(tensor)))}
