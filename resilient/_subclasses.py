"""Tensor subclasses that wrap plain tensors (torchao's low-bit optimizer states), saved as
the tensors they wrap and rebuilt through the class's own ``__tensor_unflatten__``.

Why: torchao's ``AdamW8bit`` keeps each moment as an ``OptimState8bit`` (uint8 codes, one
scale per block and a quantization map) behind a tensor with no storage of its own. Such a
state was refused ("a tensor subclass without storage"), which left a run with a low-bit
optimizer, picked to fit a model in memory, with no checkpoint at all. Here it is saved as
its inner tensors, which are written, checksummed and restored like any other, and its
flatten context as plain values (``_tree``'s "wrapped" node).

What comes back: a restore fills the program's own subclass's inner tensors in place and
wraps them in that class again. Where the program holds none there (a freshly built
optimizer makes its state at its first step) the class is rebuilt only if the program holds
it elsewhere in its state or allows it for ``torch.load(weights_only=True)`` (``torch.serialization.add_safe_globals``, which torchao
does for its optimizer states): a checkpoint names the class, and naming one must never be
enough to run its code. 
**Parts, and sharding.** A part is one of three kinds, as the class's own slicing along the
first dimension shows (``aten.slice``, which torchao implements for DCP's resharding): one
element per element of the tensor (the codes), one per ``k`` consecutive elements (block
scales; 4-bit codes, two to a byte), or a table that every slice keeps whole (the
quantization map). Block parts are held flat by the class and saved as a view with the
tensor's own shape but ``1/k`` of its last dimension (or of its rows), so that under FSDP2,
where each state is a DTensor over the subclass, every part but the tables is a DTensor
placed as the parameter is: shards of one tensor, written once and resharded at another
world size like any other, and restored into a program without FSDP (or the reverse).
Tables are plain tensors, the same on every rank (checked at save as any replicated tensor).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ._errors import StateError, UnsupportedStateError
from ._snapshot import PLAIN_TYPES, is_dtensor, local_tensor, placed_box

__all__ = ["SavedParts", "saved_parts", "wrapper_parts", "class_name", "rebuilt", "blocks_template"]

#: the wrapper subclasses met in this program's own state (saved, or restored into): a
#: restore may rebuild these, as the program made them itself
_HELD: dict[str, type] = {}


def wrapper_parts(t: torch.Tensor) -> tuple[list[str], Any] | None:
    """(names of the inner tensors, flatten context) of a wrapper subclass that says how to
    take it apart and put it together again (``__tensor_flatten__`` and
    ``__tensor_unflatten__``, as every subclass ``torch.compile`` traces has); None for a
    plain tensor, a parameter, a DTensor, or a subclass with storage of its own (saved as
    its bytes, as before)."""
    cls = type(t)
    if cls in PLAIN_TYPES or is_dtensor(t):
        return None
    if not (callable(getattr(cls, "__tensor_flatten__", None)) and callable(getattr(cls, "__tensor_unflatten__", None))):
        return None
    try:
        t.untyped_storage().data_ptr()
        return None  # storage of its own: its bytes are the state
    except RuntimeError:
        pass
    names, context = t.__tensor_flatten__()
    _HELD.setdefault(class_name(cls), cls)
    return list(names), context


@dataclass
class SavedParts:
    """How a wrapper is saved: its parts' names and flatten context, what is saved under
    each name (the part, a view of it, or a DTensor over either), and the names saved as a
    view of blocks that the class holds flat."""

    names: list[str]
    context: Any
    items: dict[str, torch.Tensor]
    blocks: list[str] = field(default_factory=list)
    #: the context as a saved tree once checked to round-trip (``_tree``), kept with the parts
    saved_context: dict[str, Any] | None = None
    #: (name, node, (tensor name, tensor) of each part): the saved node made for this wrapper
    #: under that name, kept while the parts are these (a DTensor's, ``_PLACED``)
    saved_node: tuple[str, dict[str, Any], tuple[tuple[str, torch.Tensor], ...]] | None = None


#: "like" (a part with the tensor's shape), k (one element per k of the tensor's) or
#: "table" for each part, by (class, shape, parts' shapes); None where the class does not say
_KINDS: dict[tuple[Any, ...], dict[str, Any] | None] = {}
_KINDS_KEPT = 4096


#: a DTensor over a wrapper -> (itself, weakly; its parts; what it is saved as), while it
#: lives: making the parts' DTensors took 0.19 ms a state at every save (77 ms for 400, a
#: flatten of as many plain DTensor states 2.6 ms), and an optimizer writes its states'
#: parts in place, step after step
_PLACED: dict[int, tuple[weakref.ref, tuple[tuple[str, torch.Tensor], ...], SavedParts]] = {}


def saved_parts(t: torch.Tensor, path: str, *, saving: bool) -> SavedParts | None:
    """What a wrapper subclass, or a DTensor over one, is saved (or restored) as; None for
    any other tensor. A DTensor over a wrapper whose parts cannot be placed is refused by
    name when ``saving``; as a restore target it is left to the restore's own refusal."""
    if is_dtensor(t):
        local = local_tensor(t)
        if type(local) in PLAIN_TYPES:
            return None
        kept = _PLACED.get(id(t))
        if kept is not None and kept[0]() is t and all(getattr(local, name) is part for name, part in kept[1]):
            return kept[2]
        parts = wrapper_parts(local)
        if parts is None:
            return None
        try:
            placed = _placed_parts(t, local, *parts, path)
        except UnsupportedStateError:
            if saving:
                raise
            return None
        key = id(t)
        _PLACED[key] = (weakref.ref(t, lambda _, key=key: _PLACED.pop(key, None)),
                        tuple((name, getattr(local, name)) for name in parts[0]), placed)
        return placed
    parts = wrapper_parts(t)
    if parts is None:
        return None
    names, context = parts
    items = {name: getattr(t, name) for name in names}
    kinds = _part_kinds(t, names)
    blocks: list[str] = []
    for name, kind in (kinds or {}).items():
        shape = _blocks_shape(tuple(t.shape), kind, frozenset()) if isinstance(kind, int) else None
        if shape is not None and items[name].is_contiguous():  # else saved flat, as it is held
            items[name] = items[name].view(shape)
            blocks.append(name)
    return SavedParts(names, context, items, blocks)


