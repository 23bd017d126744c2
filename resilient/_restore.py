"""Loading one checkpoint into live state, at any world size.

Two phases, so that bad input changes nothing:

1. **check** (no data read): every entry asked for exists, every tensor the target holds
   is in the checkpoint with the same shape and dtype; errors name the key.
2. **load**: each target tensor is a box of the global tensor (the whole of it for plain
   tensors, the local shard for a DTensor); it is filled from every saved box that
   intersects it, reading straight into the tensor's memory when the boxes coincide and
   only the needed byte range when the overlap is contiguous. Every chunk read is verified.
   Then ``load_state_dict`` is called and plain values replaced.

A checksum failure in phase 2 raises ``CheckpointCorruptError``; the caller then moves to
an older checkpoint, which overwrites everything phase 2 touched.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor
from typing import Any, Callable, MutableMapping

import torch

from ._chunkio import ChunkedFile
from ._errors import CheckpointCorruptError, StateError
from ._format import dtype_from_name, dtype_name
from ._layout import Box, contiguous_range, intersect
from ._snapshot import dtensor_box, is_dtensor
from ._tree import build_value, flatten_target, is_stateful

__all__ = ["load_checkpoint"]

Task = Callable[[], None]


class _Reader:
    """Turns 'these bytes of this saved box' into chunk read tasks across files."""

    def __init__(self, step_dir: str, manifest: dict[str, Any]) -> None:
        self.files = {
            name: ChunkedFile(os.path.join(step_dir, name), record)
            for name, record in manifest["files"].items()
        }

    def box_bytes(self, pieces: list[list[Any]], start: int, dest: memoryview) -> list[Task]:
        """Tasks filling ``dest`` with bytes ``[start, start+len(dest))`` of a saved box."""
        tasks: list[Task] = []
        pos, end, filled = 0, start + len(dest), 0
        for fname, offset, nbytes in pieces:
            lo, hi = max(start, pos), min(end, pos + nbytes)
            if lo < hi:
                tasks += self.files[fname].read_tasks(offset + lo - pos, dest[filled : filled + hi - lo])
                filled += hi - lo
            pos += nbytes
        if filled != len(dest):
            raise CheckpointCorruptError(f"saved pieces hold {filled} of {len(dest)} needed bytes")
        return tasks

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _fill(
    reader: _Reader, name: str, meta: dict[str, Any], dest: torch.Tensor, target: Box
) -> tuple[list[Task], list[Task]]:
    """(read tasks, then copy tasks) that fill ``dest`` (a CPU contiguous tensor) = box
    ``target`` of saved tensor ``name``."""
    reads: list[Task] = []
    copies: list[Task] = []
    elem = dest.element_size()
    covered = 0
    for saved in meta["boxes"]:
        sbox = Box(tuple(saved["offsets"]), tuple(saved["sizes"]))
        inter = intersect(sbox, target)
        if inter is None:
            continue
        covered += inter.numel
        if sbox == target:
            reads += reader.box_bytes(saved["pieces"], 0, _as_bytes(dest))
            continue
        run = contiguous_range(inter.relative_to(sbox), sbox.sizes)
        if run is not None:
            tmp = torch.empty(inter.sizes, dtype=dest.dtype)
            reads += reader.box_bytes(saved["pieces"], run[0] * elem, _as_bytes(tmp))
        else:  # read the whole saved box, keep the overlap
            whole = torch.empty(sbox.sizes, dtype=dest.dtype)
            reads += reader.box_bytes(saved["pieces"], 0, _as_bytes(whole))
            rel = inter.relative_to(sbox)
            tmp = whole[tuple(slice(o, o + s) for o, s in zip(rel.offsets, rel.sizes))]
        rel_t = inter.relative_to(target)
        region = tuple(slice(o, o + s) for o, s in zip(rel_t.offsets, rel_t.sizes))
        copies.append(lambda region=region, tmp=tmp: dest[region].copy_(tmp))
    if covered != target.numel:
        raise CheckpointCorruptError(
            f"tensor {name!r}: saved shards cover {covered} of the {target.numel} elements needed"
        )
    return reads, copies


def _check_tensor(name: str, meta: dict[str, Any] | None, target: torch.Tensor, step: int) -> None:
    if meta is None:
        raise StateError(f"key {name!r} is not in the checkpoint of step {step}")
    if list(target.shape) != meta["shape"]:
        raise StateError(
            f"key {name!r}: shape mismatch: the state expects {list(target.shape)}, "
            f"the checkpoint of step {step} has {meta['shape']}"
        )
    if dtype_name(target.dtype) != meta["dtype"]:
        raise StateError(
            f"key {name!r}: dtype mismatch: the state expects {dtype_name(target.dtype)}, "
            f"the checkpoint of step {step} has {meta['dtype']}"
        )


def _tensor_names(node: dict[str, Any]) -> list[str]:
    names: list[str] = []
    build_value(node, lambda n: names.append(n))  # type: ignore[func-returns-value]
    return names


def load_checkpoint(
    state: MutableMapping[str, Any],
    manifest: dict[str, Any],
    step_dir: str,
    rank: int,
    pool: Executor,
) -> dict[str, Any] | None:
    """Load ``manifest``'s checkpoint into ``state``; return this rank's saved RNG state."""
    step = manifest["step"]
    record = manifest["ranks"][rank if rank < manifest["world_size"] else 0]
    saved_entries = dict(record["tree"]["items"])
    tensors_meta = manifest["tensors"]

    # -- phase 1: check, and decide where every tensor goes ---------------------------------
    # name -> (live tensor or None, its local part, CPU buffer read into, box it covers)
    destinations: dict[str, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, Box]] = {}
    for key, target in state.items():
        node = saved_entries.get(key)
        if node is None:
            raise StateError(
                f"key {key!r} is not in the checkpoint of step {step} "
                f"(it holds: {', '.join(map(repr, saved_entries)) or 'nothing'})"
            )
        # Tensors the target already holds are filled in place (so DTensors keep their
        # sharding); everything else is built fresh from the checkpoint.
        targets = flatten_target(target, key)
        saved_names = set(_tensor_names(node))
        for name, t in targets.items():
            _check_tensor(name, tensors_meta.get(name) if name in saved_names else None, t, step)
        if isinstance(target, torch.nn.Module):
            extra = sorted(saved_names - set(targets))
            if extra:
                raise StateError(f"key {key!r}: the checkpoint of step {step} has entries the module lacks: {extra[:5]}")
        for name in saved_names:
            meta = tensors_meta[name]
            t = targets.get(name)
            if t is None:
                dest = torch.empty(meta["shape"], dtype=dtype_from_name(meta["dtype"]))
                destinations[name] = (None, dest, dest, Box((0,) * dest.dim(), tuple(dest.shape)))
                continue
            if is_dtensor(t):
                box, _, _ = dtensor_box(t, name)
                local = t.to_local()
            else:
                box, local = Box((0,) * t.dim(), tuple(t.shape)), t
            direct = local.device.type == "cpu" and local.is_contiguous()
            cpu = local.detach() if direct else torch.empty(tuple(local.shape), dtype=local.dtype)
            destinations[name] = (t, local, cpu, box)

    # -- phase 2: read ------------------------------------------------------------------------
    reader = _Reader(step_dir, manifest)
    try:
        reads: list[Task] = []
        copies: list[Task] = []
        for name, (_, _, cpu, box) in destinations.items():
            r, c = _fill(reader, name, tensors_meta[name], cpu, box)
            reads += r
            copies += c
        for future in [pool.submit(task) for task in reads]:
            future.result()
    finally:
        reader.close()
    with torch.no_grad():
        for task in copies:
            task()
        for _, local, cpu, _ in destinations.values():
            if local.data_ptr() != cpu.data_ptr():
                local.copy_(cpu)

    # -- apply --------------------------------------------------------------------------------
    def tensor_for(name: str) -> torch.Tensor:
        live, _, cpu, _ = destinations[name]
        return cpu if live is None else live

    for key, target in list(state.items()):
        node = saved_entries[key]
        if node["t"] in ("obj", "dict") and is_stateful(target):
            target.load_state_dict(build_value(node, tensor_for))
        else:  # tensors loaded in place come back as the same objects
            state[key] = build_value(node, tensor_for)
    return record.get("rng")

