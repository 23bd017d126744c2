"""A tensor subclass of the kind torchao's low-bit optimizer states are (a wrapper with no
storage of its own, taken apart by ``__tensor_flatten__``), small enough to read whole.
A module of its own so that a second process can import the class by name."""

from __future__ import annotations

from typing import Any

import torch


class Scaled(torch.Tensor):
    """``payload * scale`` held as the two, with a note in its flatten context."""

    @staticmethod
    def __new__(cls, payload: torch.Tensor, scale: torch.Tensor, note: Any) -> "Scaled":
        return torch.Tensor._make_wrapper_subclass(cls, payload.shape, dtype=torch.float32, device=payload.device)

    def __init__(self, payload: torch.Tensor, scale: torch.Tensor, note: Any) -> None:
        self.payload, self.scale, self.note = payload, scale, note

    def __tensor_flatten__(self) -> tuple[list[str], list[Any]]:
        return ["payload", "scale"], [self.note]

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], context: list[Any], outer_size: Any,
                             outer_stride: Any) -> "Scaled":
        return cls(inner["payload"], inner["scale"], *context)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"Scaled does not run {func}")


def scaled(seed: int, note: Any = "per-row") -> Scaled:
    g = torch.Generator().manual_seed(seed)
    return Scaled(torch.randint(-128, 127, (4, 6), dtype=torch.int8, generator=g), torch.rand(4, generator=g), note)


class Viewable(Scaled):
    """``Scaled`` that ``DTensor.from_local`` can hold (it views its local tensor), and that,
    unlike torchao's states, cannot be sliced along its rows."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.view.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            x = args[0]
            payload = x.payload.view(args[1]) if func is torch.ops.aten.view.default else x.payload
            return cls(payload, x.scale, x.note)
        raise NotImplementedError(f"Viewable does not run {func}")
