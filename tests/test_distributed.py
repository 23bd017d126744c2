"""Multi-process runs on gloo (127.0.0.1): kill and resume, resharding, crashes mid-write."""

import json
import os

import pytest
import torch

from resilient import Checkpointer
from resilient._format import MANIFEST, step_dir_name

from .faults import flip_byte
from .launch import run_ranks

pytestmark = pytest.mark.timeout(240)


def _weights(path):
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """Uninterrupted 30-step runs: (world 2, dropout), (world 2, no dropout), (world 1, no dropout)."""
    d = tmp_path_factory.mktemp("baselines")
    out = {}
    for world, dropout in ((2, 0.1), (2, 0.0), (1, 0.0)):
        name = f"w{world}-d{dropout}"
        run_ranks("train", world, {"root": str(d / name), "every": 10, "total": 30, "dropout": dropout,
                                   "out": str(d / f"{name}.pt")})
        out[(world, dropout)] = _weights(d / f"{name}.pt")
    return out


def test_ddp_killed_midway_resumes_bitwise_equal(baselines, tmp_path):
    root = str(tmp_path / "run")
    args = {"root": root, "every": 10, "total": 30, "dropout": 0.1}
    killed = run_ranks("train", 2, {**args, "kill_at": 25}, expect_ok=False)
    assert killed[1].returncode == -9  # a real SIGKILL
    assert Checkpointer(root).latest() == 20
    run_ranks("train", 2, {**args, "out": str(tmp_path / "resumed.pt")})
    resumed = _weights(tmp_path / "resumed.pt")
    for k, v in baselines[(2, 0.1)].items():
        assert torch.equal(v, resumed[k]), k  # dropout masks too: RNG states were restored


def test_a_ddp_wrapped_state_resumes_bitwise_and_restores_into_the_plain_model(baselines, tmp_path):
    """Two gloo ranks save the DDP wrapper itself (``resilient/_wrappers.py``): its keys were
    saved with DDP's ``module.`` before them. Killed and resumed the same way they end bit for
    bit where an uninterrupted run does, and the plain model (one process, as an evaluation
    script) restores the checkpoint's model."""
    root = str(tmp_path / "run")
    args = {"root": root, "every": 10, "total": 30, "dropout": 0.0, "save_wrapped": True}
    run_ranks("train", 2, {**args, "kill_at": 25}, expect_ok=False)
    with open(os.path.join(root, step_dir_name(20), MANIFEST)) as f:
        assert not [n for n in json.load(f)["tensors"] if "module." in n]  # the module's own keys
    run_ranks("train", 2, {**args, "out": str(tmp_path / "resumed.pt")})
    whole = baselines[(2, 0.0)]  # the same run, saving the plain model
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for k, v in whole.items():
        assert torch.equal(v, resumed[k]), k

    from .workers import build

    plain, _, _ = build(0.0)
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"model": plain}, strict=False) == 30
    for k, v in whole.items():
        assert torch.equal(v, plain.state_dict()[k]), k


def test_ddp_with_overlapped_staging_resumes_bitwise_equal(baselines, tmp_path):
    """Each save's copy of parameters and Adam state runs while the next forward and
    backward do; the optimizer step waits for it. The resumed run still equals the
    uninterrupted one bit for bit, so every committed step held the state at its save."""
    root = str(tmp_path / "run")
    args = {"root": root, "every": 5, "total": 30, "dropout": 0.1}
    overlap = {"RESILIENT_STAGING": "overlap"}
    run_ranks("train", 2, {**args, "kill_at": 25}, env=overlap, expect_ok=False)
    assert Checkpointer(root).latest() == 25
    run_ranks("train", 2, {**args, "out": str(tmp_path / "resumed.pt")}, env=overlap)
    resumed = _weights(tmp_path / "resumed.pt")
    for k, v in baselines[(2, 0.1)].items():
        assert torch.equal(v, resumed[k]), k


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_tracks_the_uninterrupted_run(baselines, tmp_path, before, after):
    root = str(tmp_path / "run")
    run_ranks("train", before, {"root": root, "every": 10, "total": 20, "dropout": 0.0})
    run_ranks("train", after, {"root": root, "every": 10, "total": 30, "dropout": 0.0,
                               "out": str(tmp_path / "resumed.pt")})
    resumed = _weights(tmp_path / "resumed.pt")
    with open(tmp_path / "resumed.pt.json") as f:
        assert '"start": 20' in f.read()
    for k, v in baselines[(before, 0.0)].items():
        # Same global batches; only the order of the gradient sum differs after the switch.
        torch.testing.assert_close(resumed[k], v, rtol=1e-4, atol=1e-5)


