"""Turning the user's state into a JSON skeleton plus named tensors, and back.

The skeleton keeps the exact nesting, container types and key types (optimizer state is
keyed by int) so that ``load_state_dict`` receives what ``state_dict`` gave. Only plain
JSON scalars are stored as values: anything else is refused at save time, naming the key,
because writing it would need pickle, and a checkpoint must never run code when loaded.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import pathlib
import re
import uuid
import warnings
from collections.abc import Mapping
from typing import Any, Callable
from urllib.parse import quote

import numpy as np
import torch
from torch.nn.parameter import is_lazy

from ._errors import UnsupportedStateError
from ._format import DTYPE_ITEMSIZE
from ._generators import stateful_generator
from ._per_rank import PerRank
from ._snapshot import PLAIN_TYPES, local_tensor
from ._wrappers import state_holder

__all__ = ["Flattened", "flatten_state", "flatten_target", "build_value", "child_path", "is_stateful", "is_plain_leaf",
           "per_rank_path", "tensor_names", "without_plain_bytes"]

_SCALARS = (type(None), bool, int, float, str)
#: torch's dtypes that the format can name (a set lookup per tensor on the save's path)
_SAVABLE_DTYPES = frozenset(getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name))


_META_REMEDY = "materialize it first (module.to_empty(device=...), then initialize or restore it)"


def without_plain_bytes(t: torch.Tensor) -> tuple[str, str] | None:
    """(why, what to do) when the tensor's elements are not plain bytes in memory that a
    checkpoint can copy out or read into; None when they are. Caught here, by name, because
    each of these fails later and far from the user's key otherwise: a quantized tensor's
    copy crashed the process, a meta tensor was "restored" by a copy that does nothing, and
    a wrapper subclass raised torch's "invalid python storage" naming nothing."""
    t = local_tensor(t)  # a DTensor: its local tensor, read directly
    if (t.layout is torch.strided and not (t.is_nested or t.is_quantized or t.is_meta)
            and type(t) in PLAIN_TYPES):
        return None  # the common case in one test: this runs for every tensor of every save
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
        return (f"it is a {type(t).__qualname__}, a tensor subclass without storage of its own",
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

    def __init__(self, *, saving: bool = True) -> None:
        # Restore targets (saving=False) keep every tensor, savable or not: restore then
        # names the one it cannot fill, instead of rebuilding the whole entry around it.
        self.saving = saving
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
        if isinstance(obj, PerRank):
            raise UnsupportedStateError(
                f"state[{path!r}]: PerRank must wrap a top-level entry of the state "
                "(state['name'] = PerRank(value))"
            )
        holder = (obj if is_stateful(obj) else stateful_generator(obj)) if expand_stateful else None
        if holder is not None:
            return {"t": "obj", "sd": self.encode(holder.state_dict(), path, expand_stateful=False)}
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
        if isinstance(obj, _SCALARS):
            return {"t": "v", "v": obj}
        if _number_scalar(obj):
            return {"t": "v", "v": obj.item()}  # back as numpy's kind where the program holds one
        if isinstance(obj, np.ndarray):
            if not self.saving:  # filled where it fits, replaced where not (_restore._into)
                return {"t": "v", "v": None}
            return {**self.encode(_array_tensor(obj, path), path, expand_stateful=False), "numpy": True}
        if isinstance(obj, (bytes, bytearray)):
            if not self.saving:  # not a target: the saved bytes replace it (_restore._into)
                return {"t": "v", "v": None}
            data = torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj else torch.empty(0, dtype=torch.uint8)
            return {**self.encode(data, path, expand_stateful=False), "bytes": type(obj).__name__}
        if _scalar_set(obj):
            # in an order alike on every rank (ranks' trees are compared); a set's order is not
            items = sorted(obj, key=lambda v: (type(v).__name__, v))
            return {"t": "list", "items": [{"t": "v", "v": v} for v in items], "set": type(obj).__name__}
        text = _text_kind(obj)
        if text is not None:
            return {"t": "v", "v": text[2](obj), "kind": text[0]}
        if isinstance(obj, enum.Enum):  # by name: back as the member where the program holds one
            return {"t": "v", "v": obj.name, "kind": "enum"}
        raise UnsupportedStateError(
            f"state[{path!r}]: a value of type {type(obj).__module__}.{type(obj).__qualname__} "
            f"cannot be checkpointed without pickle; {_remedy(obj)}"
        )


def _held(value: Any, expand_stateful: bool) -> Any:
    """What holds the state of an object in the program's own dicts and lists: a module
    wrapper's (DDP, torch.compile) module, as at the top level (``_wrappers``), so the
    checkpoint names the module's own keys and restores into the model wrapped or not."""
    return state_holder(value) if expand_stateful and is_stateful(value) else value


def _array_tensor(array: np.ndarray, path: str) -> torch.Tensor:
    """A numpy array's values as a tensor (its memory, when contiguous), saved as one and
    restored as an array where the program holds one: numpy's arrays are what torch.save
    users keep in a sampler's or a metric's state. Kinds with no tensor dtype (strings,
    objects, dates) are refused by path."""
    if not _numeric_array(array):
        raise UnsupportedStateError(
            f"state[{path!r}]: a numpy array of dtype {array.dtype} cannot be checkpointed without pickle; "
            "store numbers (array.astype(...)), or strings in a list (array.tolist())")
    with warnings.catch_warnings():  # a read-only array: the save only reads it
        warnings.simplefilter("ignore", UserWarning)
        try:
            return torch.from_numpy(np.ascontiguousarray(array))
        except TypeError as exc:  # float128 and the like
            raise UnsupportedStateError(f"state[{path!r}]: a numpy array of dtype {array.dtype} has no tensor "
                                        f"dtype ({exc}); convert it (array.astype(np.float64))") from exc


def _as_bytes(value: Any, kind: str) -> Any:
    """Saved bytes as bytes again (a manifest's flag on another kind of tensor: its bytes)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    data = bytes(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return data if kind == "bytes" else bytearray(data)


def _as_set(items: list[Any], kind: str) -> Any:
    """A saved set as one again (a manifest's flag on a list of unhashable values: the list)."""
    try:
        return set(items) if kind == "set" else frozenset(items)
    except TypeError:
        return items


def _as_numpy(value: Any) -> Any:
    """A tensor saved from a numpy array, as an array again (sharing its memory); one that
    cannot be (a manifest's flag on a bfloat16 tensor) stays a tensor."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        try:
            return value.numpy()
        except (TypeError, RuntimeError):
            return value
    return value


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
    for kinds, instead in _INSTEAD:
        if isinstance(obj, kinds):
            return f"store {instead}"
    return ("store tensors, numbers, strings, lists and dicts, or an object with "
            "state_dict()/load_state_dict()")


#: the plain value that keeps each of these whole, for the error that refuses them: values
#: a config or a sampler holds, which torch.save pickled
_INSTEAD: list[tuple[type | tuple[type, ...], str]] = [
    (os.PathLike, "str(value) (restored as a string)"),
    ((set, frozenset), "a set of numbers and strings, or sorted(value) (restored as a list)"),
]


def _torch_dtype(text: str) -> torch.dtype:
    value = getattr(torch, text, None)  # an attribute looked up, never called
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {text!r}")
    return value


#: values a config holds that are saved as text and made again from it by a parser, never
#: by code of the checkpoint's: (kind, type, to text, from text). A datetime before a date
#: (it is one).
_TEXT_KINDS: tuple[tuple[str, type, Callable[[Any], str], Callable[[str], Any]], ...] = (
    ("path", pathlib.PurePath, str, pathlib.Path),
    ("datetime", datetime.datetime, datetime.datetime.isoformat, datetime.datetime.fromisoformat),
    ("date", datetime.date, datetime.date.isoformat, datetime.date.fromisoformat),
    ("timedelta", datetime.timedelta, lambda d: repr(d.total_seconds()),
     lambda t: datetime.timedelta(seconds=float(t))),
    ("dtype", torch.dtype, lambda d: str(d).removeprefix("torch."), _torch_dtype),
    ("device", torch.device, str, torch.device),
    ("complex", complex, repr, complex),
    ("uuid", uuid.UUID, str, uuid.UUID),
)
_FROM_TEXT = {kind: parse for kind, _, _, parse in _TEXT_KINDS}


def _text_kind(value: Any) -> tuple[str, type, Callable[[Any], str], Callable[[str], Any]] | None:
    return next((kind for kind in _TEXT_KINDS if isinstance(value, kind[1])), None)


def _from_text(text: Any, kind: str) -> Any:
    """A value saved as text, made again (a manifest's text that does not parse: the text)."""
    try:
        return _FROM_TEXT[kind](text) if isinstance(text, str) else text
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return text


def _number_scalar(value: Any) -> bool:
    return isinstance(value, np.generic) and type(value.item()) in (bool, int, float)


def _scalar_set(value: Any) -> bool:
    return isinstance(value, (set, frozenset)) and all(isinstance(v, _SCALARS) for v in value)


def is_plain_leaf(value: Any) -> bool:
    """Whether a checkpoint holds ``value`` without pickle as a leaf: a tensor, a JSON scalar,
    numpy's numbers, bytes, a set of scalars, or a value kept as text (a path, a date, a
    torch dtype or device, a complex number, a UUID, an enum's member by name). What the
    Lightning plugin keeps as is."""
    if isinstance(value, (torch.Tensor, bytes, bytearray, *_SCALARS)) or _number_scalar(value) or _scalar_set(value):
        return True
    return _numeric_array(value) or _text_kind(value) is not None or isinstance(value, enum.Enum)


def _numeric_array(value: Any) -> bool:
    """A numpy array of numbers in this machine's byte order: what a tensor can hold."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.dtype.byteorder != ">"


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


def flatten_target(obj: Any, path: str) -> dict[str, torch.Tensor]:
    """Tensors of a restore target (after expanding ``state_dict``), by checkpoint name."""
    flat = Flattened(saving=False)
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
    build_value(node, lambda n: names.append(n))  # type: ignore[func-returns-value]
    return names


def build_value(node: dict[str, Any], tensor: Callable[[str], torch.Tensor], *, kinds: bool = True) -> Any:
    """Rebuild a Python value from a skeleton node, asking ``tensor(name)`` for tensors.
    numpy's arrays, bytes and sets come back as such, or, unless ``kinds``, as the tensors
    and lists they are stored as (an export: every file format it writes holds those)."""
    kind = node["t"]
    if kind == "tensor":
        value = tensor(node["name"])
        if kinds and node.get("bytes") in ("bytes", "bytearray"):
            return _as_bytes(value, node["bytes"])
        return _as_numpy(value) if kinds and node.get("numpy") is True else value
    if kind == "v":
        return _from_text(node["v"], node["kind"]) if kinds and node.get("kind") in _FROM_TEXT else node["v"]
    if kind == "dict":
        return {k: build_value(v, tensor, kinds=kinds) for k, v in node["items"]}
    if kind == "list":
        items = [build_value(v, tensor, kinds=kinds) for v in node["items"]]
        return _as_set(items, node["set"]) if kinds and node.get("set") in ("set", "frozenset") else items
    if kind == "tuple":
        return tuple(build_value(v, tensor, kinds=kinds) for v in node["items"])
    if kind in ("obj", "per_rank"):
        return build_value(node["sd"], tensor, kinds=kinds)
    raise ValueError(f"unknown node type {kind!r} in checkpoint tree")
