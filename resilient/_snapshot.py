"""Planning what this rank writes, and the snapshot: the only part of a save that stalls.

The plan decides, from the flattened state, which byte ranges of which tensors this rank
owns (see ``_layout``). The snapshot copies exactly those ranges into one reusable host
buffer, in file order, each starting on a ``BLOB_ALIGN`` boundary (the buffer is the
rank's data file); the background writer then works from the buffer while training
mutates the tensors.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._chunkio import crc32
from ._errors import UnsupportedStateError
from ._fence import CopyProgress, CopyThread, StagingFence, register
from ._format import dtype_itemsize, dtype_name
from ._hostmem import HostBuffer
from ._layout import Box, replicated_slices, shard_box, sharding_order

__all__ = ["Blob", "RankPlan", "describe", "gather_descriptions", "plan_rank", "Staging", "is_dtensor",
           "dtensor_box", "byte_view", "bitwise", "local_tensor", "storage_shortfall"]


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
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnsupportedStateError(f"state[{name!r}]: this rank is not part of the tensor's mesh")
    placements = tuple(t.placements)
    key = (tuple(t.shape), tuple(mesh.shape), tuple(coord), placements)
    try:
        box = _placed_box(*key)
    except TypeError:  # a placement that cannot be hashed: worked out each time
        box = _placed_box.__wrapped__(*key)
    if isinstance(box, str):
        raise UnsupportedStateError(f"state[{name!r}]: {box}")
    local_shape = tuple(local_tensor(t).shape)
    if local_shape != box.sizes:
        raise UnsupportedStateError(
            f"state[{name!r}]: local shard has shape {list(local_shape)} but placements "
            f"{list(placements)} imply {list(box.sizes)}"
        )
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


_FINGERPRINT_WHOLE = 1 << 20  # bytes hashed whole; larger tensors are sampled
_FINGERPRINT_SAMPLE = 1 << 16


def fingerprint(t: torch.Tensor) -> int:
    """A CRC of a plain tensor's bytes (an even sample of 64 KiB of them above 1 MiB).

    Run once per layout, to catch state that differs by rank where it would be saved once
    as replicated: a per-rank generator or counter differs in most bytes, so a sample
    finds it without reading gigabytes of a replicated model.
    """
    flat = byte_view(t)
    if flat.numel() > _FINGERPRINT_WHOLE:
        stride = flat.numel() // _FINGERPRINT_SAMPLE
        flat = flat[: stride * _FINGERPRINT_SAMPLE : stride]
    return crc32(flat.cpu().numpy().tobytes())


def find_aliases(tensors: dict[str, torch.Tensor], skip: set[str]) -> dict[str, str]:
    """name -> the first name of the same memory (tied weights: an embedding and the output
    layer share one tensor). Such names are written once and share the saved pieces."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        if name in skip:
            continue
        local = local_tensor(t)
        if local.numel() == 0:
            continue
        placement = (tuple(t.placements), id(t.device_mesh)) if is_dtensor(t) else None
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
               local.stride(), local.dtype, local.device, tuple(t.shape), placement)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def describe(tensors: dict[str, torch.Tensor], per_rank: set[str], *, alone: bool = False) -> dict[str, list[list[Any]]]:
    """What this rank holds, for every rank to plan from: its boxes of sharded tensors (its
    per-rank tensors are a whole box only it holds), each with the tensor's dtype and global
    shape, and each plain one's dtype, shape and fingerprint (not computed when the rank is
    ``alone``: nothing to compare with)."""
    sharded: list[list[Any]] = []
    plain: list[list[Any]] = []
    aliases = find_aliases(tensors, per_rank)
    for name, t in tensors.items():
        if name in aliases:
            continue
        if name in per_rank:
            sharded.append([name, [0] * t.dim(), list(t.shape), dtype_name(t.dtype), list(t.shape)])
        elif is_dtensor(t):
            box = dtensor_box(t, name)
            sharded.append([name, list(box.offsets), list(box.sizes), dtype_name(t.dtype), list(t.shape)])
        else:
            plain.append([name, 0 if alone else fingerprint(t), dtype_name(t.dtype), list(t.shape)])
    return {"sharded": sharded, "plain": plain, "aliases": sorted(aliases.items())}


def gather_descriptions(all_gather: Callable[[object], list[Any]], rank: int,
                        description: dict[str, list[list[Any]]]) -> list[dict[str, list[list[Any]]]]:
    """Every rank's ``describe``, in two gathers: first each rank's boxes with a digest of
    its plain tensors, then each distinct plain list once, from the first rank holding it.
    Why: under data parallelism every rank's plain list is the same (names, dtypes, shapes,
    fingerprints), and gathering it from every rank sent world_size copies to every rank:
    26,800 tensors of a mixture of experts make a 1.5 MB list, 1.5 GB gathered on each of
    1,024 ranks when the layout is planned."""
    plain = description["plain"]
    digest = hashlib.sha256(json.dumps(plain).encode()).hexdigest()
    heads = all_gather({"sharded": description["sharded"], "aliases": description["aliases"], "plain": digest})
    first: dict[str, int] = {}
    for r, head in enumerate(heads):
        first.setdefault(head["plain"], r)
    lists = all_gather(plain if first[digest] == rank else None)
    by_digest = {head["plain"]: lists[r] for r, head in enumerate(heads) if first[head["plain"]] == r}
    return [{**head, "plain": by_digest[head["plain"]]} for head in heads]


