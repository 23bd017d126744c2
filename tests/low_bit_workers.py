"""FSDP2 with torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``),
run by ``tests.launch``, one scenario per rank: each optimizer state of a quantized shard
is a DTensor over the class's state (``OptimState8bit``: uint8 codes with the parameter's
shape, one scale per 256 values, a 256-entry map; 4-bit: codes two to a byte, held flat,
its shape in its flatten context; fp8: float8 codes, no map).

The reference is gathered without resilient: each rank's parts joined in rank order
(FSDP2 shards rows, so a rank's shard is a run of the parameter's rows and of its blocks),
the map taken once. A twin at another world size is made from it by torchao's own slicing
of the whole state along rows, the operation DCP's resharding of these states uses.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from resilient import Checkpointer, UnsupportedStateError
from tests.workers import finish_scenario, init

BLOCK = 256


class Net(torch.nn.Module):
    """Shards that every rank quantizes alike at 1, 2 and 3 ranks: ``up`` (50 x 256: 17,
    17 and 16 rows at 3), ``gain`` (1-D, 12,288 values); ``down`` (8 x 50) is kept in full
    precision everywhere (fewer than 4096 values)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(BLOCK, 50, bias=False)
        self.down = torch.nn.Linear(50, 8)
        self.gain = torch.nn.Parameter(torch.ones(3 * 4096))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * self.gain[:8] + self.gain[8:16].sum()


def build(sharded: bool, optimizer: str = "AdamW8bit", hsdp: bool = False) -> tuple[torch.nn.Module,
                                                                                     torch.optim.Optimizer]:
    """The model, sharded by FSDP2 over every rank, or (``hsdp``) over half of them and
    replicated across the halves, and a fresh optimizer."""
    import torchao.optim

    torch.manual_seed(0)
    model = Net()
    if sharded:
        world = dist.get_world_size()
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
                else init_device_mesh("cpu", (world,)))
        for layer in (model.up, model.down):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, getattr(torchao.optim, optimizer)(model.parameters(), lr=1e-2)


def train_steps(model: torch.nn.Module, optim: torch.optim.Optimizer, first: int, last: int) -> None:
    """The same global batch at every world size (each rank averages its share)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for step in range(first, last):
        x = torch.randn(12, BLOCK, generator=torch.Generator().manual_seed(step))
        per = 12 // world
        optim.zero_grad()
        model(x[rank * per:(rank + 1) * per]).square().mean().backward()
        optim.step()


#: torchao's quantization maps: the same on every rank, not split with the rows
TABLES = ("qmap",)


def _whole(value: torch.Tensor) -> torch.Tensor | tuple:
    """A state or parameter as plain whole tensors: (class, {part: whole part}, context)
    for a quantized one, each part but the map gathered in rank order under FSDP2, and a
    shape in the context made the whole tensor's (4-bit's flat codes keep it there)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if not hasattr(local, "__tensor_flatten__") or type(local) is torch.Tensor:
            return value.full_tensor()
        names, context = local.__tensor_flatten__()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (_shard_of(value), {n: _bits(getattr(local, n)) for n in names}))
        shards = [held for (replica, _), held in sorted(gathered, key=lambda g: g[0][1]) if replica == 0]
        parts = {n: shards[0][n] if n in TABLES else torch.cat([held[n] for held in shards]) for n in names}
        context = [torch.Size(value.shape) if c == local.shape else c for c in context]
        return type(local).__name__, parts, context
    if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
        names, context = value.__tensor_flatten__()
        return type(value).__name__, {n: _bits(getattr(value, n)).clone() for n in names}, list(context)
    return value.detach().clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes as their bytes: torch's object collectives cannot send float8 tensors."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    out = {f"param/{n}": _whole(p) for n, p in model.named_parameters()}
    for param, state in optim.state.items():
        for key, value in state.items():
            out[f"state/{names[param]}/{key}"] = _whole(value)
    return out


def compare(got: dict, want: dict, when: str) -> None:
    assert got.keys() == want.keys(), (when, sorted(got.keys() ^ want.keys()))
    for key, w in want.items():
        g = got[key]
        assert type(g) is type(w), (when, key, type(g), type(w))
        if isinstance(w, tuple):
            assert g[0] == w[0] and g[2] == w[2] and g[1].keys() == w[1].keys(), (when, key, g[0], g[2])
            assert all(torch.equal(g[1][n], w[1][n]) for n in w[1]), (when, key)
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), (when, key)