def _placed_parts(t: torch.Tensor, local: torch.Tensor, names: list[str], context: Any, path: str) -> SavedParts:
    """A DTensor over a wrapper: each part but a table as a DTensor placed as ``t``, a block
    part through its view of blocks, which has the same placements."""
    from torch.distributed.tensor import DTensor

    kinds = _part_kinds(local, names)
    cls = type(local).__qualname__
    if kinds is None:
        raise UnsupportedStateError(
            f"state[{path!r}]: it is a DTensor over a {cls} (a low-bit optimizer's state under FSDP2), whose "
            f"parts ({', '.join(names)}) cannot be told apart: the class does not slice along its first "
            f"dimension, or this rank's shard ({list(local.shape)}) is too small to slice; use a full-precision "
            "optimizer for sharded parameters, or the low-bit one without FSDP")
    mesh, placements = t.device_mesh, tuple(t.placements)
    context = _shape_replaced(context, tuple(local.shape), tuple(t.shape))
    sharded, strided = _sharded_dims(placements, t.dim())
    items: dict[str, torch.Tensor] = {}
    blocks: list[str] = []
    for name in names:
        part, kind = getattr(local, name), kinds[name]
        if kind == "table":
            items[name] = part
            continue
        shape, local_shape = tuple(t.shape), tuple(local.shape)
        if isinstance(kind, int):
            shape = _blocks_shape(tuple(t.shape), kind, sharded, strided)
            local_shape = _blocks_shape(tuple(local.shape), kind, sharded, strided) if shape is not None else None
            if (shape is None or local_shape is None or len(shape) != len(local_shape)
                    or not part.is_contiguous()):
                raise UnsupportedStateError(
                    f"state[{path!r}]: it is a DTensor over a {cls} whose part {name!r} holds one value per "
                    f"{kind} elements, and blocks of {kind} do not divide the last dimension, nor the rows, of "
                    f"this rank's shard ({list(local.shape)} of {list(t.shape)}, placed {list(placements)}), so they "
                    "cannot be resharded; use a block size that divides the parameter's last dimension")
            part = part.view(local_shape)
            blocks.append(name)
        items[name] = DTensor.from_local(part, mesh, placements, shape=torch.Size(shape),
                                         stride=_contiguous_stride(shape), run_check=False)
    return SavedParts(names, context, items, blocks)


