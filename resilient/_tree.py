"""Turning the user's state into a JSON skeleton plus named tensors, and back.

The skeleton keeps the exact nesting, container types and key types (optimizer state is
keyed by int) so that ``load_state_dict`` receives what ``state_dict`` gave. Only plain
JSON scalars are stored as values: anything else is refused at save time, naming the key,
because writing it would need pickle, and a checkpoint must never run code when loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, Callable
from urllib.parse import quote

import numpy as np
import torch
from torch.nn.parameter import is_lazy

from ._errors import UnsupportedStateError
from ._format import DTYPE_ITEMSIZE
from ._generators import stateful_generator
from ._kinds import (FROM_TEXT, SCALARS, array_tensor, as_bytes, as_numpy, as_set, from_text, number_scalar,
                     scalar_set, text_kind)
from ._per_rank import PerRank
from ._snapshot import PLAIN_TYPES, local_tensor
from ._subclasses import SavedParts, class_name, rebuilt, saved_parts
from ._wrappers import adapter_for, plain_module_keys, state_holder

__all__ = ["Flattened", "flatten_state", "flatten_target", "build_value", "child_path", "is_stateful",
           "per_rank_path", "tensor_names", "without_plain_bytes", "wrapped_parts"]

#: torch's dtypes that the format can name (a set lookup per tensor on the save's path)
_SAVABLE_DTYPES = frozenset(getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name))


_META_REMEDY = "materialize it first (module.to_empty(device=...), then initialize or restore it)"


def without_plain_bytes(t: torch.Tensor) -> tuple[str, str] | None:
    """(why, what to do) when the tensor's elements are not plain bytes in memory that a
    checkpoint can copy out or read into; None when they are. Caught here, by name, because
    each of these fails later and far from the user's key otherwise: a quantized tensor's
    copy crashed the process, a meta tensor was "restored" by a copy that does nothing, and
    a wrapper subclass raised torch's "invalid python storage" naming nothing."""
    whole, t = t, local_tensor(t)  # a DTensor: its local tensor, read directly
    if (type(t) in PLAIN_TYPES and t.layout is torch.strided
            and not (t.is_nested or t.is_quantized or t.is_meta)):
        return None  # the common case in one test: this runs for every tensor of every save
    sharded = getattr(sys.modules.get("torch.distributed._shard.sharded_tensor.api"), "ShardedTensor", None)
    if isinstance(sharded, type) and isinstance(t, sharded):  # before any attribute: each raises for it
        return ("it is a ShardedTensor, as FSDP (FullyShardedDataParallel) made without a device mesh gives in "
                "its sharded state dict (DCP's get_state_dict)",
                "make it with FullyShardedDataParallel(..., device_mesh=init_device_mesh(...)), whose sharded "
                "state dicts hold DTensors, which resilient saves and reshards, or use FSDP2 (fully_shard)")
    if t.is_nested:
        return "it is a nested tensor", "save its components (tensor.unbind()) instead"
    if t.is_sparse or t.layout != torch.strided:
        return f"it has layout {t.layout}", "convert it to a dense tensor first"
    if t.is_quantized:
        return ("it is a quantized tensor, whose scale and zero point the format does not store",
                "save tensor.int_repr() with tensor.q_scale() and tensor.q_zero_point(), or tensor.dequantize()")
    if t.is_meta:
        return "it is on the meta device and has no data", _META_REMEDY
    if is_lazy(t):
        return ("it is an uninitialized parameter of a lazy module (shape unknown until its first forward)",
                "run a forward pass first, or restore into it (its shape is then the checkpoint's)")
    try:
        t.untyped_storage().data_ptr()  # a wrapper's own data_ptr() is 0, not an error
    except RuntimeError:
        if whole is not t:  # placeable ones (FSDP2 with torchao's low-bit optimizer) are saved by parts
            return (f"it is a DTensor over a {type(t).__qualname__}, a tensor subclass whose parts cannot be "
                    "placed as shards (the class does not slice along rows, or its blocks straddle what is "
                    "sharded)",
                    "use a full-precision optimizer for sharded parameters, or the low-bit one without FSDP")
        return (f"it is a {type(t).__qualname__}, a tensor subclass without storage of its own that does not "
                "say how to take it apart (__tensor_flatten__ and __tensor_unflatten__)",
                "save the plain tensors it wraps (or their state_dict)")
    return None


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