def _shard_of(value: DTensor) -> tuple[int, int]:
    """(which replica, which shard) this rank holds: HSDP's mesh is (replicas, shards)."""
    coordinate = value.device_mesh.get_coordinate()
    return (coordinate[0], coordinate[1]) if len(coordinate) == 2 else (0, coordinate[0])


def _rows(param: DTensor) -> slice:
    """This rank's rows of a parameter FSDP2 shards (torch.chunk's split)."""
    rows, shards, shard = param.shape[0], param.device_mesh.size(-1), _shard_of(param)[1]
    each = -(-rows // shards)
    return slice(min(shard * each, rows), min((shard + 1) * each, rows))


def twin(reference: dict, sharded: bool, optimizer: str, hsdp: bool) -> tuple[torch.nn.Module,
                                                                              torch.optim.Optimizer]:
    """A model and optimizer given the reference's state without resilient: parameters
    distributed by torch, quantized states rebuilt whole and sliced by torchao
    (``state[rows]``)."""
    import torchao.optim

    model, optim = build(sharded, optimizer, hsdp)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            whole = reference[f"param/{name}"]
            if sharded:
                param.to_local().copy_(distribute_tensor(whole, param.device_mesh, param.placements).to_local())
            else:
                param.copy_(whole)
    for name, param in params.items():
        state = {}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            saved = reference[f"state/{name}/{key}"]
            if isinstance(saved, tuple):
                value = _rebuilt(torchao.optim, saved, param)
                if sharded:
                    value = DTensor.from_local(value[_rows(param)], param.device_mesh, param.placements,
                                               shape=param.shape, stride=param.stride(), run_check=False)
            elif key != "step" and sharded:
                value = distribute_tensor(saved.clone(), param.device_mesh, param.placements)
            else:
                value = saved.clone()
            state[key] = value
        optim.state[param] = state
    return model, optim


def _rebuilt(module, saved: tuple, param: torch.Tensor) -> torch.Tensor:
    """The whole quantized state from the reference's parts, through its class."""
    cls_name, parts, context = saved
    cls = next(getattr(sub, cls_name) for sub in (module.subclass_8bit, module.subclass_4bit, module.subclass_fp8)
               if hasattr(sub, cls_name))
    parts = {n: p.clone() for n, p in parts.items()}
    if cls_name == "OptimStateFp8":
        parts["codes"] = parts["codes"].view(torch.float8_e4m3fn)
    return cls.__tensor_unflatten__(parts, context, param.shape, param.stride())


def save(a: dict) -> None:
    """Train 3 steps on FSDP2, save step 3; the reference is the gathered state. Then one
    step more and a restore in place gives step 3's state back."""
    rank, world = init()
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step; eager spares inductor
        model, optim = build(True, a["optimizer"], a.get("hsdp", False))
        train_steps(model, optim, 0, 3)
        kinds = {type(value.to_local()).__name__ for key, value in optim.state[model.up.weight].items()
                 if isinstance(value, DTensor)}
        assert kinds == {a["state_class"]}, kinds
        state = {"model": model, "optim": optim}
        with Checkpointer(a["root"], staging=a.get("staging", "sync")) as ckpt:
            ckpt.save(3, state).result()
            reference = full_state(model, optim)
            if rank == 0:
                torch.save(reference, a["reference"])
            train_steps(model, optim, 3, 4)
            assert ckpt.restore(state) == 3
        compare(full_state(model, optim), reference, "restored in place")
    print(f"rank {rank} saved at world {world}", flush=True)


def resume(a: dict) -> None:
    """A fresh model and optimizer (no state before its first step), sharded or not,
    restored: the same gathered state, every quantized state a DTensor over the class
    placed as its parameter; the next step equals the twin's bit for bit."""
    rank, world = init()
    sharded = a["sharded"]
    with torch.compiler.set_stance("force_eager"):
        model, optim = build(sharded, a["optimizer"], a.get("resume_hsdp", False))
        with Checkpointer(a["root"]) as ckpt:
            assert ckpt.restore({"model": model, "optim": optim}) == 3
        reference = torch.load(a["reference"], weights_only=True)
        compare(full_state(model, optim), reference, "after restore")
        for param, state in optim.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key]
                if sharded:
                    assert isinstance(value, DTensor) and value.placements == param.placements, (key, value)
                    value = value.to_local()
                quantized = isinstance(reference[f"state/{_name(model, param)}/{key}"], tuple)
                assert (type(value).__name__ == a["state_class"]) == quantized, (key, type(value))
        twin_model, twin_optim = twin(reference, sharded, a["optimizer"], a.get("resume_hsdp", False))
        train_steps(model, optim, 3, 4)
        train_steps(twin_model, twin_optim, 3, 4)
        compare(full_state(model, optim), full_state(twin_model, twin_optim), "after the next step")
    print(f"rank {rank} resumed at world {world}", flush=True)


