"""A rank sends rank 0 again only the pieces of its report that changed since the last
committed save (``resilient/_report_memo.py``), over a real TCPStore, rank by rank as in
``test_commit_protocol``. Every manifest is compared with the one the same reports give
when sent whole, and every report that travelled is read back from what was published."""

import json
import random

import pytest

from resilient._commit import assemble_manifest, encode_report
from resilient._errors import CommitError
from resilient._format import decode_manifest
from resilient._report_memo import HeldPieces, SentPieces

from .test_commit_protocol import coordinators, report, run_save, store, written  # noqa: F401 - store: a fixture

pytestmark = pytest.mark.timeout(60)


class Published:
    """Every rank's report as it was published, by save: the store's own traffic, read back."""

    def __init__(self, coords):
        self.reports: dict[int, dict[int, bytes]] = {}
        for coord in coords:
            publish = coord.publish

            def recording(key, value, publish=publish, rank=coord.rank):
                if "/report/" in key:
                    self.reports.setdefault(int(key.split("/")[0]), {})[rank] = value
                publish(key, value)

            coord.publish = recording

    def kept(self, seq: int) -> dict[int, set[str]]:
        """Which pieces each rank left out of its report at save ``seq``."""
        return {rank: set(json.loads(raw.partition(b"\n")[0]).get("kept", {}))
                for rank, raw in self.reports[seq].items()}


def memos(world):
    return {r: (SentPieces(), HeldPieces() if r == 0 else None) for r in range(world)}


