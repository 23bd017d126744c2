"""Hugging Face ``Trainer`` integration: ``ResilientTrainer`` in place of ``Trainer``.

    from resilient.hf import ResilientTrainer
    trainer = ResilientTrainer(model=model, args=args, train_dataset=data)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint="auto")   # newest checkpoint if any, else from the start

``Trainer`` decides when to save (``save_steps``, ``save_strategy``); this class decides how.
Its checkpoints are resilient's, under ``<output_dir>/resilient`` (``resilient_root=``):

* a save returns once the model, optimizer, scheduler and generators are snapshotted into
  host memory; the files are written, checksummed and committed in the background (the
  Trainer's own save writes ``model.safetensors``, ``optimizer.pt`` and the rest inline);
* replicated (DDP) state is written once, spread over the ranks, not once per process;
* a step exists only once every rank's files are durable; ``resume_from_checkpoint`` takes
  the newest such step (the Trainer's own ``checkpoint-N`` directory can be half written);
* loading never unpickles anything from the checkpoint;
* ``resilient_remote=`` drains every checkpoint to an object store as well.

Resuming goes through the Trainer's own path, so what it restores is restored as it does:
the step, epoch and data position (it skips the batches already trained), the callbacks'
state, the generators at the point the Trainer sets them. For that path, the step resumed
from gets a small ``<output_dir>/checkpoint-N`` directory holding the Trainer's state file
(``trainer_state.json``, kept in the checkpoint and written back at resume) and a marker
(``resilient.json``); everything else comes from the checkpoint.

Switching a run from ``Trainer`` to ``ResilientTrainer`` midway: ``"auto"`` resumes from the
plain Trainer's newest ``checkpoint-N`` when resilient has none yet.

On SIGTERM or SIGUSR1 (a preemption, to any rank) the step just trained is saved at once,
whatever ``save_steps`` says, committed and drained, and the process exits with status 0
(``_AtEveryStep``).

A model with PEFT adapters (LoRA and the like) saves its trainable parameters alone, as
the Trainer's checkpoints hold the adapter alone (``_saved_part``).

The best step (``metric_for_best_model``) is kept by retention besides the newest
``save_total_limit`` steps, as the Trainer's rotation keeps its directory, and
``load_best_model_at_end`` loads its model from resilient's checkpoint. With
``save_only_model`` a save holds the model and the Trainer's state only, and a run is not
resumed from it (the optimizer and schedule would start again): that is refused, naming
the step.

Not covered: DeepSpeed and the Trainer's FSDP (their engines save their own state; both
refused when the Trainer is made, with the reason), and ``push_to_hub`` of checkpoints (the
final model is pushed as usual; a warning says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import Any, Iterator, Sequence

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import HubStrategy, _is_peft_model, get_last_checkpoint

from ._checkpointer import Checkpointer
from ._policy import RetentionPolicy, retention_policy
from ._storage import LocalStorage

__all__ = ["ResilientTrainer", "ResilientTrainerMixin"]

MARKER = "resilient.json"
TRAINER_STATE = "trainer_state.json"
MODEL_ONLY = "model_only"  # an entry of a save_only_model step: no optimizer or schedule to resume

log = logging.getLogger("resilient")


class ResilientTrainerMixin:
    """The checkpointing of ``ResilientTrainer``, for a class derived from ``Trainer`` of
    one's own (``class MyTrainer(ResilientTrainerMixin, SFTTrainer)``)."""

    def __init__(self, *args: Any, resilient_root: str | None = None, resilient_remote: str | None = None,
                 resilient_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ResilientTrainer: DeepSpeed and the Trainer's FSDP save their engines' own state; "
                             "use the plain Trainer with them, or FSDP2 in a loop of your own with Checkpointer")
        self.resilient_root = resilient_root or os.path.join(self.args.output_dir, "resilient")
        self._resilient_remote = resilient_remote
        self._resilient_options = dict(resilient_options or {})
        self._resilient: Checkpointer | None = None
        self._best_saved: list[int] = []  # steps that were the best when saved, oldest first
        self.add_callback(_AtEveryStep(self))
        if self.args.push_to_hub and self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            log.warning("resilient: hub_strategy=%r pushes checkpoint directories, which ResilientTrainer does "
                        "not write; the final model is pushed as usual", str(self.args.hub_strategy))

    # -- the checkpointer -----------------------------------------------------------------------
    def checkpointer(self) -> Checkpointer:
        """The run's ``Checkpointer`` (made at first use: the process group is up by then).
        It keeps ``save_total_limit`` steps (or every step when that is unset), and the best
        step besides (``_KeepingTheBest``)."""
        if self._resilient is None:
            options = {"keep": self.args.save_total_limit, **self._resilient_options}
            options["keep"] = _KeepingTheBest.around(options["keep"], self._best_saved)
            self._resilient = Checkpointer(self.resilient_root, remote=self._resilient_remote, **options)
        return self._resilient

    def _entries(self) -> dict[str, Any]:
        """What a checkpoint holds besides the Trainer's state: the model (a DDP wrapper's
        module's keys), the optimizer and scheduler, and the gradient scaler under fp16;
        with ``save_only_model``, the model alone."""
        entries: dict[str, Any] = {"model": _saved_part(self.model)}
        if self.args.save_only_model:
            return entries
        if self.optimizer is not None:
            entries["optimizer"] = self.optimizer
        if self.lr_scheduler is not None:
            entries["lr_scheduler"] = self.lr_scheduler
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            entries["scaler"] = scaler
        return entries

    # -- saving ---------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Every rank snapshots its state; the writes and the commit go on in the background.
        The Trainer's state goes in as its JSON, with the callbacks' states as the Trainer
        itself records them, and the best step's directory name as the Trainer gives it
        (``_note_the_best``)."""
        self._note_the_best(trial)
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                name, value = type(callback).__name__, callback.state()
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(value)
                else:
                    self.state.stateful_callbacks[name] = value
        # as process zero writes it: the flags saying which process this is are set again at
        # load, and left as they are they made the state differ by rank (saved once per rank,
        # and a warning at every resize)
        fields = {**dataclasses.asdict(self.state), "is_local_process_zero": True, "is_world_process_zero": True}
        trainer_state = json.dumps(fields, indent=2, sort_keys=True) + "\n"
        entries = {**self._entries(), "trainer_state": trainer_state}
        if self.args.save_only_model:
            entries[MODEL_ONLY] = True
        self.checkpointer().save(self.state.global_step, entries, force=True)

    def _note_the_best(self, trial: Any) -> None:
        """When the step being saved is the best so far (``metric_for_best_model``, decided by
        the evaluation just before the save), it becomes ``best_model_checkpoint``, the
        ``checkpoint-N`` path the Trainer would have written: what it records in its state,
        keeps from rotation and loads at the end (``_load_best_model``). An evaluation's best
        at a step not saved changes nothing, as with the Trainer's own directories."""
        step = self.state.global_step
        if self.state.best_global_step != step:
            return
        if step not in self._best_saved:
            self._best_saved.append(step)
        self.state.best_model_checkpoint = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{step}")

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``resume_from_checkpoint``: ``"auto"`` (the newest committed step; when there is
        none, the plain Trainer's newest ``checkpoint-N`` in ``output_dir``, or the start),
        True (the newest committed step; an error when there is none), a ``checkpoint-N``
        directory, or None (from the start)."""
        try:
            resume_dir = self._resume_dir(resume_from_checkpoint)
            self.checkpointer()  # from the start: it is what hears a preemption signal
            return super().train(resume_dir, *args, **kwargs)  # type: ignore[misc]
        finally:
            if self._resilient is not None:  # every save of the run committed (or its error raised)
                ckpt, self._resilient = self._resilient, None
                ckpt.close()

    def _resume_dir(self, asked: str | bool | None) -> str | None:
        """The ``checkpoint-N`` directory the Trainer resumes from, written for the step chosen:
        the step is agreed by every rank (``restore``), and each writes the directory's two
        small files itself (atomically), so none reads another's half-written one."""
        if asked is None or asked is False:
            return None
        step = None
        if isinstance(asked, str) and asked != "auto":
            step = _marked_step(asked)
            if step is None:
                return asked  # the Trainer's own checkpoint directory: its own loading
        holder: dict[str, Any] = {"trainer_state": None, MODEL_ONLY: False}
        with _without_generators(self.checkpointer()):
            found = self.checkpointer().restore(holder, step=step, strict=False)
        if not found:
            if asked == "auto":  # a run the plain Trainer checkpointed: resumed from its own newest
                theirs = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
                return theirs if _marked_step(theirs) is None else None
            raise ValueError(f"ResilientTrainer: no committed checkpoint in {self.resilient_root} to resume from")
        if holder[MODEL_ONLY]:
            raise ValueError(f"ResilientTrainer: step {found} in {self.resilient_root} was saved with "
                             "save_only_model=True: it holds the model but not the optimizer, scheduler or "
                             "generators, so training cannot resume from it; start without "
                             "resume_from_checkpoint (or load its model with resilient's restore), and drop "
                             "save_only_model to make steps a run resumes from")
        trainer_state = json.loads(holder["trainer_state"])
        best_dir = trainer_state.get("best_model_checkpoint")
        best = _step_of_dir(best_dir)
        if best is not None and (not os.path.isdir(best_dir) or _marked_step(best_dir) is not None):
            # resilient's best step (retention keeps it): the Trainer forgets a best step whose
            # directory is missing, so it gets one too (a plain Trainer's own is left as it is)
            trainer_state["best_model_checkpoint"] = self._marked_dir(best).root
            self._best_saved[:] = [best]
        folder = self._marked_dir(found)
        folder.write(TRAINER_STATE, [(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n").encode()])
        return folder.root

    def _marked_dir(self, step: int) -> LocalStorage:
        """``<output_dir>/checkpoint-<step>`` with the marker naming resilient's step in it."""
        folder = LocalStorage(os.path.join(self.args.output_dir, f"checkpoint-{step}"))
        folder.write(MARKER, [json.dumps({"root": self.resilient_root, "step": step}).encode()])
        return folder

    # -- the Trainer's loading, for a marked directory ------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if _marked_step(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # else: with the optimizer and scheduler, once they exist (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        step = _marked_step(checkpoint)
        if step is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        with _without_generators(self.checkpointer()):
            self.checkpointer().restore(self._entries(), step=step, strict=False)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if _marked_step(checkpoint) is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """The generators, at the point the Trainer sets them (after skipping the batches
        already trained), every rank its own."""
        step = _marked_step(checkpoint)
        if step is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif self.checkpointer().rng:
            self.checkpointer().restore({}, step=step, strict=False)

    def _load_best_model(self) -> None:
        """At the end of ``train`` with ``load_best_model_at_end``: the best step's model, from
        resilient's checkpoint (every save so far is committed first)."""
        path = self.state.best_model_checkpoint
        step = _marked_step(path) if os.path.isdir(path) else _step_of_dir(path)
        if step is None:  # the plain Trainer's own directory (a run switched midway)
            super()._load_best_model()  # type: ignore[misc]
            return
        log.info("resilient: loading the best model, step %d (%s %s)", step, self.args.metric_for_best_model,
                 self.state.best_metric)
        with _without_generators(self.checkpointer()):
            self.checkpointer().restore({"model": _saved_part(self.model)}, step=step, strict=False)


class _AtEveryStep(TrainerCallback):
    """What resilient does at the end of every step of the Trainer's loop, on every rank:

    * at the first step (and the first after a resume), the layout is planned and the
      staging buffer made in the background (``Checkpointer.prepare``, which a loop
      calling ``save()`` every step gets at its first call not due): the Trainer calls
      ``save()`` only when a save is due, and its first save paid both in its stall;
    * when the job is being preempted (SIGTERM or SIGUSR1 on any rank, agreed by
      ``Checkpointer.preempted``), the step just trained is saved: committed, drained to the
      remote tier, and the process exits with status 0 within the grace. Without it the
      next save came on the Trainer's schedule (``save_steps``), after the platform's
      SIGKILL: every step since the last save was lost."""

    def __init__(self, trainer: ResilientTrainerMixin) -> None:
        self.trainer = trainer
        self._prepared: Checkpointer | None = None  # the run's, once prepared (``train`` makes one a run)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ckpt = self.trainer._resilient
        if ckpt is None:
            return
        if ckpt is not self._prepared:  # once a run: the entries of a PEFT model are a walk over its parameters
            ckpt.prepare(self.trainer._entries())
            self._prepared = ckpt
        if ckpt.preempted():
            control.should_save = True


class ResilientTrainer(ResilientTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are resilient's (see the module's text)."""


@dataclasses.dataclass(frozen=True)
class _KeepingTheBest:
    """A retention policy that keeps, besides what ``inner`` keeps, the newest committed step
    among those saved as the best: the Trainer's rotation keeps its best directory the same
    way. The previous best is kept until the new one is committed, so a best step whose
    save failed leaves the one before it in place."""

    inner: RetentionPolicy
    best_saved: list[int]  # the trainer's list, appended to as the run goes on

    @classmethod
    def around(cls, keep: Any, best_saved: list[int]) -> RetentionPolicy | None:
        inner = retention_policy(keep)
        return None if inner is None else cls(inner, best_saved)

    def __repr__(self) -> str:  # the retention named in its log lines
        return f"{self.inner!r} and the best step"

    def keep(self, steps: Sequence[int]) -> set[int]:
        committed_best = set(self.best_saved) & set(steps)
        return self.inner.keep(steps) | ({max(committed_best)} if committed_best else set())


def _saved_part(model: Any) -> Any:
    """What of ``model`` a checkpoint holds: the model; of a model with PEFT adapters (a
    ``PeftModel``, or one given adapters by ``add_adapter``), its trainable parameters by
    name, as the Trainer's own checkpoints hold the adapter alone. The frozen base comes
    from ``from_pretrained`` at every start; saving it at every step would write the whole
    pretrained model each time (gigabytes for megabytes of adapter). They are restored in
    place, into the parameters of the adapter the program has just made."""
    if not (_is_peft_model(model) or getattr(model, "_hf_peft_config_loaded", False)):
        return model
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def _step_of_dir(path: Any) -> int | None:
    """N of a ``.../checkpoint-N`` path, or None."""
    found = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(str(path or "").rstrip("/\\")))
    return int(found.group(1)) if found else None


def _marked_step(folder: Any) -> int | None:
    """The step a ``checkpoint-N`` directory written by ``_resume_dir`` stands for, or None."""
    if not isinstance(folder, str):
        return None
    try:
        with open(os.path.join(folder, MARKER)) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


@contextlib.contextmanager
def _without_generators(ckpt: Checkpointer) -> Iterator[None]:
    """Restore the model or the Trainer's state without setting the generators: the Trainer
    sets them later, after skipping the batches already trained (``_load_rng_state``)."""
    rng, ckpt.rng = ckpt.rng, False
    try:
        yield
    finally:
        ckpt.rng = rng
