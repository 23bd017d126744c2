"""State that differs by rank: a data loader's position, a per-rank generator, a counter.

Plain tensors are saved once, as state every rank shares (that is what makes a DDP
checkpoint cost one copy, not one per rank), so rank-dependent state must say so. Wrapping a
top-level entry in ``PerRank`` saves it from every rank and restores each rank its own. When
the world size changes there is no right answer in general, so the user gives one
(``reshard``), or the restore refuses, naming the entry.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["PerRank", "Reshard"]

Reshard = Callable[[list[Any], int, int], Any]


class PerRank:
    """A top-level state entry kept per rank: ``state["loader"] = PerRank(loader)``.

    ``value`` is anything a state entry may be (an object with ``state_dict``, a dict of
    tensors and plain values). ``reshard(saved, rank, world_size)``, used only when the job
    restores at another world size, receives every saved rank's value (a list indexed by the
    old rank, each as ``state_dict()`` returned it) and returns this rank's: what is then
    given to ``load_state_dict`` (or put in place of a plain value).
    """

    def __init__(self, value: Any, *, reshard: Reshard | None = None) -> None:
        if isinstance(value, PerRank):
            raise TypeError("PerRank(PerRank(...)): wrap the value once")
        self.value = value
        self.reshard = reshard

    def __repr__(self) -> str:
        rule = "" if self.reshard is None else f", reshard={getattr(self.reshard, '__name__', self.reshard)!r}"
        return f"PerRank({type(self.value).__name__}{rule})"
