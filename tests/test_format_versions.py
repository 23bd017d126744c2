"""Checkpoints written by an older resilient (format version 1: boxes one by one, each rank's
tree and RNG state in ``ranks``, generator words as lists of numbers) still restore, RNG
states included, and the CLI reads them."""

import base64
import json
import os
import random
import zlib

import numpy as np
import pytest
import torch

from resilient import Checkpointer
from resilient.ckpt import main as ckpt_main

pytestmark = pytest.mark.timeout(120)


def _as_version_1(manifest: dict) -> dict:
    """A version 2 manifest as version 1 wrote the same checkpoint."""
    def words(saved: str) -> list[int]:
        return np.frombuffer(base64.b64decode(saved), dtype="<u4").tolist()

    rngs = []
    for rng in manifest["rngs"]:
        rng = dict(rng)
        rng["python"] = [rng["python"][0], words(rng["python"][1]), rng["python"][2]]
        rng["numpy"] = [rng["numpy"][0], words(rng["numpy"][1]), *rng["numpy"][2:]]
        assert rng["torch"].startswith("z:")  # version 1 kept torch's state raw
        rng["torch"] = base64.b64encode(zlib.decompress(base64.b64decode(rng["torch"][2:]))).decode()
        rngs.append(rng)
    ranks = [{"tree": manifest["trees"][t], "rng": None if g is None else rngs[g]} for t, g in manifest["ranks"]]
    for meta in manifest["tensors"].values():
        assert all("repeat" not in box for box in meta["boxes"])  # one rank: no runs to expand
    for record in manifest["files"].values():  # version 1 listed chunks, offsets included
        rows = np.frombuffer(base64.b64decode(record.pop("table")),
                             dtype=[("length", "<u4"), ("stored", "<u4"), ("crc", "<u4"), ("codec", "u1")])
        record["chunks"], off, soff = [], 0, 0
        for length, stored, crc, codec in rows.tolist():
            record["chunks"].append([off, length, soff, stored, crc, codec])
            off, soff = off + length, soff + stored
        assert soff == record["bytes"]
    rest = {k: v for k, v in manifest.items() if k not in ("trees", "rngs", "ranks")}
    return {**rest, "version": 1, "ranks": ranks}


def test_a_version_1_checkpoint_restores_with_its_generators(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"epoch": 4}}
    with Checkpointer(root) as ckpt:
        ckpt.save(5, state)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    path = os.path.join(root, "step-0000000005", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    assert manifest["version"] == 2
    with open(path, "w") as f:
        json.dump(_as_version_1(manifest), f)

    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    target = {"w": torch.zeros(3, 4), "meta": {}}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target) == 5
    assert torch.equal(target["w"], state["w"]) and target["meta"] == {"epoch": 4}
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert ckpt_main(["verify", root, "--step", "5"]) == 0
    assert ckpt_main(["show", root, "--step", "5"]) == 0
    assert "epoch" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["torch_state_cut", "torch_state_bomb", "python_words_short", "numpy_kind"])
def test_damaged_generator_states_fall_back_to_the_older_step(tmp_path, damage, caplog):
    """A rank's generator states are checked while the restore can still choose another
    step, not applied half-way after the tensors are loaded."""
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(1, {"w": torch.full((4,), 1.0)})
        ckpt.save(2, {"w": torch.full((4,), 2.0)})
    path = os.path.join(root, "step-0000000002", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    rng = manifest["rngs"][0]
    if damage == "torch_state_cut":
        rng["torch"] = "z:" + base64.b64encode(zlib.compress(b"\0" * 100)).decode()
    elif damage == "torch_state_bomb":
        rng["torch"] = "z:" + base64.b64encode(zlib.compress(b"\0" * (64 << 20))).decode()
    elif damage == "python_words_short":
        rng["python"][1] = base64.b64encode(b"\1\0\0\0" * 10).decode()
    else:
        rng["numpy"][0] = "not-a-generator"
    with open(path, "w") as f:
        json.dump(manifest, f)
    target = {"w": torch.zeros(4)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["w"], torch.full((4,), 1.0))
    assert "step-0000000002" in caplog.text


def test_a_resized_restore_warns_of_an_entry_that_differs_by_rank_once_per_distinct_tree(caplog):
    """Restoring into another world size, a plain entry whose saved value differs by rank is
    named (ranks beyond the old world get rank 0's). Ranks sharing one tree (format 2) are
    compared once; trees of format 1, one object per rank, still each count."""
    from resilient._restore import _plan_entry

    def tree(seen):
        return {"t": "dict", "items": [["meta", {"t": "dict", "items": [["seen", {"t": "v", "v": seen}]]}]]}

    shared = tree(7)
    alike = {"step": 3, "world_size": 4096, "ranks": [{"tree": shared, "rng": None}] * 4096}
    differing = {"step": 3, "world_size": 3, "ranks": [{"tree": tree(r), "rng": None} for r in range(3)]}
    for manifest, warned in ((alike, False), (differing, True)):
        caplog.clear()
        node = dict(manifest["ranks"][0]["tree"]["items"])["meta"]
        _plan_entry("meta", {}, node, manifest, rank=0, world_size=2)
        assert ("'meta' differs by rank" in caplog.text) is warned