def _refuse_rank_dependent(descriptions: list[dict[str, list[list[Any]]]]) -> None:
    values: dict[str, set[int]] = {}
    for plain, _, _ in _plain_lists(descriptions):
        for name, fp, _, _ in plain:
            values.setdefault(name, set()).add(fp)
    differ = [name for name, fps in values.items() if len(fps) > 1]
    if differ:
        raise UnsupportedStateError(
            f"state{differ[:5]!r}: plain tensors that differ across ranks ({len(differ)} in all). "
            "A plain tensor is saved once, as state every rank shares, so every rank would get "
            "one rank's copy back. Keep state that differs by rank in an entry wrapped in "
            "resilient.PerRank(...), or make it a DTensor; key an optimizer's state by parameter name "
            "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) when ranks hold different "
            "parameters (pipeline stages)"
        )


def _assign_writers(descriptions: list[dict[str, list[list[Any]]]]) -> dict[tuple, int]:
    """(name, offsets, sizes) -> the one rank that writes that box.

    Ranks holding the same box (HSDP replicas, FSDP2 meshes repeated across TP ranks) are
    found from what every rank holds, not from one tensor's mesh, so a box is written once
    however the meshes are nested. A box one rank holds is that rank's; the others, biggest
    first, each go to its least-loaded holder. Why not all of them in size order, as before:
    under FSDP2 every box has one holder, and sorting every rank's boxes took 0.7 s of 2.9 s
    at 16 ranks x 26,800 tensors, every rank, for nothing to choose.
    """
    holders: dict[tuple, list[int]] = {}
    dtypes: dict[tuple, str] = {}
    for rank, d in enumerate(descriptions):
        for name, offsets, sizes, dtype, _ in d["sharded"]:
            key = (name, tuple(offsets), tuple(sizes))
            held = holders.get(key)
            if held is None:
                holders[key] = [rank]
                dtypes[key] = dtype
            else:
                held.append(rank)

    def nbytes(key: tuple) -> int:
        return math.prod(key[2]) * dtype_itemsize(dtypes[key])

    load = [0] * len(descriptions)
    writers: dict[tuple, int] = {}
    shared = []
    for key, held in holders.items():
        if len(held) == 1:
            writers[key] = held[0]
            load[held[0]] += nbytes(key)
        else:
            shared.append(key)
    for key in sorted(shared, key=lambda k: (-nbytes(k), k)):
        writer = min(holders[key], key=lambda r: (load[r], r))
        writers[key] = writer
        load[writer] += nbytes(key)
    return writers


def _plain_lists(descriptions: list[dict[str, list[list[Any]]]]) -> list[tuple[list[list[Any]], int, int]]:
    """Each distinct list of plain tensors (one object, as ``gather_descriptions`` gives
    ranks that hold the same), with the first rank holding it and how many do. Why: under
    data parallelism every rank's list is the same, and walking it once per rank was
    world_size x tensors steps for every check (27 million at 1,024 ranks x 26,800)."""
    seen: dict[int, list[Any]] = {}
    for rank, d in enumerate(descriptions):
        entry = seen.setdefault(id(d["plain"]), [d["plain"], rank, 0])
        entry[2] += 1
    return [(plain, rank, count) for plain, rank, count in seen.values()]


def _held_by_all(descriptions: list[dict[str, list[list[Any]]]]) -> set[str]:
    """The plain tensors every rank holds (aliases aside): replicated state."""
    counts: dict[str, int] = {}
    for plain, _, holders in _plain_lists(descriptions):
        for name, _, _, _ in plain:
            counts[name] = counts.get(name, 0) + holders
    return {name for name, count in counts.items() if count == len(descriptions)}


def _refuse_one_name_for_two_tensors(descriptions: list[dict[str, list[list[Any]]]]) -> None:
    """Raise, on every rank alike, when ranks hold tensors of one name with different
    dtypes, global shapes, or one plain and one a DTensor: a checkpoint name is one tensor.
    The usual cause is an optimizer under pipeline parallelism, whose state each stage keys
    0, 1, 2, ... for its own parameters."""
    seen: dict[str, tuple[bool, str, list[int], int]] = {}  # name -> (sharded, dtype, shape, first rank)
    for plain, rank, _ in _plain_lists(descriptions):
        for name, _, dtype, shape in plain:
            first = seen.setdefault(name, (False, dtype, shape, rank))
            if first[0] or first[1] != dtype or first[2] != shape:
                _two_tensors(name, first, (False, dtype, shape, rank))
    for rank, d in enumerate(descriptions):
        for name, _, _, dtype, shape in d["sharded"]:
            first = seen.setdefault(name, (True, dtype, shape, rank))
            if not first[0] or first[1] != dtype or first[2] != shape:
                _two_tensors(name, first, (True, dtype, shape, rank))


