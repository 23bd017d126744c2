"""resilient: fault-tolerant checkpointing and elastic training for PyTorch.

The public surface is deliberately small; everything else lives in ``_``-prefixed modules.
"""

from ._checkpointer import Checkpointer
from ._elastic import HangError, PeerFailure, elastic
from ._errors import (
    CheckpointCorruptError,
    CommitError,
    GangChange,
    ResilientError,
    StateError,
    StorageError,
    UnsupportedStateError,
)
from ._per_rank import PerRank
from ._policy import AnyOf, EveryNSeconds, EveryNSteps, KeepEvery, KeepLast
from ._writer import SaveHandle

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "elastic",
    "PerRank",
    "PeerFailure",
    "HangError",
    "GangChange",
    "SaveHandle",
    "ResilientError",
    "StateError",
    "UnsupportedStateError",
    "CheckpointCorruptError",
    "CommitError",
    "StorageError",
    "AnyOf",
    "EveryNSteps",
    "EveryNSeconds",
    "KeepLast",
    "KeepEvery",
]