def _name(model: torch.nn.Module, param: torch.Tensor) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


class Block(torch.nn.Module):
    """A transformer's MLP: ``up`` split by columns of its output (ColwiseParallel: rows of
    the weight), ``down`` by its input (RowwiseParallel: columns of the weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(BLOCK, 2 * BLOCK, bias=False)
        self.down = torch.nn.Linear(2 * BLOCK, BLOCK, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build_tp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Tensor parallel over pairs of ranks, FSDP2 across them, as torchtitan composes them:
    ``up``'s weight placed (_StridedShard(0), Shard(0)), ``down``'s (Shard(0), Shard(1))."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.optim import AdamW8bit

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Block()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, AdamW8bit(model.parameters(), lr=1e-2)


def _dequantized(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and moment as a whole plain tensor, by torch's own ``full_tensor``;
    a quantized moment dequantized on its rank first (its codes and scales are equal where
    these are)."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor()
        for key in ("exp_avg", "exp_avg_sq"):
            value = optim.state[param][key]
            local = value.to_local()
            assert type(local).__name__ == "OptimState8bit" and value.placements == param.placements, (name, key)
            out[f"{name}/{key}"] = DTensor.from_local(local.dequantize(), value.device_mesh, value.placements,
                                                      shape=value.shape, stride=value.stride(),
                                                      run_check=False).full_tensor()
    return out


def tp_save(a: dict) -> None:
    """FSDP2 + TP with AdamW8bit, 3 steps, step 3 saved; the reference is the whole state."""
    rank, world = init()
    with torch.compiler.set_stance("force_eager"):
        model, optim = build_tp()
        x = torch.randn(8, BLOCK, generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            optim.zero_grad()
            model(x).square().mean().backward()
            optim.step()
        with Checkpointer(a["root"]) as ckpt:
            ckpt.save(3, {"model": model, "optim": optim}).result()
        reference = _dequantized(model, optim)
    if rank == 0:
        torch.save(reference, a["reference"])
    print(f"rank {rank} saved at world {world}", flush=True)


def tp_resume(a: dict) -> None:
    """A fresh FSDP2 + TP model and optimizer at this world size, restored: the same whole
    state, each moment a DTensor over the class placed as its parameter; then a step."""
    rank, world = init()
    with torch.compiler.set_stance("force_eager"):
        model, optim = build_tp()
        with Checkpointer(a["root"]) as ckpt:
            assert ckpt.restore({"model": model, "optim": optim}) == 3
        reference = torch.load(a["reference"], weights_only=True)
        got = _dequantized(model, optim)
        assert got.keys() == reference.keys()
        for key, want in reference.items():
            assert torch.equal(got[key], want), key
        model(torch.randn(8, BLOCK)).square().mean().backward()
        optim.step()
    print(f"rank {rank} resumed at world {world}", flush=True)


def refused_where_shards_differ(a: dict) -> None:
    """7 rows of 2048 on 3 ranks: shards of 3, 3 and 1 rows, the last too small for
    torchao to quantize. The save is refused on every rank, naming the state, and nothing
    is written."""
    rank, world = init()
    with torch.compiler.set_stance("force_eager"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(BLOCK, 2048, bias=False), torch.nn.Linear(2048, 7, bias=False))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        from torchao.optim import AdamW8bit

        optim = AdamW8bit(model.parameters(), lr=1e-2, block_size=BLOCK)
        x = torch.randn(4, BLOCK, generator=torch.Generator().manual_seed(0))
        model(x).square().mean().backward()
        optim.step()
        with Checkpointer(a["root"]) as ckpt:
            try:
                ckpt.save(1, {"model": model, "optim": optim})
            except UnsupportedStateError as exc:
                assert "state['optim/state/1/exp_avg'] is one tensor on rank 2" in str(exc), exc
                print(f"rank {rank} refused: {exc}", flush=True)
            else:
                raise AssertionError("a state quantized on some ranks only was saved")
    assert not [n for n in os.listdir(a["root"]) if n.startswith("step-")] if os.path.isdir(a["root"]) else True


SCENARIOS = {f.__name__: f for f in (save, resume, tp_save, tp_resume, refused_where_shards_differ)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    finish_scenario()
