"""FSDP2 with torchao's low-bit optimizer (``AdamW8bit``): saves and restores against DCP.

    python -m benchmarks.bench_low_bit [--gb 1] [--world 2] [--rounds 3] [--saves 1] [--restores 2]
                                       [--out results-low-bit.json]
    python -m benchmarks.bench_low_bit --render benchmarks/results-low-bit.json

A low-bit optimizer is picked to fit a model in memory: its moments are a byte per value
(uint8 codes, one fp32 scale per 256 values), each under FSDP2 a DTensor over torchao's
``OptimState8bit``. DCP saves such state (torch.save of each rank's subclass, resharded
on load by torchao's slicing); resilient saves its parts as shards of plain tensors
(``resilient/_subclasses.py``).

``--world`` ranks on gloo hold ``LAYERS`` bias-free linear layers of 1024 inputs, each
``fully_shard``-ed, and ``AdamW8bit`` over them after one step (its state made): ``--gb``
is the parameters (fp32) and the two quantized moments together, about 6 bytes a value.
Both methods restore in place, as a run's in-process recovery does: DCP through its
documented recipe (``get_state_dict``, ``dcp.load``, ``set_state_dict``). The rounds
(unmeasured and measured saves, cold restores, the limits beside them) are
``benchmarks/save_restore_rounds.py``'s.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench_checkpoint import _timed_together
from benchmarks.common import GB
from benchmarks.save_restore_rounds import ResilientMethod, measured_rounds, rounds_main, rounds_table

METHODS = ("resilient", "dcp.save", "dcp.async_save", "dcp.async_save+DefaultStager")
LAYERS = 8
INPUTS = 1024
#: bytes per value: the fp32 parameter, two moments of a uint8 code and 4/256 of a scale each
BYTES_PER_VALUE = 4 + 2 * (1 + 4 / 256)


def build(total_bytes: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``LAYERS`` layers of unlike numbers of rows (multiples of ``world``, so that every
    rank's shard is quantized alike), sharded by FSDP2, ``AdamW8bit`` after one step."""
    from torch.distributed.fsdp import fully_shard
    from torchao.optim import AdamW8bit

    values = int(total_bytes / BYTES_PER_VALUE)
    unit = values // INPUTS // sum(range(1, LAYERS + 1)) // world * world
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(INPUTS, max(unit, world) * (i + 1), bias=False)
                                  for i in range(LAYERS)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = AdamW8bit(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step: eager spares inductor's build
        optim.step()
    return model, optim


def _own_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of this rank's part: its shards of the parameters and of their states' parts."""
    total = 0
    for param in model.parameters():
        total += param.to_local().numel() * param.element_size()
        for value in optim.state[param].values():
            local = value.to_local() if hasattr(value, "to_local") else value
            names = local.__tensor_flatten__()[0] if hasattr(local, "__tensor_flatten__") else None
            parts = [getattr(local, n) for n in names] if names and type(local) is not torch.Tensor else [local]
            total += sum(p.numel() * p.element_size() for p in parts)
    return total


class Dcp:
    """DCP's recipe: the state dicts of ``get_state_dict`` saved by ``dcp.save`` (fsync'd,
    its default) into a directory per step, the older one removed; loaded in place. With
    ``stager`` (``async_save``'s ``async_stager``, None for its default), by
    ``dcp.async_save``: the stall ends once it returns, the save durable at its future's
    result."""

    def __init__(self, root: str, model: torch.nn.Module, optim: torch.optim.Optimizer, *, staged: bool = False,
                 stager: Any = None) -> None:
        self.root, self.model, self.optim, self.last = root, model, optim, 0
        self.staged, self.stager = staged, stager

    def _path(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def save(self, step: int) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        started, responses = time.perf_counter(), []

        def saved() -> None:
            model_sd, optim_sd = get_state_dict(self.model, self.optim)
            state = {"model": model_sd, "optim": optim_sd}
            if not self.staged:
                dcp.save(state, checkpoint_id=self._path(step))
            else:
                responses.append(dcp.async_save(state, checkpoint_id=self._path(step), async_stager=self.stager))
                if hasattr(responses[0], "staging_completion"):  # a stager's: the state may change after this
                    responses[0].staging_completion.result()

        stall = _timed_together(saved)
        if responses:
            done = getattr(responses[0], "upload_completion", responses[0])
            done.result()
        dist.barrier()
        durable = time.perf_counter() - started
        if dist.get_rank() == 0 and self.last:
            shutil.rmtree(self._path(self.last), ignore_errors=True)
        self.last = step
        dist.barrier()
        return stall, durable

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=self._path(self.last))
        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def directory(self) -> str:
        return self._path(self.last)


def worker(args: dict[str, Any]) -> None:
    """One rank: every method's saves and cold restores, round by round, with the limits."""
    dist.init_process_group("gloo")
    model, optim = build(int(args["gb"] * GB), dist.get_world_size())
    own = _own_bytes(model, optim)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    methods = {"resilient": ResilientMethod(os.path.join(args["root"], "resilient"),
                                            {"model": model, "optim": optim}),
               "dcp.save": Dcp(os.path.join(args["root"], "dcp"), model, optim),
               "dcp.async_save": Dcp(os.path.join(args["root"], "dcp-async"), model, optim, staged=True),
               "dcp.async_save+DefaultStager": Dcp(os.path.join(args["root"], "dcp-stager"), model, optim,
                                                   staged=True, stager=_default_stager())}
    with torch.compiler.set_stance("force_eager"):
        failed = {}
        for name in ("dcp.async_save", "dcp.async_save+DefaultStager"):
            try:  # one save tried first: DCP's staging asks torchao's state for what it lacks
                methods[name].save(0)
            except Exception as exc:  # noqa: BLE001 - whatever the anchor raises is its result
                failed[name] = f"{type(exc).__name__}: {str(exc).split(', types=')[0][:160]}"
                del methods[name]
        measured_rounds(methods, own, sum(everyone), args, failed)
    dist.destroy_process_group()


def _default_stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(torch.cuda.is_available(), False, True, False))


def render(result: dict[str, Any]) -> str:
    return rounds_table(result, METHODS, "parameters + AdamW8bit state (FSDP2)")


if __name__ == "__main__":
    rounds_main("benchmarks.bench_low_bit", __doc__, worker, render)
