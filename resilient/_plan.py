"""Planning a save's layout together: which rank writes which bytes, decided alike on every rank.

The first save of a layout (and the first after it changes) is collective. Every rank
describes what it holds (``describe``), the descriptions are gathered (``gather_descriptions``),
and every rank works out the same global decisions from them (``plan_rank``): which rank
writes each box of a sharded tensor, how replicated bytes are split, the manifest's tensors,
and the checks that refuse state that differs by rank.

Why the descriptions group tensors into classes: at a thousand ranks and tens of thousands
of tensors, anything done per rank per tensor is tens of millions of steps on every rank (90
s by measurement, at the first save of a job) and a gigabyte gathered to each. The tensors
that share a dtype, a global shape, placements and a mesh of the same form have the same box
on any one rank, so a rank describes its tensors once (a list that every rank of the same
sharding holds alike, gathered once) and its boxes once per class. Matching the ranks that
hold the same box is then done per class, not per tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ._chunkio import crc32
from ._errors import UnsupportedStateError
from ._format import dtype_itemsize, dtype_name
from ._layout import replicated_slices
from ._snapshot import Blob, RankPlan, align_up, byte_view, dtensor_box, is_dtensor, local_tensor

__all__ = ["describe", "gather_descriptions", "plan_rank"]

#: what ``describe`` returns, ``gather_descriptions`` hands back for every rank, and
#: ``plan_rank`` reads:
#: - ``sharded``: ``[name, dtype, global shape, class]`` of each DTensor;
#: - ``boxes``: per class, ``[offsets, sizes]`` of the box this rank holds;
#: - ``own``: ``[name, dtype, shape]`` of each per-rank tensor (a whole box only it holds);
#: - ``plain``: ``[name, fingerprint, dtype, shape]`` of each plain tensor;
#: - ``aliases``: ``[name, first name]`` pairs of tensors sharing memory.
Description = dict[str, Any]

#: the lists that ranks of one sharding hold alike, gathered once each however many hold them
_SHARED_LISTS = ("plain", "sharded")

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


def _mesh_form(mesh: Any, forms: dict[int, tuple]) -> tuple:
    """The mesh's shape and its ranks relative to its first: alike for the data-parallel
    replicas of one tensor-parallel mesh, unlike for two meshes of one size over other
    dimensions (whose boxes could coincide on some ranks only). Asked once per mesh."""
    form = forms.get(id(mesh))
    if form is None:
        ranks = mesh.mesh
        form = forms[id(mesh)] = (tuple(ranks.shape), tuple((ranks - ranks.min()).flatten().tolist()))
    return form


def describe(tensors: dict[str, torch.Tensor], per_rank: set[str], *, alone: bool = False) -> Description:
    """What this rank holds, for every rank to plan from (see ``Description``). The class of
    a DTensor is its dtype, global shape, placements, mesh form and this rank's box of it:
    one box per class, and on the usual meshes (FSDP2, HSDP, FSDP2 + TP) the same classes on
    every rank, so the ``sharded`` list is one list for all of them. Fingerprints of plain
    tensors are not computed when the rank is ``alone``: nothing to compare with."""
    sharded: list[list[Any]] = []
    boxes: list[list[list[int]]] = []
    classes: dict[tuple, int] = {}
    forms: dict[int, tuple] = {}
    own: list[list[Any]] = []
    plain: list[list[Any]] = []
    aliases = find_aliases(tensors, per_rank)
    for name, t in tensors.items():
        if name in aliases:
            continue
        dtype = dtype_name(t.dtype)
        if name in per_rank:
            own.append([name, dtype, list(t.shape)])
        elif is_dtensor(t):
            box = dtensor_box(t, name)
            key = (dtype, tuple(t.shape), tuple(map(str, t.placements)), _mesh_form(t.device_mesh, forms),
                   box.offsets, box.sizes)
            cls = classes.setdefault(key, len(classes))
            if cls == len(boxes):
                boxes.append([list(box.offsets), list(box.sizes)])
            sharded.append([name, dtype, list(t.shape), cls])
        else:
            plain.append([name, 0 if alone else fingerprint(t), dtype, list(t.shape)])
    return {"sharded": sharded, "boxes": boxes, "own": own, "plain": plain, "aliases": sorted(aliases.items())}


def gather_descriptions(all_gather: Callable[[object], list[Any]], rank: int,
                        description: Description) -> list[Description]:
    """Every rank's ``describe``, in two gathers: first each rank's boxes with a digest of
    each of its shared lists, then each distinct list once, from the first rank holding it.
    Ranks holding the same list get one object. Why: under data parallelism every rank's
    plain list is the same, under FSDP2 every rank's sharded list, and gathering them from
    every rank sent world_size copies to every rank: 26,800 tensors of a mixture of experts
    make a 1.5 MB list, 1.5 GB gathered on each of 1,024 ranks when the layout is planned."""
    digests = {field: hashlib.sha256(json.dumps(description[field]).encode()).hexdigest()
               for field in _SHARED_LISTS}
    heads = all_gather({**description, **digests})
    first: dict[tuple[str, str], int] = {}
    for r, head in enumerate(heads):
        for field in _SHARED_LISTS:
            first.setdefault((field, head[field]), r)
    lists = all_gather({field: description[field] for field in _SHARED_LISTS
                        if first[(field, digests[field])] == rank})
    by_digest = {(field, heads[r][field]): value for r, sent in enumerate(lists) for field, value in sent.items()}
    return [{**head, **{field: by_digest[(field, head[field])] for field in _SHARED_LISTS}} for head in heads]


def _distinct(descriptions: list[Description], field: str) -> list[tuple[list[list[Any]], list[int]]]:
    """Each distinct shared list (one object, as ``gather_descriptions`` gives ranks that
    hold the same), with the ranks holding it. Why: walking it once per rank was
    world_size x tensors steps for every check (27 million at 1,024 ranks x 26,800)."""
    seen: dict[int, tuple[list[list[Any]], list[int]]] = {}
    for rank, d in enumerate(descriptions):
        seen.setdefault(id(d[field]), (d[field], []))[1].append(rank)
    return list(seen.values())


def _refuse_rank_dependent(descriptions: list[Description]) -> None:
    values: dict[str, set[int]] = {}
    for plain, _ in _distinct(descriptions, "plain"):
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
            "parameters (pipeline stages); under FSDP1 (FullyShardedDataParallel), whose optimizer holds flat "
            "per-rank shards, save the model and optimizer through DCP's get_state_dict and set_state_dict, "
            "the FSDP made with a device mesh (README: FSDP1)"
        )


def _held_by_all(descriptions: list[Description]) -> set[str]:
    """The plain tensors every rank holds (aliases aside): replicated state."""
    counts: dict[str, int] = {}
    for plain, holders in _distinct(descriptions, "plain"):
        for name, _, _, _ in plain:
            counts[name] = counts.get(name, 0) + len(holders)
    return {name for name, count in counts.items() if count == len(descriptions)}


def _tensors(descriptions: list[Description]) -> list[tuple[str, bool, str, list[int], int]]:
    """(name, a DTensor?, dtype, global shape, a rank holding it) of every rank's tensors,
    each distinct list walked once: plain, then sharded, then each rank's per-rank ones."""
    out = [(name, False, dtype, shape, holders[0])
           for plain, holders in _distinct(descriptions, "plain") for name, _, dtype, shape in plain]
    out += [(name, True, dtype, shape, holders[0])
            for sharded, holders in _distinct(descriptions, "sharded") for name, dtype, shape, _ in sharded]
    out += [(name, True, dtype, shape, rank) for rank, d in enumerate(descriptions) for name, dtype, shape in d["own"]]
    return out


