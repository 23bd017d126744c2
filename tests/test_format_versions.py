"""Checkpoints written by an older resilient still restore, RNG states included, and the CLI
reads them: format version 3 (chunk tables in the manifest, not in each file's footer),
version 2 (every RNG state in the manifest's ``rngs``, not in the rank's
data file) and version 1 (boxes one by one, each rank's tree and RNG state in ``ranks``,
generator words as lists of numbers). Damaged generator states, in a data file or in a
manifest, make the restore fall back to the older step."""

import base64
import json
import os
import random
import zlib

import numpy as np
import pytest
import torch
from isal.isal_zlib import crc32

from resilient import Checkpointer
from resilient.ckpt import main as ckpt_main
from resilient._format import MANIFEST, VERSION, step_dir_name

pytestmark = pytest.mark.timeout(120)

_ROW = np.dtype([("length", "<u4"), ("stored", "<u4"), ("crc", "<u4"), ("codec", "u1")])


def _rows(record: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(record["table"]), dtype=_ROW).copy()


def _as_version_3(manifest: dict, step_dir: str) -> dict:
    """A version 4 manifest as version 3 wrote the same checkpoint: each file's chunk table
    taken out of its footer (cut off) into the manifest, base64."""
    for name, record in manifest["files"].items():
        count, crc = record.pop("footer")
        end = record.pop("bytes") - 13 * count
        with open(os.path.join(step_dir, name), "r+b") as f:
            f.seek(end)
            table = f.read()
            f.truncate(end)
        assert len(table) == 13 * count and zlib.crc32(table) == crc
        del record["logical"]
        record.update(bytes=end, table=base64.b64encode(table).decode())
    del manifest["chunk_bytes"]
    return {**manifest, "version": 3}


def _as_version_2(manifest: dict, step_dir: str) -> dict:
    """A version 3 manifest as version 2 wrote the same checkpoint: each rank's generator
    states taken out of its data file (its last chunk, cut off) into ``rngs``."""
    rngs, ranks = [], []
    for rank, (tree, at) in enumerate(manifest["ranks"]):
        if isinstance(at, list):
            name = f"rank-{rank:05d}.data"
            record, rows = manifest["files"][name], _rows(manifest["files"][name])
            assert rows[-1]["length"] == at[1] and record["bytes"] == at[0] + at[1]  # raw, last
            with open(os.path.join(step_dir, name), "r+b") as f:
                f.seek(at[0])
                rngs.append(json.loads(f.read(at[1])))
                f.truncate(at[0])
            record["table"], record["bytes"] = base64.b64encode(rows[:-1].tobytes()).decode(), at[0]
            at = len(rngs) - 1
        ranks.append([tree, at])
    return {**manifest, "version": 2, "rngs": rngs, "ranks": ranks}


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
        rows = _rows(record)
        record["chunks"], off, soff = [], 0, 0
        for length, stored, crc, codec in rows.tolist():
            record["chunks"].append([off, length, soff, stored, crc, codec])
            off, soff = off + length, soff + stored
        del record["table"]
        assert soff == record["bytes"]
    rest = {k: v for k, v in manifest.items() if k not in ("trees", "rngs", "ranks")}
    return {**rest, "version": 1, "ranks": ranks}


def _rewrite(root: str, step: int, change) -> None:
    """The manifest of ``step`` replaced by ``change(manifest, step_dir)``."""
    step_dir = os.path.join(root, f"step-{step:010d}")
    path = os.path.join(step_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    assert manifest["version"] == 4
    with open(path, "w") as f:
        json.dump(change(manifest, step_dir), f)


_OLDER = {3: _as_version_3, 2: lambda m, d: _as_version_2(_as_version_3(m, d), d),
          1: lambda m, d: _as_version_1(_as_version_2(_as_version_3(m, d), d))}


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_checkpoint_restores_with_its_generators(tmp_path, capsys, version):
    root = str(tmp_path / "ckpt")
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"epoch": 4}}
    with Checkpointer(root) as ckpt:
        ckpt.save(5, state)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    _rewrite(root, 5, _OLDER[version])

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


def _two_steps(root: str) -> None:
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(1, {"w": torch.full((4,), 1.0)})
        ckpt.save(2, {"w": torch.full((4,), 2.0)})


def _restores_step_1(root: str, caplog) -> None:
    target = {"w": torch.zeros(4)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["w"], torch.full((4,), 1.0))
    assert "step-0000000002" in caplog.text


