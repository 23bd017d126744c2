"""Random generators held in the state as objects: ``torch.Generator``, ``random.Random`` and
numpy's ``Generator`` and ``RandomState``.

Why: a resumable data pipeline draws from a generator of its own (``DataLoader(...,
generator=g)``, a sampler's, an augmentation's), and none of these has ``state_dict``: they
were refused as values that would need pickle, so a resumed run shuffled differently from
the uninterrupted one. Each is saved as its state (a byte tensor, or plain numbers) through
an adapter with ``state_dict``/``load_state_dict`` (``stateful_generator``), and restored
into the program's own generator object, which its data loader keeps using.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["stateful_generator"]


class _TorchGenerator:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["state"])


class _PythonRandom:
    def __init__(self, generator: random.Random) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.generator.getstate()
        return {"version": version, "internal": list(internal), "gauss": gauss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.setstate((state["version"], tuple(state["internal"]), state["gauss"]))


class _NumpyGenerator:
    """numpy's ``Generator``: its bit generator's state is a dict of names and integers."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.bit_generator.state = state["state"]


class _NumpyRandomState:
    """numpy's legacy ``RandomState``: its key array is kept as a list of integers."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        state = self.generator.get_state(legacy=False)
        return {**state, "state": {**state["state"], "key": state["state"]["key"].tolist()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np

        inner = dict(state["state"], key=np.asarray(state["state"]["key"], dtype=np.uint32))
        self.generator.set_state(dict(state, state=inner))


def stateful_generator(obj: Any) -> Any | None:
    """An adapter with ``state_dict``/``load_state_dict`` for a random generator, or None.
    numpy's classes are looked up only if numpy is loaded: a program holding one has."""
    if isinstance(obj, torch.Generator):
        return _TorchGenerator(obj)
    if isinstance(obj, random.Random):
        return _PythonRandom(obj)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(obj, numpy.random.Generator):
            return _NumpyGenerator(obj)
        if isinstance(obj, numpy.random.RandomState):
            return _NumpyRandomState(obj)
    return None