def reports_of(world, seq, notes=None, moved=None):
    """Every rank's report at save ``seq``: its file's checksums new at every save, as a
    writer's are; ``notes``: a value of its own in a rank's tree; ``moved``: ranks whose one
    box is written as two."""
    out = {}
    for r in range(world):
        rep = report(r, world, note=(notes or {}).get(r, ""))
        rng = random.Random(seq * 1000 + r)
        rep["record"] = written([[i * 64, 64, i * 64, 64, rng.getrandbits(32), 0] for i in range(2)])
        if r in (moved or ()):
            name, offsets, sizes, at, nbytes = rep["shards"][0]
            half = sizes[0] // 2
            rep["shards"] = [[name, offsets, [half, sizes[1]], at, nbytes // 2],
                             [name, [offsets[0] + half, 0], [half, sizes[1]], at + nbytes // 2, nbytes // 2]]
        out[r] = rep
    return out


def assert_as_if_sent_whole(tmp_path, leaders, seq, reports):
    """Every leader committed the manifest that every report sent whole gives."""
    whole = decode_manifest(assemble_manifest(seq, [encode_report(reports[r]) for r in sorted(reports)], "none"),
                            "whole")
    for leader in leaders:
        got = decode_manifest((tmp_path / f"leader-{leader}.json").read_bytes(), f"leader {leader}")
        assert {**got, "created": 0} == {**whole, "created": 0}


def test_a_rank_sends_again_only_what_changed_and_every_manifest_is_as_if_sent_whole(store, tmp_path):
    coords = coordinators(store, nodes=3, per_node=2)
    published, kept = Published(coords), memos(6)
    plan = {1: {}, 2: {}, 3: {"notes": {4: "a value of rank 4's own"}}, 4: {"notes": {4: "a value of rank 4's own"},
                                                                          "moved": {1}}}
    for seq, changes in plan.items():
        reports = reports_of(6, seq, **changes)
        results, done = run_save(coords, seq, tmp_path, reports=reports, memos=kept)
        assert results == {r: None for r in range(6)}, results
        assert done == {0: ["committed"], 2: ["committed"], 4: ["committed"]}
        assert_as_if_sent_whole(tmp_path, (0, 2, 4), seq, reports)
    everything = {"meta", "tree", "rows", "replicated"}
    assert published.kept(1) == {r: set() for r in range(6)}  # nothing to refer to yet: sent whole
    assert published.kept(2) == {r: everything for r in range(6)}
    assert published.kept(3) == {**{r: everything for r in range(6)}, 4: everything - {"tree"}}  # its tree changed
    assert published.kept(4) == {**{r: everything for r in range(6)}, 1: everything - {"rows"}}  # its box split in two


def test_after_a_failed_save_every_rank_sends_its_report_whole_once(store, tmp_path):
    coords = coordinators(store, nodes=3, per_node=2)
    published, kept = Published(coords), memos(6)
    assert run_save(coords, 1, tmp_path, reports=reports_of(6, 1), memos=kept)[0] == {r: None for r in range(6)}
    results, _ = run_save(coords, 2, tmp_path, reports=reports_of(6, 2), memos=kept, failing={2})
    assert all(isinstance(exc, CommitError) for exc in results.values())
    for seq in (3, 4):
        reports = reports_of(6, seq)
        assert run_save(coords, seq, tmp_path, reports=reports, memos=kept)[0] == {r: None for r in range(6)}
        assert_as_if_sent_whole(tmp_path, (0, 2, 4), seq, reports)
    assert published.kept(2) == {r: {"meta", "tree", "rows", "replicated"} for r in range(6)}  # save 1 committed
    assert published.kept(3) == {r: set() for r in range(6)}  # save 2 did not: whole again
    assert published.kept(4) == {r: {"meta", "tree", "rows", "replicated"} for r in range(6)}


def test_pieces_rank_0_no_longer_holds_fail_that_save_alone_naming_the_ranks(store, tmp_path):
    """Rank 0 without what the ranks think it holds (its side of the last settlement lost):
    that save fails, naming every rank that left a piece out, and nothing is committed from
    stale pieces; the next one is sent whole and commits."""
    coords = coordinators(store, nodes=2, per_node=2)
    published, kept = Published(coords), memos(4)
    assert run_save(coords, 1, tmp_path, reports=reports_of(4, 1), memos=kept)[0] == {r: None for r in range(4)}
    kept[0] = (kept[0][0], HeldPieces())
    results, done = run_save(coords, 2, tmp_path, reports=reports_of(4, 2), memos=kept)
    for exc in results.values():
        assert isinstance(exc, CommitError) and sorted(exc.failures) == [0, 1, 2, 3]
        assert all("which rank 0 does not hold" in why for why in exc.failures.values())
    assert done == {0: ["discarded"], 2: ["discarded"]}
    reports = reports_of(4, 3)
    assert run_save(coords, 3, tmp_path, reports=reports, memos=kept)[0] == {r: None for r in range(4)}
    assert published.kept(3) == {r: set() for r in range(4)}
    assert_as_if_sent_whole(tmp_path, (0, 2), 3, reports)


def test_a_rank_whose_deflate_differs_from_save_to_save_still_leaves_its_pieces_out(monkeypatch):
    """Deflate need not give the same bytes for the same piece twice (ISA-L, now and then,
    under load): a rank compares its pieces before deflating them, so an unchanged piece is
    still left out, and rank 0 fills it in with what it holds."""
    import zlib

    import resilient._commit as commit

    sent, held = SentPieces(), HeldPieces()
    first = assemble_manifest(1, [encode_report(report(0, 1), sent)], "none", held)
    sent.settled(True), held.settled(True)

    class Otherwise:  # the same content, deflated to other bytes (stored blocks)
        decompress = staticmethod(commit._deflate.decompress)

        @staticmethod
        def compress(data, level):
            return zlib.compress(data, 0)

    monkeypatch.setattr(commit, "_deflate", Otherwise)
    raw = encode_report(report(0, 1), sent)
    assert set(json.loads(raw.partition(b"\n")[0])["kept"]) == {"meta", "tree", "rows", "replicated"}
    second = assemble_manifest(2, [raw], "none", held)
    assert {**json.loads(second), "step": 1, "created": 0} == {**json.loads(first), "created": 0}


def test_a_report_that_leaves_pieces_out_without_a_memo_on_rank_0_is_refused():
    sent = SentPieces()
    encode_report(report(0, 1), sent)
    sent.settled(True)
    with pytest.raises(CommitError) as caught:
        assemble_manifest(2, [encode_report(report(0, 1), sent)], "none")
    assert "rank 0 holds no earlier report" in caught.value.failures[0]



def test_a_checkpointers_manifests_follow_its_state_when_pieces_are_reused(tmp_path):
    """One process, saves in a row: the second reuses the first's encoded plan and tensors
    section, the third adds a tensor, the fourth changes a shape, the fifth goes back to the
    first state. Each step restores to exactly what was saved at it."""
    import torch

    from resilient import Checkpointer
    from resilient._format import decode_manifest

    g = torch.Generator().manual_seed(4)
    first = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}
    states = {1: first, 2: {k: v + 1 for k, v in first.items()},
              3: {**first, "extra": torch.arange(4.0)}, 4: {"w": torch.randn(2, 3, generator=g), "b": first["b"]},
              5: first}
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None, rng=False) as ckpt:
        for step, state in states.items():
            ckpt.save(step, {"m": state})
            ckpt.wait()
    for step, state in states.items():
        manifest = decode_manifest((tmp_path / "ckpt" / f"step-{step:010d}" / "manifest.json").read_bytes(), "m")
        assert sorted(manifest["tensors"]) == sorted(f"m/{k}" for k in state)
        assert all(manifest["tensors"][f"m/{k}"]["shape"] == list(v.shape) for k, v in state.items())
        target = {"m": {k: torch.zeros_like(v) for k, v in state.items()}}
        with Checkpointer(root, rng=False) as ckpt:
            assert ckpt.restore(target, step=step) == step
        assert all(torch.equal(target["m"][k], v) for k, v in state.items()), step