def _refuse_one_name_for_two_tensors(descriptions: list[Description]) -> None:
    """Raise, on every rank alike, when ranks hold tensors of one name with different
    dtypes, global shapes, or one plain and one a DTensor: a checkpoint name is one tensor.
    The usual cause is an optimizer under pipeline parallelism, whose state each stage keys
    0, 1, 2, ... for its own parameters."""
    seen: dict[str, tuple[bool, str, list[int], int]] = {}
    for name, sharded, dtype, shape, rank in _tensors(descriptions):
        first = seen.setdefault(name, (sharded, dtype, shape, rank))
        if first[:3] != (sharded, dtype, shape):
            what = [f"rank {r} {'a DTensor' if s else 'a tensor'} of {d} {list(sh)}"
                    for s, d, sh, r in (first, (sharded, dtype, shape, rank))]
            raise UnsupportedStateError(
                f"state[{name!r}] is not one tensor on every rank that holds it: {what[0]}, {what[1]}. Keep "
                "state that differs by rank in resilient.PerRank(...); key an optimizer's state by parameter "
                "name (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) when stages hold "
                "different parameters")


def _refuse_parts_beside_whole(descriptions: list[Description]) -> None:
    """Raise, on every rank alike, when a name is one tensor on some ranks and a tensor
    subclass's parts on others (``name`` and ``name/codes``): no reader could fill either
    from the other, and the checkpoint would be committed unloadable. The cause is a
    low-bit optimizer (torchao's) under FSDP2, which quantizes a shard only where it has at
    least 4096 values and whole blocks: a parameter with few rows leaves some ranks a small
    or empty shard, kept in full precision, and others a quantized one."""
    where: dict[str, int] = {}
    for name, _, _, _, rank in _tensors(descriptions):
        where.setdefault(name, rank)
    for name, rank in where.items():
        whole = name.rpartition("/")[0]
        if whole in where:
            parts = sorted(n.rpartition("/")[2] for n in where if n.rpartition("/")[0] == whole)
            raise UnsupportedStateError(
                f"state[{whole!r}] is one tensor on rank {where[whole]} and a tensor subclass's parts "
                f"({', '.join(parts)}) on rank {rank}: a low-bit optimizer quantizes only shards of at least "
                "4096 values made of whole blocks, and this parameter's shards differ across ranks, so its state "
                "cannot be saved as one tensor. Give every rank a shard that is quantized alike: a world size "
                "that divides its first dimension, fully_shard(..., shard_placement_fn=...) to shard it along "
                "another dimension, or a full-precision optimizer for it")


