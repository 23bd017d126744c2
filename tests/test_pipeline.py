"""Pipeline parallelism: each stage saves its own layers under the full model's names, its
data-parallel replicas the same ones. Before, a checkpoint needed every rank to save the
same names ("its state differs from rank 0's"), so a pipeline-parallel job could not save
at all. Now each stage's tensors are written once, by one of its replicas, and restore at
the same split, at another split, or consolidated on one rank."""

import json
import os

import pytest
import torch

from resilient import Checkpointer
from resilient._format import step_dir_name

from .launch import run_ranks

pytestmark = pytest.mark.timeout(240)


def _after(results) -> dict:
    """Every rank's parameters after training on, by name (replicas agree)."""
    out: dict = {}
    for r in results:
        line = next(line for line in r.output.splitlines() if line.startswith("AFTER "))
        for name, value in json.loads(line[len("AFTER "):]).items():
            assert out.setdefault(name, value) == value, name
    return out


def _run(scenario: str, world: int, args: dict, **kw):
    return run_ranks(scenario, world, args, module="tests.pipeline_workers", env={"FORCE_DIST": "1"}, **kw)


@pytest.fixture(scope="module")
def saved_by_two_stages_of_two(tmp_path_factory):
    """2 stages x 2 data-parallel replicas (4 ranks), optimizer keyed by parameter name."""
    root = str(tmp_path_factory.mktemp("pp") / "ckpt")
    return root, _after(_run("save", 4, {"root": root, "stages": 2}))


def test_each_stages_tensors_are_written_once_by_one_replica(saved_by_two_stages_of_two):
    root, _ = saved_by_two_stages_of_two
    with open(os.path.join(root, step_dir_name(3), "manifest.json")) as f:
        manifest = json.load(f)
    model = {n: t for n, t in manifest["tensors"].items() if n.startswith("app/model/")}
    assert sorted(model) == sorted(f"app/model/{i}.{k}" for i in range(4) for k in ("weight", "bias"))
    for name, tensor in manifest["tensors"].items():
        if tensor["shape"] and "same_as" not in tensor:
            pieces = [p for box in tensor["boxes"] for p in box["pieces"]]
            assert len(tensor["boxes"]) == 1 and sum(n for _, _, n in pieces) == 4 * torch.Size(
                tensor["shape"]).numel(), (name, tensor)  # float32, once


def test_the_same_split_resumes_bit_for_bit(saved_by_two_stages_of_two, tmp_path):
    root, want = saved_by_two_stages_of_two
    assert _after(_run("resume", 4, {"root": root, "stages": 2})) == want
    # the data-parallel degree changes, the split does not: 2 ranks, one per stage
    assert _after(_run("resume", 2, {"root": root, "stages": 2})) == want


@pytest.mark.parametrize("world,stages", [(1, 1), (4, 4), (3, 1)])
def test_the_model_restores_at_another_split_or_whole(saved_by_two_stages_of_two, world, stages):
    root, _ = saved_by_two_stages_of_two
    _run("another_split", world, {"root": root, "stages": stages, "saved_stages": 2})


@pytest.mark.parametrize("world,stages", [(4, 4), (1, 1)])
def test_the_optimizer_keyed_by_name_restores_at_another_split(saved_by_two_stages_of_two, world, stages):
    """Each stage's optimizer groups are joined, so a rank of another split finds the group
    of each of its parameters (DCP's set_state_dict looks them up by name); before, it got
    the groups of the old rank of its number, naming other parameters."""
    root, _ = saved_by_two_stages_of_two
    results = _run("another_split", world, {"root": root, "stages": stages, "saved_stages": 2, "optim": True})
    assert not any("differs by rank" in r.output for r in results), results[0].output[-2000:]


def test_a_consolidating_reader_sees_every_stages_names(saved_by_two_stages_of_two, tmp_path, capsys):
    from resilient.ckpt import main

    root, _ = saved_by_two_stages_of_two
    out = str(tmp_path / "model.pt")
    assert main(["export", root, out, "--format", "torch", "--key", "app"]) == 0
    exported = torch.load(out, weights_only=True)
    assert sorted(exported["model"]) == sorted(f"{i}.{k}" for i in range(4) for k in ("weight", "bias"))
    assert sorted(exported["optim"]["state"]) == sorted(exported["model"])
    capsys.readouterr()
    assert main(["show", root, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {"app/model/3.weight", "app/model/0.weight"} <= {t["name"] for t in shown["tensors"]}


def test_one_name_for_two_tensors_is_refused_on_every_rank(tmp_path):
    results = _run("raw_optimizer_refused", 2, {"root": str(tmp_path / "ckpt")})
    for r in results:
        assert "is not one tensor on every rank that holds it" in r.output, r.output[-2000:]
        assert "get_optimizer_state_dict" in r.output and "PerRank" in r.output
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        assert ckpt.latest() is None


def test_stages_sharded_by_fsdp2_over_their_replicas_resume_bit_for_bit(tmp_path):
    """Pipeline x FSDP2 (2 stages, each sharded over 2 ranks): every stage's shards are
    written once, and a fresh stage and optimizer resume as the uninterrupted run goes on."""
    root = str(tmp_path / "ckpt")
    uninterrupted = _after(_run("sharded_stages", 4, {"root": root, "stages": 2}))
    assert _after(_run("sharded_stages", 4, {"root": root, "stages": 2, "resume": True})) == uninterrupted


def test_values_that_differ_by_rank_come_back_as_each_rank_saved_them(tmp_path):
    """Joining the ranks' trees serves a rank only where its own does not (another world
    size, names it lacks): at the same world size each rank gets its own values back."""
    _run("own_values", 2, {"root": str(tmp_path / "ckpt")})


def test_an_entry_only_the_last_stage_saves_restores_where_it_is_asked_for(tmp_path):
    """A top-level entry one stage alone saved was missing from the other ranks' trees, so
    a rank asking for it at another split (or whole, on one rank) got "not in the
    checkpoint"; and at the same split the other stages were warned of it as forgotten."""
    root = str(tmp_path / "ckpt")
    _run("last_stage_entry", 2, {"root": root})
    whole = _run("last_stage_entry", 1, {"root": root, "restore": True})
    assert "restored ['head', 'progress']" in whole[0].output, whole[0].output[-2000:]
    same = _run("last_stage_entry", 2, {"root": root, "restore": True})
    assert "also holds" not in same[0].output, same[0].output[-2000:]
