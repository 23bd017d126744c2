"""resilient: fault-tolerant checkpointing and elastic training for PyTorch.

The public surface is deliberately small; everything else lives in ``_``-prefixed modules.

Names are imported when first used (PEP 562), so that ``resilient-ckpt ls``, ``show`` or
``timeline`` start without importing torch (2 s of CPU on a small machine); a training
script pays nothing for it, since it imports torch anyway.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that owns it
_OWNERS = {
    "Checkpointer": "._checkpointer",
    "elastic": "._elastic",
    "PeerFailure": "._elastic",
    "HangError": "._elastic",
    "GangChange": "._errors",
    "ResilientError": "._errors",
    "StateError": "._errors",
    "UnsupportedStateError": "._errors",
    "CheckpointCorruptError": "._errors",
    "CommitError": "._errors",
    "StorageError": "._errors",
    "PerRank": "._per_rank",
    "AnyOf": "._policy",
    "EveryNSteps": "._policy",
    "EveryNSeconds": "._policy",
    "KeepLast": "._policy",
    "KeepEvery": "._policy",
    "SaveHandle": "._writer",
}

__all__ = list(_OWNERS)


def __getattr__(name: str) -> Any:
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    value = getattr(importlib.import_module(owner, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OWNERS))


if TYPE_CHECKING:
    from ._checkpointer import Checkpointer
    from ._elastic import HangError, PeerFailure, elastic
    from ._errors import (CheckpointCorruptError, CommitError, GangChange, ResilientError, StateError, StorageError,
                          UnsupportedStateError)
    from ._per_rank import PerRank
    from ._policy import AnyOf, EveryNSeconds, EveryNSteps, KeepEvery, KeepLast
    from ._writer import SaveHandle
