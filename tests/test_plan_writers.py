"""Who writes what, planned from every rank's description: each box of every tensor any rank
holds is written exactly once, by a rank holding it, for the meshes real jobs use; and the
ranks of one sharding describe their tensors with one list, so planning walks classes of
tensors per rank rather than every tensor of every rank.

The ranks' DTensors are real, made one rank at a time in this process on torch's ``fake``
process group (which gives a mesh its coordinates without any communication); the gathers
run with ranks as threads; every rank's ``plan_rank`` is then compared with the others'."""

import collections
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from resilient._errors import UnsupportedStateError
from resilient._plan import describe, plan_rank

from .thread_ranks import gathered_by

pytestmark = pytest.mark.timeout(120)

Build = Callable[[int, int], tuple[dict[str, torch.Tensor], set[str]]]


def _dtensor(mesh: Any, placements: list[Any], shape: tuple[int, ...], fill: float = 0.0) -> DTensor:
    """This rank's part of a global tensor of ``shape`` placed so (its local shape worked out
    by torch), as ``fully_shard`` or ``parallelize_module`` would leave it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = torch.empty(shape).stride()
    return DTensor.from_local(torch.full(local_shape, fill), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _each_rank(world: int, build: Build) -> list[tuple[dict[str, torch.Tensor], set[str], dict[str, Any]]]:
    """(tensors, per-rank names, description) of every rank, built on its own fake group."""
    out = []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            tensors, per_rank = build(rank, world)
            out.append((tensors, per_rank, describe(tensors, per_rank)))
        finally:
            dist.destroy_process_group()
    return out


def _plans(world: int, build: Build) -> tuple[list[Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every rank's plan, and the descriptions as rank 0 received them."""
    ranks = _each_rank(world, build)
    gathered, _ = gathered_by([d for _, _, d in ranks])
    plans = [plan_rank(tensors, per_rank, gathered[r], r, world) for r, (tensors, per_rank, _) in enumerate(ranks)]
    return plans, gathered[0], [d for _, _, d in ranks]


def _held_boxes(descriptions: list[dict[str, Any]]) -> dict[tuple, list[int]]:
    """(name, offsets, sizes) -> the ranks holding that box, from each rank's own description,
    tensor by tensor (the plain per-tensor walk the classes save: the test's reference)."""
    held: dict[tuple, list[int]] = {}
    for rank, d in enumerate(descriptions):
        for name, _, _, cls in d["sharded"]:
            offsets, sizes = d["boxes"][cls]
            held.setdefault((name, tuple(offsets), tuple(sizes)), []).append(rank)
        for name, _, shape in d["own"]:
            held.setdefault((name, (0,) * len(shape), tuple(shape)), []).append(rank)
    return held


def _check_written_once(plans: list[Any], descriptions: list[dict[str, Any]]) -> dict[int, int]:
    """Assert each non-empty box is written by exactly one of its holders; bytes per rank."""
    written: dict[tuple, list[int]] = collections.defaultdict(list)
    nbytes = collections.Counter()
    for rank, plan in enumerate(plans):
        for name, offsets, sizes, _, n in plan.shards:
            written[(name, tuple(offsets), tuple(sizes))].append(rank)
            nbytes[rank] += n
    held = {box: ranks for box, ranks in _held_boxes(descriptions).items() if all(box[2])}
    assert set(written) >= set(held), sorted(set(held) - set(written))[:5]
    for box, holders in held.items():
        assert len(written[box]) == 1 and written[box][0] in holders, (box, written[box], holders)
    assert len({plan.signature for plan in plans}) == 1
    return nbytes


