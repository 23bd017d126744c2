"""Crafted or damaged manifests: restore loads the older step instead, every CLI command
exits 1 with one line naming the step, nothing allocates what the manifest merely claims."""

import base64
import json
import os
import resource
import shutil
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from resilient import Checkpointer
from resilient.ckpt import main as ckpt_main

MANIFEST = os.path.join("step-0000000002", "manifest.json")


def _mutations() -> dict:
    """The damage, by name, each applied to a good manifest of step 2."""

    def deep(m):  # the entry becomes 200,000 nested lists
        m["trees"][0]["items"][0][1] = "__DEEP__"
        return '{"t":"list","items":[' * 200_000 + '{"t":"v","v":1}' + "]}" * 200_000

    return {
        "dtype_is_a_list": lambda m: m["tensors"]["w"].__setitem__("dtype", ["float32"]),
        "missing_shape": lambda m: m["tensors"]["w"].pop("shape"),
        "missing_files": lambda m: m.pop("files"),
        # the chunk table's place in the file (format 4)
        "footer_of_more_rows_than_the_file": lambda m: m["files"]["rank-00000.data"]["footer"].__setitem__(0, 10**9),
        "footer_checksum_2_40": lambda m: m["files"]["rank-00000.data"]["footer"].__setitem__(1, 2**40),
        "footer_a_string": lambda m: m["files"]["rank-00000.data"].__setitem__("footer", "*" * 20),
        "logical_size_negative": lambda m: m["files"]["rank-00000.data"].__setitem__("logical", -1),
        "logical_size_past_the_chunks": lambda m: m["files"]["rank-00000.data"].__setitem__("logical", 2**50),
        "chunk_bytes_zero": lambda m: m.__setitem__("chunk_bytes", 0),
        "shape_2_42_elements": lambda m: m["tensors"]["w"].__setitem__("shape", [2**21, 2**21]),
        "tree_names_unknown_tensor": lambda m: m["trees"][0]["items"][0][1].__setitem__("name", "nope"),
        "deep_tree": deep,
        "rank_names_a_tree_not_there": lambda m: m["ranks"][0].__setitem__(0, 1),
        # runs of boxes (format 2): w as two halves, in rank 0's file and in rank 1's (a copy)
        "run_names_a_rank_without_a_file": lambda m: _as_run(m, 2, [128, 2, 512]),
        "run_of_2_40_boxes": lambda m: _as_run(m, 2**40, [0, 1, 0]),
        "run_of_one_box": lambda m: _as_run(m, 1, [128, 1, 512]),
        "run_in_one_rank": lambda m: _as_run(m, 2, [128, 0, 512]),
        "run_past_the_shape": lambda m: _as_run(m, 2, [129, 1, 512]),
        "run_past_a_files_end": lambda m: _as_run(m, 2, [128, 1, 1 << 20]),  # the file holds 1 kB + RNG states
        "run_stride_too_short": lambda m: _as_run(m, 2, [128, 1]),
        "run_before_a_files_start": lambda m: _as_run(m, 2, [128, 1, -512]),
        "run_file_offset_2_100": lambda m: _as_run(m, 2, [128, 1, 2**100]),
        "run_rank_2_100": lambda m: _as_run(m, 2, [128, 2**100, 0]),
        # a rank's generator states in its data file (format 3): [offset, length]
        "rng_past_a_files_end": lambda m: m["ranks"][0][1].__setitem__(0, 1 << 20),
        "rng_of_2_30_bytes": lambda m: m["ranks"][0].__setitem__(1, [0, 2**30]),
        "rng_of_no_bytes": lambda m: m["ranks"][0][1].__setitem__(1, 0),
        "rng_negative_offset": lambda m: m["ranks"][0][1].__setitem__(0, -1),
        "rng_a_string": lambda m: m["ranks"][0].__setitem__(1, "rank-00000.data"),
        "rng_three_numbers": lambda m: m["ranks"][0][1].append(5),
        # w as a tensor subclass's parts (format 5), damaged
        "wrapped_shape_a_string": lambda m: _as_wrapped(m, shape="*"),
        "wrapped_class_a_number": lambda m: _as_wrapped(m, cls=7),
        "wrapped_items_not_a_list": lambda m: _as_wrapped(m, items={"payload": "w"}),
        # parts saved as views of blocks (format 6) naming what is not a part
        "wrapped_blocks_not_a_part": lambda m: _as_wrapped(m, blocks=["scale"]),
        "wrapped_blocks_a_string": lambda m: _as_wrapped(m, blocks="payload"),
        "wrapped_blocks_a_list_key": lambda m: _as_wrapped(m, items=[[["payload"], {"t": "v", "v": 1}]],
                                                           blocks=["payload"]),
    }


