"""Loading one checkpoint into live state, at any world size.

Two phases, so that bad input changes nothing:

1. **check** (no data read): every entry asked for exists, every tensor the target holds
   is in the checkpoint with the same shape and dtype (or a floating-point dtype converted
   into the target's, as ``load_state_dict`` does, named in a warning); errors name the key.
2. **load**: each target tensor is a box of the global tensor (the whole of it for plain
   tensors, the local shard for a DTensor); it is filled from every saved box that
   intersects it, reading straight into the tensor's memory when the boxes coincide and
   only the needed byte range when the overlap is contiguous. Every chunk read is verified.
   Then ``load_state_dict`` is called and plain values put into the state's own dicts and lists.

A checksum failure in phase 2 raises ``CheckpointCorruptError``; the caller then moves to
an older checkpoint, which overwrites everything phase 2 touched.

**Shared reads.** Under several ranks, a tensor every rank needs whole (replicated state,
as under DDP) is not read from storage by every rank: its bytes are split at chunk
boundaries, each rank reads and verifies its part, and the parts are shared. Storage then
serves each byte once per node, not once per rank (8 GPUs per node: 8x less). The ranks
agree on what is shared (one small all-gather), then share one of two ways:

* **through the page cache** (host tensors, when the shared bytes fit in half of every
  rank's available memory): the parts are split over the ranks that see the same step directory (one node);
  each reads and verifies its own part, and the others' a few reads behind their owners
  (``PEER_LAG_TASKS``), which the kernel by then serves from memory. One copy per byte, no
  network stack, no barrier, one small vote; ranks on other nodes read their own copy.
* **by broadcast** otherwise (and for GPU tensors, which NCCL moves faster): the parts are split over every rank and each is broadcast as
  soon as its reader has it, so sharing overlaps reading.

Either way, a rank whose read fails still takes part in every collective, and an
all-reduce after each phase tells every rank that a read failed: nobody waits for a
collective that will not come, and every rank falls back together.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import socket
import threading
import warnings
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator, MutableMapping
from urllib.parse import unquote

import torch
from torch.nn.parameter import is_lazy

from ._box_runs import SavedBoxes
from ._chunkio import ChunkedFile, ChunkRun, batched
from ._coord import Coordinator
from ._errors import CheckpointCorruptError, ResilientError, StateError
from ._format import dtype_from_name, dtype_name
from ._kinds import NOT_A_KIND, into_own_kind
from ._gc_pause import gc_paused
from ._layout import Box, contiguous_range, intersect
from ._snapshot import bitwise, dtensor_box, is_dtensor, local_tensor, storage_shortfall
from ._per_rank import PerRank, Reshard
from ._rng import decode_rng
from ._saved_trees import partitioned_entries
from ._subclasses import blocks_template
from ._tree import (build_value, child_path, flatten_target, is_stateful, per_rank_path, tensor_names,
                    without_plain_bytes, wrapped_parts)
from ._wrappers import COMPILED_SEGMENT, adapter_for, load_module_state, state_holder
from ._zero import others_state, zero_class

__all__ = ["load_checkpoint", "OtherRankFailed"]

log = logging.getLogger("resilient")

Task = Callable[[], None]

#: a tensor smaller than this is read by every rank that needs it: a broadcast costs more
SHARE_MIN_BYTES = 1 << 20
#: ``auto`` (page cache when the shared bytes fit in half the available memory, else
#: broadcast), ``page-cache`` or ``broadcast``: how ranks share what they read (see above)
SHARING_ENV = "RESILIENT_RESTORE_SHARING"


class OtherRankFailed(Exception):
    """Another rank could not plan or read its part of this checkpoint; this rank stops too
    (its own copy is not shown to be bad)."""


class _Reader:
    """Turns 'these bytes of this saved box' into chunk read tasks across files."""

    def __init__(self, step_dir: str, manifest: dict[str, Any]) -> None:
        self.step_dir = step_dir
        self.records: dict[str, Any] = manifest["files"]
        self.files: dict[str, ChunkedFile] = {}
        self._lock = threading.Lock()

    def file(self, name: str) -> ChunkedFile:
        """``name``, its size checked against the manifest's on first use. Why not every file
        up front: a rank of a job of thousands reads a few of their files; checking all of
        them was a stat per file per rank, and each file's chunk table turned into lists."""
        opened = self.files.get(name)  # opened already: no lock, once per tensor read
        if opened is not None:
            return opened
        with self._lock:
            opened = self.files.get(name)
            if opened is None:
                path, record = os.path.join(self.step_dir, name), self.records[name]
                size = os.path.getsize(path)
                if size != record["bytes"]:
                    raise CheckpointCorruptError(f"{path}: {size} bytes, the manifest says {record['bytes']}")
                opened = self.files[name] = ChunkedFile(path, record)
            return opened

    def box_bytes(self, pieces: list[list[Any]], start: int, dest: memoryview) -> list[Task]:
        """Tasks filling ``dest`` with bytes ``[start, start+len(dest))`` of a saved box."""
        tasks: list[Task] = []
        pos, end, filled = 0, start + len(dest), 0
        for fname, offset, nbytes in pieces:
            lo, hi = max(start, pos), min(end, pos + nbytes)
            if lo < hi:
                tasks += self.file(fname).read_tasks(offset + lo - pos, dest[filled : filled + hi - lo])
                filled += hi - lo
            pos += nbytes
        if filled != len(dest):
            raise CheckpointCorruptError(f"saved pieces hold {filled} of {len(dest)} needed bytes")
        return tasks

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor with whole storage (what ``_check_tensor`` lets
    through, or a new one), writable; the view holds ``t``. Why not ``memoryview(t.reshape(-1)
    .view(torch.uint8).numpy())``: three torch calls a tensor, ~4 µs against ~1.5 µs, 0.07 s
    of a restore of 26,800 small tensors."""
    memory = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    memory.tensor = t  # alive as long as the view is
    return memoryview(memory).cast("B")


def _as_bytes_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor on its device (a view)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _fill(
    reader: _Reader, name: str, meta: dict[str, Any], dest: torch.Tensor, target: Box
) -> tuple[list[Task], list[Task]]:
    """(read tasks, then copy tasks) that fill ``dest`` (a CPU contiguous tensor) = box
    ``target`` of saved tensor ``name``."""
    boxes = meta["boxes"]
    if len(boxes) == 1:  # saved whole by one writer, restored whole: most tensors of a DDP job
        only = boxes[0]
        if tuple(only["offsets"]) == target.offsets and tuple(only["sizes"]) == target.sizes:
            return reader.box_bytes(only["pieces"], 0, _as_bytes(dest)), []
    reads: list[Task] = []
    copies: list[Task] = []
    elem = dest.element_size()
    covered = 0
    for saved in _along_first_dim(meta["boxes"], target):
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
            tmp = torch.empty(inter.sizes, dtype=dest.dtype, device="cpu")
            reads += reader.box_bytes(saved["pieces"], run[0] * elem, _as_bytes(tmp))
        else:  # read the whole saved box, keep the overlap
            whole = torch.empty(sbox.sizes, dtype=dest.dtype, device="cpu")
            reads += reader.box_bytes(saved["pieces"], 0, _as_bytes(whole))
            rel = inter.relative_to(sbox)
            tmp = whole[tuple(slice(o, o + s) for o, s in zip(rel.offsets, rel.sizes))]
        rel_t = inter.relative_to(target)
        region = tuple(slice(o, o + s) for o, s in zip(rel_t.offsets, rel_t.sizes))
        copies.append(lambda region=region, tmp=tmp: bitwise(dest[region]).copy_(bitwise(tmp)))
    if covered != target.numel:
        raise CheckpointCorruptError(
            f"tensor {name!r}: saved shards cover {covered} of the {target.numel} elements needed"
        )
    return reads, copies


def _along_first_dim(boxes: SavedBoxes, target: Box) -> list[dict[str, Any]]:
    """The saved boxes whose first-dimension range meets ``target``'s: the only ones that
    can intersect it. Why: a tensor saved by N FSDP ranks has N boxes; a rank comparing its
    target with each, for each of its tensors, spent 0.27 s at 1,024 ranks x 300 tensors
    building and intersecting boxes. Runs of boxes answer by division (``SavedBoxes``)."""
    if not target.sizes:
        return list(boxes)
    return boxes.meeting_first_dim(target.offsets[0], target.offsets[0] + target.sizes[0])


def _check_tensor(name: str, meta: dict[str, Any] | None, target: torch.Tensor, step: int) -> None:
    if meta is None:
        raise StateError(f"key {name!r} is not in the checkpoint of step {step}")
    if is_lazy(target):  # its shape is the checkpoint's, as load_state_dict makes it (_materialize)
        _check_dtype(name, meta, target, step)
        return
    unplain = without_plain_bytes(target)
    if unplain is not None:
        why, remedy = unplain
        raise StateError(f"key {name!r}: the state's tensor cannot be restored into: {why}; {remedy}")
    short = storage_shortfall(target)
    if short is not None:  # read into, it stayed as it was, and the restore said it was done
        raise StateError(f"key {name!r}: the state's tensor cannot be restored into: {short}; restore into "
                         "the sharded state, or once its storage is allocated again")
    shared = _shared_dim(target)
    if shared is not None:  # before: torch's "unsupported operation" at the copy, naming nothing
        raise StateError(
            f"key {name!r}: the state's tensor cannot be restored into: it is an expanded view (stride 0 along "
            f"dim {shared}: its elements there share one memory location, as torch.arange(n).expand(...) makes), "
            "which load_state_dict cannot copy into either; register it with persistent=False (a constant needs no "
            "checkpoint), or make it with .clone()"
        )
    if list(target.shape) != meta["shape"]:
        raise StateError(
            f"key {name!r}: shape mismatch: the state expects {list(target.shape)}, "
            f"the checkpoint of step {step} has {meta['shape']}"
        )
    _check_dtype(name, meta, target, step)


def _shared_dim(target: torch.Tensor) -> int | None:
    """The first dimension along which ``target``'s elements share memory (stride 0, more
    than one element), or None; asked only of tensors that are not contiguous."""
    local = local_tensor(target)
    if local.is_contiguous():
        return None
    return next((d for d, (n, s) in enumerate(zip(local.shape, local.stride())) if s == 0 and n > 1), None)


def _check_dtype(name: str, meta: dict[str, Any], target: torch.Tensor, step: int) -> None:
    if dtype_name(target.dtype) != meta["dtype"] and not converts(dtype_from_name(meta["dtype"]), target.dtype):
        raise StateError(
            f"key {name!r}: dtype mismatch: the state expects {dtype_name(target.dtype)}, "
            f"the checkpoint of step {step} has {meta['dtype']} (a restore converts between "
            "floating-point dtypes, or complex ones, only)"
        )


@functools.lru_cache(maxsize=None)
def converts(saved: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether a tensor saved as ``saved`` is restored into a live tensor of ``wanted``: both
    floating point (or both complex), as ``load_state_dict`` converts them (a bf16 model from
    an fp32 checkpoint, to fine-tune or evaluate), and torch has the conversion (none for
    float4, say). An integer or bool dtype that changed is more likely indices read as
    something else: refused."""
    if saved.is_complex != wanted.is_complex or not (saved.is_floating_point or saved.is_complex):
        return False
    if not (wanted.is_floating_point or wanted.is_complex):
        return False
    try:
        with warnings.catch_warnings():  # complex32's "experimental" note, said by the probe only
            warnings.simplefilter("ignore")
            torch.zeros(1, dtype=wanted, device="cpu").copy_(torch.zeros(1, dtype=saved, device="cpu"))
    except (RuntimeError, TypeError):
        return False
    return True


