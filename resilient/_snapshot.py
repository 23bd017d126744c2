"""The snapshot: the only part of a save that stalls, and the boxes of DTensors it copies.

The plan (``_plan``) decides, from the flattened state, which byte ranges of which tensors
this rank owns (see ``_layout``). The snapshot copies exactly those ranges into one reusable host
buffer, in file order, each starting on a ``BLOB_ALIGN`` boundary (the buffer is the
rank's data file); the background writer then works from the buffer while training
mutates the tensors.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ._background import Handover, drain
from ._errors import UnsupportedStateError
from ._fence import CopyProgress, CopyThread, StagingFence, register
from ._hostmem import HostBuffer, can_populate, populate
from ._layout import Box, shard_box, sharding_order

__all__ = ["Blob", "RankPlan", "Staging", "is_dtensor", "dtensor_box", "placed_box", "byte_view", "bitwise",
           "local_tensor", "storage_shortfall"]

log = logging.getLogger("resilient")

#: bytes of a new staging buffer touched at a time (``Staging._allocating``, ``_populating``):
#: one huge page, about 3 ms at this VM's 1.45 s/GB, which is what a save that takes over a
#: zeroing prewarm waits for, or runs beside
_TOUCH_PIECE = 2 << 20


def is_dtensor(t: torch.Tensor) -> bool:
    """DTensor's class is looked up among the loaded modules, never imported: importing
    ``torch.distributed.tensor`` costs ~1 s of every process start here (sympy, through
    torch.fx), a second added to every worker restart of a recovery, and no tensor can be
    a DTensor before something imported that module."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's part, the same memory), else ``t``. Why not
    ``to_local()``: outside ``no_grad`` it is an autograd Function (~20 µs), and a DTensor's
    own attributes each cost a trip through its dispatch; restoring 26,800 DTensors spent
    a third of its time there. Reading or writing the memory under ``no_grad`` is the same."""
    if type(t) in PLAIN_TYPES or not is_dtensor(t):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise(t: torch.Tensor) -> torch.Tensor:
    """``t`` (detached) as integers of its element's size, a view: copying that moves the
    bits whatever the dtype, including those torch has no copy for at all (uint1–7,
    int1–7: "copy_kernel not implemented", so a transposed one could not be saved)."""
    as_int = _SAME_SIZE_INT.get(t.element_size())
    t = t.detach()
    return t if as_int is None or t.dtype == as_int else t.view(as_int)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's (local) elements as a flat uint8 tensor, without a copy when possible."""
    local = local_tensor(t).detach()
    if not local.is_contiguous():
        local = bitwise(local).contiguous()
    return local.reshape(-1).view(torch.uint8)


def dtensor_box(t: torch.Tensor, name: str) -> Box:
    """The box of the global tensor this rank holds (replicas hold the same box)."""
    box = placed_box(tuple(t.shape), t.device_mesh, tuple(t.placements), name)
    local_shape = tuple(local_tensor(t).shape)
    if local_shape != box.sizes:
        raise UnsupportedStateError(
            f"state[{name!r}]: local shard has shape {list(local_shape)} but placements "
            f"{list(t.placements)} imply {list(box.sizes)}"
        )
    return box


