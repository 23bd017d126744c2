"""Planning what this rank writes, and the snapshot: the only part of a save that stalls.

The plan decides, from the flattened state, which byte ranges of which tensors this rank
owns (see ``_layout``). The snapshot copies exactly those ranges into one reusable host
buffer, back to back, which is also the order they take in the rank's data file; the
background writer then works from the buffer while training mutates the tensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ._errors import UnsupportedStateError
from ._format import dtype_name
from ._layout import Box, replica_writer, replicated_slices, shard_box, sharding_order

try:  # DTensor is optional: older or stripped torch builds may lack it.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["Blob", "RankPlan", "plan_rank", "Staging", "is_dtensor", "dtensor_box", "byte_view"]


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's (local) elements as a flat uint8 tensor, without a copy when possible."""
    local = t.to_local() if is_dtensor(t) else t
    local = local.detach()
    if not local.is_contiguous():
        local = local.contiguous()
    return local.reshape(-1).view(torch.uint8)


def dtensor_box(t: torch.Tensor, name: str) -> tuple[Box, int, int]:
    """(box this rank holds, its index among replicas of that box, number of replicas)."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnsupportedStateError(f"state[{name!r}]: this rank is not part of the tensor's mesh")
    shard_dims: list[int | None] = []
    split_factors: list[int] = []
    replica_index, replicas = 0, 1
    for mesh_dim, placement in enumerate(t.placements):
        factor = int(getattr(placement, "split_factor", 1))  # _StridedShard: FSDP2 over TP
        if placement.is_shard() or (factor > 1 and hasattr(placement, "dim")):
            shard_dims.append(placement.dim)
        elif placement.is_replicate():
            shard_dims.append(None)
            replica_index = replica_index * mesh.size(mesh_dim) + coord[mesh_dim]
            replicas *= mesh.size(mesh_dim)
        else:
            raise UnsupportedStateError(
                f"state[{name!r}]: placement {placement} cannot be checkpointed; "
                "redistribute partial tensors to Shard or Replicate first"
            )
        split_factors.append(factor)
    order = sharding_order(tuple(mesh.shape), shard_dims, split_factors)
    if order is None:
        raise UnsupportedStateError(
            f"state[{name!r}]: placements {list(t.placements)} on a mesh of shape {list(mesh.shape)} "
            "do not give each rank one box of the tensor"
        )
    box = shard_box(tuple(t.shape), tuple(mesh.shape), coord, shard_dims, order)
    local_shape = tuple(t.to_local().shape)
    if local_shape != box.sizes:
        raise UnsupportedStateError(
            f"state[{name!r}]: local shard has shape {list(local_shape)} but placements "
            f"{list(t.placements)} imply {list(box.sizes)}"
        )
    return box, replica_index, replicas


@dataclass(frozen=True)
class Blob:
    """``length`` bytes of tensor ``name``'s byte view from ``start``: one run in the file."""

    name: str
    start: int
    length: int


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
        return sum(b.length for b in self.blobs)


def layout_key(tensors: dict[str, torch.Tensor]) -> tuple:
    """Everything the plan depends on: names, dtypes, shapes, and DTensor placements."""
    return tuple(
        (
            name,
            t.dtype,
            tuple(t.shape),
            (tuple(t.placements), tuple(t.device_mesh.shape)) if is_dtensor(t) else None,
        )
        for name, t in tensors.items()
    )


def plan_rank(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> RankPlan:
    meta: dict[str, dict[str, Any]] = {}
    replicated_sizes: list[tuple[str, int]] = []
    blobs: list[Blob] = []
    shards: list[list[Any]] = []
    offset = 0
    sharded_ordinal = 0
    for name, t in tensors.items():
        meta[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        if is_dtensor(t):
            meta[name]["layout"] = "sharded"
            box, replica_index, replicas = dtensor_box(t, name)
            if replica_index == replica_writer(sharded_ordinal, replicas) and box.numel:
                nbytes = box.numel * t.element_size()
                blobs.append(Blob(name, 0, nbytes))
                shards.append([name, list(box.offsets), list(box.sizes), offset, nbytes])
                offset += nbytes
            sharded_ordinal += 1
        else:
            meta[name]["layout"] = "replicated"
            replicated_sizes.append((name, t.numel() * t.element_size()))
    replicated: list[list[Any]] = []
    for piece in replicated_slices(replicated_sizes, rank, world_size):
        blobs.append(Blob(piece.name, piece.start, piece.length))
        replicated.append([piece.name, piece.start, piece.length, offset])
        offset += piece.length
    signature = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    return RankPlan(blobs, meta, signature, replicated, shards)


class Staging:
    """One host buffer, allocated on first use and reused: memory does not grow per save.

    Pinned when the state lives on an accelerator, so the device-to-host copy runs at
    full bandwidth and asynchronously.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def _ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.is_pinned() != pin:
            self.buffer = None  # free the old one first: never hold two
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self.buffer.zero_()  # touch every page now, not during the copy
        return self.buffer

    def stage(self, plan: RankPlan, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Copy the plan's blobs into the buffer; returns the filled prefix."""
        pin = torch.cuda.is_available() and any(
            (t.to_local() if is_dtensor(t) else t).is_cuda for t in tensors.values()
        )
        buffer = self._ensure(plan.nbytes, pin)
        pos = 0
        with torch.no_grad():
            for blob in plan.blobs:
                src = byte_view(tensors[blob.name])[blob.start : blob.start + blob.length]
                buffer[pos : pos + blob.length].copy_(src, non_blocking=pin)
                pos += blob.length
        if pin:
            torch.cuda.synchronize()
        return buffer[:pos]
