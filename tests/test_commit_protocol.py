"""The commit protocol of a save, rank by rank, over a real TCPStore on loopback.

Each simulated rank is a thread with a client connection of its own, running
``commit_together`` as a rank's writer thread does; each node's leader commits to a file of
its own. What a multi-process job adds (files, collectives) is covered by the distributed
and launcher tests; here the nodes, the store's limits and the failures are set exactly.
"""

import base64
import json
import os
import random
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore

from resilient._chunk_table import with_footer
from resilient._commit import assemble_manifest, commit_together, encode_report
from resilient._coord import StoreCoordinator
from resilient._errors import CommitError
from resilient._format import decode_manifest


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server
    del server


def coordinators(server, nodes, per_node):
    world, leaders = nodes * per_node, list(range(0, nodes * per_node, per_node))
    out = []
    for r in range(world):
        client = TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
        out.append(StoreCoordinator(PrefixStore("resilient/test/", client), rank=r, world_size=world,
                                    leader=r - r % per_node, leaders=leaders, session="test"))
    return out


def written(chunks):
    """The record the writer returns for a file of these raw chunks (its table in a footer)."""
    return with_footer(chunks, chunks[-1][2] + chunks[-1][3] if chunks else 0)[1]


def report(rank, world, chunks=2, signature="same", note=""):
    """A sharded rank's report: one tensor split along dim 0, ``chunks`` chunks in its file;
    ``note``: a string its tree holds (a rank's own value)."""
    rng = random.Random(rank)
    items = [["w", {"t": "tensor", "name": "w"}]] + ([["note", {"t": "v", "v": note}]] if note else [])
    return {"rank": rank, "file": f"rank-{rank:05d}.data",
            "record": written([[i * 64, 64, i * 64, 64, rng.getrandbits(32), 0] for i in range(chunks)]),
            "signature": signature, "meta": {"w": {"dtype": "float32", "shape": [4 * world, 4], "layout": "sharded"}},
            "replicated": [], "shards": [["w", [4 * rank, 0], [4, 4], 0, 64]], "chunk_bytes": 64,
            "tree": {"t": "dict", "items": items}, "rng": None}


def run_save(coords, seq, tmp_path, *, reports=None, skip=(), failing=(), timeout=20.0, memos=None):
    """Every rank but ``skip`` plays its part; leaders in ``failing`` fail to commit. Returns
    each rank's outcome (None: committed; else the CommitError) and what each leader did.
    ``memos``: each rank's ``(SentPieces, HeldPieces or None)``, kept across saves as a
    writer keeps them."""
    world = len(coords)
    done: dict[int, list[str]] = {}
    lock = threading.Lock()

    def one(coord):
        def commit(manifest):
            if coord.rank in failing:
                raise OSError(f"no space left on node of rank {coord.rank}")
            (tmp_path / f"leader-{coord.rank}.json").write_bytes(manifest)
            with lock:
                done.setdefault(coord.rank, []).append("committed")

        def discard():
            with lock:
                done.setdefault(coord.rank, []).append("discarded")

        try:
            sent, held = (memos or {}).get(coord.rank, (None, None))
            commit_together(coord, seq, seq, (reports or {}).get(coord.rank) or report(coord.rank, world),
                            codec="none", timeout=timeout, commit=commit, discard=discard, mark=lambda phase: None,
                            sent=sent, held=held)
            return None
        except CommitError as exc:
            return exc

    playing = [c for c in coords if c.rank not in skip]
    with ThreadPoolExecutor(max_workers=len(playing)) as pool:
        results = dict(zip([c.rank for c in playing], pool.map(one, playing)))
    return results, done


@pytest.mark.timeout(60)
def test_every_node_commits_the_same_manifest_save_after_save(store, tmp_path):
    coords = coordinators(store, nodes=3, per_node=2)
    for seq in (1, 2, 3):
        results, done = run_save(coords, seq, tmp_path)
        assert results == {r: None for r in range(6)}
        assert done == {0: ["committed"], 2: ["committed"], 4: ["committed"]}
        manifests = {(tmp_path / f"leader-{r}.json").read_bytes() for r in (0, 2, 4)}
        assert len(manifests) == 1  # byte for byte: assembled once, by rank 0
        manifest = decode_manifest(manifests.pop(), "test")
        assert manifest["step"] == seq and manifest["world_size"] == 6
        assert sorted(manifest["files"]) == [f"rank-{r:05d}.data" for r in range(6)]
        assert [b["offsets"] for b in manifest["tensors"]["w"]["boxes"]] == [[4 * r, 0] for r in range(6)]
    # what save 1 left in the store is gone once save 3 is done; save 3's own keys stay
    # until save 4 (a rank may still be reading them)
    probe = coords[0]
    assert probe.missing(["1/manifest", "1/settled", "1/outcome/0", "1/report/3", "2/manifest"]) == \
        ["1/manifest", "1/settled", "1/outcome/0", "1/report/3", "2/manifest"]
    assert probe.missing(["3/manifest", "3/settled"]) == []