def _two_tensors(name: str, *held: tuple[bool, str, list[int], int]) -> None:
    what = [f"rank {rank} {'a DTensor' if sharded else 'a tensor'} of {dtype} {list(shape)}"
            for sharded, dtype, shape, rank in held]
    raise UnsupportedStateError(
        f"state[{name!r}] is not one tensor on every rank that holds it: {what[0]}, {what[1]}. Keep state "
        "that differs by rank in resilient.PerRank(...); key an optimizer's state by parameter name "
        "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) when stages hold different parameters")


def _global_meta(tensors: dict[str, torch.Tensor], per_rank: set[str], descriptions: list[dict[str, list[list[Any]]]],
                 rank: int, everywhere: set[str]) -> dict[str, dict[str, Any]]:
    """Every rank's tensors' dtype, shape and layout: the same on every rank (this rank's
    first, in its order, then the others' it lacks)."""
    meta: dict[str, dict[str, Any]] = {}
    aliases = dict(descriptions[rank]["aliases"])

    def layout(name: str, dtensor: bool) -> str:
        return "sharded" if dtensor or name not in everywhere else "replicated"

    for name, t in tensors.items():
        if name in per_rank:
            continue
        meta[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        if name in aliases:
            meta[name]["same_as"] = aliases[name]
        meta[name]["layout"] = layout(aliases.get(name, name), is_dtensor(t))
    for plain, _, _ in _plain_lists(descriptions):  # what only other ranks hold
        for name, _, dtype, shape in plain:
            meta.setdefault(name, {"dtype": dtype, "shape": shape, "layout": layout(name, False)})
    for d in descriptions:  # every rank's per-rank tensors, and DTensors only other ranks hold
        for name, _, _, dtype, shape in d["sharded"]:
            meta.setdefault(name, {"dtype": dtype, "shape": shape, "layout": "sharded"})
    for d in descriptions:
        for name, source in d["aliases"]:
            if name not in meta and source in meta:
                meta[name] = {**meta[source], "same_as": source}
    return meta


def plan_rank(
    tensors: dict[str, torch.Tensor],
    per_rank: set[str],
    descriptions: list[dict[str, list[list[Any]]]],
    rank: int,
    world_size: int,
) -> RankPlan:
    """This rank's part of a save, from every rank's ``describe`` (the same list on all
    ranks, so every rank computes the same global decisions).

    A plain tensor every rank holds is replicated state: its bytes are split over all
    ranks. One that only some ranks hold (a pipeline stage's layers, the same names on the
    stage's data-parallel replicas) is written whole, once, by one of its holders, as a
    sharded tensor of one box. The manifest's tensors are every rank's, so every rank
    computes the same ``meta``, whatever part of it this rank holds."""
    _refuse_one_name_for_two_tensors(descriptions)
    _refuse_rank_dependent(descriptions)
    everywhere = _held_by_all(descriptions)
    whole = {id(plain): [[name, [0] * len(shape), shape, dtype, shape]
                         for name, _, dtype, shape in plain if name not in everywhere]
             for plain, _, _ in _plain_lists(descriptions)}  # a box each, for what only some ranks hold
    boxes = [{"sharded": d["sharded"] + whole[id(d["plain"])]} for d in descriptions]
    writers = _assign_writers(boxes)
    meta = _global_meta(tensors, per_rank, descriptions, rank, everywhere)
    replicated_sizes = [(name, math.prod(shape) * dtype_itemsize(dtype))
                        for name, _, dtype, shape in descriptions[0]["plain"] if name in everywhere]
    blobs: list[Blob] = []
    shards: list[list[Any]] = []
    offset = 0
    for name, offsets, sizes, _, _ in boxes[rank]["sharded"]:
        box = Box(tuple(offsets), tuple(sizes))
        if writers[(name, box.offsets, box.sizes)] == rank and box.numel:
            nbytes = box.numel * tensors[name].element_size()
            offset = align_up(offset)
            blobs.append(Blob(name, 0, nbytes, offset))
            shards.append([name, offsets, sizes, offset, nbytes])
            offset += nbytes
    replicated: list[list[Any]] = []
    for piece in replicated_slices(replicated_sizes, rank, world_size):
        offset = align_up(offset)
        blobs.append(Blob(piece.name, piece.start, piece.length, offset))
        replicated.append([piece.name, piece.start, piece.length, offset])
        offset += piece.length
    signature = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    return RankPlan(blobs, meta, signature, replicated, shards)


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

    @property
    def buffer(self) -> torch.Tensor | None:
        """The staging buffer now held (None before the first save or after ``close``)."""
        return None if self._memory is None else self._memory.tensor

    def _ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        if self._memory is None or self._memory.tensor.numel() < nbytes or self._memory.pinned != pin:
            self._release()  # free the old one first: never hold two
            self._memory = HostBuffer(max(nbytes, 1), pin)
            self._memory.tensor.zero_()  # touch every page now, not during the copy
        return self._memory.tensor

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
        self._copier.close()
        self._release()