def _fsdp(rank: int, world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """FSDP2 over every rank, rows unevenly (10 rows over 8 ranks leave some ranks none),
    in two dtypes, and a per-rank entry."""
    mesh = init_device_mesh("cpu", (world,))
    tensors: dict[str, torch.Tensor] = {f"w{i}": _dtensor(mesh, [Shard(0)], (16, 4)) for i in range(6)}
    tensors |= {f"b{i}": _dtensor(mesh, [Shard(0)], (10,)) for i in range(3)}
    tensors["half"] = _dtensor(mesh, [Shard(0)], (16, 4)).to(torch.bfloat16)
    tensors[f"rng/rank{rank}"] = torch.full((3,), float(rank))
    return tensors, {f"rng/rank{rank}"}


def _hsdp(rank: int, world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Replicated over 4, sharded over 2: each shard's boxes on four ranks."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return {f"w{i}": _dtensor(mesh, [Replicate(), Shard(0)], (8, 8)) for i in range(40)}, set()


def _fsdp_tp(rank: int, world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """FSDP2 across ``dp``, TP inside nodes of 2: a 2-D sharded weight, one sharded on the TP
    submesh only (its data-parallel replicas hold the same boxes on meshes of their own),
    a norm replicated over TP, and two tensors of one shape on two 1-D meshes of one size
    (their boxes coincide on some ranks only)."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "up": _dtensor(mesh, [Shard(0), Shard(1)], (8, 8)),
        "tp_only": _dtensor(mesh["tp"], [Shard(0)], (8, 8)),
        "norm": _dtensor(mesh, [Shard(0), Replicate()], (8,)),
        "on_dp": _dtensor(mesh["dp"], [Shard(0)], (4, 4)),
        "on_tp": _dtensor(mesh["tp"], [Shard(0)], (4, 4)),
    }, set()


@pytest.mark.parametrize("build", [_fsdp, _hsdp, _fsdp_tp], ids=["fsdp2-uneven", "hsdp", "fsdp2-tp"])
def test_every_box_is_written_once_by_a_holder_and_one_sharded_list_serves_every_rank(build):
    world = 8 if build is not _fsdp_tp else 4
    plans, gathered, own = _plans(world, build)
    _check_written_once(plans, own)
    assert len({id(d["sharded"]) for d in gathered}) == 1  # the classes are alike on every rank


def test_the_replicas_of_a_shard_share_its_writing():
    plans, _, own = _plans(8, _hsdp)
    nbytes = _check_written_once(plans, own)
    each = 4 * 8 * 4  # a box: 4 rows of 8 fp32
    assert all(nbytes[r] == 10 * each for r in range(8)), nbytes  # 40 boxes of a shard over 4 replicas


def test_a_rank_holding_one_dtensor_more_is_matched_box_by_box():
    def build(rank: int, world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
        tensors, per_rank = _hsdp(rank, world)
        if rank == 3:
            mesh = init_device_mesh("cpu", (world,))
            tensors["extra"] = _dtensor(mesh, [Replicate()], (5,))
        return tensors, per_rank

    plans, gathered, own = _plans(8, build)
    _check_written_once(plans, own)
    assert len({id(d["sharded"]) for d in gathered}) == 2
    assert [s[0] for p in plans for s in p.shards].count("extra") == 1


def test_pipeline_stages_with_their_replicas_write_each_stage_tensor_once():
    """Plain tensors only a stage holds (the same on its data-parallel replicas), state every
    rank holds, and the stage's FSDP2-sharded layers."""
    def build(rank: int, world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
        stage = rank // 4
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))["dp"]
        tensors: dict[str, torch.Tensor] = {f"stage{stage}.{i}": torch.full((6,), float(i)) for i in range(5)}
        tensors |= {f"stage{stage}.sharded{i}": _dtensor(mesh, [Shard(0)], (8, 2)) for i in range(3)}
        tensors["step"] = torch.tensor(7.0)
        return tensors, set()

    plans, gathered, own = _plans(8, build)
    _check_written_once(plans, own)
    whole = [s[0] for p in plans for s in p.shards if ".sharded" not in s[0]]
    assert sorted(whole) == sorted(f"stage{s}.{i}" for s in range(2) for i in range(5))
    assert sum(len(p.replicated) for p in plans) >= 1 and all("step" in p.meta for p in plans)
    assert len({id(d["sharded"]) for d in gathered}) == 2  # one list per stage


def test_one_name_for_two_shapes_is_refused_on_every_rank():
    def build(rank: int, world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
        mesh = init_device_mesh("cpu", (world,))
        return {"w": _dtensor(mesh, [Shard(0)], (8, 2) if rank < 2 else (8, 3))}, set()

    ranks = _each_rank(4, build)
    gathered, _ = gathered_by([d for _, _, d in ranks])
    for r, (tensors, per_rank, _) in enumerate(ranks):
        with pytest.raises(UnsupportedStateError, match=r"state\['w'\] is not one tensor.*\[8, 2\].*\[8, 3\]"):
            plan_rank(tensors, per_rank, gathered[r], r, 4)