@dataclass
class _Unit:
    """Tensors of one size, each a box that the same ranks hold: what writers are chosen for."""

    holders: tuple[int, ...]
    names: list[str]
    each: int  # bytes of each one's box


def _units(descriptions: list[Description], everywhere: set[str]) -> list[_Unit]:
    """Everything some rank writes whole, as units. A class of one distinct sharded list is
    one unit per distinct box its ranks hold of it (per rank under FSDP2, per shard under
    HSDP): ranks x classes steps, not ranks x tensors. A name that two distinct lists hold
    (one rank holds a DTensor more than the others) is matched box by box. Per-rank tensors
    are their rank's; a plain tensor only some ranks hold (a pipeline stage's) is one box,
    its holders the ranks whose lists have it."""
    units: list[_Unit] = []
    lists = _distinct(descriptions, "sharded")
    count: dict[str, int] = {}
    for sharded, _ in lists:
        for entry in sharded:
            count[entry[0]] = count.get(entry[0], 0) + 1
    crossing: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[list[int], int]] = {}  # -> holders, bytes
    for sharded, ranks in lists:
        by_class: dict[int, list[str]] = {}
        itemsize: dict[int, int] = {}
        for name, dtype, _, cls in sharded:
            if count[name] > 1:
                for r in ranks:
                    offsets, sizes = descriptions[r]["boxes"][cls]
                    key = (name, tuple(offsets), tuple(sizes))
                    crossing.setdefault(key, ([], math.prod(sizes) * dtype_itemsize(dtype)))[0].append(r)
            else:
                by_class.setdefault(cls, []).append(name)
                itemsize.setdefault(cls, dtype_itemsize(dtype))
        for cls, names in by_class.items():
            holders: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
            for r in ranks:
                offsets, sizes = descriptions[r]["boxes"][cls]
                holders.setdefault((tuple(offsets), tuple(sizes)), []).append(r)
            for (_, sizes), held in holders.items():
                units.append(_Unit(tuple(held), names, math.prod(sizes) * itemsize[cls]))
    units += [_Unit(tuple(held), [key[0]], nbytes) for key, (held, nbytes) in crossing.items()]
    for rank, d in enumerate(descriptions):
        units += [_Unit((rank,), [name], math.prod(shape) * dtype_itemsize(dtype)) for name, dtype, shape in d["own"]]
    partial: dict[str, tuple[list[int], int]] = {}
    for plain, ranks in _distinct(descriptions, "plain"):
        for name, _, dtype, shape in plain:
            if name not in everywhere:
                partial.setdefault(name, ([], math.prod(shape) * dtype_itemsize(dtype)))[0].extend(ranks)
    units += [_Unit(tuple(sorted(held)), [name], nbytes) for name, (held, nbytes) in partial.items()]
    return units


