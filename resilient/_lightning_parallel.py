"""Lightning strategies whose every rank writes its part of each checkpoint, resilient's way:
``ResilientModelParallelStrategy`` (FSDP2, tensor parallelism) in place of
``ModelParallelStrategy``, and ``ResilientDDPStrategy`` in place of ``DDPStrategy``
(``strategy="ddp"``), with the same arguments.

Why strategies and not the plugin: ``ModelParallelStrategy`` does not use the Trainer's
``CheckpointIO``; it saves every checkpoint itself, with ``torch.distributed.checkpoint``,
inside the training step. Under DDP the Trainer calls the plugin from rank 0 alone, so rank
0 copies the whole state in the step (the other ranks wait for it at a barrier) and writes
all of it. Here every rank snapshots its part (its shards; of replicated state, its slice
of the bytes) and writes it in the background; the rest of Lightning's checkpoint (loops,
callbacks, schedulers, hyper-parameters) is stored once. A checkpoint saved at one world
size loads at another (shards are cut again). Each checkpoint path is a resilient root, as
with the plugin, so ``ModelCheckpoint``'s top-k, ``last.ckpt`` and ``ckpt_path="last"`` work
unchanged.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ._checkpointer import Checkpointer
from ._errors import ResilientError
from ._zero import zero_adapter
from .lightning import (
    FirstSteps,
    ResilientCheckpointIO,
    as_lightning_saved_it,
    buffer_size,
    _key,
    _lightning_packages,
    _local,
    _move,
    checkpointer_for,
    done_with,
    finish,
    finish_all,
    next_number,
    saves_at_a_checkpoint,
    storable,
)

__all__ = ["ResilientDDPStrategy", "ResilientModelParallelStrategy"]


#: the shards as they are: sharded (``save_distributed_checkpoint``), on their device
_IN_PLACE = StateDictOptions(full_state_dict=False, cpu_offload=False)


def _gathered(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _lightnings(name: str) -> type:
    """Strategy ``name`` of ``pytorch_lightning``, else of ``lightning``: a strategy's class
    cannot serve both packages' Trainers (their internals differ)."""
    return getattr(importlib.import_module(f"{_lightning_packages()[0]}.strategies"), name)