#: keys that ``quote`` leaves as they are: most are (``layers.0.weight``, ``exp_avg``), and
#: matching them costs a tenth of quoting, once per tensor of every save
_UNQUOTED = re.compile(r"[A-Za-z0-9_.~-]*")


#: each key's text in a name, kept: the same few thousand keys (parameter names, ``exp_avg``,
#: list positions) come at every save, and a lookup is a third of matching (0.3 against
#: 0.9 µs, ~40,000 times a save of 26,800 tensors)
_KEY_TEXTS: dict[str | int, str] = {}
_KEY_TEXTS_KEPT = 1 << 16


def child_path(path: str, key: str | int) -> str:
    """The checkpoint name of ``key`` under ``path``."""
    # kept for plain str and int keys only: a str enum equals its value but is named otherwise
    kept = type(key) is str or type(key) is int
    text = _KEY_TEXTS.get(key) if kept else None
    if text is None:
        text = str(key)
        if not _UNQUOTED.fullmatch(text):
            text = quote(text, safe="")
        if kept:
            if len(_KEY_TEXTS) >= _KEY_TEXTS_KEPT:
                _KEY_TEXTS.clear()
            _KEY_TEXTS[key] = text
    return f"{path}/{text}" if path else text


def per_rank_path(key: str, rank: int) -> str:
    """Where rank ``rank``'s tensors of per-rank entry ``key`` are named: ``key@rank``
    (keys are quoted, so a literal '@' in a key can never produce this name)."""
    return f"{child_path('', key)}@{rank}"


