"""torch's ``ZeroRedundancyOptimizer`` (ZeRO-1 under DDP): each rank saves its own part.

Why: each rank's ZeRO optimizer keeps the state of its partition of the parameters only,
and its ``state_dict`` refuses to run until ``consolidate_state_dict(to=r)`` has gathered
every rank's part onto rank ``r``: a checkpoint of a DDP + ZeRO loop could not be taken at
all (every rank raised torch's "Optimizer state has not been consolidated"), and the
consolidation torch's recipe asks for sends the whole optimizer state to one rank to be
written by one rank, the cost ZeRO was chosen to avoid.

So a checkpoint holds ZeRO's state in the format of its consolidated ``state_dict`` (the
optimizer's global state, keyed by each parameter's index over all parameter groups, as a
plain optimizer over the same parameters keys it), each rank giving the indices its
partition holds: every state tensor is written once, by the rank that has it (the entry
differs by rank, as a pipeline stage's does: ``partitioned_entries`` in ``_saved_trees``).
The checkpoint then restores into a ZeRO optimizer at any world size (each rank reads the
state of the parameters its new partition holds; ZeRO partitions by size, so the parts
move between ranks), or into a plain optimizer over the same parameters (an evaluation or
a run without ZeRO), and a plain optimizer's checkpoint restores into ZeRO.

The class is looked up among the modules already loaded: a program holding one has loaded
it.
"""

from __future__ import annotations

import sys
from itertools import chain
from typing import Any

import torch

from ._errors import UnsupportedStateError

__all__ = ["zero_adapter", "ZeroOptimizer", "zero_class", "is_zero", "others_state"]

_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def zero_class() -> type | None:
    """``ZeroRedundancyOptimizer``, where its module is loaded."""
    found = getattr(sys.modules.get(_MODULE), "ZeroRedundancyOptimizer", None)
    return found if isinstance(found, type) else None


def is_zero(obj: Any) -> bool:
    """Whether ``obj`` is a ``ZeroRedundancyOptimizer``."""
    zero = zero_class()
    return zero is not None and isinstance(obj, zero)


def zero_adapter(obj: Any) -> "ZeroOptimizer | None":
    """What gives and takes a ZeRO optimizer's state for a checkpoint, or None for anything
    else."""
    return ZeroOptimizer(obj) if is_zero(obj) else None


def others_state(optim: Any, path: str, names: set[str]) -> list[str]:
    """Of the saved tensor ``names``, those of parameters outside this rank's partition of
    ZeRO optimizer ``optim`` (saved under ``path``): not read. Why: ZeRO's
    ``load_state_dict`` drops them, but a rank restoring a state saved at another world
    size (or by a plain optimizer) first read every parameter's state into memory, the
    whole optimizer state on every rank, which ZeRO is used to avoid holding."""
    prefix = f"{path}/state/"
    own = ZeroOptimizer(optim).own_indices()
    others = []
    for name in names:
        index = name[len(prefix):].partition("/")[0] if name.startswith(prefix) else ""
        if index.isdigit() and int(index) not in own:
            others.append(name)
    return others


class ZeroOptimizer:
    """A ``ZeroRedundancyOptimizer``'s part of the global optimizer state (see the module's
    text)."""

    def __init__(self, optim: Any) -> None:
        self.optim = optim

    def _params(self) -> list[torch.Tensor]:
        """Every parameter of every rank, in the order of the global state's indices."""
        return list(chain.from_iterable(group["params"] for group in self.optim.param_groups))

    def own_indices(self) -> set[int]:
        """The global indices of the parameters this rank's partition holds."""
        mine = {id(p) for group in self.optim.optim.param_groups for p in group["params"]}
        return {index for index, p in enumerate(self._params()) if id(p) in mine}

    def state_dict(self) -> dict[str, Any]:
        """This rank's part, without the consolidation ZeRO's own ``state_dict`` needs first
        (each rank's state sent to one rank inside the step: ``benchmarks/bench_zero.py``)."""
        if getattr(self.optim, "_overlap_with_ddp", False):
            raise UnsupportedStateError(
                "a ZeroRedundancyOptimizer made with overlap_with_ddp=True builds its partition from DDP's "
                "buckets during the first steps; make it with overlap_with_ddp=False to checkpoint it")
        index = {id(p): i for i, p in enumerate(self._params())}
        local = self.optim.optim.state
        state = {index[id(p)]: value for group in self.optim.optim.param_groups for p in group["params"]
                 if (value := local.get(p))}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[id(p)] for p in group["params"]]} for group in self.optim.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the state of this rank's partition (``ZeroRedundancyOptimizer.load_state_dict``
        takes the global format and keeps its own part), once every index is checked."""
        self.optim.load_state_dict(self.checked(state_dict))

    def checked(self, state_dict: Any) -> dict[str, Any]:
        """``state_dict`` (a copy of its top level: ZeRO's load writes into it), once every
        parameter index in it is one of this optimizer's: a checkpoint is input, and ZeRO
        would take an index of -1 as its last parameter, giving it another's state."""
        count = len(self._params())
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(state, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise ValueError("the saved optimizer state is not a dict with 'state' and 'param_groups'")
        for index in state:
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
                raise ValueError(f"the saved optimizer state has an entry for parameter {index!r}; "
                                 f"this optimizer's are numbered 0 to {count - 1}")
        return {"state": dict(state), "param_groups": state_dict["param_groups"]}
