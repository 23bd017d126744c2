"""Data loaders whose position a checkpoint keeps: what their own ``state_dict`` leaves out.

torchdata's ``StatefulDataLoader`` gives its position within the epoch. Two things decide
whether a resumed run then sees what an uninterrupted one would have:

* **The draw of a new iterator.** Making an iterator draws a seed from torch's global
  generator (``DataLoader``'s base seed, for its workers). The uninterrupted run drew it as
  the epoch began; a resumed run drew it at its first batch, after the restore had set the
  generators as they were at the save: every random number after that was one draw off (a
  dropout mask, an augmentation made in the main process), though the batches were right. So a restore makes the
  resumed iterator at once (``state_dict`` does, torchdata's way of keeping one), and the
  generators are set after it (``Checkpointer.restore`` applies them after the state).
* **The epoch, with accelerate.** ``Accelerator.prepare(loader)`` (with
  ``DataLoaderConfiguration(use_stateful_dataloader=True)``) returns a ``DataLoaderShard``
  that counts epochs itself (``iteration``), which its state leaves out and a new process
  starts at 0: a run resumed after its first epoch replayed the first epoch's order, and
  one saved at an epoch's last batch began that epoch again (a shuffled 4-batch epoch
  resumed at batches 4, 5 and 8: the wrong batches followed every time). So its checkpoint
  holds ``{"epoch", "position"}``, and a restore sets both (``set_epoch``); saved at an
  epoch's end, the next epoch starts afresh, its iterator made at the first batch as in
  the uninterrupted run.
* **The number of processes**, where each process takes its share of every epoch: the
  processes of accelerate's ``DataLoaderShard`` take every N-th batch, those of a
  ``DistributedSampler`` every N-th sample of the same shuffled order. The position counts
  the batches this process took: restored by another number of processes (a resized gang)
  as it was, it went back or forward in the epoch (two processes 8 batches in, 16 of the
  epoch's batches, became one process 8 batches in). So the checkpoint holds the number
  too, and the position is rescaled to the same point of the epoch; where that point falls
  between two steps of the new gang, to the step before it (a batch or two seen again, none
  skipped), with a warning. (A ``DistributedSampler``'s epoch is the program's to keep, as
  it is the program's to set.)

The shuffled order comes back only from accelerate's ``SeedableRandomSampler``
(``use_seedable_sampler=True``: the order is its seed and the epoch). The default
``RandomSampler`` draws each epoch's order from a generator as the epoch starts, a state no
checkpoint holds: such a loader is saved all the same, with a warning (once a loader)
saying what to change. Both libraries are looked up only among the modules already loaded:
a program holding such a loader has loaded them.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

from ._errors import UnsupportedStateError

__all__ = ["loader_adapter"]

log = logging.getLogger("resilient")

EPOCH, POSITION, PROCESSES = "epoch", "position", "processes"
#: the position's counts of batches taken, in a StatefulDataLoader's state
_COUNTS = ("_sampler_iter_yielded", "_num_yielded")
_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _class(module: str, name: str) -> type | None:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def loader_adapter(obj: Any) -> "_StatefulLoader | None":
    """What gives and takes a data loader's state for a checkpoint (see the module's text),
    or None for anything else."""
    accelerated = _class("accelerate.data_loader", "DataLoaderAdapter")
    if accelerated is not None and isinstance(obj, accelerated):  # before torchdata's: it passes for one
        return _AcceleratedLoader(obj) if hasattr(obj, "iteration") and hasattr(obj, "base_dataloader") else None
    stateful = _class("torchdata.stateful_dataloader.stateful_dataloader", "StatefulDataLoader")
    if stateful is not None and isinstance(obj, stateful):
        return _StatefulLoader(obj)
    nodes = _class("torchdata.nodes.loader", "Loader")
    if nodes is not None and isinstance(obj, nodes):
        return _NodesLoader(obj)
    return None


class _NodesLoader:
    """torchdata.nodes' ``Loader``, whose state a restore must not ask for before loading.

    Why: asked for its ``state_dict()`` before it has an iterator, such a loader makes one
    (its sampler drawing the epoch's order from its generator) and hands it to the next
    ``iter()`` as it is, not from a state loaded in between. A restore asks every object of
    the state for its ``state_dict()`` first, to find the tensors to fill in place: a
    resumed run began the epoch again (10 batches where 7 were left), and with that fixed
    alone, drew its order once too often (the right count, other batches). A loader's state
    holds no tensors to fill, so a restore does not ask (``holds_no_tensors``), and the
    loader's own ``load_state_dict`` decides the program's next ``iter()``, as on a loader
    restored by hand."""

    holds_no_tensors = True

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)


def _make_resumed_iterator(loader: Any) -> None:
    """A StatefulDataLoader's iterator from the state just loaded, made now (its seed drawn
    before the restore sets the generators): the loader's next ``iter`` takes this one."""
    if getattr(loader, "next_iter_state", None):
        loader.state_dict()


