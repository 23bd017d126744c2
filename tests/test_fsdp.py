"""Sharded models as people train them today: FSDP2 (``fully_shard``), HSDP and FSDP2 + TP on
gloo ranks, restored into a freshly built optimizer at other world sizes.

Each saved run's full state is also kept through torch's own API (DCP's ``get_state_dict``);
a restore must reproduce it exactly, give every optimizer state its parameter's placement,
and take the next step bit-identically to a twin (the uninterrupted run at the saved world
size; elsewhere one loaded by torch's ``set_state_dict``).
"""

import os

import pytest

from .launch import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """mode -> arguments of its saved run (made once per mode, on first use)."""
    runs: dict[str, dict] = {}

    def get(mode: str, world: int, nested: bool = False, appstate: bool = False) -> dict:
        name = f"{mode}-nested" if nested else f"{mode}-appstate" if appstate else mode
        if name not in runs:
            d = tmp_path_factory.mktemp(name)
            args = {"root": str(d / "ckpt"), "reference": str(d / "reference.pt"), "steps": STEPS, "mode": mode,
                    "saved_world": world, "nested": nested, "appstate": appstate}
            run_ranks("save", world, args, module="tests.fsdp_workers", env={"FORCE_DIST": "1"}, timeout=120)
            runs[name] = args
        return runs[name]

    return get


def resume(args: dict, world: int) -> None:
    results = run_ranks("resume", world, args, module="tests.fsdp_workers", env={"FORCE_DIST": "1"}, timeout=120)
    for r in results:
        assert f"resumed {args['mode']} at world {world}" in r.output, r.output[-2000:]


@pytest.mark.parametrize("world", [2, 1, 3])
def test_fsdp2_saved_by_2_resumes_with_a_fresh_optimizer(saved, world):
    resume(saved("fsdp", 2), world)


def test_fsdp2_model_and_optimizer_under_one_entry_resume_at_another_world_size(saved):
    """A model and its fresh optimizer inside the program's own dict (state["train"] =
    {"model": ..., "optim": ...}): saved through their state_dict() and restored into them
    in place, the optimizer's state taking its parameters' placements, as at the top
    level. Before, saving refused them ("cannot be checkpointed without pickle ... or an
    object with state_dict()")."""
    resume(saved("fsdp", 2, nested=True), 3)


def test_fsdp2_through_dcps_own_state_dict_recipe_resumes_at_another_world_size(saved):
    """A program written for DCP (its tutorial's ``AppState``: ``get_state_dict`` and
    ``set_state_dict``, the optimizer's state keyed by parameter name) passes the same
    object to resilient: saved on 2 ranks, restored on 3 into a fresh optimizer, exact."""
    resume(saved("fsdp", 2, appstate=True), 3)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_with_a_mesh_through_dcps_recipe_resumes_at_another_world_size(saved, world):
    """FSDP1 (``FullyShardedDataParallel``, which many programs still use), made with a
    device mesh, through DCP's ``get_state_dict``/``set_state_dict``: its sharded state
    dicts hold DTensors, saved on 2 ranks and restored on 2 and 3, exact. (Without a mesh
    they hold ShardedTensors, which are refused by name: the next test.)"""
    resume(saved("fsdp1", 2, appstate=True), world)


def test_fsdp1_without_a_mesh_is_refused_saying_what_to_do(tmp_path):
    """Without a mesh, FSDP1's sharded state dict holds ShardedTensors (before: torch's own
    "not supported for ShardedTensor" from deep inside the save), and its optimizer given as
    it is holds flat shards that differ by rank: both refused, naming the fix."""
    results = run_ranks("fsdp1_refused", 2, {"root": str(tmp_path / "ckpt")}, module="tests.fsdp_workers",
                        env={"FORCE_DIST": "1"}, timeout=120)
    for r in results:
        assert r.output.count("refused") == 2, r.output[-2000:]


@pytest.mark.parametrize("world", [4, 2])
def test_hsdp_saved_by_4_resumes(saved, world):
    resume(saved("hsdp", 4), world)


@pytest.mark.parametrize("world", [4, 2])
def test_fsdp2_with_tensor_parallel_saved_by_4_resumes(saved, world):
    resume(saved("fsdp_tp", 4), world)


def _launch(*args: str) -> str:
    import os
    import subprocess
    import sys

    from .launch import REPO

    cmd = [sys.executable, "-m", "resilient.launch.run", "--standalone", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_fsdp2_example_interrupted_resumed_and_resized(tmp_path):
    """examples/fsdp2_train.py under resilient-run: interrupted at 15 (checkpoint at 10) and
    resumed equals the uninterrupted run bit for bit; then it grows to 3 ranks, the per-rank
    data streams going through the example's reshard rule."""
    import torch

    from resilient.ckpt import main as ckpt_main

    example = "examples/fsdp2_train.py"
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    _launch("--nproc-per-node", "2", example, "--dir", full, "--steps", "20")
    _launch("--nproc-per-node", "2", example, "--dir", resumed, "--steps", "20", "--stop-at", "15")
    assert "resumed at step 10 at world size 2" in _launch("--nproc-per-node", "2", example, "--dir", resumed,
                                                           "--steps", "20")
    weights = []
    for root in (full, resumed):
        out = str(tmp_path / f"{os.path.basename(root)}.pt")
        assert ckpt_main(["export", root, out, "--format", "torch", "--key", "model"]) == 0
        weights.append(torch.load(out, weights_only=True))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    grown = _launch("--nproc-per-node", "3", example, "--dir", resumed, "--steps", "30")
    assert "resumed at step 20 at world size 3" in grown
    for rank in range(3):  # rank 2 is new: its stream starts at the furthest position, 20
        assert f"rank {rank} data position 30" in grown
