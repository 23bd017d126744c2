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
enough to run its code. A subclass inside a DTensor (FSDP2 with such an optimizer) is not
handled: its inner tensors are per-rank quantization blocks, not shards of one tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ._errors import StateError
from ._snapshot import PLAIN_TYPES, is_dtensor

__all__ = ["wrapper_parts", "class_name", "rebuilt"]

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


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def rebuilt(name: str, inner: dict[str, torch.Tensor], context: Any, shape: list[int], stride: list[int],
            path: str) -> torch.Tensor:
    """The subclass ``name`` made from its saved parts, if the program allows the class."""
    cls = _allowed(name)
    if cls is None:
        module, _, qualname = name.rpartition(".")
        raise StateError(
            f"key {path!r}: the checkpoint holds a {name} (a tensor subclass) where the state has none to "
            f"restore into, and this program does not allow that class to be rebuilt from a checkpoint: "
            f"import it and call torch.serialization.add_safe_globals([{qualname}]) (from {module}), as "
            "torch.load(weights_only=True) asks, or restore into state that holds one"
        )
    try:
        return cls.__tensor_unflatten__(inner, context, torch.Size(shape), tuple(stride))
    except Exception as exc:  # noqa: BLE001 - the class's own code, whatever it raises
        raise StateError(f"key {path!r}: {name}.__tensor_unflatten__ refused the saved parts: "
                         f"{type(exc).__name__}: {exc}") from exc


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