def _without(node: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A saved tree minus the tensors named ``names`` (dict entries holding them are dropped)."""
    kind = node["t"]
    if kind in ("obj", "per_rank"):
        return {**node, "sd": _without(node["sd"], names)}
    if kind == "dict":
        return {**node, "items": [[k, _without(v, names)] for k, v in node["items"]
                                  if not (v["t"] == "tensor" and v["name"] in names)]}
    return node


def _held_in(target: Any, path: str, node: dict[str, Any], kind: type) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """(object, its name, its saved node) for the entry ``target`` if it is a ``kind``, and
    for the ``kind`` objects in its dicts, lists and tuples (a GAN's models and their
    optimizers under one entry)."""
    if isinstance(target, kind):
        yield target, path, node
    elif isinstance(target, dict) and node.get("t") == "dict":
        for key, child in node["items"]:
            if key in target:
                yield from _held_in(target[key], child_path(path, key), child, kind)
    elif isinstance(target, (list, tuple)) and node.get("t") in ("list", "tuple"):
        for index, (live, child) in enumerate(zip(target, node["items"])):
            yield from _held_in(live, child_path(path, index), child, kind)


def _optimizer_templates(optim: torch.optim.Optimizer, key: str, node: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Saved optimizer-state names -> the parameter whose placement they must take.

    A freshly built optimizer has no state yet, so its saved state would come back as plain
    full-size tensors next to sharded (DTensor) parameters, and the next ``step()`` would
    mix the two. ``Optimizer.load_state_dict`` pairs the saved parameter ids with the live
    parameters in group order; the same pairing tells which parameter each state belongs to.
    A state tensor takes its parameter's placement when it has the parameter's global shape
    (moments do; scalars such as ``step`` stay plain).
    """
    saved = dict(node.get("sd", node).get("items", []))
    groups = build_value(saved["param_groups"], lambda name: None) if "param_groups" in saved else []
    saved_ids = [pid for group in groups if isinstance(group, dict) for pid in group.get("params", [])]
    live = [p for group in optim.param_groups for p in group["params"]]
    by_id = {pid: p for pid, p in zip(saved_ids, live) if is_dtensor(p)}
    templates: dict[str, torch.Tensor] = {}
    state_path = f"{key}/state"
    for name in tensor_names(saved.get("state", {"t": "v", "v": None})):
        pid, _, _field = name[len(state_path) + 1 :].partition("/")
        param = by_id.get(int(pid)) if pid.lstrip("-").isdigit() else None
        if param is not None:
            templates[name] = param
    return templates


class _Destination:
    """Where one saved tensor goes: ``buffer`` (CPU, contiguous) is read into, covering
    ``box`` of the global tensor; then copied into ``local`` (the live tensor's memory) when
    they differ. ``value`` is what the rebuilt state holds: the live tensor itself when the
    target had one (so DTensors keep their sharding), else a new tensor."""

    def __init__(self, live: torch.Tensor | None, local: torch.Tensor, buffer: torch.Tensor, box: Box) -> None:
        self.live, self.local, self.buffer, self.box = live, local, buffer, box
        self.value: torch.Tensor = live if live is not None else local

    @classmethod
    def into(cls, live: torch.Tensor, name: str, saved: torch.dtype | None = None) -> "_Destination":
        """Into ``live``, whose saved bytes are of dtype ``saved`` (default: the live
        tensor's; converted at ``finish`` when it differs)."""
        if is_dtensor(live):
            box = dtensor_box(live, name)
            local = local_tensor(live)
        else:
            box, local = Box((0,) * live.dim(), tuple(live.shape)), live
        saved = local.dtype if saved is None else saved
        direct = local.is_cpu and local.is_contiguous() and local.dtype == saved
        if direct:  # detached only when it must be: ~5 µs a tensor, at every restore
            buffer = local.detach() if local.requires_grad else local
        else:
            buffer = torch.empty(tuple(local.shape), dtype=saved, device="cpu")
        return cls(live, local, buffer, box)

    @classmethod
    def fresh(cls, meta: dict[str, Any]) -> "_Destination":
        buffer = torch.empty(meta["shape"], dtype=dtype_from_name(meta["dtype"]), device="cpu")
        return cls(None, buffer, buffer, Box((0,) * buffer.dim(), tuple(buffer.shape)))

    @classmethod
    def placed_like(cls, template: torch.Tensor, meta: dict[str, Any], name: str) -> "_Destination":
        """A new DTensor with ``template``'s mesh and placements, this rank's part read."""
        from torch.distributed.tensor import DTensor

        box = dtensor_box(template, name)
        buffer = torch.empty(box.sizes, dtype=dtype_from_name(meta["dtype"]), device="cpu")
        dest = cls(None, buffer, buffer, box)
        device = local_tensor(template).device
        dest.value = DTensor.from_local(
            buffer.to(device), template.device_mesh, template.placements,
            shape=template.shape, stride=template.stride(), run_check=False,
        )
        return dest

    @property
    def moves_at_finish(self) -> bool:
        """Whether ``finish`` copies bytes: into device memory (CUDA state) or into a
        tensor that is not contiguous; not when the reads landed in place."""
        if self.local.data_ptr() != self.buffer.data_ptr():
            return True
        return (self.live is None and is_dtensor(self.value)
                and local_tensor(self.value).data_ptr() != self.buffer.data_ptr())

    @property
    def converts(self) -> bool:
        """Whether the saved dtype (the buffer's) is converted into the live tensor's."""
        return self.local.dtype != self.buffer.dtype

    def finish(self) -> None:
        if self.converts:
            self.local.detach().copy_(self.buffer)
        elif self.local.data_ptr() != self.buffer.data_ptr():
            bitwise(self.local).copy_(bitwise(self.buffer))
        if self.live is None and is_dtensor(self.value):
            local = local_tensor(self.value)
            if local.data_ptr() != self.buffer.data_ptr():
                bitwise(local).copy_(bitwise(self.buffer))


@contextmanager
def _refused_by(key: str, step: int, who: str) -> Iterator[None]:
    """An error of the program's own code given a checkpoint that passed every check: the
    state does not fit it (an optimizer built with other parameter groups, a loader of
    another version), which no older checkpoint mends. Before, it counted as this
    checkpoint being unusable: every older step was loaded in turn, into the same state,
    and the restore ended blaming the checkpoints ("no loadable checkpoint")."""
    try:
        yield
    except ResilientError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the program's code raises
        raise StateError(f"key {key!r}: {who} refused the checkpoint of step {step}: "
                         f"{type(exc).__name__}: {exc}") from exc


class _Entry:
    """How one top-level entry of the state is restored: ``sources`` are the saved trees its
    value is built from (one; or, for per-rank state at a new world size, every old rank's,
    combined by the user's ``reshard`` rule), ``inner`` is what receives it."""

    def __init__(self, key: str, target: Any, sources: list[dict[str, Any]], reshard: Reshard | None) -> None:
        self.key, self.target, self.sources, self.reshard = key, target, sources, reshard
        #: the program's object (a ZeRO optimizer), as ``inner`` may be its adapter
        self.held = target.value if isinstance(target, PerRank) else target
        # of a module wrapper (torch.compile, DDP), the level whose keys were saved (``_wrappers``)
        self.inner = state_holder(self.held, _saved_keys(sources[0]))

    def _class_name(self) -> str:
        """The class of what loads the entry, as the program knows it: an adapter's object's
        (``ZeroRedundancyOptimizer``, not the adapter), a wrapper's module's."""
        return type(self.held if adapter_for(self.held) is not None else self.inner).__name__

    def apply(self, state: MutableMapping[str, Any], tensor: Callable[[str], torch.Tensor], rank: int,
              world_size: int, strict: bool, step: int) -> None:
        values = [build_value(source, tensor) for source in self.sources]
        with _refused_by(self.key, step, "its reshard rule"):
            value = self.reshard(values, rank, world_size) if self.reshard is not None else values[0]
        if self.sources[0]["t"] in ("obj", "dict") and is_stateful(self.inner):
            with _refused_by(self.key, step, f"{self._class_name()}.load_state_dict"):
                if isinstance(self.inner, torch.nn.Module):
                    load_module_state(self.inner, value, strict=strict)
                else:
                    self.inner.load_state_dict(value)
        elif isinstance(self.target, PerRank):
            with _refused_by(self.key, step, "the load_state_dict of an object in it"):
                self.target.value = _into(self.target.value, value, set(), strict)
        else:  # tensors loaded in place come back as the same objects
            with _refused_by(self.key, step, "the load_state_dict of an object in it"):
                state[self.key] = _into(self.target, value, set(), strict)


def _into(live: Any, saved: Any, filled: set[int], strict: bool = True) -> Any:
    """``saved``, put into ``live``'s own dicts and lists where both have one at the same
    place (as DCP's load does), and into the objects there through their
    ``load_state_dict`` (a module in the program's dict: the models of a GAN under one
    entry); elsewhere ``saved`` itself. Why: a program holds references into its state
    (``progress = state["progress"]``, the model it trains), and a restore that replaced
    them with new containers left those at their old values, without a word. The result
    equals ``saved`` (keys it lacks are removed), in the program's containers; a container
    met twice (one dict under two keys) is filled once, the second place taking
    ``saved``'s own."""
    if id(live) in filled:
        return saved
    if (is_stateful(live) or adapter_for(live) is not None) and isinstance(saved, dict):
        filled.add(id(live))
        holder = state_holder(live, saved)  # a wrapper's module (DDP, torch.compile), as at the top level
        if isinstance(holder, torch.nn.Module):
            load_module_state(holder, saved, strict=strict)
        else:
            holder.load_state_dict(saved)
        return live
    if isinstance(live, dict) and type(saved) is dict:
        filled.add(id(live))
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            live[key] = _into(live.get(key), value, filled, strict)
        return live
    if isinstance(live, list) and type(saved) is list:
        filled.add(id(live))
        live[:] = [_into(live[i] if i < len(live) else None, value, filled, strict)
                   for i, value in enumerate(saved)]
        return live
    value = into_own_kind(live, saved, lambda mine, theirs: _into(mine, theirs, filled, strict))
    return saved if value is NOT_A_KIND else value  # a tuple, an array, a set, an enum, a dataclass (_kinds)


def _saved_keys(node: dict[str, Any]) -> list[Any]:
    """The keys of the state dict a saved entry holds (none unless it is an object's)."""
    state_dict = node.get("sd") if node.get("t") == "obj" else None
    if not isinstance(state_dict, dict) or state_dict.get("t") != "dict":
        return []
    return [item[0] for item in state_dict.get("items", ()) if isinstance(item, list) and item]


def _planned(key: str, target: Any, node: dict[str, Any], manifest: dict[str, Any], rank: int,
             world_size: int) -> tuple["_Entry", str, dict[str, torch.Tensor], set[str]]:
    """(the entry's plan, its path, the target's tensors by name, the names ``node`` saved)."""
    entry, path = _plan_entry(key, target, node, manifest, rank, world_size)
    saved = {name for source in entry.sources for name in tensor_names(source)}
    # an earlier version's checkpoint kept the _orig_mod. of blocks compiled one by one
    plain_keys = not any(COMPILED_SEGMENT in name for name in saved)
    targets = flatten_target(entry.inner, path, plain_keys) if path else {}
    return entry, path, targets, saved


def _warn_if_values_differ(key: str, manifest: dict[str, Any], rank: int, world_size: int,
                           where: str | None) -> None:
    """At another world size, an entry whose saved values (not only its names) differ by
    rank: each rank gets those of the old rank of its number, which may not be what it
    needs (a pipeline stage's optimizer ``param_groups``, a per-rank counter)."""
    if where is not None and rank == 0:
        log.warning("resilient: key %r differs by rank in the checkpoint of step %d (saved by %d ranks), "
                    "first at %r; at %d ranks, each rank gets that of the old rank of its number (rank "
                    "0's beyond the old world). Wrap it in resilient.PerRank(..., reshard=...) to decide",
                    key, manifest["step"], manifest["world_size"], where, world_size)


def _plan_entry(key: str, target: Any, node: dict[str, Any], manifest: dict[str, Any], rank: int,
                world_size: int) -> tuple[_Entry, str]:
    """(the entry's restore plan, the path its live tensors are named under)."""
    if node["t"] != "per_rank":
        return _Entry(key, target, [node], None), key
    if manifest["world_size"] == world_size:
        return _Entry(key, target, [node["sd"]], None), per_rank_path(key, rank)
    reshard = target.reshard if isinstance(target, PerRank) else None
    if reshard is None:
        raise StateError(
            f"key {key!r} holds per-rank state saved by {manifest['world_size']} ranks; this job has "
            f"{world_size}: restore it with PerRank(value, reshard=rule), where rule(saved, rank, "
            "world_size) returns this rank's value from the list of saved ones"
        )
    sources = []
    for old_rank, record in enumerate(manifest["ranks"]):
        saved = dict(record["tree"]["items"]).get(key)
        if saved is None or saved["t"] != "per_rank":
            raise CheckpointCorruptError(f"rank {old_rank}'s tree lacks per-rank entry {key!r}")
        sources.append(saved["sd"])
    return _Entry(key, target, sources, reshard), ""  # rebuilt from the saved values, none in place


def _shareable(name: str, dest: "_Destination", meta: dict[str, Any], device: str) -> int:
    """Bytes of ``name`` if every rank can take it from one read split over the ranks (a
    whole, contiguous, non-DTensor destination saved as one box), else 0."""
    if is_dtensor(dest.value) or len(meta["boxes"]) != 1 or list(meta["boxes"][0]["sizes"]) != list(meta["shape"]):
        return 0
    if list(dest.box.sizes) != list(meta["shape"]) or not dest.local.is_contiguous():
        return 0
    if dest.local.device.type != device or dest.converts:  # shared as the live tensor's bytes
        return 0
    nbytes = dest.buffer.numel() * dest.buffer.element_size()
    return nbytes if nbytes >= SHARE_MIN_BYTES else 0


def _boundaries(manifest: dict[str, Any], pieces: list[list[Any]]) -> list[int]:
    """Byte offsets in a saved box where a piece or a chunk starts (0 and the end included):
    reads split there verify no chunk twice. Format 4 keeps the chunk tables in the files:
    there a chunk starts at each piece and every ``chunk_bytes`` after, as the writer cuts
    them (``_chunkio._split``), which spares every rank reading every file's table."""
    files, step = manifest["files"], manifest.get("chunk_bytes")
    cuts, pos = {0}, 0
    for fname, offset, nbytes in pieces:
        starts = (range(offset + step, offset + nbytes, step) if "footer" in files[fname]
                  else [c[0] for c in files[fname]["chunks"] if offset < c[0] < offset + nbytes])
        cuts.update(pos + start - offset for start in starts)
        pos += nbytes
        cuts.add(pos)
    return sorted(cuts)


def _split_reads(manifest: dict[str, Any], shared: list[tuple[str, int]], world_size: int
                 ) -> list[tuple[str, int, int, int]]:
    """(name, lo, hi, reader rank) for every shared tensor: the bytes of all of them, in name
    order, cut into ``world_size`` contiguous runs of about equal size at chunk boundaries.
    From the manifest alone, so every rank computes the same runs, whatever it can read."""
    segments: list[tuple[str, int, int]] = []
    for name, _ in shared:
        cuts = _boundaries(manifest, manifest["tensors"][name]["boxes"][0]["pieces"])
        segments += [(name, lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    total = sum(hi - lo for _, lo, hi in segments) or 1
    plan: list[tuple[str, int, int, int]] = []
    before = 0
    for name, lo, hi in segments:
        owner = min(world_size - 1, int((before + (hi - lo) / 2) * world_size // total))
        if plan and plan[-1][0] == name and plan[-1][3] == owner and plan[-1][2] == lo:
            plan[-1] = (name, plan[-1][1], hi, owner)  # one run per tensor and rank
        else:
            plan.append((name, lo, hi, owner))
        before += hi - lo
    return plan


class _Sharing:
    """How the shared tensors are read: split over ``group`` (ranks that see this step
    directory) and shared through the page cache, or over every rank and broadcast
    (``group`` None)."""

    def __init__(self, coord: Coordinator, tensors: list[tuple[str, int]], group: list[int] | None) -> None:
        self.coord, self.tensors, self.group = coord, tensors, group

    @property
    def names(self) -> set[str]:
        return {name for name, _ in self.tensors}


def _place(step_dir: str) -> list[Any]:
    """What tells ranks reading the same files apart from ranks reading another copy."""
    st = os.stat(step_dir)
    return [socket.gethostname(), st.st_dev, st.st_ino]


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0  # unknown: broadcast, which needs no page cache


def _through_page_cache(nbytes: int, available: list[int], device: str) -> bool:
    """Page cache for host tensors that fit; a broadcast for device tensors (NCCL moves them
    faster than each rank could copy every byte from host memory) or when memory is short."""
    mode = os.environ.get(SHARING_ENV, "auto")
    if mode not in ("auto", "page-cache", "broadcast"):
        raise ValueError(f"{SHARING_ENV} must be auto, page-cache or broadcast, got {mode!r}")
    return mode == "page-cache" or (mode == "auto" and device == "cpu" and nbytes <= min(available) // 2)


def _settle(futures: list["Future[None]"], error: BaseException | None) -> BaseException | None:
    """Wait for every future; the first error (``error`` if already set) is returned."""
    for future in futures:
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - the caller raises it after the vote
            error = error or exc
    return error


def load_checkpoint(
    state: MutableMapping[str, Any],
    manifest: dict[str, Any],
    step_dir: str,
    rank: int,
    world_size: int,
    pool: Executor,
    *,
    strict: bool = True,
    coord: Coordinator | None = None,
    rng: bool = True,
) -> tuple[dict[str, Any] | None, int]:
    """Load ``manifest``'s checkpoint into ``state``; return (this rank's saved RNG state,
    or None with ``rng=False``, when it is not read; the bytes of saved tensors this rank
    loaded into its state).

    ``strict=False`` restores what the state and the checkpoint have in common: entries or
    module tensors absent from the checkpoint keep their current values, saved entries the
    state lacks are ignored (shapes and dtypes of what is loaded are still checked).

    ``coord`` (several ranks, each calling this together): share the reads of tensors every
    rank needs whole (see the module's docstring); a failure on any rank raises on all of
    them (there ``OtherRankFailed``), never leaving one in a collective alone.
    """
    together = coord is not None and coord.world_size > 1
    plan: tuple[Any, ...] | None = None
    error: BaseException | None = None
    try:
        with gc_paused():  # tens of thousands of small objects: see _gc_pause
            plan = _check_and_place(state, manifest, rank, world_size, strict)
    except BaseException as exc:  # noqa: BLE001 - raised below, once every rank has spoken
        error = exc
    if not together:
        if error is not None:
            raise error
        assert plan is not None
        return _read_and_apply(state, manifest, step_dir, rank, world_size, pool, strict, plan, None, rng)
    assert coord is not None
    device = coord.tensor_device
    offers = None if plan is None else sorted(
        (name, n) for name, dest in plan[0].items()
        if (n := _shareable(name, dest, manifest["tensors"][name], device)))
    place = _place(step_dir)
    everyone = coord.all_gather(None if offers is None else [offers, place, _available_memory()])
    if error is not None:
        raise error
    if any(o is None for o in everyone):
        raise OtherRankFailed(f"another rank could not plan its restore of step {manifest['step']}")
    common = set(map(tuple, everyone[0][0]))  # type: ignore[index]
    for other in everyone[1:]:
        common &= set(map(tuple, other[0]))  # type: ignore[index]
    assert plan is not None
    shared = sorted(common)
    group = None  # every rank computes the same choice from what all of them said
    if _through_page_cache(sum(n for _, n in shared), [o[2] for o in everyone], device):  # type: ignore[index]
        group = [r for r, other in enumerate(everyone) if other[1] == place]  # type: ignore[index]
    return _read_and_apply(state, manifest, step_dir, rank, world_size, pool, strict, plan,
                           _Sharing(coord, shared, group), rng)


def _check_and_place(state: MutableMapping[str, Any], manifest: dict[str, Any], rank: int, world_size: int,
                     strict: bool) -> tuple[dict[str, "_Destination"], list["_Entry"], dict[str, Any]]:
    """Phase 1: (where every saved tensor goes, how each entry is rebuilt, this rank's record)."""
    step = manifest["step"]
    record = manifest["ranks"][rank if rank < manifest["world_size"] else 0]
    saved_entries = dict(record["tree"]["items"])
    own_keys = list(saved_entries)
    # entries whose nodes differ by rank (pipeline stages'): every rank's names joined, taken
    # where this rank's own node does not serve (another world size, or names it lacks)
    partitioned = partitioned_entries(manifest, rank)
    for key, (joined_node, _) in partitioned.items():
        saved_entries.setdefault(key, joined_node)
    resized = manifest["world_size"] != world_size
    tensors_meta = manifest["tensors"]

    # -- phase 1: check, and decide where every tensor goes ---------------------------------
    destinations: dict[str, _Destination] = {}
    lazy: dict[str, torch.Tensor] = {}
    entries: list[_Entry] = []
    for key, target in state.items():
        node = saved_entries.get(key)
        if node is None:
            if not strict:
                log.info("resilient: key %r is not in the checkpoint of step %d: left as it is", key, step)
                continue
            raise StateError(
                f"key {key!r} is not in the checkpoint of step {step} "
                f"(it holds: {', '.join(map(repr, saved_entries)) or 'nothing'})"
            )
        # Tensors the target already holds are filled in place (so DTensors keep their
        # sharding); everything else is built fresh from the checkpoint.
        entry, path, targets, saved_names = _planned(key, target, node, manifest, rank, world_size)
        joined = key in partitioned and (node is partitioned[key][0] or resized or not set(targets) <= saved_names)
        if joined and node is not partitioned[key][0]:
            entry, path, targets, saved_names = _planned(key, target, partitioned[key][0], manifest, rank, world_size)
        if joined and resized:
            _warn_if_values_differ(key, manifest, rank, world_size, partitioned[key][1])
        entries.append(entry)
        optimizers = list(_held_in(entry.held, path, entry.sources[0], torch.optim.Optimizer)) if path else []
        if optimizers:
            # its load_state_dict replaces the whole state: a live tensor the checkpoint lacks
            # (LBFGS's history, longer now than when saved) goes, and is no missing key
            theirs = tuple(f"{optim_path}/" for _, optim_path, _ in optimizers)
            targets = {name: t for name, t in targets.items() if name in saved_names or not name.startswith(theirs)}
        if not strict:
            live = targets
            targets = {name: t for name, t in targets.items() if name in saved_names}
            if live and saved_names and not targets:
                _warn_nothing_matched(key, step, sorted(live), sorted(saved_names))
        # a tensor subclass's parts (format 5 on): walked for only where there can be some
        parts, blocks = wrapped_parts(entry.sources[0]) if manifest.get("version", 1) >= 5 else (set(), set())
        if parts:
            targets = _in_saved_shapes(targets, parts, tensors_meta)
        # a module that loads its own way may take a tensor of the checkpoint's shape, not its
        # own (read fresh, for its load_state_dict), and may hold one the checkpoint lacks (a
        # longer list state, which its load_state_dict replaces)
        own_way = {name for name, t in targets.items()
                   if (name not in saved_names or (not is_lazy(t) and list(t.shape) != tensors_meta[name]["shape"]))
                   and _loads_its_own_way(entry, path, name)}
        for name, t in targets.items():
            if name not in own_way:
                _check_tensor(name, tensors_meta.get(name) if name in saved_names else None, t, step)
        # a module takes only its own names, and under strict says which it lacks before
        # anything is read; an entry saved in parts (pipeline stages) takes only the names its
        # tensors have, the other stages' being theirs, unless it holds none to say which
        extra: list[str] = []
        if path and key in partitioned and targets:
            extra = sorted(saved_names - set(targets))
            # an optimizer in it with no state yet holds no names to say which are its own:
            # it keeps all it was saved with, as one at the top level does (before, a fresh
            # ZeRO optimizer beside its model in one dict was restored with no state at all)
            fresh = tuple(f"{optim_path}/" for _, optim_path, _ in optimizers
                          if not any(name.startswith(f"{optim_path}/") for name in targets))
            extra = [name for name in extra if not name.startswith(fresh)] if fresh else extra
        elif path:
            for _, module_path, _ in _held_in(entry.inner, path, entry.sources[0], torch.nn.Module):
                # what a module that loads its own way lacks is its load_state_dict's to take
                # (torchmetrics' list states, empty in a fresh metric): read, and handed to it
                lacked = sorted(n for n in saved_names - set(targets)
                                if n.startswith(f"{module_path}/") and not _loads_its_own_way(entry, path, n))
                if lacked and strict:
                    raise StateError(f"key {module_path!r}: the checkpoint of step {step} has entries the module "
                                     f"lacks: {lacked[:5]}")
                extra += lacked
        zero = zero_class()
        if path and zero is not None:  # a ZeRO optimizer reads its partition's state alone
            for optim, optim_path, _ in _held_in(entry.held, path, entry.sources[0], zero):
                extra += others_state(optim, optim_path, saved_names)
        if extra:
            saved_names -= set(extra)
            entry.sources = [_without(source, set(extra)) for source in entry.sources]
        templates = {name: param for optim, optim_path, node in optimizers
                     for name, param in _optimizer_templates(optim, optim_path, node).items()}
        for name in saved_names:
            meta = tensors_meta[name]
            if name in own_way:
                destinations[name] = _Destination.fresh(meta)
            elif name in targets and is_lazy(targets[name]):
                lazy[name] = targets[name]  # materialized once every entry is checked
            elif name in targets:
                destinations[name] = _Destination.into(targets[name], name, dtype_from_name(meta["dtype"]))
            elif name in templates and list(templates[name].shape) == meta["shape"]:
                destinations[name] = _Destination.placed_like(templates[name], meta, name)
            elif name in templates and name in blocks and (
                    template := blocks_template(templates[name], meta["shape"], name)) is not None:
                destinations[name] = _Destination.placed_like(template, meta, name)  # a low-bit state's scales
            else:
                destinations[name] = _Destination.fresh(meta)
    for name, param in lazy.items():
        destinations[name] = _materialized(param, name, tensors_meta[name])
    converted = sorted(name for name, dest in destinations.items() if dest.converts)
    if converted and rank == 0:
        _warn_converted(step, converted, destinations)
    unasked = [key for key in own_keys if key not in state]  # another stage's entries are its own
    if strict and unasked and rank == 0:
        # a forgotten entry (the scheduler, the data loader) would go on from its initial
        # state while the run resumes; a part restored on purpose is strict=False's
        log.warning("resilient: the checkpoint of step %d also holds %s, which the state to restore does not name: "
                    "not restored (name it in the state, or pass strict=False to restore a part on purpose)",
                    step, ", ".join(map(repr, unasked)))
    return destinations, entries, record


def _in_saved_shapes(targets: dict[str, torch.Tensor], parts: set[str],
                     tensors_meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``targets``, a tensor subclass's part in the shape it was saved in where that is
    another view of the same elements: block scales are saved as views of blocks since
    format 6 and flat before it, and a program's class holds them flat."""
    for name in parts & targets.keys():
        target, meta = targets[name], tensors_meta.get(name)
        if (meta is not None and not is_dtensor(target) and list(target.shape) != meta["shape"]
                and target.numel() == math.prod(meta["shape"]) and target.is_contiguous()):
            targets[name] = target.view(meta["shape"])
    return targets


def _loads_its_own_way(entry: _Entry, path: str, name: str) -> bool:
    """Whether the module holding tensor ``name`` loads its state through code of its own
    (``_load_from_state_dict`` overridden, or a load pre-hook), which may take a tensor of
    another shape than its own. Why: quantization-aware training's ``FakeQuantize`` keeps a
    scale of one value until its first forward and one per channel after (its observers
    likewise), and resizes it in ``load_state_dict``; a restore into a freshly prepared model
    refused the checkpoint ("shape mismatch") where ``load_state_dict`` takes it. A plain
    module's parameter of another shape is still refused here, by name."""
    for module, module_path, _ in _held_in(entry.inner, path, entry.sources[0], torch.nn.Module):
        if not name.startswith(f"{module_path}/"):
            continue
        owner_path = unquote(name[len(module_path) + 1:]).rpartition(".")[0]
        try:
            owner = module.get_submodule(owner_path)
        except AttributeError:
            return False
        custom = type(owner)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
        return custom or bool(owner._load_state_dict_pre_hooks)
    return False


def _materialized(param: torch.Tensor, name: str, meta: dict[str, Any]) -> "_Destination":
    """Where a lazy module's uninitialized parameter or buffer (``nn.LazyLinear`` before its
    first forward) is restored: made the checkpoint's shape, in place (the module keeps the
    same object), as ``load_state_dict`` makes it. Before, the restore raised torch's
    "uninitialized parameter" error and counted every checkpoint as unloadable."""
    with torch.no_grad():
        param.materialize(tuple(meta["shape"]))  # type: ignore[attr-defined]
    return _Destination.into(param, name, dtype_from_name(meta["dtype"]))


def _warn_converted(step: int, names: list[str], destinations: dict[str, "_Destination"]) -> None:
    """Tensors restored into the state's own dtypes: said once, with each conversion, as a
    bitwise resume is then no longer what happens (fp32 into a bf16 model loses bits)."""
    pairs = sorted({(dtype_name(destinations[n].buffer.dtype), dtype_name(destinations[n].local.dtype))
                    for n in names})
    log.warning("resilient: %d tensor%s of step %d restored into the state's dtypes (%s; first %r)",
                len(names), "" if len(names) == 1 else "s", step,
                ", ".join(f"{a} -> {b}" for a, b in pairs), names[0])


def _warn_nothing_matched(key: str, step: int, live: list[str], saved: list[str]) -> None:
    """``strict=False``, and none of an entry's tensors is among the many it has in the
    checkpoint: renamed attributes, most likely, and silence would leave the whole entry
    as initialised while the restore reports the step."""
    log.warning("resilient: key %r: none of its %d tensors is among the %d the checkpoint of step %d holds "
                "for it (it has %r, the checkpoint %r, ...): nothing of it was loaded", key, len(live),
                len(saved), step, live[0], saved[0])


def _read_and_apply(state: MutableMapping[str, Any], manifest: dict[str, Any], step_dir: str, rank: int,
                    world_size: int, pool: Executor, strict: bool,
                    plan: tuple[dict[str, "_Destination"], list["_Entry"], dict[str, Any]],
                    sharing: _Sharing | None, rng: bool) -> tuple[dict[str, Any] | None, int]:
    """Phase 2 (read, verify, share) and the rebuild of the state: (the saved RNG state, the
    bytes loaded)."""
    destinations, entries, record = plan
    saved_rng = _SavedRngRead(record if rng else {})
    tensors_meta = manifest["tensors"]
    shared = sharing.names if sharing else set()
    copies: list[Task] = []
    reader: _Reader | None = None
    finisher: _FinishWhenRead | None = None
    try:
        error: BaseException | None = None
        others: list[Future[None]] = []
        try:
            reader = _Reader(step_dir, manifest)
            reads: list[Task] = saved_rng.tasks(reader)
            moved: dict[str, tuple[list[Task], list[Task]]] = {}
            with gc_paused():  # a task or more for each tensor: see _gc_pause
                for name, dest in destinations.items():
                    if name not in shared:
                        r, c = _fill(reader, name, tensors_meta[name], dest.buffer, dest.box)
                        reads += r
                        if dest.moves_at_finish:
                            moved[name] = (r, c)
                        else:
                            copies += c
                finisher = _FinishWhenRead(moved, destinations)
                others = [pool.submit(finisher.wrap(task)) for task in batched(reads)]
        except BaseException as exc:  # noqa: BLE001 - raised below, once every rank has spoken
            error = exc
        if sharing is not None and sharing.group is not None:
            _share_through_page_cache(reader, manifest, destinations, rank, pool, sharing, others, error)
        elif sharing is not None:
            _share_by_broadcast(reader, manifest, destinations, rank, world_size, pool, sharing, others, error)
        else:
            error = _settle(others, error)
            if error is not None:
                raise error
    finally:
        if reader is not None:
            reader.close()
    in_place = shared if sharing is not None and sharing.group is None else set()
    done = in_place | (finisher.finished if finisher is not None else set())
    with torch.no_grad():
        for task in copies:
            task()
        for name, dest in destinations.items():
            if name not in done:  # a broadcast one is complete where it lives (its buffer is not)
                dest.finish()

    # -- apply --------------------------------------------------------------------------------
    with gc_paused():
        for entry in entries:
            entry.apply(state, lambda name: destinations[name].value, rank, world_size, strict, manifest["step"])
    loaded = sum(dest.buffer.numel() * dest.buffer.element_size() for dest in destinations.values())
    return saved_rng.state(step_dir), loaded


class _SavedRngRead:
    """A rank's saved generator states: in its record (formats 1 and 2, and a rank that had
    no file), or read from its data file beside the tensors (format 3: ``rng_at``), the
    chunk's checksum verified like theirs."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._inline = record.get("rng")
        self._at = record.get("rng_at")
        self._buffer = bytearray(self._at[2]) if self._at else None

    def tasks(self, reader: _Reader) -> list[Task]:
        if self._at is None:
            return []
        assert self._buffer is not None
        return list(reader.file(self._at[0]).read_tasks(self._at[1], memoryview(self._buffer)))

    def state(self, step_dir: str) -> dict[str, Any] | None:
        if self._buffer is None:
            return self._inline
        return decode_rng(self._buffer, os.path.join(step_dir, self._at[0]))


class _FinishWhenRead:
    """Finishes a destination whose bytes must still move (``moves_at_finish``: into device
    memory, for CUDA state) in the read thread that completes its last read: its resharding
    copies, then ``finish``. Why: finished only once every read of the checkpoint was done,
    the copies to the device came after the disk was idle and added their whole time to
    the restore; tensor by tensor, they overlap the reads still going."""

    def __init__(self, moved: dict[str, tuple[list[Task], list[Task]]],
                 destinations: dict[str, "_Destination"]) -> None:
        self._moved, self._destinations = moved, destinations
        self._owner = {id(read): name for name, (reads, _) in moved.items() for read in reads}
        self._left = {name: len(reads) for name, (reads, _) in moved.items()}
        self._lock = threading.Lock()
        #: the destinations finished here (the rest are finished after the reads)
        self.finished: set[str] = set()

    def wrap(self, task: Task) -> Task:
        """``task`` (a read, or a merged run of reads), then the finish of each destination
        whose last read it was."""
        members = task.reads if isinstance(task, ChunkRun) else [task]
        names = [self._owner[id(m)] for m in members if id(m) in self._owner]
        if not names:
            return task

        def read_then_finish() -> None:
            task()
            ready = []
            with self._lock:
                for name in names:
                    self._left[name] -= 1
                    if self._left[name] == 0:
                        ready.append(name)
            with torch.no_grad():
                for name in ready:
                    for copy in self._moved[name][1]:
                        copy()
                    self._destinations[name].finish()
                    with self._lock:
                        self.finished.add(name)

        return read_then_finish


def _runs_reads(reader: _Reader | None, runs: list[tuple[str, int, int, int]], mine: Callable[[int], bool],
                manifest: dict[str, Any], destinations: dict[str, "_Destination"]) -> dict[int, list[Task]]:
    """The reads (not yet started) of the runs ``mine(reader index)`` picks, into their
    destinations' buffers, by run."""
    assert reader is not None
    return {i: reader.box_bytes(manifest["tensors"][name]["boxes"][0]["pieces"], lo,
                                _as_bytes(destinations[name].buffer)[lo:hi])
            for i, (name, lo, hi, owner) in enumerate(runs) if mine(owner)}


def _vote(sharing: _Sharing, error: BaseException | None, manifest: dict[str, Any]) -> None:
    """Every rank raises if any rank's reads failed (this one's own error first)."""
    if sharing.coord.agree_max(int(error is not None)):
        raise error or OtherRankFailed(f"another rank could not read its part of step {manifest['step']}")


#: how many of its own reads a rank queues before each read of another rank's part (turn
#: ``t`` of the others' parts ``t`` times this far behind). Why: with every own read queued
#: first, the copies out of the page cache all came after the disk was done (each rank copies
#: the others' parts: three quarters of the bytes at 4 ranks); queued a little behind, a copy
#: follows the part's owner through the page cache and overlaps the reads still going (the
#: kernel waits on a page being read rather than reading it twice). How far behind, measured
#: by ``benchmarks/bench_peer_lag.py`` (1 GB replicated, cold, the lags interleaved in the
#: same processes, medians of 4): on 4 ranks 0.55 s at 0, 0.61 s at 2, 0.66 s at 8 (there a
#: part is 8 reads of 32 MB, so 8 put every copy after the disk); on 2 and 3 ranks the three
#: were within this disk's noise (0.47-0.54 s; 0.45-0.51 s), and so were 4 GB on 2 ranks
#: (1.68, 1.67, 1.70 s). An ad-hoc run of the same comparison gave 0.45, 0.48 and 0.62-0.68 s
#: on 4 ranks, but 4 GB on 2 ranks took 1.68 s at 0 against 1.23-1.25 s at 2 and at 8: 2
#: hedges between the two. (8 was chosen from 4 GB on 2 ranks alone, against 4 and 12-16,
#: where 4 had been slower: 3.43 s against 2.72-2.77 s; 2 was not tried then.)
PEER_LAG_TASKS = 2


#: the shared reads are read and checksummed this many bytes at a time: the checksum then
#: reads what the copy has just left in the core's cache (2 MB of L2 here), not memory. Why
#: only here: a rank that copies the other ranks' parts does as many copies as the node has
#: ranks, so the CPU and memory, not the disk, set the pace; a rank reading only its own
#: shard waits on the disk, which serves one large read as well or better. Measured here,
#: 1 GB in the page cache copied and checksummed by every process at once: 4 processes
#: 0.52-0.64 s in 256 kB pieces against 0.72-0.78 s in 32 MB reads (4 MB pieces were as slow
#: as 32 MB). In cold restores (``benchmarks/bench_peer_lag.py``, 1 GB, medians of 6, both
#: in the same processes): replicated on 4 ranks 0.730 s against 0.850 s in whole runs, on
#: 3 ranks 0.713 s against 0.776 s, on 2 ranks 0.691 s against 0.732 s; sharded, 1 rank
#: 0.548 s against 0.526 s, 2 ranks 0.645 s against 0.613 s. 512 kB from a sweep of 256 kB,
#: 512 kB and 1 MB on 2, 3 and 4 ranks (``results-peer-pieces.json``, only the other ranks'
#: parts in pieces): never the fastest median nor the slowest, faster than whole runs in 15
#: of 18 rounds, paired. Asking the kernel to read ahead (``POSIX_FADV_WILLNEED``) before
#: the pieces was slower.
SHARED_PIECE_BYTES = 512 << 10


def lagged(by_turn: list[list[Task]], lag: int) -> list[Task]:
    """One queue of every turn's reads, turn ``t``'s ``k``-th read after turn 0's
    ``k + t * lag``-th (each turn's own order kept)."""
    keyed = [(k + turn * lag, turn, task) for turn, tasks in enumerate(by_turn) for k, task in enumerate(tasks)]
    keyed.sort(key=lambda item: item[:2])
    return [task for _, _, task in keyed]


def _share_through_page_cache(reader: _Reader | None, manifest: dict[str, Any],
                              destinations: dict[str, "_Destination"], rank: int, pool: Executor,
                              sharing: _Sharing, others: list["Future[None]"],
                              error: BaseException | None) -> None:
    """Read (and verify) every part: this rank's own from storage while the others read
    theirs, and the others' parts each ``PEER_LAG_TASKS`` reads behind, which the kernel
    by then serves from this node's page cache (a page another rank is still reading is
    waited for, not read twice). No barrier between the parts; one vote at the end."""
    assert sharing.group is not None
    me, size = sharing.group.index(rank), len(sharing.group)
    runs = _split_reads(manifest, sharing.tensors, size)
    if error is None:
        try:
            by_turn = []
            for turn in range(size):
                part = (me + turn) % size
                turn_reads = _runs_reads(reader, runs, lambda owner: owner == part, manifest, destinations)
                by_turn.append(batched((t for ts in turn_reads.values() for t in ts), piece=SHARED_PIECE_BYTES))
            error = _settle([pool.submit(task) for task in lagged(by_turn, PEER_LAG_TASKS)], None)
        except BaseException as exc:  # noqa: BLE001 - voted on below
            error = exc
    error = _settle(others, error)
    _vote(sharing, error, manifest)


def _share_by_broadcast(reader: _Reader | None, manifest: dict[str, Any], destinations: dict[str, "_Destination"],
                        rank: int, world_size: int, pool: Executor, sharing: _Sharing,
                        others: list["Future[None]"], error: BaseException | None) -> None:
    """Read this rank's runs and broadcast every run in one order on every rank, each as
    soon as its reader has it. A rank whose read failed still takes part in every broadcast
    (what it sends is then garbage); the vote after them makes every rank raise."""
    runs = _split_reads(manifest, sharing.tensors, world_size)
    own: dict[int, list[Future[None]]] = {}
    if error is None:
        try:
            own = {i: [pool.submit(task) for task in batched(reads)]
                   for i, reads in _runs_reads(reader, runs, lambda owner: owner == rank, manifest,
                                               destinations).items()}
        except BaseException as exc:  # noqa: BLE001 - voted on below
            error = exc
    works = []
    with torch.no_grad():
        for i, (name, lo, hi, owner) in enumerate(runs):
            dest = destinations[name]
            part = _as_bytes_tensor(dest.local)[lo:hi]
            if owner == rank:
                error = _settle(own.get(i, []), error)
                if error is None and dest.local.data_ptr() != dest.buffer.data_ptr():
                    part.copy_(_as_bytes_tensor(dest.buffer)[lo:hi])  # to the device it is sent from
            works.append(sharing.coord.broadcast(part, owner))
    error = _settle(others, error)
    for work in works:
        work.wait()
    _vote(sharing, error, manifest)