@pytest.mark.parametrize("damage", ["torch_state_cut", "torch_state_bomb", "python_words_short", "numpy_kind"])
def test_damaged_generator_states_fall_back_to_the_older_step(tmp_path, damage, caplog):
    """A rank's generator states are checked while the restore can still choose another
    step, not applied half-way after the tensors are loaded (here states kept in the
    manifest, as version 2 did: a checksum covers them in a data file)."""
    root = str(tmp_path / "ckpt")
    _two_steps(root)

    def damaged(manifest: dict, step_dir: str) -> dict:
        manifest = _OLDER[2](manifest, step_dir)
        rng = manifest["rngs"][0]
        if damage == "torch_state_cut":
            rng["torch"] = "z:" + base64.b64encode(zlib.compress(b"\0" * 100)).decode()
        elif damage == "torch_state_bomb":
            rng["torch"] = "z:" + base64.b64encode(zlib.compress(b"\0" * (64 << 20))).decode()
        elif damage == "python_words_short":
            rng["python"][1] = base64.b64encode(b"\1\0\0\0" * 10).decode()
        else:
            rng["numpy"][0] = "not-a-generator"
        return manifest

    _rewrite(root, 2, damaged)
    _restores_step_1(root, caplog)


@pytest.mark.parametrize("damage", ["flipped_byte", "not_json_checksum_fixed", "a_list_checksum_fixed"])
def test_generator_states_damaged_in_the_data_file_fall_back_to_the_older_step(tmp_path, damage, caplog):
    """Since format 3 a rank's states are in its data file, as a chunk of their own: a flipped
    byte fails its checksum; bytes that are not states, with a checksum that matches them
    (a hostile writer), fail to parse. Either way the older step is restored. A restore
    that does not want the states (``rng=False``) does not read them."""
    root = str(tmp_path / "ckpt")
    _two_steps(root)
    step_dir = os.path.join(root, "step-0000000002")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        offset, length = json.load(f)["ranks"][0][1]
    path = os.path.join(step_dir, "rank-00000.data")
    with open(path, "r+b") as f:
        f.seek(offset)
        saved = f.read(length)
        assert json.loads(saved)["torch"].startswith("z:")
        if damage == "flipped_byte":
            replacement = saved[:100] + bytes([saved[100] ^ 1]) + saved[101:]
        elif damage == "not_json_checksum_fixed":
            replacement = b"{" * length
        else:
            replacement = b"[" + b" " * (length - 2) + b"]"
        f.seek(offset)
        f.write(replacement)
    if damage != "flipped_byte":
        def with_checksum(manifest: dict, step_dir: str) -> dict:
            """The states' chunk's CRC changed in the file's chunk table (its footer), and the
            manifest's CRC of that table."""
            record = manifest["files"]["rank-00000.data"]
            start = record["bytes"] - 13 * record["footer"][0]
            with open(path, "r+b") as f:
                f.seek(start)
                rows = np.frombuffer(f.read(), dtype=_ROW).copy()
                rows[-1]["crc"] = crc32(replacement)
                f.seek(start)
                f.write(rows.tobytes())
            record["footer"][1] = zlib.crc32(rows.tobytes())
            return manifest
        _rewrite(root, 2, with_checksum)
    target = {"w": torch.zeros(4)}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(target) == 2
    assert torch.equal(target["w"], torch.full((4,), 2.0))
    _restores_step_1(root, caplog)


def test_a_resized_restore_warns_of_an_entry_that_differs_by_rank_once_per_distinct_tree(caplog):
    """Restoring into another world size, a plain entry whose saved value differs by rank is
    named (ranks beyond the old world get rank 0's). Ranks sharing one tree (format 2) are
    compared once; trees of format 1, one object per rank, still each count."""
    from resilient._restore import _warn_if_values_differ
    from resilient._saved_trees import partitioned_entries

    def tree(seen):
        return {"t": "dict", "items": [["meta", {"t": "dict", "items": [["seen", {"t": "v", "v": seen}]]}]]}

    shared = tree(7)
    alike = {"step": 3, "world_size": 4096, "ranks": [{"tree": shared, "rng": None}] * 4096}
    differing = {"step": 3, "world_size": 3, "ranks": [{"tree": tree(r), "rng": None} for r in range(3)]}
    for manifest, warned in ((alike, False), (differing, True)):
        caplog.clear()
        parts = partitioned_entries(manifest, 0).get("meta")
        _warn_if_values_differ("meta", manifest, 0, 2, parts[1] if parts else None)
        assert ("'meta' differs by rank" in caplog.text) is warned
        assert ("first at 'meta/seen'" in caplog.text) is warned


def test_a_manifest_of_a_newer_format_is_refused_not_stepped_back_from(root):
    """A newer resilient wrote the newest step: a restore names the format and refuses, on
    every rank, instead of restoring an older step without a word; the step is not marked
    bad, and an older one is restored when asked for by its number."""
    from resilient import CheckpointCorruptError

    with Checkpointer(root) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((3,), float(step))})
    path = os.path.join(root, step_dir_name(2), MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["version"] = VERSION + 1
    with open(path, "w") as f:
        json.dump(manifest, f)
    back = {"w": torch.zeros(3)}
    with Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointCorruptError, match=rf"step-0000000002.*written by a newer resilient \(checkpoint "
                                                         rf"format {VERSION + 1}; this one reads formats 1, 2, 3, 4, 5, 6\)"):
            ckpt.restore(back)
        assert back["w"].tolist() == [0.0] * 3
        assert ckpt.restore(back, step=1) == 1 and back["w"].tolist() == [1.0] * 3
    assert not os.path.exists(os.path.join(root, ".bad"))
