"""Where each byte of the state goes: pure arithmetic, no I/O and no storage imports.

Two layouts exist on disk:

* **replicated** tensors (plain tensors under DDP: identical on every rank) are laid end to
  end in one virtual byte stream, and rank ``r`` of ``N`` writes only the slice
  ``[r*T//N, (r+1)*T//N)`` of it. The state is written once in total, the work is even
  across ranks, and each rank's save stall is only its own slice.
* **sharded** tensors (DTensor) are written shard by shard as boxes (``offsets``,
  ``sizes``) in the global tensor; replicas of a shard are written by one rank only.

Restoring into any world size is then one operation: fill a target box from the saved
boxes that intersect it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "Box",
    "StreamSlice",
    "even_split",
    "replicated_slices",
    "chunk_bounds",
    "shard_box",
    "sharding_order",
    "intersect",
    "contiguous_range",
]


@dataclass(frozen=True)
class Box:
    """A rectangular region of a tensor: ``offsets[d] <= i[d] < offsets[d] + sizes[d]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)


@dataclass(frozen=True)
class StreamSlice:
    """Part of a replicated tensor that one rank writes: bytes ``[start, start+length)``."""

    name: str
    start: int
    length: int


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """Split ``[0, total)`` into ``parts`` contiguous ranges whose lengths differ by <= 1."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return [(i * total // parts, (i + 1) * total // parts) for i in range(parts)]


def replicated_slices(
    sizes: Sequence[tuple[str, int]], rank: int, world_size: int
) -> list[StreamSlice]:
    """The slices of the replicated stream that ``rank`` writes, in stream order.

    ``sizes`` lists (name, nbytes) in the order every rank agrees on.
    """
    total = sum(n for _, n in sizes)
    lo, hi = even_split(total, world_size)[rank]
    out: list[StreamSlice] = []
    pos = 0
    for name, nbytes in sizes:
        start, end = max(pos, lo), min(pos + nbytes, hi)
        if start < end:
            out.append(StreamSlice(name, start - pos, end - start))
        pos += nbytes
        if pos >= hi:
            break
    return out


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of piece ``index`` when ``size`` is split as ``torch.chunk`` does.

    DTensor's ``Shard`` placement uses this rule: pieces of ``ceil(size/parts)``, the last
    ones shorter or empty.
    """
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, min(step, size - start)


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    shard_dims: Sequence[int | None],
    order: Sequence[int] | None = None,
) -> Box:
    """The box of the global tensor held at ``coordinate`` of a device mesh.

    ``shard_dims[i]`` is the tensor dimension that mesh dimension ``i`` shards, or None when
    mesh dimension ``i`` replicates. Several mesh dimensions may shard the same tensor
    dimension; each splits the piece left by the ones before it, in ``order`` (mesh order
    by default, as DTensor's ``Shard`` does; FSDP2 + TP shards right to left, which DTensor
    spells ``_StridedShard``, see ``sharding_order``).
    """
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for mesh_dim in order if order is not None else range(len(shard_dims)):
        tensor_dim = shard_dims[mesh_dim]
        if tensor_dim is None:
            continue
        start, length = chunk_bounds(sizes[tensor_dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offsets[tensor_dim] += start
        sizes[tensor_dim] = length
    return Box(tuple(offsets), tuple(sizes))


def sharding_order(
    mesh_shape: Sequence[int], shard_dims: Sequence[int | None], split_factors: Sequence[int]
) -> list[int] | None:
    """The order in which mesh dimensions split the tensor, or None when no consistent
    order exists.

    ``split_factors[i] > 1`` says mesh dimension ``i`` splits a piece that later mesh
    dimensions have already split into that many parts (right-to-left sharding, as FSDP2
    applies on top of tensor parallelism). Such dimensions go after every plain one, the
    rightmost first; each factor must equal the number of pieces its tensor dimension is
    in by then, else the layout is not a box per rank and is refused.
    """
    plain = [i for i, f in enumerate(split_factors) if f <= 1]
    strided = [i for i, f in enumerate(split_factors) if f > 1][::-1]
    pieces: dict[int, int] = {}
    for mesh_dim in plain + strided:
        tensor_dim = shard_dims[mesh_dim]
        if tensor_dim is None:
            continue
        before = pieces.get(tensor_dim, 1)
        if split_factors[mesh_dim] > 1:
            later = math.prod(mesh_shape[j] for j in range(mesh_dim + 1, len(shard_dims))
                              if shard_dims[j] == tensor_dim and split_factors[j] <= 1)
            if split_factors[mesh_dim] != later or before != later:
                return None
        pieces[tensor_dim] = before * mesh_shape[mesh_dim]
    return plain + strided


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they share no element."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def contiguous_range(inner: Box, shape: Sequence[int]) -> tuple[int, int] | None:
    """(first element, count) of ``inner`` in a row-major array of ``shape``, when the
    box is one contiguous run of memory; else None.

    That holds when, reading dimensions from the last, every dimension is taken whole up to
    some dimension ``k``, and every dimension before ``k`` is a single index. It lets a
    reshard read just the bytes it needs instead of a whole saved shard.
    """
    ndim = len(shape)
    k = ndim
    while k > 0 and inner.offsets[k - 1] == 0 and inner.sizes[k - 1] == shape[k - 1]:
        k -= 1
    # dims [k, ndim) are whole; dim k-1 (if any) is partial; dims before it must be single.
    if any(inner.sizes[d] != 1 for d in range(max(k - 1, 0))):
        return None
    start = 0
    for d in range(ndim):
        start = start * shape[d] + inner.offsets[d]
    return start, inner.numel