def placed_box(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], name: str) -> Box:
    """The box this rank holds of a tensor of ``shape`` placed so on ``mesh``: a DTensor's,
    or one about to be made (a low-bit optimizer state's parts, ``_subclasses``)."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnsupportedStateError(f"state[{name!r}]: this rank is not part of the tensor's mesh")
    key = (shape, tuple(mesh.shape), tuple(coord), placements)
    try:
        box = _placed_box(*key)
    except TypeError:  # a placement that cannot be hashed: worked out each time
        box = _placed_box.__wrapped__(*key)
    if isinstance(box, str):
        raise UnsupportedStateError(f"state[{name!r}]: {box}")
    return box


@functools.lru_cache(maxsize=4096)
def _placed_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                placements: tuple[Any, ...]) -> Box | str:
    """The box at ``coord`` of a tensor of ``shape`` placed so, or why there is none. Kept:
    a rank's tensors share a few layouts, and working one out costs ~8 µs, asked of every
    DTensor at every restore (0.2 s of restoring 26,800 of them)."""
    shard_dims: list[int | None] = []
    split_factors: list[int] = []
    for placement in placements:
        factor = int(getattr(placement, "split_factor", 1))  # _StridedShard: FSDP2 over TP
        if placement.is_shard() or (factor > 1 and hasattr(placement, "dim")):
            shard_dims.append(placement.dim)
        elif placement.is_replicate():
            shard_dims.append(None)
        else:
            return (f"placement {placement} cannot be checkpointed; "
                    "redistribute partial tensors to Shard or Replicate first")
        split_factors.append(factor)
    order = sharding_order(mesh_shape, shard_dims, split_factors)
    if order is None:
        return (f"placements {list(placements)} on a mesh of shape {list(mesh_shape)} "
                "do not give each rank one box of the tensor")
    return shard_box(shape, mesh_shape, coord, shard_dims, order)


#: every blob starts at a multiple of this in the rank's file and staging buffer (a cache
#: line). Why: packed back to back, one tensor of an odd size (an optimizer's 4-byte
#: ``step``) shifts every later copy off the cache lines, and a copy whose destination is
#: not on one ran 20-25% slower here (4 GB in 24 tensors: 0.41-0.43 s against 0.33-0.34 s).
#: The gaps are zeros; the manifest records each blob's offset, so readers need no change.
BLOB_ALIGN = 64


def align_up(offset: int) -> int:
    return -(-offset // BLOB_ALIGN) * BLOB_ALIGN


@dataclass(frozen=True)
class Blob:
    """``length`` bytes of tensor ``name``'s byte view from ``start``: one run in the file,
    at ``offset``."""

    name: str
    start: int
    length: int
    offset: int


@dataclass
class RankPlan:
    """What one rank writes for one state layout; reusable while the layout is unchanged."""

    blobs: list[Blob]
    meta: dict[str, dict[str, Any]]
    signature: str
    replicated: list[list[Any]] = field(default_factory=list)  # [name, start, length, file_offset]
    shards: list[list[Any]] = field(default_factory=list)  # [name, offsets, sizes, file_offset, nbytes]

    @property
    def nbytes(self) -> int:
        """The file's size: up to the end of its last blob."""
        return self.blobs[-1].offset + self.blobs[-1].length if self.blobs else 0

    def extents(self) -> list[tuple[int, int]]:
        """Each blob's (start, end) in the file with the padding after it: together they
        tile ``[0, nbytes)``, which is how the writer hands the buffer to ``write_chunked``."""
        ends = [blob.offset for blob in self.blobs[1:]] + [self.nbytes]
        return [(blob.offset, end) for blob, end in zip(self.blobs, ends)]

    def gaps(self) -> list[tuple[int, int]]:
        """The (start, end) byte ranges between blobs: alignment padding, stored as zeros."""
        out, pos = [], 0
        for blob in self.blobs:
            if blob.offset > pos:
                out.append((pos, blob.offset))
            pos = blob.offset + blob.length
        return out


def layout_key(tensors: dict[str, torch.Tensor]) -> tuple:
    """Everything the plan depends on: names, dtypes, shapes, and DTensor placements.
    Computed at every save, in the stall: a mesh's shape is asked once per mesh, not once
    per tensor (~2.5 µs each through torch's mesh layout; the meshes stay alive, held by
    the tensors, so their ids name them for the length of the call)."""
    mesh_shapes: dict[int, tuple[int, ...]] = {}

    def mesh_shape(mesh: Any) -> tuple[int, ...]:
        shape = mesh_shapes.get(id(mesh))
        if shape is None:
            shape = mesh_shapes[id(mesh)] = tuple(mesh.shape)
        return shape

    return tuple(
        (
            name,
            t.dtype,
            tuple(t.shape),
            (tuple(t.placements), mesh_shape(t.device_mesh)) if is_dtensor(t) else None,
        )
        for name, t in tensors.items()
    )