@pytest.mark.timeout(60)
def test_a_manifest_larger_than_the_store_takes_goes_in_parts(store, tmp_path):
    # 4 ranks each with a value of its own in its tree, 4 MB of random base64: ~16 MB of
    # manifest, ~12 MB deflated, over the 8 MB a TCPStore value may hold (the connection is
    # reset beyond it)
    coords = coordinators(store, nodes=2, per_node=2)
    reports = {r: report(r, 4, note=base64.b64encode(os.urandom(3 << 20)).decode()) for r in range(4)}
    results, done = run_save(coords, 1, tmp_path, reports=reports)
    assert results == {r: None for r in range(4)} and done == {0: ["committed"], 2: ["committed"]}
    raw = (tmp_path / "leader-2.json").read_bytes()
    assert len(zlib.compress(raw, 1)) > 2 * StoreCoordinator.PART_BYTES  # as it travels: in parts
    assert raw == (tmp_path / "leader-0.json").read_bytes()
    manifest = decode_manifest(raw, "test")
    assert manifest["files"]["rank-00003.data"] == {k: reports[3]["record"][k] for k in ("bytes", "logical", "footer")}
    assert dict(manifest["ranks"][3]["tree"]["items"])["note"] == {"t": "v", "v": reports[3]["tree"]["items"][1][1]["v"]}


@pytest.mark.timeout(60)
def test_a_value_in_parts_round_trips_and_is_forgotten_whole(store):
    a, b = coordinators(store, nodes=1, per_node=2)
    value = os.urandom(3 * StoreCoordinator.PART_BYTES + 12345)
    a.publish("big", value)
    a.publish("small", b"x")
    assert b.collect(["small", "big"], timeout=5) == [b"x", value]
    assert b.missing(["big#0", "big#3"]) == []
    a.forget("big")
    parts = ["big#0", "big#1", "big#2", "big#3"]
    assert b.missing(["big", *parts, "small"]) == ["big", *parts]


@pytest.mark.timeout(60)
def test_a_rank_that_never_reports_is_named_and_nothing_is_committed(store, tmp_path):
    coords = coordinators(store, nodes=2, per_node=2)
    results, done = run_save(coords, 1, tmp_path, skip={3}, timeout=2.0)
    assert set(results) == {0, 1, 2}
    for exc in results.values():
        assert isinstance(exc, CommitError)
        assert list(exc.failures) == [3] and "never sent its report" in exc.failures[3]
    assert done == {0: ["discarded"], 2: ["discarded"]}


@pytest.mark.timeout(60)
def test_a_leader_that_cannot_commit_fails_the_save_on_every_rank(store, tmp_path):
    coords = coordinators(store, nodes=3, per_node=2)
    results, done = run_save(coords, 1, tmp_path, failing={2})
    for exc in results.values():
        assert isinstance(exc, CommitError) and list(exc.failures) == [2]
        assert "no space left on node of rank 2" in exc.failures[2]
    assert done == {0: ["committed"], 2: ["discarded"], 4: ["committed"]}
    # the next save goes through: nothing of the failed one is in its way
    results, done = run_save(coords, 2, tmp_path)
    assert results == {r: None for r in range(6)}


@pytest.mark.timeout(60)
def test_ranks_saving_different_states_fail_on_every_rank_naming_the_odd_one(store, tmp_path):
    coords = coordinators(store, nodes=2, per_node=2)
    reports = {r: report(r, 4, signature="odd" if r == 1 else "same") for r in range(4)}
    reports[1]["meta"] = {"w": {"dtype": "bfloat16", "shape": [16, 4], "layout": "sharded"}}
    results, done = run_save(coords, 1, tmp_path, reports=reports)
    for exc in results.values():
        assert isinstance(exc, CommitError) and list(exc.failures) == [1]
        assert "differs from rank 0" in exc.failures[1]
    assert done == {0: ["discarded"], 2: ["discarded"]}