def _written_by(rank: int, units: list[_Unit], world_size: int) -> set[str]:
    """The names whose box (of those it holds) ``rank`` writes. A unit one rank holds is
    that rank's. The others, biggest boxes first, are dealt out among their holders, the
    least loaded first: a unit of k boxes gives each of its h holders k // h of them and
    one more to the k % h least loaded. Every rank computes every rank's load the same
    way, so the holders of a box agree on its one writer."""
    load = [0] * world_size
    mine: set[str] = set()
    shared = []
    for unit in units:
        if len(unit.holders) == 1:
            load[unit.holders[0]] += unit.each * len(unit.names)
            if unit.holders[0] == rank:
                mine.update(unit.names)
        else:
            shared.append(unit)
    shared.sort(key=lambda u: (-u.each, u.holders, u.names[0]))
    for unit in shared:
        order = sorted(unit.holders, key=lambda r: (load[r], r))
        k, h = len(unit.names), len(order)
        for i, r in enumerate(order):
            load[r] += (k // h + (i < k % h)) * unit.each
        if rank in unit.holders:
            mine.update(unit.names[order.index(rank)::h])
    return mine


def _global_meta(tensors: dict[str, torch.Tensor], per_rank: set[str], descriptions: list[Description],
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
    for name, sharded, dtype, shape, _ in _tensors(descriptions):  # what only other ranks hold
        meta.setdefault(name, {"dtype": dtype, "shape": shape, "layout": layout(name, sharded)})
    for d in descriptions:
        for name, source in d["aliases"]:
            if name not in meta and source in meta:
                meta[name] = {**meta[source], "same_as": source}
    return meta


def _whole_boxes(d: Description, everywhere: set[str]) -> list[tuple[str, list[int], list[int]]]:
    """(name, offsets, sizes) of what a rank holds whole and may write whole: its per-rank
    tensors, and the plain ones only some ranks hold."""
    whole = [(name, [0] * len(shape), shape) for name, _, shape in d["own"]]
    return whole + [(name, [0] * len(shape), shape) for name, _, _, shape in d["plain"] if name not in everywhere]


def plan_rank(
    tensors: dict[str, torch.Tensor],
    per_rank: set[str],
    descriptions: list[Description],
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
    _refuse_parts_beside_whole(descriptions)
    _refuse_rank_dependent(descriptions)
    everywhere = _held_by_all(descriptions)
    mine = _written_by(rank, _units(descriptions, everywhere), world_size)
    meta = _global_meta(tensors, per_rank, descriptions, rank, everywhere)
    own = descriptions[rank]
    boxes = [(name, *own["boxes"][cls]) for name, _, _, cls in own["sharded"]] + _whole_boxes(own, everywhere)
    replicated_sizes = [(name, math.prod(shape) * dtype_itemsize(dtype))
                        for name, _, dtype, shape in descriptions[0]["plain"] if name in everywhere]
    blobs: list[Blob] = []
    shards: list[list[Any]] = []
    offset = 0
    for name, offsets, sizes in boxes:
        numel = math.prod(sizes)
        if name in mine and numel:
            nbytes = numel * tensors[name].element_size()
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


def plan_layout(tensors: dict[str, torch.Tensor], per_rank: set[str], rank: int, world_size: int,
                all_gather: Callable[[object], list[Any]]) -> RankPlan:
    """This rank's plan, from every rank's description (``all_gather``: collective). One
    piece for a Checkpointer's saves and for what sizes a staging buffer ahead of them (a
    Lightning strategy's first optimizer step), so that both size it alike."""
    description = describe(tensors, per_rank, alone=world_size == 1)
    return plan_rank(tensors, per_rank, gather_descriptions(all_gather, rank, description), rank, world_size)