#: blobs up to this size are copied by one ``memmove`` from the tensor's memory when it is
#: on the CPU and contiguous, not by torch's ``copy_``: what a copy of a small tensor costs
#: is the Python around it (views, slices, checks: ~8 µs a tensor, against ~2 µs so; 26,800
#: tensors of 1 kB, as a mixture of experts has, stalled training 0.2 s more for it).
#: Larger ones keep torch's copy, which splits them among its threads.
SMALL_COPY_BYTES = 256 << 10


def _small_source(t: torch.Tensor, blob: "Blob") -> int | None:
    """The address of ``blob``'s bytes in ``t``'s memory, when one ``memmove`` can copy
    them: ``t`` (its local part) on the CPU, contiguous, its storage holding all of it (a
    storage freed by ``resize_(0)`` goes to torch's path, which names it); else None."""
    local = local_tensor(t)
    if not local.is_cpu or not local.is_contiguous():  # is_cpu: 0.2 µs, device.type 0.9 µs
        return None
    nbytes = local.nbytes
    if (blob.start + blob.length > nbytes
            or local.untyped_storage().nbytes() < local.storage_offset() * local.element_size() + nbytes):
        return None
    return local.data_ptr() + blob.start


def copy_ranges(length: int) -> list[tuple[int, int]]:
    """(lo, hi) ranges that copy ``[0, length)``: a bulk that is a multiple of ``BLOB_ALIGN``
    times torch's thread count, then a short tail. Why: torch splits one copy evenly among
    its threads, and a thread whose range starts off a cache line slowed the whole copy as
    much as a misaligned destination does (4 GB in 24 tensors of odd sizes, 64-byte-aligned
    destinations: 0.39-0.42 s copied whole, 0.34 s so)."""
    grain = BLOB_ALIGN * max(1, torch.get_num_threads())
    bulk = length - length % grain
    return [(lo, hi) for lo, hi in ((0, bulk), (bulk, length)) if hi > lo]


def storage_shortfall(t: torch.Tensor) -> str | None:
    """Why ``t``'s memory cannot be read or written (None when it can): its storage holds
    fewer bytes than its shape needs, what FSDP leaves of an unsharded parameter, freed with
    ``untyped_storage().resize_(0)`` after forward. Its data pointer is then null, and a copy
    through it crashes the process or, read into, leaves it as it was."""
    local = local_tensor(t)
    have, size = local.untyped_storage().nbytes(), local.element_size()
    if local.is_contiguous() and have >= local.storage_offset() * size + local.nbytes:
        return None  # the common case, in ~1 µs: restore asks it of every target tensor
    need = (local.storage_offset() + sum((n - 1) * s for n, s in zip(local.shape, local.stride())) + 1) \
        * size if local.numel() else 0
    if have >= need:
        return None
    return (f"its storage holds {have} bytes, fewer than the {need} its shape {list(local.shape)} needs "
            "(freed with untyped_storage().resize_(0), as FSDP does to unsharded parameters?)")


def _storage_short(name: str, t: torch.Tensor) -> UnsupportedStateError | None:
    """The error naming a tensor whose storage holds less than its shape needs."""
    why = storage_shortfall(t)
    if why is None:
        return None
    return UnsupportedStateError(f"state[{name!r}]: {why}; save it while its storage is whole, or save the sharded state")


def _not_prepared(exc: Exception) -> None:
    log.warning("resilient: could not prepare the staging buffer ahead of the first save (%s: %s)",
                type(exc).__name__, exc)