class _SavedByEveryRank:
    """What the strategies here share: each checkpoint saved by every rank at once, its part
    of the state; placed before Lightning's strategy class in the bases.

    Args (besides the strategy's own):
        remote, storage_options, compress: as for ``ResilientCheckpointIO``.
    """

    #: the Trainer's ``CheckpointIO`` is not called: ``_bypassed_by`` says so to a plugin given too
    saves_itself = True

    def __init__(self, *args: Any, remote: str | None = None, storage_options: Mapping[str, Any] | None = None,
                 compress: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._files = ResilientCheckpointIO(remote=remote, storage_options=storage_options, compress=compress)
        self._saving: dict[str, Checkpointer] = {}  # path -> this rank's checkpointer with a save in flight, or kept
        self._saves: Counter[str] = Counter()  # path -> saves of it in this process
        self._first_steps = FirstSteps()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step; once every optimizer has made its first, the buffers of the first
        checkpoint are made (``_prepare_buffers``): the optimizers' state exists then."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._first_steps.all_made(optimizer, self.optimizers):
            self._prepare_buffers()
        return result

    def _prepare_buffers(self) -> None:
        """Size the staging buffers for the state the saves will be given (the shards of the
        model and the optimizers; Lightning's own tensors, a few scores, go in ``ROOM``:
        ``buffer_size``) and make them now, touched in the background
        (``_SharedBuffers.prepare``). Collective: every rank makes its optimizer steps in the
        same order."""
        count = saves_at_a_checkpoint(self.lightning_module.trainer)  # the same on every rank
        if not count:
            return
        state = {"state_dict": self.lightning_module_state_dict(),
                 "optimizer_states": [self.optimizer_state(o) for o in self.optimizers]}
        sized = buffer_size(state, self.global_rank, self.world_size, _gathered,
                            lambda ok: self.reduce_boolean_decision(ok, all=True))
        if sized is not None:
            self._files._buffers.prepare(*sized, count)

    # -- saving ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options are given to the strategy "
                            "(remote=, storage_options=), not to each save")
        # the model's and optimizers' state as Lightning collected it (its hooks may have
        # changed it); the rest as plain data, rank 0's on every rank (``_agreed_save``)
        model, optimizers = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        path, rest = self._agreed_save(filepath, storable(checkpoint) if self.is_global_zero else None)
        state = {"state_dict": model, "optimizer_states": optimizers, "lightning": rest}
        ckpt = checkpointer_for(self._saving, self._saves, path, lambda: self._files._checkpointer(path))
        # a sequence number, not the global step: the same path may be saved twice at one
        # step. A new checkpointer's is agreed: each rank's local tier, and the remote tier
        # as rank 0 lists it (when the path's name may be there)
        def newest() -> int:
            asks = self.is_global_zero and self._files._may_be_remote(path)
            return ckpt._coord.agree_max(ckpt._latest(remote=asks) or 0)

        self._files._buffers.save(ckpt, next_number(ckpt, newest), state)

    def remove_checkpoint(self, filepath: Any) -> None:
        path, link = self._agreed(filepath, "remove")
        if link:
            if self.is_global_zero:
                self._files.remove_checkpoint(path)  # the link alone
            return
        ckpt = self._saving.pop(path, None)
        if ckpt is not None:  # its writers may still be moving files there; its uploader is told to stop
            ckpt.abandon(wait=ckpt.commit_timeout)
        self.barrier()  # every rank's writers are done with it
        # The uploads are not waited for here: a rank's stops after the file in hand, which
        # took 1.1-1.5 s inside the step (0.2 GB on 2 ranks, moto's server, a checkpoint every
        # two steps). Rank 0 deletes the store's copy once its own has stopped; a rank whose
        # uploader was busy deletes it again once its own has stopped, so that a file landed
        # after rank 0's deletion goes too. Both off the step.
        uploading = None if ckpt is None else ckpt._uploader
        if self.is_global_zero:
            self._files._remove(path, uploading)
        elif uploading is not None and self._files.remote and uploading.busy():
            self._files._remove_remote(path, uploading)

    # -- loading --------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model's and optimizers' state in place (each byte read once per node
        and shared by its ranks; shards cut again for this world size) and return the rest
        of Lightning's checkpoint; never unpickles."""
        path, _ = self._agreed(checkpoint_path, "load")  # through a link: its target
        self._finish(path)
        model_state, optimizer_states = self._restore_targets()
        state: dict[str, Any] = {"state_dict": model_state, "optimizer_states": optimizer_states, "lightning": {}}
        with self._files._checkpointer(path) as ckpt:
            if ckpt.restore(state) == 0:
                raise FileNotFoundError(f"{path} holds no committed checkpoint"
                                        + (f", nor {self._files.remote}/{os.path.basename(path)}"
                                           if self._files.remote else ""))
        self._restored(state["state_dict"], state["optimizer_states"])
        return as_lightning_saved_it(state)  # without optimizer_states when saved weights_only: Lightning is told

    def _restore_targets(self) -> tuple[dict[str, Any], list[Any]]:
        """The model's state and the optimizers' as a restore fills them (in place where they
        are the live tensors); a list the restore makes entries in when it is empty."""
        raise NotImplementedError

    def _restored(self, model_state: dict[str, Any], optimizer_states: list[Any]) -> None:
        """Apply what the restore filled, where filling it in place is not enough."""

    # -- the end --------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Commit (and drain to ``remote``) every save still in flight on this rank; free
        its buffers. A save that failed is raised once all that is done."""
        self._first_steps = FirstSteps()  # a later fit prepares its buffers again
        failed = finish_all(self._saving)
        try:
            self._files.teardown()  # rank 0's deletions; every rank's closes and buffers
        finally:
            super().teardown()
        if failed is not None:
            raise failed

    # -- helpers --------------------------------------------------------------------------------
    def _agreed(self, filepath: Any, action: str, replace: bool = False) -> tuple[str, bool]:
        """Rank 0's view of the path, on every rank (callbacks may name it differently by
        rank, and a link, ``save_last="link"``, is made on rank 0's node alone): the
        directory it names through any link, or the link itself; whether it is a link.
        ``replace``: rank 0 first removes a file or a link there (a save replaces it)."""
        path = _local(filepath, action)  # a URL refused on every rank alike
        path, link = self.broadcast(self._view(path, replace) if self.is_global_zero else None)
        return path, link

    @staticmethod
    def _view(path: str, replace: bool) -> tuple[str, bool]:
        """Rank 0's part of ``_agreed``."""
        link = os.path.islink(path)
        if replace and (link or os.path.isfile(path)):
            os.remove(path)  # a torch.save file, or a link: replaced
            link = False
        return (path if link else _key(path)), link

    def _agreed_save(self, filepath: Any, rest: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """``_agreed`` for a save, ``_finish_done``, and rank 0's ``rest`` of Lightning's
        checkpoint (given by rank 0), in one gather: (the path to save to, that ``rest``).

        Why one: each was a collective inside the step. Why a failure rides in it: a save
        that failed in the background is raised at the next save (``done_with``), and one
        rank raising before a collective the others enter left them waiting there. Every
        rank raises now: the failing rank its error, the others an error naming that rank.
        Why rank 0's rest: it holds what each rank's callbacks and loops keep, which may
        differ by rank (``ModelCheckpoint``'s ``best_model_score`` of a metric each rank
        logs alone), and a plain tensor that differs by rank was refused, failing the save.
        Lightning saves rank 0's (under DDP only rank 0 saves), and every rank loads it."""
        path = _local(filepath, "save")
        view = self._view(path, replace=True) if self.is_global_zero else None
        failed: Exception | None = None
        try:
            mine = done_with(self._saving, self._saves, _key(path))
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank has heard of it
            mine, failed = [], exc
        sent = None if rest is None else _move(rest, torch.device("cpu"))  # not onto another rank's device
        everyone = _gathered((view, mine, None if failed is None else f"{type(failed).__name__}: {failed}", sent))
        if failed is not None:
            raise failed
        for rank, (_, _, why, _) in enumerate(everyone):
            if why is not None:
                raise ResilientError(f"a save that {type(self).__name__} wrote in the background failed on rank "
                                     f"{rank}: {why}")
        self._finish_done(mine, [done for _, done, _, _ in everyone])
        return everyone[0][0][0], everyone[0][3]

    def _finish(self, path: str) -> None:
        finish(self._saving, path)

    def _finish_done(self, mine: list[str], everyone: list[list[str]]) -> None:
        """Close (off the step) the checkpointers every rank is done with (``done_with``;
        ``mine``: this rank's list, ``everyone``: every rank's). Agreed, so that every rank
        holds a checkpointer for the same paths, and goes on with it at the next save there
        or makes a new one (a collective) alike. Each rank's own choice closed one rank's
        while the other's upload was still running: that rank then waited in the step for
        its upload and for rank 0's commit on the store (0.9 s, 0.2 GB on 2 ranks, moto's
        server)."""
        for path in set(mine).intersection(*everyone):
            self._files._housekeeper.close(self._saving.pop(path))


class ResilientModelParallelStrategy(_SavedByEveryRank, _lightnings("ModelParallelStrategy")):  # type: ignore[misc]
    """``ModelParallelStrategy`` whose checkpoints are resilient's: each rank writes its
    shards.

    Args:
        remote, storage_options, compress: as for ``ResilientCheckpointIO``.
        Others: ``ModelParallelStrategy``'s (``data_parallel_size``, ``tensor_parallel_size``,
        ...). Its ``save_distributed_checkpoint=False`` (one full file from rank 0) is refused:
        the point here is that every rank writes its own shards.
    """

    def __init__(self, *args: Any, remote: str | None = None, storage_options: Mapping[str, Any] | None = None,
                 compress: str | None = None, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise ValueError("ResilientModelParallelStrategy: save_distributed_checkpoint=False gathers the whole "
                             "state on rank 0; every rank writes its own shards here (a checkpoint loads at any "
                             "world size, and resilient-ckpt export makes one file of it)")
        super().__init__(*args, remote=remote, storage_options=storage_options, compress=compress, **kwargs)

    # -- collecting the state -------------------------------------------------------------------
    # Lightning's ModelParallelStrategy collects the shards with ``cpu_offload=True``: on an
    # accelerator, a blocking copy of every shard into new pageable host memory, inside the
    # step, before the save is called. The save stages them itself (into its pinned buffer,
    # and with ``staging="overlap"`` beside the step), so they are taken where they are.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_IN_PLACE)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer), options=_IN_PLACE)

    def _restore_targets(self) -> tuple[dict[str, Any], list[Any]]:
        return self.lightning_module_state_dict(), [self.optimizer_state(o) for o in self.optimizers]

    def _restored(self, model_state: dict[str, Any], optimizer_states: list[Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, model_state)
        for optimizer, optimizer_state in zip(self.optimizers, optimizer_states):
            set_optimizer_state_dict(self.model, optimizer, optimizer_state)


class ResilientDDPStrategy(_SavedByEveryRank, _lightnings("DDPStrategy")):  # type: ignore[misc]
    """``DDPStrategy`` (``strategy="ddp"``) whose checkpoints are resilient's: the model and
    the optimizers, the same on every rank, are saved by all the ranks together, each
    copying and writing a slice of their bytes, not by rank 0 alone.

    Why not the plugin under DDP: the Trainer calls a ``CheckpointIO`` from rank 0 alone,
    which copies the whole state inside the step while the other ranks wait for it at a
    barrier, then writes all of it. Here each of N ranks copies 1/N of it, over its own
    device's link on an accelerator, and the node's disks (or the nodes') write in parallel.

    Args:
        remote, storage_options, compress: as for ``ResilientCheckpointIO``.
        Others: ``DDPStrategy``'s.
    """

    def _restore_targets(self) -> tuple[dict[str, Any], list[Any]]:
        # the module's own tensors, filled in place; the optimizers' state as saved (an
        # optimizer before its first step has none to fill), loaded by Lightning as usual
        return self.lightning_module_state_dict(), []

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """A ZeRO optimizer's (``ZeroRedundancyOptimizer``) part on each rank, as a
        ``Checkpointer`` saves it (``_zero``), instead of Lightning's consolidation: every
        rank's part sent to rank 0 inside the step (1 GB: 21 s on gloo here, ``bench_zero``),
        then written by rank 0 alone. Any other optimizer as Lightning gives it."""
        zero = zero_adapter(getattr(optimizer, "_optimizer", optimizer))
        return zero.state_dict() if zero is not None else super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's load, a ZeRO optimizer's saved indices checked first (``_zero``)."""
        states = list(checkpoint["optimizer_states"])
        for index, optimizer in enumerate(self.optimizers[:len(states)]):
            zero = zero_adapter(getattr(optimizer, "_optimizer", optimizer))
            if zero is not None:
                states[index] = zero.checked(states[index])
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})
