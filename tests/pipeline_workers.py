"""Pipeline-parallel state, as ``torch.distributed.pipelining`` leaves it: each stage holds
some of the model's layers under the full model's names, its data-parallel replicas the
same ones, and its optimizer state keyed by those names (DCP's ``get_state_dict``).
Scenarios for ``tests.launch.run_ranks(..., module="tests.pipeline_workers")``."""

from __future__ import annotations

import json
import sys

import torch

from resilient import Checkpointer, UnsupportedStateError

from .fsdp_workers import AppState  # DCP's recipe: state keyed by parameter name
from .workers import finish_scenario, init

LAYERS = 4


def _full_model() -> torch.nn.Sequential:
    torch.manual_seed(7)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(LAYERS)])


def _stage(model: torch.nn.Sequential, rank: int, stages: int) -> tuple[torch.nn.Sequential, int]:
    """This rank's stage: its layers kept, the others' replaced (names keep their places);
    ranks r and r + stages are replicas of one stage."""
    stage = rank % stages
    return _layers_of(model, stage, stages), stage


def _layers_of(model: torch.nn.Sequential, stage: int, stages: int) -> torch.nn.Sequential:
    mine = [i for i in range(LAYERS) if i * stages // LAYERS == stage]
    return torch.nn.Sequential(*[model[i] if i in mine else torch.nn.Identity() for i in range(LAYERS)])


def _sharded_stage(world: int, stages: int) -> torch.nn.Sequential:
    """This rank's stage, FSDP2-sharded over the stage's ranks (mesh pp x dp, row-major)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (stages, world // stages), mesh_dim_names=("pp", "dp"))
    stage = _layers_of(_full_model(), mesh.get_coordinate()[0], stages)
    for layer in stage:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(stage, mesh=mesh["dp"])


def _full_params(stage: torch.nn.Module) -> str:
    return "AFTER " + json.dumps({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist()
                                  for k, v in stage.state_dict().items()})


def sharded_stages(a: dict) -> None:
    """Stages FSDP2-sharded over their replicas: save at step 3 (or, ``resume``, restore
    into a fresh stage and optimizer), then train to step 6."""
    rank, world = init()
    stage = _sharded_stage(world, a["stages"])
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    state = {"app": AppState(stage, optim)}
    with Checkpointer(a["root"], keep=None) as ckpt:
        if a.get("resume"):
            assert ckpt.restore(state) == 3
        else:
            _train(stage, optim, range(3))
            ckpt.save(3, state, force=True)
            ckpt.wait()
    _train(stage, optim, range(3, 6))
    print(_full_params(stage), flush=True)


class _ModelOnly:
    """The model's part of ``AppState``: a restore for evaluation, or a new split."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])


def _train(stage: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    """Each stage's own layers on a batch of the step (no activations cross stages here:
    what is tested is the state each stage keeps)."""
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        optim.zero_grad()
        stage(x).square().mean().backward()
        optim.step()


def _trained(rank: int, stages: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    stage, _ = _stage(_full_model(), rank, stages)
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    _train(stage, optim, range(3))
    return stage, optim


def save(a: dict) -> None:
    """Train 3 steps, save, train 3 more; print this stage's parameters after all 6."""
    rank, _ = init()
    stage, optim = _trained(rank, a["stages"])
    with Checkpointer(a["root"], keep=None) as ckpt:
        ckpt.save(3, {"app": AppState(stage, optim), "progress": {"epoch": 1}}, force=True)
        ckpt.wait()
    _train(stage, optim, range(3, 6))
    print("AFTER " + json.dumps({k: v.tolist() for k, v in stage.state_dict().items()}), flush=True)


def resume(a: dict) -> None:
    """A fresh stage of this layout, restored, trained the same 3 more steps."""
    rank, _ = init()
    stage, _ = _stage(_full_model(), rank, a["stages"])
    with torch.no_grad():
        for p in stage.parameters():
            p.zero_()
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    state = {"app": AppState(stage, optim), "progress": {}}
    with Checkpointer(a["root"]) as ckpt:
        assert ckpt.restore(state) == 3
    assert state["progress"] == {"epoch": 1}
    _train(stage, optim, range(3, 6))
    print("AFTER " + json.dumps({k: v.tolist() for k, v in stage.state_dict().items()}), flush=True)


def another_split(a: dict) -> None:
    """The model (and, ``optim``, its optimizer keyed by parameter name) at another split, or
    whole on one rank: each rank's layers and their moments are those the checkpoint holds
    for their names; each parameter's group keeps its hyperparameters."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    rank, _ = init()
    stage, _ = _stage(_full_model(), rank, a["stages"])
    want, want_optim = {}, {}  # what each stage of the saved split held
    for saved_stage in range(a["saved_stages"]):
        saved, saved_optim = _trained(saved_stage, a["saved_stages"])
        want.update(saved.state_dict())
        want_optim.update(get_optimizer_state_dict(saved, saved_optim)["state"])
    with torch.no_grad():
        for p in stage.parameters():
            p.zero_()
    optim = torch.optim.AdamW(stage.parameters(), lr=0.5)  # the saved lr (1e-2) must come back
    entry = AppState(stage, optim) if a.get("optim") else _ModelOnly(stage)
    with Checkpointer(a["root"]) as ckpt:
        assert ckpt.restore({"app": entry}, strict=False) == 3
    for name, t in stage.state_dict().items():
        assert torch.equal(t, want[name]), (rank, name)
    if a.get("optim"):
        got = get_optimizer_state_dict(stage, optim)["state"]
        assert sorted(got) == sorted(stage.state_dict()), (rank, sorted(got))
        for name, fields in got.items():
            for field, value in fields.items():
                assert torch.equal(value, want_optim[name][field]), (rank, name, field)
        assert all(group["lr"] == 1e-2 for group in optim.param_groups), optim.param_groups
        _train(stage, optim, range(3, 4))  # and it steps
    print(f"rank {rank} holds {sorted(stage.state_dict())}", flush=True)


def raw_optimizer_refused(a: dict) -> None:
    """Each stage's plain optimizer keys its state 0, 1, ...: one name, two tensors of
    other shapes on two stages. Refused on every rank, naming the key and the remedy."""
    rank, _ = init()
    stage, _ = _stage(_full_model(), rank, 2)
    if rank == 1:
        stage[3] = torch.nn.Linear(16, 4)  # the last stage's head: another shape
    optim = torch.optim.Adam(stage.parameters())
    _train(stage, optim, range(1)) if rank == 0 else None
    if rank == 1:
        stage(torch.randn(2, 16)).sum().backward()
        optim.step()
    with Checkpointer(a["root"]) as ckpt:
        try:
            ckpt.save(1, {"model": stage, "optim": optim}, force=True)
        except UnsupportedStateError as exc:
            print(f"rank {rank} refused: {exc}", flush=True)
        else:
            raise AssertionError("one name for two tensors was saved")


def last_stage_entry(a: dict) -> None:
    """An entry only the last stage saves (its head's state): restored whole on one rank,
    and at the same split by the rank that holds it, the other rank not told of it."""
    rank, world = init()
    head = {"scale": torch.full((3,), 7.0)}
    with Checkpointer(a["root"], keep=None) as ckpt:
        if a.get("restore"):
            state = {"progress": {}, "head": {"scale": torch.zeros(3)}} if rank == world - 1 else {"progress": {}}
            assert ckpt.restore(state) == 1
            if rank == world - 1:
                assert torch.equal(state["head"]["scale"], head["scale"])
            print(f"rank {rank} restored {sorted(state)}", flush=True)
        else:
            state = {"progress": {"epoch": 2}, **({"head": head} if rank == world - 1 else {})}
            ckpt.save(1, state, force=True)
            ckpt.wait()


def own_values(a: dict) -> None:
    """Plain values saved differently by each rank (a counter of its own, outside PerRank):
    at the same world size each rank gets back exactly what it saved, not every rank's."""
    rank, _ = init()
    with Checkpointer(a["root"], keep=None) as ckpt:
        ckpt.save(1, {"meta": {f"seen_by_{rank}": rank, "shared": 1}}, force=True)
        ckpt.wait()
        back = {"meta": {}}
        assert ckpt.restore(back) == 1
    assert back == {"meta": {f"seen_by_{rank}": rank, "shared": 1}}, back


SCENARIOS = {f.__name__: f for f in (save, resume, another_split, raw_optimizer_refused, sharded_stages, own_values,
                                     last_stage_entry)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    finish_scenario()
