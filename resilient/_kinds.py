"""Values a checkpoint holds in another form than the program's, and how each comes back.

JSON holds numbers, strings, lists and dicts; the data files hold tensors. What programs
keep in their state besides those (numpy's arrays and numbers, bytes, sets, paths, dates,
torch dtypes, enums, dataclasses, namedtuples) was refused, or came back as something else:
torch.save pickles them, and a checkpoint never runs code when it is read. So each is
stored as one of those forms, flagged with its kind where the tree has room (docs/format.md),
and made again by a parser or by the program's own class at restore: the class that a
restored value takes is the one the program's state holds at that place, never one the
checkpoint names. Without such a target (an export) the stored form is what comes back.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import pathlib
import uuid
import warnings
from typing import Any, Callable

import numpy as np
import torch

from ._errors import UnsupportedStateError

__all__ = ["SCALARS", "FROM_TEXT", "array_tensor", "as_bytes", "as_numpy", "as_set", "from_text", "into_own_kind",
           "is_plain_leaf", "number_scalar", "numeric_array", "scalar_set", "text_kind", "NOT_A_KIND"]

SCALARS = (type(None), bool, int, float, str)

#: restores a saved value into the program's value at the same place (``_restore._into``)
Into = Callable[[Any, Any], Any]

#: what ``into_own_kind`` returns for a value of none of these kinds
NOT_A_KIND = object()


def array_tensor(array: np.ndarray, path: str) -> torch.Tensor:
    """A numpy array's values as a tensor (its memory, when contiguous), saved as one and
    restored as an array where the program holds one: numpy's arrays are what torch.save
    users keep in a sampler's or a metric's state. Kinds with no tensor dtype (strings,
    objects, dates) are refused by path."""
    if not numeric_array(array):
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


def as_bytes(value: Any, kind: str) -> Any:
    """Saved bytes as bytes again (a manifest's flag on another kind of tensor: its bytes)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    data = bytes(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return data if kind == "bytes" else bytearray(data)


def as_set(items: list[Any], kind: str) -> Any:
    """A saved set as one again (a manifest's flag on a list of unhashable values: the list)."""
    try:
        return set(items) if kind == "set" else frozenset(items)
    except TypeError:
        return items


def as_numpy(value: Any) -> Any:
    """A tensor saved from a numpy array, as an array again (sharing its memory); one that
    cannot be (a manifest's flag on a bfloat16 tensor) stays a tensor."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        try:
            return value.numpy()
        except (TypeError, RuntimeError):
            return value
    return value


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
FROM_TEXT = {kind: parse for kind, _, _, parse in _TEXT_KINDS}


def text_kind(value: Any) -> tuple[str, type, Callable[[Any], str], Callable[[str], Any]] | None:
    return next((kind for kind in _TEXT_KINDS if isinstance(value, kind[1])), None)


def from_text(text: Any, kind: str) -> Any:
    """A value saved as text, made again (a manifest's text that does not parse: the text)."""
    try:
        return FROM_TEXT[kind](text) if isinstance(text, str) else text
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return text


def number_scalar(value: Any) -> bool:
    return isinstance(value, np.generic) and type(value.item()) in (bool, int, float)


def scalar_set(value: Any) -> bool:
    return isinstance(value, (set, frozenset)) and all(isinstance(v, SCALARS) for v in value)


def is_plain_leaf(value: Any) -> bool:
    """Whether a checkpoint holds ``value`` without pickle as a leaf: a tensor, a JSON scalar,
    numpy's numbers, bytes, a set of scalars, or a value kept as text (a path, a date, a
    torch dtype or device, a complex number, a UUID, an enum's member by name). What the
    Lightning plugin keeps as is."""
    if isinstance(value, (torch.Tensor, bytes, bytearray, *SCALARS)) or number_scalar(value) or scalar_set(value):
        return True
    return numeric_array(value) or text_kind(value) is not None or isinstance(value, enum.Enum)


def numeric_array(value: Any) -> bool:
    """A numpy array of numbers in this machine's byte order: what a tensor can hold."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.dtype.byteorder != ">"


def _into_dataclass(live: Any, saved: dict[str, Any], into: Into) -> Any:
    """A dataclass's saved fields, into the program's instance (a frozen one: a copy made by
    ``dataclasses.replace``): a config read back as its own class, not a dict. Saved fields
    the class no longer has are left out; fields the checkpoint lacks keep their values."""
    fields = dataclasses.fields(live)
    names, init = {f.name for f in fields}, {f.name for f in fields if f.init}
    values = {name: into(getattr(live, name), value) for name, value in saved.items() if name in names}
    if type(live).__dataclass_params__.frozen:  # type: ignore[attr-defined]
        return dataclasses.replace(live, **{name: value for name, value in values.items() if name in init})
    for name, value in values.items():
        setattr(live, name, value)
    return live


def _member(live: enum.Enum, saved: Any) -> Any:
    """The member of the program's enum that was saved (by name; an int or str enum by its
    value), else what was saved: the class is the program's, never the checkpoint's."""
    members = type(live).__members__
    if isinstance(saved, str) and saved in members:
        return members[saved]
    try:
        return type(live)(saved)
    except (ValueError, TypeError):
        return saved


def _as_array(live: np.ndarray, saved: np.ndarray) -> np.ndarray:
    """A saved numpy array, into the program's array when it fits (same shape and dtype,
    writable: a reference to it sees the restored values), else the saved one."""
    if live.flags.writeable and live.shape == saved.shape and live.dtype == saved.dtype:
        live[...] = saved
        return live
    return saved


def _as_tuple_like(live: tuple, saved: tuple, into: Into) -> tuple:
    """``saved`` as a tuple of ``live``'s kind, its items put into ``live``'s (a tuple of
    models loads them): a namedtuple stays one (the program reads its fields by name), a
    ``torch.Size`` stays one; any other kind is a plain tuple, as saved. Why: the checkpoint
    holds a tuple's items only (no pickle, so no class), and a restore handed back a plain
    tuple for ``Progress(epoch=3, step=7)``, breaking ``progress.epoch``, and a tuple of
    state dicts in place of a tuple of modules."""
    if isinstance(live, torch.Size):
        return torch.Size(saved) if all(type(i) is int for i in saved) else saved
    if len(live) != len(saved):
        return saved
    items = [into(mine, value) for mine, value in zip(live, saved)]
    if hasattr(type(live), "_fields") and hasattr(type(live), "_make"):
        return type(live)._make(items)  # type: ignore[attr-defined]
    return tuple(items)


def into_own_kind(live: Any, saved: Any, into: Into) -> Any:
    """``saved`` as the kind of value the program holds at that place (``live``): a tuple of
    its kind, its numpy array (filled where it fits), its set or bytearray (filled), its
    enum's member, its dataclass (filled, or a frozen one copied), its numpy number; else
    ``NOT_A_KIND``. ``into`` restores the items inside (a tuple of models loads them)."""
    if isinstance(live, tuple) and type(saved) is tuple:
        return _as_tuple_like(live, saved, into)
    if isinstance(live, np.ndarray) and isinstance(saved, np.ndarray):
        return _as_array(live, saved)
    if isinstance(live, (set, bytearray)) and type(saved) is type(live):
        if isinstance(live, set):  # mutable: a reference the program holds sees the saved items
            live.clear()
            live.update(saved)
        else:
            live[:] = saved
        return live
    if isinstance(live, enum.Enum):
        return _member(live, saved)
    if dataclasses.is_dataclass(live) and not isinstance(live, type) and type(saved) is dict:
        return _into_dataclass(live, saved, into)
    if isinstance(live, np.generic) and type(saved) in (bool, int, float):
        return type(live)(saved)  # np.int64, np.float32, np.bool_: the kind the program held
    return NOT_A_KIND