class _StatefulLoader:
    """torchdata's StatefulDataLoader: its own state (over a DistributedSampler, with the
    number of processes: ``{"position", "processes"}``), its resumed iterator made at restore."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> Any:
        replicas = _replicas(self.loader)
        position = self.loader.state_dict()
        return position if replicas is None else {POSITION: position, PROCESSES: replicas}

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, dict) and POSITION in state and PROCESSES in state:  # (an accelerate loader's too)
            state = _position_for(state, _replicas(self.loader) or 1)
        self._resume_at(state)

    def _resume_at(self, position: Any) -> None:
        """The loader at ``position``, its resumed iterator made now (``_make_resumed_iterator``)."""
        self.loader.load_state_dict(position)
        _make_resumed_iterator(self._torchdata())

    def _torchdata(self) -> Any:
        """The StatefulDataLoader itself (accelerate's loader wraps one)."""
        return self.loader


def _replicas(loader: Any) -> int | None:
    """The number of processes sharing each epoch of ``loader`` through its
    DistributedSampler (None without one)."""
    sampler = getattr(loader, "sampler", None)
    distributed = _class("torch.utils.data.distributed", "DistributedSampler")
    return int(sampler.num_replicas) if distributed is not None and isinstance(sampler, distributed) else None


class _AcceleratedLoader(_StatefulLoader):
    """accelerate's prepared loader: ``{"epoch", "position": its state_dict, "processes"}``."""

    def state_dict(self) -> dict[str, Any]:
        if not getattr(self.loader, "use_stateful_dataloader", False):
            raise UnsupportedStateError(
                "a data loader prepared by accelerate keeps its position only when the Accelerator is made with "
                "dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True) (torchdata's "
                "StatefulDataLoader); make it so, or leave the loader out of the state")
        self._warn_if_unordered()
        return {EPOCH: int(self.loader.iteration), POSITION: self.loader.state_dict(), PROCESSES: _processes()}

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or not {EPOCH, POSITION} <= set(state):
            self._resume_at(state)  # the loader's own state, as saved before its epoch was kept
            return
        epoch = _whole(state, EPOCH, least=0)
        if isinstance(state[POSITION], dict) and state[POSITION].get("_iterator_finished"):
            # saved at the epoch's last batch: the next epoch from its start, its iterator
            # made (and its seed drawn) at its first batch, as the uninterrupted run made it
            self.loader.load_state_dict({})
            epoch += 1
        else:
            self._resume_at(_position_for(state, _processes()))
        self.loader.set_epoch(epoch)

    def _torchdata(self) -> Any:
        return self.loader.base_dataloader

    def _warn_if_unordered(self) -> None:
        """Once a loader: a shuffle whose order a restore cannot bring back."""
        if self.loader in _warned:
            return
        _warned.add(self.loader)
        sampler = self.loader.get_sampler() if hasattr(self.loader, "get_sampler") else None
        seedable = _class("accelerate.data_loader", "SeedableRandomSampler")
        random_sampler = _class("torch.utils.data", "RandomSampler")
        if (random_sampler is not None and isinstance(sampler, random_sampler)
                and not (seedable is not None and isinstance(sampler, seedable))):
            log.warning("resilient: a data loader prepared by accelerate shuffles with a RandomSampler, which draws "
                        "each epoch's order from a generator as the epoch starts: a restore brings back the "
                        "position within the epoch, not that order. Make the Accelerator with "
                        "dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, "
                        "use_seedable_sampler=True) for a resumed run to see the batches it would have seen")


def _processes() -> int:
    state = getattr(sys.modules.get("accelerate.state"), "PartialState", None)
    return int(state().num_processes) if state is not None else 1


def _whole(state: dict[str, Any], name: str, least: int) -> int:
    """``state[name]``, a whole number of at least ``least``; else the checkpoint is refused,
    naming the field (a checkpoint is input, and may have been made by anyone)."""
    value = state[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"the data loader's saved {name} is {value!r}, not a whole number of at least {least}")
    return value


def _position_for(state: dict[str, Any], now: int) -> Any:
    """The saved position, rescaled for ``now`` processes when saved by another number."""
    saved_by = _whole(state, PROCESSES, least=1) if PROCESSES in state else now
    return state[POSITION] if saved_by == now else _rescaled(state[POSITION], saved_by, now)


def _rescaled(position: Any, saved_by: int, now: int) -> Any:
    """``position`` of one of ``saved_by`` processes as the same point of the epoch for one
    of ``now`` (see the module's text); as it was, with a warning, where it cannot be. The
    counts are the batches this process took, and, where torchdata's batch sampler keeps
    its own (``_sampler_iter_state``), the samples it took."""
    counts = [position.get(name) if isinstance(position, dict) else None for name in _COUNTS]
    sampler_state = position.get("_sampler_iter_state") if isinstance(position, dict) else None
    samples = sampler_state.get("samples_yielded") if isinstance(sampler_state, dict) else None
    own_state = sampler_state is not None and not (set(sampler_state) == {"samples_yielded"}
                                                   and isinstance(samples, int))
    if any(not isinstance(c, int) for c in counts) or position.get("_index_sampler_state") is not None or own_state:
        log.warning("resilient: a data loader was saved by %d processes and is restored "
                    "by %d; its position is not one resilient can carry over (a sampler with a state of its own), "
                    "so each process resumes %s batches into the epoch as saved", saved_by, now, counts[0])
        return position
    each, over = divmod(counts[0] * saved_by, now)  # the epoch's batches the processes had taken, shared anew
    if over:
        log.warning("resilient: a data loader was saved by %d processes, %d batches into "
                    "the epoch, and is restored by %d: each resumes %d batches in, the step before that point "
                    "(%d batch(es) seen again, none skipped)", saved_by, counts[0] * saved_by, now, each, over)
    rescaled = {**position, **{name: count * saved_by // now for name, count in zip(_COUNTS, counts)}}
    if samples is not None:  # as many samples as the batches now taken hold
        rescaled["_sampler_iter_state"] = {"samples_yielded": samples * each // counts[0] if counts[0] else 0}
    return rescaled