def _populating(buffer: torch.Tensor) -> Iterator[None]:
    """``buffer``'s pages faulted in, ``_TOUCH_PIECE`` bytes a step, its bytes unchanged."""
    for start in range(0, buffer.numel(), _TOUCH_PIECE):
        if not populate(buffer[start:start + _TOUCH_PIECE]):
            return
        yield


class Staging:
    """One host buffer, allocated on first use and reused: memory does not grow per save.

    Pinned when the state lives on an accelerator, so the device-to-host copy runs at
    full bandwidth and asynchronously: on CUDA every copy goes on a side stream, the
    training stream waits (on the device, not the host) only for the blobs that are not
    deferred, and the deferred ones (see ``_fence``) are awaited by the next optimizer
    step. On the CPU the deferred blobs are copied by a thread of their own.
    """

    def __init__(self) -> None:
        self._memory: HostBuffer | None = None  # the buffer, unlocked on replacing or closing
        self._stream: Any = None
        self._copier = CopyThread()
        self._gaps_zeroed: tuple[RankPlan, int] | None = None  # (plan, buffer address)
        self._warming: Handover | None = None  # ``prewarm``'s work, ended before the buffer is used
        self._populating = False  # that work populates the buffer (changing no byte), or zeroes it

    @property
    def buffer(self) -> torch.Tensor | None:
        """The staging buffer now held (None before the first save or after ``close``)."""
        return None if self._memory is None else self._memory.tensor

    def prewarm(self, nbytes: int, pin: bool) -> None:
        """Allocate the buffer and touch its pages now, in a background thread, rather than
        in the stall of the first save. Why: a new buffer's first touch is the kernel's (or,
        in a VM whose free memory goes back to its host, the host's) work, page by page:
        1 GB in huge pages took 1.45-1.51 s on this project's VM, against 0.14 s for a save's
        copy of 1.64 GB into a touched one. The first save does not wait for the thread's
        work (``_join_warming``)."""
        self._join_warming()
        device = torch.cuda.current_device() if pin else None  # page-locked for this rank's device's context
        self._populating = not pin and can_populate()
        if self._populating:  # mapped here (no page touched: microseconds), populated there
            held = self._memory
            try:
                drain(self._allocating(nbytes, pin, touch=False))
            except Exception as exc:  # noqa: BLE001 - out of memory, say: the save allocates again and says so
                _not_prepared(exc)
                return
            if self._memory is held:  # large enough already, and touched by the saves that used it
                return
            assert self._memory is not None
            self._warming = Handover(_populating(self._memory.tensor))
        else:  # registered with CUDA or zeroed there, piece by piece
            self._warming = Handover(self._allocating(nbytes, pin))
        threading.Thread(target=self._warm, args=(self._warming, device), name="resilient-prewarm",
                         daemon=True).start()

    @staticmethod
    def _warm(work: Handover, device: int | None) -> None:
        # at the job's priority, unlike other background work: it is done once, in pieces of
        # a few ms, and mostly inside the kernel, where a thread at nice 19 that holds the
        # process's memory-map lock (populating, registering with CUDA) makes the training
        # thread's next allocation, and then its page faults, wait until it is scheduled
        if device is not None:
            torch.cuda.set_device(device)
        work.run()

    def _join_warming(self, wanted: bool = True) -> None:
        """End ``prewarm``'s work before the buffer is used. Waited for whole, beside busy
        cores, its thread (at nice 19 then) held the first save for 34 s (1 GB, 0.5 s after
        ``prepare``, ``bench_busy_drain``). Populating (which changes no byte) is stopped and not waited
        for: its piece in hand runs on beside the save's copy, and the pages it has not
        reached the copy faults in. Zeroing (where the kernel cannot populate) and a pinned
        buffer's registration are taken over: what is left is done here, after the piece in
        hand. Not ``wanted`` (closing): it stops after that."""
        work, self._warming = self._warming, None
        if work is None:
            return
        if self._populating:
            work.stop()
        elif not wanted:
            work.abandon()
        else:
            try:
                work.take()
            except Exception as exc:  # noqa: BLE001 - out of memory, say: the save allocates again and says so
                _not_prepared(exc)

    def _ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        self._join_warming()
        drain(self._allocating(nbytes, pin))
        assert self._memory is not None
        return self._memory.tensor

    def _allocating(self, nbytes: int, pin: bool, touch: bool = True) -> Iterator[None]:
        """A new buffer when the one held is too small or pinned otherwise: allocated, then
        (``touch``) every page zeroed, so that no save's copy pays the first touch, one piece
        of ``_TOUCH_PIECE`` bytes per step, so that a save can take over ``prewarm``'s work."""
        if self._memory is not None and self._memory.tensor.numel() >= nbytes and self._memory.pinned == pin:
            return
        self._release()  # free the old one first: never hold two
        self._memory = HostBuffer(max(nbytes, 1), pin)
        flat = self._memory.tensor
        for start in range(0, flat.numel() if touch else 0, _TOUCH_PIECE):
            yield
            flat[start:start + _TOUCH_PIECE].zero_()

    def _release(self) -> None:
        """Drop the buffer, unlocking it once no copy into it can still be running (every
        save that used it has been waited for; the side stream is drained for the rest)."""
        if self._memory is not None:
            if self._stream is not None:
                self._stream.synchronize()
            self._memory.release()
        self._memory = None

    def _zero_gaps(self, buffer: torch.Tensor, plan: RankPlan) -> None:
        """Zeros between the blobs, once per plan and buffer: the reused buffer may hold an
        earlier layout's bytes there, and the file should hold nothing but the state."""
        if self._gaps_zeroed is None or self._gaps_zeroed[0] is not plan or self._gaps_zeroed[1] != buffer.data_ptr():
            for lo, hi in plan.gaps():
                buffer[lo:hi].zero_()
            self._gaps_zeroed = (plan, buffer.data_ptr())

    @staticmethod
    def on_device(tensors: dict[str, torch.Tensor]) -> bool:
        return torch.cuda.is_available() and any(
            local_tensor(t).is_cuda for t in tensors.values()
        )

    def buffer_for(self, plan: RankPlan, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The part of the buffer that ``stage`` fills for ``plan`` (allocated, pinned for
        device state, before the copy, so the writer can be handed it first)."""
        return self._ensure(plan.nbytes, self.on_device(tensors))[: plan.nbytes]

    def stage(self, plan: RankPlan, tensors: dict[str, torch.Tensor], deferred: set[str] | frozenset[str] = frozenset(),
              on_wait: Callable[[float], None] = lambda seconds: None) -> StagingFence | None:
        """Copy the plan's blobs into ``buffer_for(plan, tensors)``; return the fence that
        tells when it is complete, or None when it already is."""
        pin = self.on_device(tensors)
        buffer = self._ensure(plan.nbytes, pin)
        self._zero_gaps(buffer, plan)
        now = [blob for blob in plan.blobs if blob.name not in deferred]
        later = [blob for blob in plan.blobs if blob.name in deferred]
        fence = StagingFence([(name, tensors[name]) for name in sorted({b.name for b in later})], on_wait,
                             self._progress(now, later, pin)) if later or pin else None
        if fence is not None and later:
            register(fence)  # before the copy starts: the writer forgets it once complete
        with torch.no_grad():
            if pin:
                self._stage_on_device(buffer, tensors, now, later, fence)
            else:
                self._copy(buffer, tensors, now, non_blocking=False)
                if later:
                    def copy_later(fence: StagingFence = fence) -> None:  # type: ignore[assignment]
                        error = None
                        try:
                            with torch.no_grad():
                                self._copy(buffer, tensors, later, non_blocking=False,
                                           on_blob=lambda place, blob: fence.progress.copied(place + 1))
                        except BaseException as exc:  # noqa: BLE001 - the fence reports it to the writer
                            error = exc
                        fence.cpu_copied(error)
                    self._copier.run(copy_later)
        return fence

    @staticmethod
    def _progress(now: list[Blob], later: list[Blob], pin: bool) -> CopyProgress:
        """Copy order: on CUDA everything goes on the side stream, ``now`` first; on the CPU
        ``now`` is final when ``stage`` returns and the copy thread does ``later``."""
        if pin:
            return CopyProgress([(blob.offset, place) for place, blob in enumerate(now + later)])
        return CopyProgress([(blob.offset, -1) for blob in now] + [(blob.offset, place) for place, blob in enumerate(later)])

    @staticmethod
    def _copy(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], blobs: list[Blob], non_blocking: bool,
              on_blob: Callable[[int, Blob], None] = lambda place, blob: None) -> None:
        """Copy ``blobs`` in order, calling ``on_blob(place, blob)`` after each one's copy
        (on CUDA: once it is enqueued)."""
        base = buffer.data_ptr()
        for place, blob in enumerate(blobs):
            small = not non_blocking and blob.length <= SMALL_COPY_BYTES
            source = _small_source(tensors[blob.name], blob) if small else None
            if source is not None:
                ctypes.memmove(base + blob.offset, source, blob.length)
                on_blob(place, blob)
                continue
            # sliced even when the blob is the whole tensor: the slice checks the bounds of
            # its storage, which copy_ does not (a storage freed by resize_(0) crashed it)
            try:
                src = byte_view(tensors[blob.name])[blob.start : blob.start + blob.length]
            except RuntimeError as exc:
                raise _storage_short(blob.name, tensors[blob.name]) or exc from exc
            dest = buffer[blob.offset : blob.offset + blob.length]
            ranges = copy_ranges(blob.length)
            if len(ranges) == 1:  # no slices to make (a few µs a tensor, in the stall)
                dest.copy_(src, non_blocking=non_blocking)
            else:
                for lo, hi in ranges:
                    dest[lo:hi].copy_(src[lo:hi], non_blocking=non_blocking)
            on_blob(place, blob)

    def _stage_on_device(self, buffer: torch.Tensor, tensors: dict[str, torch.Tensor], now: list[Blob],
                         later: list[Blob], fence: StagingFence | None) -> None:
        """Both parts on a side stream that first waits for the work that made the values;
        the training stream then waits for the first part (state that forward may write,
        such as batch-norm statistics), the optimizer step for the second."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        training = torch.cuda.current_stream()
        self._stream.wait_stream(training)
        with torch.cuda.stream(self._stream):
            for name in {blob.name for blob in now + later}:
                local = local_tensor(tensors[name])
                if local.is_cuda:
                    local.record_stream(self._stream)  # its memory is not reused before the copy ran
            assert fence is not None
            progress, since = fence.progress, [0]

            # the writer thread waits on these: blocking events put it to sleep until the copy
            # is there, where a default one spins a core (the training's, on a busy host)
            def mark(place: int, blob: Blob) -> None:  # an event every EVENT_BYTES, for the writer
                since[0] += blob.length
                if since[0] >= CopyProgress.EVENT_BYTES:
                    since[0] = 0
                    event = torch.cuda.Event(blocking=True)
                    event.record(self._stream)
                    progress.recorded(place + 1, event)

            self._copy(buffer, tensors, now, non_blocking=True, on_blob=mark)
            first = torch.cuda.Event()
            first.record(self._stream)
            self._copy(buffer, tensors, later, non_blocking=True,
                       on_blob=lambda place, blob: mark(len(now) + place, blob))
            done = torch.cuda.Event(blocking=True)
            done.record(self._stream)
            progress.recorded(len(now) + len(later), done)
        training.wait_event(first)
        fence.cuda_recorded(done)

    def close(self) -> None:
        self._join_warming(wanted=False)
        self._copier.close()
        self._release()