def _shape_replaced(context: Any, old: tuple[int, ...], new: tuple[int, ...]) -> Any:
    """``context`` with each shape equal to ``old`` (a list, tuple or ``torch.Size`` of
    ints, anywhere in its lists and tuples) made ``new``, of the same type. Why: a wrapper's
    context may hold its own shape (torchao's 4-bit state, whose codes are flat): under
    FSDP2 that is the rank's shard's, which another world size changes. Saved as the
    global shape, it is made the new shard's at the restore."""
    if isinstance(context, (list, tuple)):
        if context and tuple(context) == old and all(type(n) is int for n in context):
            return type(context)(new) if isinstance(context, (list, torch.Size)) else tuple(new)
        items = [_shape_replaced(item, old, new) for item in context]
        return type(context)(items) if isinstance(context, list) or type(context) is tuple else context
    return context


def _part_kinds(t: torch.Tensor, names: list[str]) -> dict[str, Any] | None:
    """Each part's kind (above): a part with the tensor's shape is "like"; a flat one whose
    length divides the tensor's is told from a table by the class's own slice of the first
    rows (a table stays whole); anything else is a table. None where that slice cannot be
    taken (the class has none, or the tensor is a single slice)."""
    parts = {name: getattr(t, name) for name in names}
    key = (type(t), tuple(t.shape), tuple((name, tuple(p.shape)) for name, p in parts.items()))
    if key in _KINDS:
        return _KINDS[key]
    kinds: dict[str, Any] = {}
    candidates: dict[str, int] = {}
    for name, part in parts.items():
        if part.shape == t.shape:
            kinds[name] = "like"
        elif part.dim() == 1 and 0 < part.numel() < t.numel() and t.numel() % part.numel() == 0:
            candidates[name] = t.numel() // part.numel()
        else:
            kinds[name] = "table"
    if candidates:
        kinds = _told_apart(t, parts, candidates, kinds)
    if len(_KINDS) >= _KINDS_KEPT:
        _KINDS.clear()
    _KINDS[key] = kinds
    return kinds