def _as_wrapped(m: dict, cls="tests.wrapped_tensors.Scaled", shape=(256,), items=None, blocks=None) -> None:
    """w's tree node as a wrapped subclass holding w as its payload (format 5; 6 with
    ``blocks``), as given."""
    m["version"] = 5 if blocks is None else 6
    node = m["trees"][0]["items"][0][1]
    m["trees"][0]["items"][0][1] = {"t": "wrapped", "class": cls, "name": "w",
                                    "shape": shape if isinstance(shape, str) else list(shape), "stride": [1],
                                    "ctx": {"t": "v", "v": None}, "items": [["payload", node]] if items is None else items}
    if blocks is not None:
        m["trees"][0]["items"][0][1]["blocks"] = blocks


def _footer_damage() -> dict:
    """Damage to the chunk table in rank 0's file (format 4), by name: rows changed there,
    the manifest's checksum of it made to match (a hostile writer), or not."""
    return {
        "chunk_length_2_31": _change_footer(lambda rows: rows[0].__setitem__("length", 2**31)),
        "chunk_codec_7": _change_footer(lambda rows: rows[0].__setitem__("codec", 7)),
        "raw_chunk_stored_apart": _change_footer(lambda rows: rows[0].__setitem__("stored", 1000)),
        "chunks_cover_less_than_the_file": _change_footer(lambda rows: rows[0].__setitem__("length", 4)),
        "footer_unlike_its_checksum": _change_footer(lambda rows: rows[0].__setitem__("crc", 1), fix=False),
    }


def _change_footer(change, fix: bool = True):
    """Rank 0's chunk table (13-byte rows: length, stored, crc32, codec, the file's last
    bytes), changed in the file by ``change(rows)``; with ``fix``, the manifest's checksum of
    it changed to match. Returns what ``_write_damaged`` applies to the step's files."""
    def apply(step_dir: str, m: dict) -> None:
        record = m["files"]["rank-00000.data"]
        count = record["footer"][0]
        path = os.path.join(step_dir, "rank-00000.data")
        with open(path, "r+b") as f:
            f.seek(record["bytes"] - 13 * count)
            rows = np.frombuffer(f.read(13 * count), dtype=[("length", "<u4"), ("stored", "<u4"), ("crc", "<u4"),
                                                            ("codec", "u1")]).copy()
            change(rows)
            f.seek(record["bytes"] - 13 * count)
            f.write(rows.tobytes())
        if fix:
            record["footer"][1] = zlib.crc32(rows.tobytes())
    return apply


def _as_run(m: dict, repeat: int, stride: list) -> None:
    """w's one box (256 floats in rank 0's file) as a run of ``repeat`` halves, and a rank 1
    whose file is a copy of rank 0's (``_write_damaged`` copies it)."""
    m["files"]["rank-00001.data"] = m["files"]["rank-00000.data"]
    m["tensors"]["w"]["boxes"] = [{"offsets": [0], "sizes": [128], "pieces": [["rank-00000.data", 0, 512]],
                                   "repeat": repeat, "stride": stride}]


def _write_damaged(root: str, name: str) -> None:
    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        m = json.load(f)
    in_files = _footer_damage().get(name)
    result = in_files(os.path.dirname(path), m) if in_files else _mutations()[name](m)
    raw = json.dumps(m)
    if name == "deep_tree":
        raw = raw.replace('"__DEEP__"', result)
    with open(path, "w") as f:
        f.write(raw)
    if "rank-00001.data" in m.get("files", {}):
        step_dir = os.path.dirname(path)
        shutil.copyfile(os.path.join(step_dir, "rank-00000.data"), os.path.join(step_dir, "rank-00001.data"))


@pytest.fixture
def damaged(tmp_path, request):
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(1, {"w": torch.full((256,), 1.0)})
        ckpt.save(2, {"w": torch.full((256,), 2.0)})
    _write_damaged(root, request.param)
    return root


