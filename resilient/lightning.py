"""PyTorch Lightning integration: ``Trainer(plugins=[ResilientCheckpointIO()])``, with
``pytorch_lightning`` or with ``lightning`` (``import lightning as L``) alike.

Lightning decides when to checkpoint and which files to keep (``ModelCheckpoint``); this
plugin decides how a checkpoint is written and read. Each path Lightning names becomes a
small resilient root (a directory with the usual ``.ckpt`` name) holding one committed
checkpoint, so everything Lightning does with paths keeps working: top-k deletion,
``last.ckpt``, ``ckpt_path="last"``. What changes:

* the save returns once the state is snapshotted into host memory (a buffer reused from
  save to save); files are written, fsync'd and committed in the background (Lightning's
  own ``AsyncCheckpointIO`` clones every tensor into new memory in the step, then pickles
  the clones in a thread, unsynced);
* checkpoints Lightning removes (``save_top_k``) are deleted off the training step;
* a crash mid-write leaves the previous checkpoint at that path intact, and a damaged file is
  detected by checksum on load instead of unpickling garbage;
* loading never runs code from the file (no pickle), whatever ``weights_only`` says, and
  ``Model.load_from_checkpoint(path)`` reads these checkpoints too (``_teach_load_from_checkpoint``);
* ``remote=`` drains each checkpoint to an object store as well.

Lightning calls the plugin from global rank 0 only (for DDP), so each save is a
single-process checkpoint: replicated state is written once, as resilient always does.
Values Lightning puts in a checkpoint that plain JSON cannot hold without pickle (objects
in ``hyper_parameters``) are stored as their ``repr`` with a warning naming the key.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import shutil
import threading
import uuid
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping

import torch

from ._background import yield_to_training
from ._catalog import Catalog
from ._checkpointer import Checkpointer
from ._coord import Coordinator, SoloCoordinator
from ._errors import CheckpointCorruptError, ResilientError
from ._plan import plan_layout
from ._snapshot import Staging
from ._storage import LocalStorage, Storage, is_remote, open_storage
from ._uploader import Uploader
from ._writer import SaveHandle
from ._kinds import is_plain_leaf
from ._tree import flatten_state

__all__ = ["ResilientCheckpointIO"]

log = logging.getLogger("resilient")


def _storable(value: Any, path: str, replaced: list[str]) -> Any:
    """``value`` with every leaf resilient cannot store without pickle replaced by its repr
    (numpy's numbers, bytes, paths, torch dtypes and the like it stores: ``is_plain_leaf``)."""
    if is_plain_leaf(value):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config: its fields, read as a dict
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            return {k: _storable(v, f"{path}/{k}", replaced) for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        items = [_storable(v, f"{path}/{i}", replaced) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    replaced.append(path)
    return repr(value)


def storable(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` as resilient stores it (``_storable``), with a warning naming what was
    replaced by its repr."""
    replaced: list[str] = []
    state = {k: _storable(v, k, replaced) for k, v in checkpoint.items()}
    if replaced:
        log.warning("resilient: stored as text (cannot be saved without pickle): %s", ", ".join(replaced[:10]))
    return state


def _lightning_packages() -> list[str]:
    """The Lightning packages installed: ``pytorch_lightning`` and ``lightning.pytorch``."""
    return [package for package in ("pytorch_lightning", "lightning.pytorch")
            if importlib.util.find_spec(package.split(".")[0]) is not None]


def _checkpoint_io_bases() -> tuple[type, ...]:
    """Every installed Lightning's ``CheckpointIO``.

    Why: Lightning ships as ``pytorch_lightning`` and as ``lightning`` (``lightning.pytorch``),
    each with a class of its own, and a Trainer refuses a plugin not derived from its own
    ("Found invalid type for plugin"). Derived from both, one class serves either Trainer,
    whichever the program imports and in whatever order."""
    bases = [importlib.import_module(f"{package}.plugins.io").CheckpointIO for package in _lightning_packages()]
    if not bases:
        raise ImportError("resilient.lightning needs Lightning: pip install 'resilient[lightning]' "
                          "(pytorch-lightning), or lightning")
    return tuple(dict.fromkeys(bases))


class ResilientCheckpointIO(*_checkpoint_io_bases()):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` writing resilient checkpoints.

    Args:
        remote: URL prefix of an object store (``s3://bucket/run``); each checkpoint path
            is drained to ``<remote>/<file name>`` (its newest save alone is kept there, and
            a checkpoint Lightning removes goes there too), and a path this machine lacks
            is loaded from there (a new node resuming with ``ckpt_path=<dirpath>/last.ckpt``).
        storage_options: credentials and options for ``remote`` (never written anywhere).
        compress: ``"zstd"`` or None, as for ``Checkpointer``.
    """

    def __init__(self, *, remote: str | None = None, storage_options: Mapping[str, Any] | None = None,
                 compress: str | None = None) -> None:
        self.remote = remote.rstrip("/") if remote else None
        self.storage_options = dict(storage_options or {})
        self.compress = compress
        self._open: dict[str, Checkpointer] = {}  # path -> checkpointer with a save in flight, or kept
        self._saves: Counter[str] = Counter()  # path -> saves of it in this process
        self._remote_names: set[str] | None = None  # what the object store held at the first save
        self._buffers = _SharedBuffers()
        self._housekeeper = _Housekeeper()
        self._first_steps = FirstSteps()
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, Any]:
        """What a process that ``ddp_spawn`` starts gets (the Trainer, with its strategy and
        plugin, is pickled to it): the plugin's arguments. Its checkpointers, buffers and
        threads are this process's; pickling them failed ("cannot pickle '_thread.lock'")."""
        return {"remote": self.remote, "storage_options": self.storage_options, "compress": self.compress}

    def __setstate__(self, arguments: dict[str, Any]) -> None:
        self.__init__(**arguments)  # type: ignore[misc]

    # -- CheckpointIO --------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = _local(path, "save")
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)  # a torch.save file, or a link (``save_last="link"``): replaced
        path = _key(path)
        self._finish_done(path)
        self._housekeeper.sweep(os.path.dirname(path))
        state = storable(checkpoint)
        ckpt = checkpointer_for(self._open, self._saves, path, lambda: self._checkpointer(path, SoloCoordinator()))
        # a sequence number, not the global step: the same path may be saved twice at one step
        self._buffers.save(ckpt, next_number(ckpt, lambda: ckpt._latest(remote=self._may_be_remote(path))), state)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint as ``torch.load`` would return it (tensors on CPU, or moved by
        ``map_location`` when it is a device); never unpickles, so ``weights_only`` holds."""
        path = _local(path, "load")
        self._finish(_key(path))  # through a link (``save_last="link"``): its target's save
        if os.path.isdir(path):
            where, storage = path, LocalStorage(path)
        elif self.remote:  # a new machine, its disk empty: the copy on the object store
            where = f"{self.remote}/{os.path.basename(path)}"
            storage = open_storage(where, self.storage_options)
        else:
            raise FileNotFoundError(f"{path} is not a resilient checkpoint (no such directory)")
        catalog = Catalog(storage)
        try:
            step = catalog.newest_consistent()
        except FileNotFoundError:  # nothing at all under that name on the remote tier
            step = None
        if step is None and where == path:
            raise CheckpointCorruptError(f"{path} holds no committed checkpoint")
        if step is None:
            raise FileNotFoundError(f"{path} does not exist here, and {where} holds no committed checkpoint")
        # every chunk read is CRC-checked; numpy's arrays, bytes and sets come back as such, as
        # torch.load gives them
        state, _ = catalog.read_state(catalog.manifest(step), step, kinds=True)
        state = as_lightning_saved_it(state)
        if isinstance(map_location, (str, torch.device, int)):  # a callable or a mapping: as saved, on the CPU
            state = _move(state, torch.device(map_location))
        return state

    def remove_checkpoint(self, path: Any) -> None:
        path = _local(path, "remove")
        if os.path.islink(path) or os.path.isfile(path):
            os.remove(path)  # a link: the link alone, its target's save goes on
            return
        path = _key(path)
        ckpt = self._open.pop(path, None)
        if ckpt is not None:  # its writer may still be moving files under ``path``; its uploader is told to stop
            ckpt.abandon(wait=ckpt.commit_timeout)
        self._remove(path, ckpt._uploader if ckpt is not None else None)

    def _remove(self, path: str, uploading: Uploader | None) -> None:
        """Delete the checkpoint directory at ``path``, and its copy on the object store (as
        Lightning's own plugin deletes a remote path) once ``uploading``, its uploader told
        to stop, has stopped; both off the step."""
        if os.path.isdir(path):
            self._housekeeper.delete(path)
        if self.remote:
            self._remove_remote(path, uploading)

    def _remove_remote(self, path: str, uploading: Uploader | None) -> None:
        name = os.path.basename(path)
        self._housekeeper.delete_remote(open_storage(self.remote, self.storage_options), name,
                                        f"{self.remote}/{name}", uploading)

    def _checkpointer(self, path: str, coordinator: Coordinator | None = None) -> Checkpointer:
        """The Checkpointer of the checkpoint at ``path`` (``coordinator``: the ranks that
        save it; by default every rank of the process group), sharing this plugin's buffers:
        each of its saves goes through ``_SharedBuffers.save``."""
        # one checkpoint a path on each tier (``last.ckpt`` is saved again and again)
        return Checkpointer(path, keep=1, keep_remote=1, compress=self.compress, rng=False,
                            remote=f"{self.remote}/{os.path.basename(path)}" if self.remote else None,
                            storage_options=self.storage_options, _coordinator=coordinator,
                            _signals=False,  # Lightning answers SIGTERM itself (SIGTERMException)
                            _staging=self._buffers.free_slot().staging)

    def _may_be_remote(self, path: str) -> bool:
        """Whether the object store may hold saves of ``path`` that this machine lacks, so
        that its first save here must list them for its number (``next_number``).

        Why not list each path: that request sat in the stall of each save to a new path
        (each top-k file), 0.2-1.1 s behind a store busy with the uploads here. The store's
        names are listed once, at the first save, instead. A name not among them holds
        nothing there but what this process uploads, and that this machine holds too: a
        local save is deleted only once a newer one at its path is committed here."""
        if not self.remote:
            return False
        if self._remote_names is None:
            try:
                self._remote_names = set(open_storage(self.remote, self.storage_options).list())
            except FileNotFoundError:  # nothing under that prefix yet
                self._remote_names = set()
            except Exception:  # noqa: BLE001 - unreachable: each path asks (and is warned about) then
                return True
        return os.path.basename(path) in self._remote_names

    def teardown(self) -> None:
        """Commit (and drain to ``remote``) every save still in flight, finish the
        deletions asked for; free the buffers. A save that failed is raised once all that
        is done."""
        failed = finish_all(self._open)
        self._housekeeper.finish()
        self._buffers.close()
        self._first_steps = FirstSteps()  # a later fit prepares its buffers again
        if failed is not None:
            raise failed

    def _stepped(self, strategy: Any, optimizer: Any) -> None:
        """After each optimizer step of the strategy the plugin is given to: at the first
        step of every optimizer, rank 0 (which alone saves through the plugin) makes the
        buffers of the first checkpoint (``_SharedBuffers.prepare``), sized for the model's
        and the optimizers' state as they are then. Only where that state is rank 0's own
        (one device, DDP): collecting it elsewhere (a sharded model's, a ZeRO optimizer's)
        takes every rank."""
        if not self._first_steps.all_made(optimizer, strategy.optimizers) or not strategy.is_global_zero:
            return
        count = saves_at_a_checkpoint(strategy.lightning_module.trainer)
        if not count or not _holds_its_state(strategy):
            return
        state = {"state_dict": strategy.lightning_module.state_dict(),
                 "optimizer_states": [o.state_dict() for o in strategy.optimizers]}
        sized = buffer_size(state, 0, 1, lambda description: [description], lambda ok: ok)
        if sized is not None:
            self._buffers.prepare(*sized, count)

    # -- in-flight saves -----------------------------------------------------------------------
    def _finish(self, path: str) -> None:
        finish(self._open, path)

    def _finish_done(self, now: str) -> None:
        for path in done_with(self._open, self._saves, now):
            self._housekeeper.close(self._open.pop(path))


def checkpointer_for(saving: dict[str, Checkpointer], saves: Counter[str], path: str,
                     make: Callable[[], Checkpointer]) -> Checkpointer:
    """The checkpointer a save at ``path`` goes to: the one ``saving`` holds for it (a save
    in flight there, or a path saved again: ``done_with``), else a new one (``make``); the
    save counted in ``saves``."""
    ckpt = saving.get(path)
    if ckpt is None:
        ckpt = saving[path] = make()
    saves[path] += 1
    return ckpt


def next_number(ckpt: Checkpointer, newest: Callable[[], int | None]) -> int:
    """The number of ``ckpt``'s next save: one past its last, or, for its first, one past
    ``newest()`` (the newest step at its path on any tier: a new node's save must come after
    what an earlier one drained to the object store)."""
    last = ckpt._last_saved_step
    return last + 1 if last is not None else (newest() or 0) + 1


def finish(saving: dict[str, Checkpointer], path: str) -> None:
    """Commit (and drain) the save in flight at ``path`` in ``saving``, and close its checkpointer."""
    ckpt = saving.pop(path, None)
    if ckpt is not None:
        try:  # a failed save raises here
            if ckpt.remote:
                ckpt.flush()
            else:
                ckpt.wait()
        finally:
            ckpt.close()


def finish_all(saving: dict[str, Checkpointer]) -> Exception | None:
    """``finish`` every save in ``saving``, whichever fails; the first failure."""
    failed: Exception | None = None
    for path in list(saving):
        try:
            finish(saving, path)
        except Exception as exc:  # noqa: BLE001 - raised by the caller once the rest is finished
            failed = failed or exc
    return failed


def done_with(saving: dict[str, Checkpointer], saves: Counter[str], now: str) -> list[str]:
    """The paths in ``saving`` whose checkpointers may be closed: their save has committed
    and drained (their threads need not linger), and the path was saved once (``saves``;
    ``last.ckpt``, saved again and again, goes on with its checkpointer), and it is not
    ``now``, the path about to be saved: its count goes up with this save, and closed here,
    its checkpointer was made again at once (seen when its upload drained between the two
    saves of one checkpoint, the step's file and ``last.ckpt``, under a loaded CI). A save
    that failed in the background is raised here, once (its checkpointer closed), as
    Lightning's ``AsyncCheckpointIO`` raises at the next save.

    Why paths saved again keep theirs: a new checkpointer for each save of a path waited,
    inside the step, for the previous save there to be committed and drained to the object
    store, then listed the store for its number (4 MB to a local S3 server: 0.18 s a save,
    against 0.02 s without ``remote=``). Kept, the path's next save waits only for the
    previous one's local write, as any Checkpointer's does, and the upload queue takes the
    rest."""
    done = []
    for path, ckpt in list(saving.items()):
        handle = ckpt._inflight
        if handle is not None and handle.done() and handle._error is not None:
            finish(saving, path)  # raises
        elif (path != now and saves[path] < 2 and (handle is None or handle.done())
              and not (ckpt._uploader and ckpt._uploader.pending())):
            done.append(path)
    return done


#: the top-level entries of a checkpoint a strategy here saved (``_SavedByEveryRank``)
SAVED_BY_EVERY_RANK = ("state_dict", "optimizer_states", "lightning")


def as_lightning_saved_it(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as Lightning's ``dump_checkpoint`` made it. Why: the strategies store the
    model's and optimizers' state apart from the rest (``SAVED_BY_EVERY_RANK``), and the
    plugin, ``Model.load_from_checkpoint`` and a single process's inference read their
    checkpoints too, expecting ``hyper_parameters``, ``global_step`` and the rest at the top."""
    if sorted(state) != sorted(SAVED_BY_EVERY_RANK) or not isinstance(state["lightning"], dict):
        return state
    whole = {**state["lightning"], "state_dict": state["state_dict"]}
    if state["optimizer_states"]:  # none: saved with weights_only=True
        whole["optimizer_states"] = state["optimizer_states"]
    return whole


#: room in each staging buffer made before the first save for what it is not sized for:
#: Lightning's own tensors (``ModelCheckpoint``'s scores, a grad scaler's), 64 bytes each
ROOM = 1 << 20


def buffer_size(state: Mapping[str, Any], rank: int, world_size: int, all_gather: Callable[[object], list[Any]],
                agree: Callable[[bool], bool]) -> tuple[int, bool] | None:
    """The bytes of a staging buffer for saves of ``state`` (planned as the saves plan it, and
    ``ROOM``) and whether it is pinned (the state is on an accelerator); None where the save
    would refuse the state, which it then does, naming the key. Collective over the ranks
    that save together: ``all_gather`` and ``agree`` (every rank's answer, all true)."""
    try:
        flat = flatten_state(state, rank)
    except Exception:  # noqa: BLE001 - the save refuses it, naming the key
        flat = None
    if not agree(flat is not None):
        return None
    assert flat is not None
    try:
        plan = plan_layout(flat.tensors, flat.per_rank, rank, world_size, all_gather)
    except ResilientError:  # refused alike on every rank (planned from what all gathered)
        return None
    return plan.nbytes + ROOM, Staging.on_device(flat.tensors)


class FirstSteps:
    """Says once, after the step that completes it, that every optimizer has made its first
    step: the state a save will be given exists from then on (Adam's moments are made by
    the first step), so the buffers of the first checkpoint can be sized for it."""

    def __init__(self) -> None:
        self._unstepped: set[int] | None = None  # None: no step yet

    def all_made(self, optimizer: Any, optimizers: list[Any]) -> bool:
        if self._unstepped is None:
            self._unstepped = {id(o) for o in optimizers}
        if not self._unstepped:
            return False
        self._unstepped.discard(id(getattr(optimizer, "_optimizer", optimizer)))  # a LightningOptimizer's own
        return not self._unstepped


def saves_at_a_checkpoint(trainer: Any) -> int:
    """How many saves the Trainer's ``ModelCheckpoint`` callbacks make at one step: each a
    file of its own (unless ``save_top_k=0``) and ``last.ckpt`` when that is a copy
    (``save_last=True``; a link is not a save, unless there is no file to link to)."""
    count = 0
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        top = getattr(callback, "save_top_k", 1) != 0
        last = getattr(callback, "save_last", None)
        count += top + (last is True or (bool(last) and not top))
    return count


def _holds_its_state(strategy: Any) -> bool:
    """Whether rank 0 holds the whole state the plugin saves, so that collecting it takes no
    other rank: one device, or DDP (not a subclass that saves otherwise, DeepSpeed), with no
    optimizer that shards its state (ZeRO's ``consolidate_state_dict`` is collective)."""
    for package in _lightning_packages():
        strategies = importlib.import_module(f"{package}.strategies")
        if isinstance(strategy, (strategies.SingleDeviceStrategy, strategies.DDPStrategy)):
            return _bypassed_by(strategy) is None and not any(
                hasattr(o, "consolidate_state_dict") for o in strategy.optimizers)
    return False


#: every plugin in this process, for ``load_from_checkpoint`` (``_teach_load_from_checkpoint``)
_LIVE: "weakref.WeakSet[ResilientCheckpointIO]" = weakref.WeakSet()


def _teach_load_from_checkpoint() -> None:
    """Let ``Model.load_from_checkpoint(path)`` read the plugin's checkpoints.

    Why: that is how a Lightning user loads a trained module (``best_model_path`` after
    ``fit``, for inference), and it does not go through the Trainer's ``CheckpointIO``:
    Lightning's ``core.saving`` opens the path as a file for ``torch.load``, and the
    plugin's checkpoints are directories (``IsADirectoryError``). Its loader is wrapped in
    each installed Lightning package, once: a local directory is read as the plugin reads
    it (checksummed, never unpickled); anything else goes to Lightning's loader as before."""
    for package in _lightning_packages():
        saving = importlib.import_module(f"{package}.core.saving")
        lightnings = getattr(saving, "pl_load", None)
        if lightnings is None or getattr(lightnings, "reads_resilient", False):
            continue

        def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None,
                    _lightnings: Callable[..., Any] = lightnings) -> Any:
            if isinstance(path_or_url, (str, os.PathLike)) and os.path.isdir(path_or_url):
                for plugin in list(_LIVE):  # a save of that path still in flight is waited for
                    plugin._finish(_key(os.path.abspath(path_or_url)))
                return ResilientCheckpointIO().load_checkpoint(path_or_url, map_location)
            return _lightnings(path_or_url, map_location=map_location, weights_only=weights_only)

        pl_load.reads_resilient = True  # type: ignore[attr-defined]
        saving.pl_load = pl_load


_teach_load_from_checkpoint()


def _bypassed_by(strategy: Any) -> str | None:
    """Why ``strategy`` would never call its ``CheckpointIO`` to save, with what to use
    instead; None when its saves go through it.

    Lightning's sharded strategies save with ``torch.distributed.checkpoint`` (or DeepSpeed's
    engine) themselves. Matched by the ``save_checkpoint`` the strategy's class runs, so a
    subclass with a ``save_checkpoint`` of its own is taken to know what it does."""
    save = getattr(type(strategy), "save_checkpoint", None)
    name = type(strategy).__name__
    if getattr(strategy, "saves_itself", False):
        return f"{name} saves its checkpoints itself, resilient's way; the plugin is not needed"
    for package in _lightning_packages():
        strategies = importlib.import_module(f"{package}.strategies")
        if save is strategies.FSDPStrategy.save_checkpoint and getattr(strategy, "_state_dict_type", None) == "sharded":
            return (f"{name}(state_dict_type='sharded') writes its checkpoints with torch.distributed.checkpoint "
                    f"itself. Use {_sharded_instead(strategies)} (FSDP2, every rank writes its shards), or "
                    f"{name}(state_dict_type='full') (rank 0 saves the gathered state through the plugin)")
        if (save is strategies.ModelParallelStrategy.save_checkpoint
                and getattr(strategy, "_save_distributed_checkpoint", False)):
            return (f"{name} writes its checkpoints with torch.distributed.checkpoint itself. Use "
                    f"{_sharded_instead(strategies)} in its place, same arguments")
        if save is strategies.DeepSpeedStrategy.save_checkpoint:
            return f"{name} writes its checkpoints with DeepSpeed's engine itself; resilient cannot write them"
    return None


def _sharded_instead(strategies: Any) -> str:
    """How to get resilient's sharded checkpoints under the Trainer of ``strategies``' package:
    ``ResilientModelParallelStrategy`` derives from one package's ``ModelParallelStrategy``
    (``pytorch_lightning``'s when both are installed), and the other's Trainer refuses it."""
    from ._lightning_parallel import ResilientModelParallelStrategy

    if issubclass(ResilientModelParallelStrategy, strategies.ModelParallelStrategy):
        return "strategy=resilient.lightning.ResilientModelParallelStrategy(...)"
    return ("pytorch_lightning's Trainer with strategy=resilient.lightning.ResilientModelParallelStrategy(...) "
            f"({strategies.__name__.rsplit('.', 1)[0]}'s Trainer refuses it)")


def _teach_strategies() -> None:
    """Look at the plugin a strategy is given when a Trainer is made (``_check_when_given``);
    tell the plugin of each optimizer step (``_tell_of_steps``). Each wraps a method of
    ``Strategy``, once per installed package."""
    for package in _lightning_packages():
        base = importlib.import_module(f"{package}.strategies").Strategy
        _check_when_given(base, importlib.import_module(f"{package}.plugins.io").AsyncCheckpointIO)
        _tell_of_steps(base)


def _check_when_given(base: type, async_io: type) -> None:
    """Warn that a strategy will not use the plugin; take the plugin out of Lightning's
    ``AsyncCheckpointIO``, saying so.

    Why warn: the Trainer hands its ``CheckpointIO`` to any strategy without a word, and the
    sharded ones never call it: a user who added ``plugins=[ResilientCheckpointIO()]`` to a
    ``strategy="fsdp"`` run would get DCP's checkpoints and think they were resilient's
    (committed crash-consistently, checksummed, drained to ``remote=``).

    Why unwrap: ``AsyncCheckpointIO(ResilientCheckpointIO())`` is what a user who wants
    saves off the step would write, and it undid that and broke: it cloned every tensor
    inside the step, then saved in a thread of its own while Lightning went on removing the
    files it saved ("checkpoint root ... is not a writable directory", "cannot schedule new
    futures after shutdown"). The plugin saves in the background already.

    The Trainer gives the plugin to the strategy through ``Strategy.checkpoint_io``'s setter
    (a plugin passed to the strategy's constructor too), so that setter is wrapped."""
    attached = base.__dict__.get("checkpoint_io")
    if not isinstance(attached, property) or getattr(attached.fset, "warns_when_bypassed", False):
        return

    def set_checkpoint_io(strategy: Any, io: Any, _set: Callable[[Any, Any], None] = attached.fset) -> None:
        if isinstance(io, async_io) and isinstance(io.checkpoint_io, ResilientCheckpointIO):
            log.warning("resilient: AsyncCheckpointIO(ResilientCheckpointIO()) is ResilientCheckpointIO alone: it "
                        "saves in the background already (AsyncCheckpointIO would clone every tensor inside the step)")
            io = io.checkpoint_io
        _set(strategy, io)
        why = _bypassed_by(strategy) if isinstance(io, ResilientCheckpointIO) else None
        if why is not None:
            log.warning("resilient: ResilientCheckpointIO will write nothing: %s", why)

    set_checkpoint_io.warns_when_bypassed = True  # type: ignore[attr-defined]
    base.checkpoint_io = attached.setter(set_checkpoint_io)  # type: ignore[attr-defined]


def _tell_of_steps(base: type) -> None:
    """Why: Lightning calls nothing of a ``CheckpointIO`` before the first save, and the
    first checkpoint's saves made their buffers in their stalls. ``Strategy``'s own
    ``optimizer_step``, which every strategy's runs, is wrapped (an attribute of each
    strategy would not survive the pickling of ``ddp_spawn``)."""
    stepping = base.__dict__["optimizer_step"]
    if getattr(stepping, "tells_the_plugin", False):
        return

    def optimizer_step(strategy: Any, optimizer: Any, closure: Any, model: Any = None, *,
                       _step: Callable[..., Any] = stepping, **kwargs: Any) -> Any:
        result = _step(strategy, optimizer, closure, model, **kwargs)
        io = getattr(strategy, "_checkpoint_io", None)  # not the property: it makes a default one
        if isinstance(io, ResilientCheckpointIO):
            io._stepped(strategy, optimizer)
        return result

    optimizer_step.tells_the_plugin = True  # type: ignore[attr-defined]
    optimizer_step.__doc__ = stepping.__doc__
    base.optimizer_step = optimizer_step  # type: ignore[attr-defined]


_teach_strategies()


def _local(path: Any, action: str) -> str:
    """``path`` made absolute; a URL refused, naming it. Why: the plugin writes to a local
    directory and drains it to the object store, and ``os.path`` would take
    ``s3://bucket/run/last.ckpt`` for a relative path (``./s3:/bucket/...``): the
    checkpoints would land on the local disk under that odd name, the bucket empty."""
    path = os.fspath(path)
    if is_remote(path):
        raise ValueError(f"cannot {action} {path}: ResilientCheckpointIO writes to a local directory and drains it "
                         "to an object store; use ModelCheckpoint(dirpath=<a local directory>) and "
                         f"ResilientCheckpointIO(remote={path.rsplit('/', 1)[0]!r})")
    return os.path.abspath(path)


def _key(path: str) -> str:
    """The name a checkpoint directory is known by here, whatever links lead to it: Lightning
    links ``last.ckpt`` to the newest file (``save_last="link"``) while that is still being
    written, and a load through the link must wait for that save."""
    return os.path.realpath(path)


@dataclasses.dataclass
class _Slot:
    staging: Staging
    handle: SaveHandle | None = None  # the last save into it, whose writer may still read the buffer

    def busy(self) -> bool:
        return self.handle is not None and not self.handle.done()


class _SharedBuffers:
    """The staging buffers the plugin's saves share.

    Why: Lightning names a new path for each save and the plugin makes a Checkpointer per
    path, so each save made its own host buffer and touched every page of it inside its
    stall (1 GB, 4 saves: 1.49, 0.19, 0.68 and 0.19 s, against 0.19 s for a save into a
    touched buffer). Two are kept, so that the two saves Lightning often makes at one step
    (a top-k file and ``last.ckpt``) do not wait for each other. A third save waits for the
    older one's files to be written, as a Checkpointer's next save waits for its last:
    memory stays at two buffers however often Lightning saves."""

    def __init__(self, most: int = 2) -> None:
        self._most = most
        self._slots: list[_Slot] = []

    def free_slot(self) -> _Slot:
        for slot in self._slots:
            if not slot.busy():
                return slot
        if len(self._slots) < self._most:
            self._slots.append(_Slot(Staging()))
            return self._slots[-1]
        oldest = min(self._slots, key=lambda slot: slot.handle.started)  # type: ignore[union-attr]
        oldest.handle.settled()  # type: ignore[union-attr]
        return oldest

    def prepare(self, nbytes: int, pin: bool, count: int) -> None:
        """Make ``count`` buffers now (the saves Lightning makes at one step, two at most),
        ``nbytes`` each, and touch their pages in a background thread (``Staging.prewarm``),
        unless a save has made one already.

        Why: Lightning calls nothing of the plugin's or a strategy's between the start of
        training and the first checkpoint, so the first checkpoint's two saves made their
        buffers in their stalls, at this VM's 1.45 s/GB of first touch: 1.3-1.6 s each for a
        rank's 0.5 GB on two ranks, against 0.11 s for a later save. A strategy sees every
        optimizer step, and sizes the buffers at the first (``_prepare_buffers``); the plugin
        is told of them too (``_teach_strategies``)."""
        if self._slots:
            return
        self._slots = [_Slot(Staging()) for _ in range(min(count, self._most))]
        for slot in self._slots:
            slot.staging.prewarm(nbytes, pin)

    def save(self, ckpt: Checkpointer, step: int, state: Any) -> None:
        """``ckpt`` saves ``state`` as ``step`` into a buffer no save is being written from.
        The buffer is picked at each save: a checkpointer kept for a path saved again
        (``done_with``) holds none between its saves."""
        slot = self.free_slot()
        ckpt._staging = slot.staging
        ckpt.save(step, state, force=True)
        slot.handle = ckpt._inflight

    def close(self) -> None:
        for slot in self._slots:
            slot.staging.close()
        self._slots = []


class _Housekeeper:
    """Deletes the checkpoints Lightning removes, and their copies on the remote tier, and
    closes the checkpointers done with their saves (``done_with``), on a thread of its own.

    Why: Lightning removes a checkpoint (``save_top_k``) inside the training step, and
    deleting a 1 GB checkpoint's files took 0.77-1.0 s here. A removed directory is renamed
    first (hidden: ``.<name>.deleted-<id>``), so the path is gone when ``remove_checkpoint``
    returns; one left by a process that died before deleting it is swept at the next save
    into the same directory. Closing a checkpointer whose save has gone up waits, on every
    rank but 0, for rank 0 to write the step's commit record on the object store: 1.27 s in
    each save to a new path, on the second of 2 ranks (0.2 GB, moto's server), before."""

    _MARK = ".deleted-"

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._asked: list[Future[None]] = []
        self._swept: set[str] = set()
        self._lock = threading.Lock()

    def delete(self, path: str) -> None:
        parent, name = os.path.split(path)
        gone = os.path.join(parent, f".{name}{self._MARK}{uuid.uuid4().hex[:8]}")
        os.rename(path, gone)
        self._submit(f"delete the removed checkpoint {path}", lambda: shutil.rmtree(gone, onerror=_unless_vanished))

    def delete_remote(self, storage: Storage, name: str, where: str, uploading: Uploader | None) -> None:
        """Delete ``name`` on the remote tier once ``uploading`` (the removed save's uploader,
        told to stop) has stopped: nothing of it may land there after the deletion."""
        def delete() -> None:
            if uploading is not None:
                uploading.close(timeout=None)
            storage.delete(name)

        self._submit(f"delete the removed checkpoint {where}", delete)

    def sweep(self, directory: str) -> None:
        """Delete what an earlier process renamed here and did not delete (once a directory)."""
        if directory in self._swept:
            return
        self._swept.add(directory)
        for name in os.listdir(directory) if os.path.isdir(directory) else []:
            if name.startswith(".") and self._MARK in name:
                gone = os.path.join(directory, name)
                self._submit(f"delete the removed checkpoint {gone}",
                             lambda gone=gone: shutil.rmtree(gone, onerror=_unless_vanished))

    def close(self, ckpt: Checkpointer) -> None:
        """Close ``ckpt``, whose saves are committed and drained."""
        self._submit(f"close the checkpointer of {ckpt.root}", ckpt.close)

    def _submit(self, doing: str, work: Callable[[], None]) -> None:
        def logged() -> None:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - a deletion or a close that fails loses nothing; say so
                log.warning("resilient: could not %s: %s: %s", doing, type(exc).__name__, exc)

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-housekeeping",
                                                initializer=yield_to_training)
            self._asked = [f for f in self._asked if not f.done()]
            self._asked.append(self._pool.submit(logged))

    def finish(self) -> None:
        with self._lock:
            asked, self._asked = self._asked, []
        wait(asked)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [_move(v, device) for v in value]
        return moved if isinstance(value, list) else tuple(moved)
    return value


def _unless_vanished(func: Any, path: str, exc_info: Any) -> None:
    """rmtree's error hook: an entry another thread removed first (the retention's trash
    collector, a pending save's clean-up) is gone either way."""
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


from ._lightning_parallel import ResilientDDPStrategy, ResilientModelParallelStrategy  # noqa: E402 - on the plugin

__all__ += ["ResilientDDPStrategy", "ResilientModelParallelStrategy"]
