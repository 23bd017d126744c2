"""Sharded-model scenarios (FSDP2, FSDP2 + TP, HSDP) run by ``tests.launch``, one per rank.

Every scenario builds its model and optimizer fresh, as a user's script does after a
restart, and compares against a reference computed in the same process: the full
parameters and optimizer state gathered to plain tensors (``full_state``), which do not
depend on the world size or mesh that produced them.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resilient import Checkpointer
from tests.workers import finish_scenario, init

DIM = 16
HIDDEN = 34  # even for TP (2 x 17), uneven for FSDP inside it (9 + 8) and at world 3
GLOBAL_BATCH = 12


class Block(torch.nn.Module):
    """Two linears whose hidden size gives uneven shards."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(mode: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model (same initial values everywhere) sharded as ``mode`` says, and Adam."""
    torch.manual_seed(0)
    model = Net()
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "hsdp":  # replicate across the first mesh dim, shard across the second
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "fsdp_tp":  # tensor parallel inside a node of 2, FSDP across
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp = min(world, 2)
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif mode == "fsdp1":  # FSDP1 (FullyShardedDataParallel) given a mesh: its sharded state is DTensors
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, device_mesh=init_device_mesh("cpu", (world,)),
                                         auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                                         device_id=torch.device("cpu"))
    else:
        raise ValueError(mode)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optim


def train_steps(model: torch.nn.Module, optim: torch.optim.Optimizer, first: int, last: int) -> None:
    """Steps ``first..last-1`` on the same global batch whatever the world size: the loss
    is summed over the global batch so gradients do not depend on how it was split."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_world = data_parallel_position(model, rank, world)
    for step in range(first, last):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(GLOBAL_BATCH, DIM, generator=g, dtype=torch.float64).float()
        per = GLOBAL_BATCH // dp_world
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        loss = model(x[rows]).square().sum() / GLOBAL_BATCH
        loss.backward()
        optim.step()
        optim.zero_grad()


def data_parallel_position(model: torch.nn.Module, rank: int, world: int) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel group: TP ranks see the same rows."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)  # (FSDP1's parameters are plain)
    if mesh is not None and mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        return rank // 2, world // 2
    return rank, world


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as plain full tensors keyed by parameter name (FSDP1's
    through DCP's ``get_state_dict``: its parameters are flat local shards)."""
    out: dict[str, torch.Tensor] = {}
    if not hasattr(next(model.parameters()), "full_tensor"):
        get_state_dict, _, options = reference_io("fsdp1")
        model_sd, optim_sd = get_state_dict(model, optim, options=options)
        out.update({name: t.detach().clone() for name, t in model_sd.items()})
        out.update({f"{name}:{field}": t.detach().clone() for name, fields in optim_sd["state"].items()
                    for field, t in fields.items()})
        return out
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[n] = p.full_tensor().detach().clone()
    for p, st in optim.state.items():
        for field, value in st.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{names[id(p)]}:{field}"] = full.detach().clone()
    return out