def _told_apart(t: torch.Tensor, parts: dict[str, torch.Tensor], candidates: dict[str, int],
                kinds: dict[str, Any]) -> dict[str, Any] | None:
    """Block parts told from tables by the class's slice of the fewest first rows that hold
    whole blocks of a candidate (a table's length can divide the tensor's too: a 256-entry
    map beside 65,536 values): a block part shrinks with the rows, a table keeps its length.
    A slice the class refuses (blocks it would cut) is tried with more rows."""
    rows = t.shape[0] if t.dim() else 0
    row_len = t.numel() // rows if rows else 0
    if not row_len:
        return None
    for first in sorted({k // math.gcd(k, row_len) for k in candidates.values()}):
        if first >= rows:
            return None
        try:
            with torch.no_grad():
                sliced = t[0:first]
            lengths = {name: getattr(sliced, name).numel() for name in candidates}
        except Exception:  # noqa: BLE001 - the class's own code: no slice, or one it refuses
            continue
        for name, k in candidates.items():
            if lengths[name] * k == first * row_len:
                kinds[name] = k
            elif lengths[name] == parts[name].numel():
                kinds[name] = "table"
            else:
                return None
        return kinds
    return None


def _sharded_dims(placements: tuple[Any, ...], ndim: int) -> tuple[frozenset[int], frozenset[int]]:
    """(dimensions some placement shards, those sharded in strides: FSDP2 over TP)."""
    sharded: set[int] = set()
    strided: set[int] = set()
    for placement in placements:
        dim = getattr(placement, "dim", None)
        if dim is None or placement.is_replicate():
            continue
        dim = dim % ndim if ndim else 0
        sharded.add(dim)
        if int(getattr(placement, "split_factor", 1)) > 1:
            strided.add(dim)
    return frozenset(sharded), frozenset(strided)


def _blocks_shape(shape: tuple[int, ...], k: int, sharded: frozenset[int],
                  strided: frozenset[int] = frozenset()) -> tuple[int, ...] | None:
    """The shape a part with one value per ``k`` consecutive elements of a tensor of
    ``shape`` is saved in: the tensor's, with ``1/k`` of its last dimension when ``k``
    divides it (each block then lies in one row, whatever shards the others), else its rows
    with ``1/k`` of a row's elements each, where only rows are sharded; None where blocks
    straddle what is sharded. The same rule for a plain tensor and a DTensor's global and
    local shapes, so that a checkpoint restores into either."""
    if shape and shape[-1] % k == 0 and len(shape) - 1 not in strided:
        return (*shape[:-1], shape[-1] // k)
    row_len = math.prod(shape[1:])
    if len(shape) >= 2 and row_len % k == 0 and sharded <= {0}:
        return (shape[0], row_len // k)
    return None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def blocks_template(param: torch.Tensor, shape: list[int], name: str) -> torch.Tensor | None:
    """A DTensor placed as ``param`` (an optimizer's sharded parameter) with the saved
    ``shape`` of a block part of its state, for a restore into a fresh optimizer to read this
    rank's blocks into; None where ``shape`` is not such a view of ``param``'s shape."""
    from torch.distributed.tensor import DTensor

    total = math.prod(shape)
    if not total or param.numel() % total:
        return None
    placements = tuple(param.placements)
    sharded, strided = _sharded_dims(placements, param.dim())
    if _blocks_shape(tuple(param.shape), param.numel() // total, sharded, strided) != tuple(shape):
        return None
    box = placed_box(tuple(shape), param.device_mesh, placements, name)
    local = torch.empty((), dtype=torch.uint8, device=local_tensor(param).device).expand(box.sizes)  # no memory
    return DTensor.from_local(local, param.device_mesh, placements, shape=torch.Size(shape),
                              stride=_contiguous_stride(tuple(shape)), run_check=False)


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def rebuilt(name: str, inner: dict[str, torch.Tensor], context: Any, shape: list[int], stride: list[int],
            path: str, blocks: Sequence[str] = ()) -> torch.Tensor:
    """The subclass ``name`` made from its saved parts, if the program allows the class;
    a DTensor over it where the parts are DTensors (sharded state, placed as they are)."""
    cls = _allowed(name)
    if cls is None:
        module, _, qualname = name.rpartition(".")
        raise StateError(
            f"key {path!r}: the checkpoint holds a {name} (a tensor subclass) where the state has none to "
            f"restore into, and this program does not allow that class to be rebuilt from a checkpoint: "
            f"import it and call torch.serialization.add_safe_globals([{qualname}]) (from {module}), as "
            "torch.load(weights_only=True) asks, or restore into state that holds one"
        )
    placed = next((part for part in inner.values() if is_dtensor(part)), None)
    parts = {part_name: local_tensor(part) for part_name, part in inner.items()}
    for part_name in blocks:
        parts[part_name] = parts[part_name].reshape(-1)
    outer_shape, outer_stride = torch.Size(shape), tuple(stride)
    if placed is not None:
        outer_shape = torch.Size(placed_box(tuple(shape), placed.device_mesh, tuple(placed.placements), path).sizes)
        outer_stride = _contiguous_stride(tuple(outer_shape))
        context = _shape_replaced(context, tuple(shape), tuple(outer_shape))
        if not outer_shape.numel():  # a low-bit state holds no empty shard (torchao keeps those plain)
            raise StateError(
                f"key {path!r}: this rank's shard of the saved {name} would be empty ({list(outer_shape)} of "
                f"{list(shape)}), which the class cannot hold; restore at a world size that gives every rank "
                "some of its first dimension")
    try:
        local = cls.__tensor_unflatten__(parts, context, outer_shape, outer_stride)
    except Exception as exc:  # noqa: BLE001 - the class's own code, whatever it raises
        raise StateError(f"key {path!r}: {name}.__tensor_unflatten__ refused the saved parts: "
                         f"{type(exc).__name__}: {exc}") from exc
    if placed is None:
        return local
    kinds = _part_kinds(local, list(parts))
    misplaced = [part_name for part_name, part in inner.items()
                 if kinds is None or (kinds[part_name] == "table") == is_dtensor(part)]
    if misplaced:  # a shard's codes beside a whole tensor's scales would misread every block
        raise StateError(f"key {path!r}: the saved parts of this {name} are not placed as its sharded state needs "
                         f"({', '.join(misplaced)}); restore into an optimizer that has taken a step, or without FSDP")
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, placed.device_mesh, placed.placements, shape=torch.Size(shape),
                              stride=tuple(stride), run_check=False)


def _allowed(name: str) -> type | None:
    """The tensor subclass of that name that this program holds in its state, or has among
    torch's allowed globals (weights_only's list)."""
    if name in _HELD:
        return _HELD[name]
    for entry in torch.serialization.get_safe_globals():
        cls = entry[0] if isinstance(entry, tuple) else entry  # (object, name) pairs are allowed too
        if isinstance(cls, type) and issubclass(cls, torch.Tensor) and class_name(cls) == name:
            return cls
    return None