@pytest.mark.parametrize("damaged", list(_mutations()), indirect=True)
def test_restore_falls_back_and_the_cli_names_the_step(damaged, caplog, capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    target = {"w": torch.zeros(256)}
    with Checkpointer(damaged) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["w"], torch.full((256,), 1.0))
    assert "step-0000000002" in caplog.text
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB: < 200 MiB more
    copy = damaged + "-copy"
    for argv in (["verify", damaged, "--step", "2"], ["verify", damaged, "--all"], ["show", damaged, "--step", "2"],
                 ["export", damaged, os.path.join(damaged, "x.pt"), "--step", "2", "--format", "torch"],
                 ["export", damaged, os.path.join(damaged, "x.st"), "--step", "2", "--format", "safetensors"],
                 ["diff", damaged, "1", "2"], ["pull", damaged, copy, "--step", "2"],
                 ["ls", damaged], ["ls", damaged, "--verify"]):
        assert ckpt_main(argv) == 1, argv  # an error, not an exception
        printed = capsys.readouterr()
        assert "step-0000000002" in printed.err + printed.out or "step 2" in printed.err, (argv, printed)
    assert not any(os.path.exists(os.path.join(damaged, name)) for name in ("x.pt", "x.st"))
    assert not os.path.exists(os.path.join(copy, "step-0000000002"))
    assert ckpt_main(["prune", damaged, "--keep", "1"]) == 0  # the damaged step is neither counted nor deleted
    assert sorted(n for n in os.listdir(damaged) if n.startswith("step-")) == ["step-0000000001", "step-0000000002"]


@pytest.mark.parametrize("damaged", list(_footer_damage()), indirect=True)
def test_a_damaged_chunk_table_in_a_file_falls_back_and_the_cli_names_the_file(damaged, caplog, capsys):
    """A format 4 file's table is checked where the file is read: a restore falls back, and
    the commands that read data files exit 1 naming it; the manifest itself is sound, so
    ``show`` and ``ls`` still describe the step."""
    target = {"w": torch.zeros(256)}
    with Checkpointer(damaged) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["w"], torch.full((256,), 1.0))
    assert "step-0000000002/rank-00000.data: its chunk table" in caplog.text
    copy = damaged + "-copy"
    for argv in (["verify", damaged, "--step", "2"], ["ls", damaged, "--verify"],
                 ["export", damaged, os.path.join(damaged, "x.pt"), "--step", "2", "--format", "torch"],
                 ["pull", damaged, copy, "--step", "2"]):
        assert ckpt_main(argv) == 1, argv
        printed = capsys.readouterr()
        assert "rank-00000.data" in printed.err + printed.out, (argv, printed)
    assert not os.path.exists(os.path.join(damaged, "x.pt"))
    assert not os.path.exists(os.path.join(copy, "step-0000000002"))
    assert ckpt_main(["show", damaged, "--step", "2"]) == 0


def test_a_run_of_boxes_restores_as_the_boxes_it_stands_for(tmp_path):
    """The run the hostile cases above break, unbroken: w's halves from two ranks' files."""
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(1, {"w": torch.full((256,), 1.0)})
        ckpt.save(2, {"w": torch.arange(256.0)})
    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        m = json.load(f)
    _as_run(m, 2, [128, 1, 512])
    with open(path, "w") as f:
        json.dump(m, f)
    shutil.copyfile(os.path.join(root, "step-0000000002", "rank-00000.data"),
                    os.path.join(root, "step-0000000002", "rank-00001.data"))
    target = {"w": torch.zeros(256)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target) == 2
    # the second half came from rank 1's file at its offset 512: the copy's second half
    assert torch.equal(target["w"], torch.arange(256.0))
    assert ckpt_main(["verify", root, "--step", "2"]) == 0


def test_a_huge_bad_marker_is_read_only_as_far_as_a_reason_goes(tmp_path):
    """A bad marker is read by ``resilient-ckpt ls`` and, while it waits for other nodes,
    by rank 0's uploader every 0.2 s: one planted at 64 MiB costs a few kB each time."""
    from resilient._catalog import BAD_REASON_BYTES, CORRUPT, Catalog
    from resilient._storage import open_storage

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}, force=True)
    os.makedirs(tmp_path / ".bad")
    with open(tmp_path / ".bad" / "step-0000000001", "wb") as f:
        f.write(b"x" * (64 << 20))
    catalog = Catalog(open_storage(str(tmp_path)))
    tracemalloc.start()
    try:
        assert len(catalog.bad_reason(1)) == BAD_REASON_BYTES
        entry = catalog.entry(1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert entry.state == CORRUPT and len(entry.problem) < BAD_REASON_BYTES + 100
    assert peak < 1 << 20, peak  # nothing near 64 MiB