class Flattened:
    """The result of flattening: ``tree`` (JSON-able) and ``tensors`` (name -> tensor)."""

    def __init__(self, *, saving: bool = True, plain_keys: bool = True) -> None:
        # Restore targets (saving=False) keep every tensor, savable or not: restore then
        # names the one it cannot fill, instead of rebuilding the whole entry around it.
        self.saving = saving
        # modules' keys without the _orig_mod. of blocks compiled one by one (_wrappers);
        # off for a restore target whose checkpoint holds them (an earlier version's)
        self.plain_keys = plain_keys
        self.tree: dict[str, Any] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.per_rank: set[str] = set()  # names of tensors under PerRank entries

    def encode_entry(self, key: str, obj: Any, rank: int) -> dict[str, Any]:
        """A top-level entry; a ``PerRank`` one names its tensors by rank. A module wrapper's
        entry holds its module's state (``_wrappers``)."""
        if not isinstance(obj, PerRank):
            return self.encode(state_holder(obj), child_path("", key), expand_stateful=True)
        before = set(self.tensors)
        node = {"t": "per_rank", "sd": self.encode(state_holder(obj.value), per_rank_path(key, rank),
                                                   expand_stateful=True)}
        self.per_rank |= set(self.tensors) - before
        return node

    def encode(self, obj: Any, path: str, *, expand_stateful: bool) -> dict[str, Any]:
        if isinstance(obj, torch.Tensor):
            parts = saved_parts(obj, path, saving=self.saving) if type(obj) not in PLAIN_TYPES else None
            if parts is not None:
                return self._wrapped(obj, parts, path)
            unplain = without_plain_bytes(obj) if self.saving else None
            if unplain is not None:
                why, remedy = unplain
                raise UnsupportedStateError(f"state[{path!r}]: {why}, so it cannot be checkpointed; {remedy}")
            if self.saving and obj.dtype not in _SAVABLE_DTYPES:
                raise UnsupportedStateError(
                    f"state[{path!r}]: dtype {obj.dtype} is not one the checkpoint format knows "
                    "(resilient._format.DTYPE_ITEMSIZE); convert the tensor first"
                )
            if path in self.tensors:
                raise UnsupportedStateError(f"state[{path!r}]: two entries map to this name")
            self.tensors[path] = obj
            return {"t": "tensor", "name": path}
        if type(obj) in _PLAIN:  # the commonest leaf (a log's numbers), before the checks objects need
            return {"t": "v", "v": obj}
        if isinstance(obj, PerRank):
            raise UnsupportedStateError(
                f"state[{path!r}]: PerRank must wrap a top-level entry of the state "
                "(state['name'] = PerRank(value))"
            )
        holder = (adapter_for(obj) or (obj if is_stateful(obj) else None)) if expand_stateful else None
        if holder is not None and not self.saving and getattr(holder, "holds_no_tensors", False):
            return {"t": "obj", "sd": {"t": "v", "v": None}}  # a restore target whose state_dict() acts (_loaders)
        if holder is not None:
            state = _state_dict_of(holder, path)
            if self.plain_keys and isinstance(holder, torch.nn.Module):
                state = plain_module_keys(holder, state)
            return {"t": "obj", "sd": self.encode(state, path, expand_stateful=False)}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # a config's dataclass: its fields as a dict, back into the program's instance
            obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        if isinstance(obj, Mapping):
            items = []
            seen: dict[str, Any] = {}  # each key's name in the checkpoint -> the key
            for key, value in obj.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise UnsupportedStateError(
                        f"state[{path!r}]: key {key!r} of type {type(key).__name__} "
                        "cannot be checkpointed; use str or int keys"
                    )
                child = child_path(path, key)
                if child in seen:
                    raise UnsupportedStateError(
                        f"state[{path!r}]: keys {seen[child]!r} and {key!r} are both named {child!r} in a "
                        "checkpoint; make them distinct"
                    )
                seen[child] = key
                # an object in the program's own dict (the models of a GAN under one entry) is
                # saved through its state_dict(), as at the top; not one inside a state_dict()
                items.append([key, self.encode(_held(value, expand_stateful), child, expand_stateful=expand_stateful)])
            return {"t": "dict", "items": items}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {
                "t": kind,
                "items": [
                    self.encode(_held(v, expand_stateful), child_path(path, i), expand_stateful=expand_stateful)
                    for i, v in enumerate(obj)
                ],
            }
        if isinstance(obj, SCALARS):
            return {"t": "v", "v": obj}
        if number_scalar(obj):
            return {"t": "v", "v": obj.item()}  # back as numpy's kind where the program holds one
        if isinstance(obj, np.ndarray):
            if not self.saving:  # filled where it fits, replaced where not (_restore._into)
                return {"t": "v", "v": None}
            return {**self.encode(array_tensor(obj, path), path, expand_stateful=False), "numpy": True}
        if isinstance(obj, (bytes, bytearray)):
            if not self.saving:  # not a target: the saved bytes replace it (_restore._into)
                return {"t": "v", "v": None}
            data = (torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj
                    else torch.empty(0, dtype=torch.uint8, device="cpu"))
            return {**self.encode(data, path, expand_stateful=False), "bytes": type(obj).__name__}
        if scalar_set(obj):
            # in an order alike on every rank (ranks' trees are compared); a set's order is not
            items = sorted(obj, key=lambda v: (type(v).__name__, v))
            return {"t": "list", "items": [{"t": "v", "v": v} for v in items], "set": type(obj).__name__}
        text = text_kind(obj)
        if text is not None:
            return {"t": "v", "v": text[2](obj), "kind": text[0]}
        if isinstance(obj, enum.Enum):  # by name: back as the member where the program holds one
            return {"t": "v", "v": obj.name, "kind": "enum"}
        raise UnsupportedStateError(
            f"state[{path!r}]: a value of type {type(obj).__module__}.{type(obj).__qualname__} "
            f"cannot be checkpointed without pickle; {_remedy(obj)}"
        )

    def _wrapped(self, obj: torch.Tensor, parts: SavedParts, path: str) -> dict[str, Any]:
        """A wrapper subclass (``_subclasses``), or a DTensor over one: its parts under its
        name, its flatten context as plain values, checked to come back equal, since the
        class is rebuilt from it; ``blocks`` names the parts saved as a view of blocks."""
        if self.saving and parts.saved_node is not None and parts.saved_node[0] == path:
            return self._kept(*parts.saved_node)
        cls = class_name(type(local_tensor(obj)))
        if self.saving and parts.saved_context is not None:
            saved_context = parts.saved_context
        elif self.saving:
            scratch = Flattened()
            try:
                saved_context = scratch.encode(parts.context, path, expand_stateful=False)
            except UnsupportedStateError:
                saved_context = None
            if (saved_context is None or scratch.tensors
                    or build_value(saved_context, lambda name: None) != parts.context):
                raise UnsupportedStateError(
                    f"state[{path!r}]: a {cls}'s flatten context ({str(parts.context)[:200]}) is not plain values "
                    "(numbers, strings, dtypes, lists, dicts), so it cannot be checkpointed without pickle"
                )
            parts.saved_context = saved_context
        else:
            saved_context = {"t": "v", "v": None}  # a restore target's inner tensors are what count
        items = [[name, self.encode(parts.items[name], child_path(path, name), expand_stateful=False)]
                 for name in parts.names]
        node = {"t": "wrapped", "class": cls, "name": path, "shape": list(obj.shape), "stride": list(obj.stride()),
                "ctx": saved_context, "items": items}
        if parts.blocks:
            node["blocks"] = list(parts.blocks)
        if self.saving:
            parts.saved_node = (path, node, tuple((child_path(path, name), parts.items[name]) for name in parts.names))
        return node

    def _kept(self, path: str, node: dict[str, Any], tensors: tuple[tuple[str, torch.Tensor], ...]) -> dict[str, Any]:
        """A wrapper's node made at an earlier save, its parts the same tensors (checked
        then): flattening 400 low-bit optimizer states under FSDP2 took 6.2 ms of every save
        with the parts kept (``_PLACED``), 2.8 ms with the node kept too (as many plain
        DTensor states: 2.3 ms)."""
        for name, tensor in tensors:
            if name in self.tensors:
                raise UnsupportedStateError(f"state[{name!r}]: two entries map to this name")
            self.tensors[name] = tensor
        return node