def test_sigkill_during_background_write_keeps_previous_step(tmp_path):
    root = str(tmp_path / "run")
    results = run_ranks("kill_during_write", 2, {"root": root, "mbytes": 64, "victim": 1}, expect_ok=False,
                        timeout=120, env={"RESILIENT_COMMIT_TIMEOUT": "5"})
    assert results[1].returncode == -9
    assert "not committed" in results[0].output or results[0].returncode != 0
    with Checkpointer(root) as ckpt:  # also cleans the abandoned pending save
        assert ckpt.latest() == 1
        state = {"w": torch.empty(64 * (1 << 20) // 4), "v": torch.empty(1000, dtype=torch.float64)}
        assert ckpt.restore(state) == 1
    assert torch.equal(state["w"], torch.full_like(state["w"], 1.0))
    assert os.listdir(os.path.join(root, ".pending")) == []


def test_dtensor_saved_by_n_ranks_restores_into_m(tmp_path):
    for saved_by, loaded_by in ((2, 3), (3, 1), (1, 2)):
        root = str(tmp_path / f"n{saved_by}")
        run_ranks("dtensor_save", saved_by, {"root": root}, env={"FORCE_DIST": "1"})
        results = run_ranks("dtensor_load", loaded_by, {"root": root, "expect_step": 5}, env={"FORCE_DIST": "1"})
        assert all("dtensor ok at step 5" in r.output for r in results)


def test_corrupt_shard_seen_by_one_rank_makes_all_ranks_fall_back(tmp_path):
    root = str(tmp_path / "run")
    run_ranks("dtensor_save", 2, {"root": root, "step": 3})
    run_ranks("dtensor_save", 2, {"root": root, "step": 4})
    # Flip one byte of rank 1's shard of "a" in step 4 (only rank 1 reads it back).
    path = os.path.join(root, "step-0000000004", "rank-00001.data")
    flip_byte(path, 10, 0x01)
    results = run_ranks("dtensor_load", 2, {"root": root, "expect_step": 3})
    assert "rank-00001.data" in results[1].output and "checksum mismatch" in results[1].output


def test_state_refused_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_ranks("mismatch_on_one_rank", 2, {"root": str(tmp_path / "run")}, timeout=60)
    assert "shape mismatch" in results[1].output
    assert "rank 0 refused: another rank refused" in results[0].output


def test_ranks_given_different_remote_tiers_are_refused_on_every_rank(tmp_path):
    """Only a node's leader uploads and every rank's flush waits at its own URL: a URL made
    per rank (here: suffixed with the rank) would hang the others' flush. Every rank refuses,
    naming each URL and its ranks."""
    remote = f"file://{tmp_path}/remote"
    results = run_ranks("remote_refused", 2, {"root": str(tmp_path / "run"), "remote": remote, "per_rank": True},
                        timeout=60)
    for r in results:
        assert f"rank {r.rank} refused: the ranks were given different remote tiers" in r.output
        assert f"remote='{remote}-0' on rank 0; remote='{remote}-1' on rank 1" in r.output


def test_a_remote_tier_whose_bucket_does_not_exist_is_refused_on_every_rank(tmp_path, s3_server):
    """Listed, a missing bucket looked like a new run's empty tier: a job resumed on fresh
    nodes with a mistyped bucket started from step 0 without a word. Rank 0 asks the store
    once; every rank refuses, naming the URL and the bucket, never the credentials."""
    remote = "s3://no-such-bucket-here/run"
    results = run_ranks("remote_refused", 2, {"root": str(tmp_path / "run"), "remote": remote,
                                              "storage_options": s3_server["options"]}, timeout=60)
    for r in results:
        assert (f"rank {r.rank} refused: [Errno 2] remote tier {remote}: the bucket 'no-such-bucket-here' does not "
                "exist (create it, or correct remote=)") in r.output, r.output[-2000:]
        assert all(str(secret) not in r.output for secret in s3_server["options"].values() if len(str(secret)) > 6)
    # a prefix not used yet in a bucket that exists is a new run's tier, as before
    with Checkpointer(str(tmp_path / "new"), remote=f"s3://{s3_server['bucket']}/not-used-yet",
                      storage_options=s3_server["options"]) as ckpt:
        assert ckpt.restore({"w": torch.zeros(2)}) == 0


def test_ddp_resumes_from_the_remote_tier_alone(baselines, tmp_path, s3_server):
    """Both nodes' disks are lost; the two ranks resume from the object store."""
    import shutil
    import uuid

    url = f"s3://{s3_server['bucket']}/ddp-{uuid.uuid4().hex[:8]}"
    args = {"root": str(tmp_path / "run"), "every": 10, "total": 20, "dropout": 0.1, "remote": url,
            "storage_options": s3_server["options"]}
    run_ranks("train", 2, args)  # close() flushes the uploads
    shutil.rmtree(tmp_path / "run")
    run_ranks("train", 2, {**args, "total": 30, "root": str(tmp_path / "new-disk"), "out": str(tmp_path / "r.pt")})
    with open(tmp_path / "r.pt.json") as f:
        assert '"start": 20' in f.read()
    resumed = _weights(tmp_path / "r.pt")
    for k, v in baselines[(2, 0.1)].items():
        assert torch.equal(v, resumed[k]), k


def test_plain_tensor_that_differs_by_rank_is_refused(tmp_path):
    results = run_ranks("rank_dependent_tensor_refused", 2, {"root": str(tmp_path / "run")})
    assert all("refused" in r.output for r in results)
    assert Checkpointer(str(tmp_path / "run")).latest() == 2


def test_per_rank_state_is_kept_per_rank_and_resharded_only_by_a_rule(tmp_path):
    root = str(tmp_path / "run")
    run_ranks("per_rank_save", 2, {"root": root})
    for world in (2, 3, 1):
        results = run_ranks("per_rank_restore", world, {"root": root, "saved_world": 2})
        assert all("per-rank ok" in r.output for r in results), [r.output[-1500:] for r in results]
        if world != 2:
            assert all("refused without a rule" in r.output for r in results)


def test_each_ranks_generators_resume_as_saved_at_any_world_size(tmp_path):
    """Three ranks seeded differently. Step 4 is one byte: only rank 2 writes a data file and
    keeps its states there, ranks 0 and 1 keep theirs in the manifest. Step 5: every rank's
    are in its file. Restored on 3, 2 or 4 ranks, each rank draws what its saved rank drew
    next; a rank beyond the saved world, what rank 0 drew."""
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks("rng_per_rank_save", 3, {"root": root, "out": out})
    manifests = {}
    for step in (4, 5):
        with open(os.path.join(root, f"step-{step:010d}", "manifest.json")) as f:
            manifests[step] = json.load(f)
    assert sorted(manifests[4]["files"]) == ["rank-00002.data"]
    assert [r[1] for r in manifests[4]["ranks"]][:2] == [0, 1] and isinstance(manifests[4]["ranks"][2][1], list)
    assert manifests[5]["rngs"] == [] and all(isinstance(r[1], list) for r in manifests[5]["ranks"])
    for step in (4, 5):
        saved = [json.load(open(os.path.join(out, f"saved-{step}-{r}.json"))) for r in range(3)]
        assert len({json.dumps(d) for d in saved}) == 3
        for world in (3, 2, 4):
            run_ranks("rng_per_rank_restore", world, {"root": root, "out": out, "step": step})
            for rank in range(world):
                got = json.load(open(os.path.join(out, f"{step}-{world}-{rank}.json")))
                assert got == saved[rank if rank < 3 else 0], (step, world, rank)


def test_torchdata_stateful_dataloader_kept_per_rank(tmp_path):
    pytest.importorskip("torchdata")
    results = run_ranks("stateful_dataloader_per_rank", 2, {"root": str(tmp_path / "run")})
    assert all("loader resumed exactly" in r.output for r in results)


def test_a_partial_dtensor_is_refused_at_every_save_naming_its_key_and_placement(tmp_path):
    results = run_ranks("placements_refused", 2, {"root": str(tmp_path / "ckpt")}, env={"FORCE_DIST": "1"})
    for result in results:
        refused = json.loads(result.output.split("REFUSED ", 1)[1].splitlines()[0])
        assert len(refused) == 2, result.output[-2000:]
        for key, message in zip(("first", "second"), refused):
            assert message.startswith(f"state[{key!r}]: placement P(sum) cannot") and "redistribute" in message, message