def placements_match(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Every optimizer state tensor shaped like its parameter has the parameter's placement
    (FSDP1's have none: its optimizer's state is the flat local shards its own code keeps)."""
    if not hasattr(next(model.parameters()), "placements"):
        return
    for p, st in optim.state.items():
        for field, value in st.items():
            if value.dim() == 0:
                continue
            assert hasattr(value, "placements"), f"{field} of a {tuple(p.shape)} parameter is a plain tensor"
            assert value.placements == p.placements and value.device_mesh == p.device_mesh, (
                field, value.placements, p.placements)
            assert value.to_local().shape == p.to_local().shape, (field, value.to_local().shape)


def reference_io(mode: str = ""):
    """DCP's full state dict functions and options. FSDP1's without ``cpu_offload``: torch
    2.13's FSDP1 full state dict with it crashes in its own clone of a nested module's
    parameter on a CPU (SIGSEGV in ``_state_dict_utils.param_hook``), resilient or not."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    return get_state_dict, set_state_dict, StateDictOptions(full_state_dict=True, cpu_offload=mode != "fsdp1")


class AppState:
    """torch's DCP recipe for a checkpoint's state (its tutorial's ``AppState``, a
    ``Stateful``): model and optimizer through ``get_state_dict``/``set_state_dict``, the
    optimizer's state keyed by parameter name, as programs written for DCP pass them."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state(a: dict, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """The state as saved: top-level entries; (``nested``) both under one entry, as a
    program keeping several models' parts together does; or (``appstate``) DCP's recipe."""
    if a.get("appstate"):
        return {"app": AppState(model, optim)}
    return {"train": {"model": model, "optim": optim}} if a.get("nested") else {"model": model, "optim": optim}


def save(a: dict) -> None:
    """Train ``a['steps']`` steps at this world size and save the last one; also keep the
    full state through torch's own API (DCP ``get_state_dict``) as the reference."""
    rank, world = init()
    model, optim = build(a["mode"], world)
    train_steps(model, optim, 0, a["steps"])
    with Checkpointer(a["root"], keep=None) as ckpt:
        ckpt.save(a["steps"], _state(a, model, optim), force=True)
    get_state_dict, _, options = reference_io(a["mode"])
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    reference = {"model": model_sd, "optim": optim_sd, "full": full_state(model, optim)}
    if rank == 0:
        torch.save(reference, a["reference"])
    print(f"rank {rank} saved", flush=True)


def resume(a: dict) -> None:
    """Fresh model and optimizer (no warm-up step), restore: every parameter and optimizer
    state must equal the saved one exactly and have its parameter's placement. Then one more
    step against a twin, compared bit for bit (see ``twin``)."""
    rank, world = init()
    model, optim = build(a["mode"], world)
    with Checkpointer(a["root"]) as ckpt:
        step = ckpt.restore(_state(a, model, optim))
    assert step == a["steps"], step
    placements_match(model, optim)
    reference = torch.load(a["reference"], weights_only=True)
    compare(full_state(model, optim), reference["full"], "after restore")
    twin_model, twin_optim = twin(a, world, reference, model, optim)
    train_steps(model, optim, step, step + 1)
    train_steps(twin_model, twin_optim, step, step + 1)
    compare(full_state(model, optim), full_state(twin_model, twin_optim), "after the next step")
    print(f"rank {rank} resumed {a['mode']} at world {world}", flush=True)


def twin(a: dict, world: int, reference: dict, model: torch.nn.Module,
         optim: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """What the restored run must match on its next step: at the saved world size the
    uninterrupted run itself; else a run loaded by torch's own ``set_state_dict`` from the
    saved full state. torch cannot load full optimizer state into ``_StridedShard``
    (FSDP2 + TP) parameters, so there the twin takes the restored shards, which the check
    "after restore" has already compared with the saved full state through torch's own
    ``full_tensor``."""
    twin_model, twin_optim = build(a["mode"], world)
    if world == a["saved_world"]:
        train_steps(twin_model, twin_optim, 0, a["steps"])
    elif a["mode"] != "fsdp_tp":
        _, set_state_dict, options = reference_io(a["mode"])
        set_state_dict(twin_model, twin_optim, model_state_dict=reference["model"],
                       optim_state_dict=reference["optim"], options=options)
    else:
        twin_model.load_state_dict(model.state_dict())
        twin_optim.load_state_dict(copy.deepcopy(optim.state_dict()))  # no shared moments
    return twin_model, twin_optim


def compare(got: dict, want: dict, when: str) -> None:
    assert got.keys() == want.keys(), (when, sorted(got.keys() ^ want.keys()))
    for key in want:
        g, w = got[key], want[key]
        assert g.dtype == w.dtype and torch.equal(g, w), (
            f"{when}: {key} differs by {(g.double() - w.double()).abs().max().item()}")


def fsdp1_refused(a: dict) -> None:
    """FSDP1 made without a device mesh: given as it is (its optimizer holds flat per-rank
    shards), or through DCP's recipe (its sharded state dict then holds ShardedTensors):
    each save is refused, naming what to do, before anything is written."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from resilient import UnsupportedStateError

    rank, world = init()
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 0, 1)
    for how, state, says in (("as it is", {"model": model, "optim": optim}, "README: FSDP1"),
                             ("through DCP's recipe", {"app": AppState(model, optim)}, "device_mesh=")):
        with Checkpointer(a["root"]) as ckpt:
            try:
                ckpt.save(1, state, force=True)
            except UnsupportedStateError as exc:
                assert says in str(exc) and "FullyShardedDataParallel" in str(exc), exc
                print(f"rank {rank}: {how}: refused: {exc}", flush=True)
            else:
                raise AssertionError(f"FSDP1 without a mesh, {how}, was saved")
    assert not os.path.exists(a["root"]) or not [n for n in os.listdir(a["root"]) if n.startswith("step-")]


SCENARIOS = {f.__name__: f for f in (save, resume, fsdp1_refused)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    finish_scenario()