def _held(value: Any, expand_stateful: bool) -> Any:
    """What holds the state of an object in the program's own dicts and lists: a module
    wrapper's (DDP, torch.compile) module, as at the top level (``_wrappers``), so the
    checkpoint names the module's own keys and restores into the model wrapped or not."""
    return state_holder(value) if expand_stateful and is_stateful(value) else value


def _remedy(obj: Any) -> str:
    """What to store instead of ``obj``: numpy's values, which torch.save users keep in their
    state, get the conversion that keeps them whole; a random generator, where it is kept."""
    if is_stateful(obj):  # met inside another object's state_dict(), where nothing calls its load_state_dict
        return ("an object inside a state_dict() is not saved through its own; return obj.state_dict() "
                "there, or keep the object in the state's own dicts and lists")
    if stateful_generator(obj) is not None:
        return ("a random generator is saved in the state itself or its own dicts and lists (state['name'] = "
                "generator), and restored into the same object; not inside a state_dict()")
    if type(obj).__module__ == "numpy":
        return "store value.item() (a Python value, restored as one), or value.tolist()"
    if isinstance(obj, torch.utils.data.DataLoader):
        return ("a DataLoader keeps no position to save: torchdata's StatefulDataLoader takes its place with the "
                "same arguments and is saved and restored where it was (a shuffled order too); or store the "
                "epoch and the batch index, and skip to them")
    for kinds, instead in _INSTEAD:
        if isinstance(obj, kinds):
            return f"store {instead}"
    return ("store tensors, numbers, strings, lists and dicts, or an object with "
            "state_dict()/load_state_dict()")


#: JSON's own kinds, exactly (a subclass goes through every check, as an object may)
_PLAIN = frozenset(SCALARS)

#: the plain value that keeps each of these whole, for the error that refuses them: values
#: a config or a sampler holds, which torch.save pickled
_INSTEAD: list[tuple[type | tuple[type, ...], str]] = [
    (os.PathLike, "str(value) (restored as a string)"),
    ((set, frozenset), "a set of numbers and strings, or sorted(value) (restored as a list)"),
]