def test_the_manifest_joins_every_kind_of_piece_in_order():
    """Replicated pieces split over ranks (sorted by where they start, whichever rank holds
    them), several shard boxes per rank (in rank order), a tied name, and a rank with no file."""
    def rank_report(rank, file, replicated, shards):
        return {"rank": rank, "file": file, "signature": "s",
                "record": written([[0, 48, 0, 48, 7 + rank, 0]]) if file else None, "chunk_bytes": 64,
                "meta": {"a": {"dtype": "float32", "shape": [8], "layout": "replicated"},
                         "b": {"dtype": "float32", "shape": [4, 2], "layout": "sharded"},
                         "c": {"dtype": "float32", "shape": [8], "layout": "replicated", "same_as": "a"}},
                "replicated": replicated, "shards": shards,
                "tree": {"t": "dict", "items": [[k, {"t": "tensor", "name": k}] for k in "abc"]},
                "rng": {"seed": rank}}

    def rows(*starts):
        return [["b", [row, 0], [1, 2], 16 + 8 * i, 8] for i, row in enumerate(starts)]

    reports = [
        rank_report(0, "rank-00000.data", [["a", 16, 16, 0]], rows(0, 2)),
        rank_report(1, "rank-00001.data", [["a", 0, 16, 0]], rows(1, 3)),
        rank_report(2, None, [], []),
    ]
    manifest = decode_manifest(assemble_manifest(5, [encode_report(r) for r in reports], "none"), "test")
    assert manifest["step"] == 5 and manifest["world_size"] == 3 and manifest["codec"] == "none"
    assert sorted(manifest["files"]) == ["rank-00000.data", "rank-00001.data"]
    a = manifest["tensors"]["a"]
    pieces = [["rank-00001.data", 0, 16], ["rank-00000.data", 0, 16]]
    assert a["boxes"] == [{"offsets": [0], "sizes": [8], "pieces": pieces}]
    assert manifest["tensors"]["c"]["boxes"] == a["boxes"] and manifest["tensors"]["c"]["same_as"] == "a"
    r0, r1 = "rank-00000.data", "rank-00001.data"
    assert [(b["offsets"][0], b["pieces"][0][:2]) for b in manifest["tensors"]["b"]["boxes"]] == [
        (0, [r0, 16]), (2, [r0, 24]), (1, [r1, 16]), (3, [r1, 24])]
    assert [r["rng"] for r in manifest["ranks"]] == [{"seed": 0}, {"seed": 1}, {"seed": 2}]


def deflated_otherwise(raw: bytes, kind: str) -> bytes:
    """An encoded report with its ``kind`` piece deflated as another library or CPU code
    path may deflate it: the same content, other bytes (stored, not compressed)."""
    from resilient._commit import _PIECES, _deflate, _Report

    parsed = _Report.parse(raw)
    setattr(parsed, kind, zlib.compress(_deflate.decompress(getattr(parsed, kind)), 0))
    pieces = [getattr(parsed, piece) for piece in _PIECES]
    header = {**parsed.header, "sizes": [len(p) for p in pieces]}
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(pieces)


def test_ranks_whose_deflate_differs_share_one_tree_in_the_manifest():
    """One tree on every rank, deflated to other bytes on one of them (as ISA-L did for one
    rank in six now and then, under load): the manifest holds it once, as if all agreed."""
    raws = [encode_report(report(r, 3)) for r in range(3)]
    odd = deflated_otherwise(raws[1], "tree")
    assert odd != raws[1]
    agreed = decode_manifest(assemble_manifest(1, raws, "none"), "agreed")
    manifest = decode_manifest(assemble_manifest(1, [raws[0], odd, raws[2]], "none"), "odd")
    assert {**manifest, "created": 0} == {**agreed, "created": 0}
    raw = assemble_manifest(1, [raws[0], odd, raws[2]], "none")
    assert json.loads(raw)["trees"] == [report(0, 3)["tree"]] and [r[0] for r in json.loads(raw)["ranks"]] == [0, 0, 0]


def test_a_failed_rank_is_reported_from_its_header_alone():
    reports = [encode_report(report(0, 2)), encode_report({"rank": 1, "error": "OSError: disk on fire\nsecond line"})]
    with pytest.raises(CommitError) as caught:
        assemble_manifest(1, reports, "none")
    assert caught.value.failures == {1: "OSError: disk on fire\nsecond line"}