def flatten_state(state: Mapping[str, Any], rank: int = 0) -> Flattened:
    """Flatten every entry of ``state`` (objects with ``state_dict`` are expanded once)."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"state must be a mapping of names to objects, got {type(state).__name__}"
        )
    flat = Flattened()
    flat.tree = {
        "t": "dict",
        "items": [[k, flat.encode_entry(k, v, rank)] for k, v in state.items()],
    }
    for key in state:
        if not isinstance(key, str):
            raise UnsupportedStateError(f"state keys must be str, got {key!r}")
    return flat


def flatten_target(obj: Any, path: str, plain_keys: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of a restore target (after expanding ``state_dict``), by checkpoint name."""
    flat = Flattened(saving=False, plain_keys=plain_keys)
    try:
        flat.encode(obj, path, expand_stateful=True)
    except UnsupportedStateError:
        # A target may hold things we could never save (e.g. a live iterator in a plain
        # value slot); they are replaced by the checkpoint's value, so they are not an error.
        return {}
    return flat.tensors


def tensor_names(node: dict[str, Any]) -> list[str]:
    """Names of the tensors a saved tree holds, in tree order."""
    names: list[str] = []
    build_value(node, lambda n: names.append(n), kinds=False)  # type: ignore[func-returns-value]
    return names


def wrapped_parts(node: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(names of the tensors a saved tree holds as a tensor subclass's parts, those of them
    saved as views of blocks, ``_subclasses``)."""
    parts: set[str] = set()
    blocks: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        kind = current["t"]
        if kind == "wrapped":
            names = {name: child["name"] for name, child in current["items"] if child["t"] == "tensor"}
            parts |= set(names.values())
            blocks |= {names[name] for name in current.get("blocks", []) if name in names}
        elif kind in ("obj", "per_rank"):
            stack.append(current["sd"])
        elif kind == "dict":
            stack += [child for _, child in current["items"]]
        elif kind in ("list", "tuple"):
            stack += current["items"]
    return parts, blocks


def build_value(node: dict[str, Any], tensor: Callable[[str], torch.Tensor], *, kinds: bool = True) -> Any:
    """Rebuild a Python value from a skeleton node, asking ``tensor(name)`` for tensors.
    numpy's arrays, bytes and sets come back as such, or, unless ``kinds``, as the tensors
    and lists they are stored as (an export: every file format it writes holds those)."""
    kind = node["t"]
    if kind == "tensor":
        value = tensor(node["name"])
        if kinds and node.get("bytes") in ("bytes", "bytearray"):
            return as_bytes(value, node["bytes"])
        return as_numpy(value) if kinds and node.get("numpy") is True else value
    if kind == "v":
        return from_text(node["v"], node["kind"]) if kinds and node.get("kind") in FROM_TEXT else node["v"]
    if kind == "dict":
        return {k: build_value(v, tensor, kinds=kinds) for k, v in node["items"]}
    if kind == "list":
        items = [build_value(v, tensor, kinds=kinds) for v in node["items"]]
        return as_set(items, node["set"]) if kinds and node.get("set") in ("set", "frozenset") else items
    if kind == "tuple":
        return tuple(build_value(v, tensor, kinds=kinds) for v in node["items"])
    if kind in ("obj", "per_rank"):
        return build_value(node["sd"], tensor, kinds=kinds)
    if kind == "wrapped":  # a tensor subclass: rebuilt from its parts, or, unless kinds, the parts
        inner = {k: build_value(v, tensor, kinds=kinds) for k, v in node["items"]}
        if not kinds:
            return inner
        return rebuilt(node["class"], inner, build_value(node["ctx"], tensor), node["shape"], node["stride"],
                       node["name"], node.get("blocks", []))
    raise ValueError(f"unknown node type {kind!r} in checkpoint tree")


def _state_dict_of(holder: Any, path: str) -> Any:
    """``holder.state_dict()``; an error it raises is told which entry it was saving. Why:
    the error of an object that cannot give its state (accelerate's prepared DataLoader
    without ``use_stateful_dataloader``: an ``AttributeError`` about ``dl_state_dict``)
    named neither the entry nor the object, only library internals. The note keeps the
    error's type, so a program's own ``except`` still catches it."""
    try:
        return holder.state_dict()
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"resilient: raised by {type(holder).__name__}.state_dict() of state[{path!r}], "
                         "which is being saved (pass what that object can give instead, or leave it out)")
        raise
