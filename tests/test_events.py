"""The JSON-lines event log: what happened, in order, from every rank into one file."""

import json

import torch

from resilient import Checkpointer

from .launch import run_ranks


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_saves_uploads_and_restores_are_logged_in_order(tmp_path):
    log = str(tmp_path / "run.jsonl")
    state = {"w": torch.ones(1000)}
    with Checkpointer(tmp_path / "l", remote=f"memory://events-{tmp_path.name}", events=log) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
        ckpt.flush(timeout=30)
    with Checkpointer(tmp_path / "empty", remote=f"memory://events-{tmp_path.name}", events=log) as ckpt:
        assert ckpt.restore({"w": torch.zeros(1000)}) == 2
    events = read(log)
    names = [(e["event"], e.get("step"), e.get("tier")) for e in events]
    for step in (1, 2):
        started = names.index(("save_started", step, None))
        staged = names.index(("save_staged", step, None))
        local = names.index(("save_committed", step, "local"))
        remote = names.index(("save_committed", step, "remote"))
        assert started < staged < local < remote
    restored = [e for e in events if e["event"] == "restored"]
    assert restored[0]["step"] == 2 and restored[0]["source"] == "remote" and restored[0]["seconds"] >= 0
    assert restored[0]["bytes"] == 4000  # the 1000 floats of "w"
    staged = [e for e in events if e["event"] == "save_staged"][0]
    assert staged["bytes"] == 4000 and staged["stall_s"] > 0
    assert all(e["rank"] == 0 and isinstance(e["t"], float) for e in events)


def test_failed_save_is_logged(tmp_path):
    import shutil

    import pytest

    from resilient import CommitError

    log = str(tmp_path / "run.jsonl")
    with Checkpointer(tmp_path / "l", events=log, commit_timeout=5) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)})
        ckpt.wait()
        # the pending area turned into a file: the next save cannot write (root ignores modes)
        shutil.rmtree(tmp_path / "l" / ".pending")
        (tmp_path / "l" / ".pending").write_text("not a directory")
        ckpt.save(2, {"w": torch.ones(3)})
        with pytest.raises(CommitError):
            ckpt.wait()
    failed = [e for e in read(log) if e["event"] == "save_failed"]
    assert failed and failed[0]["step"] == 2 and failed[0]["error"]


def test_every_rank_appends_whole_lines_to_one_file(tmp_path):
    log = str(tmp_path / "run.jsonl")
    run_ranks("train", 2, {"root": str(tmp_path / "r"), "every": 2, "total": 12, "dropout": 0.0},
              env={"RESILIENT_EVENT_LOG": log})
    events = read(log)  # every line parses: no interleaving
    assert {e["rank"] for e in events} == {0, 1}
    committed = {(e["rank"], e["step"]) for e in events if e["event"] == "save_committed"}
    assert committed == {(r, s) for r in (0, 1) for s in range(2, 13, 2)}
    for e in (e for e in events if e["event"] == "save_committed"):
        phases = e["phases"]  # where each save's time to committed went, in the order it passes
        assert 0 < phases["copied"] <= phases["written"] <= e["seconds"], e
        if e["rank"] == 0:  # the one storage location's leader assembles the manifest
            assert phases["written"] <= phases["reports"] <= phases["manifest"] <= e["seconds"], e
        else:
            assert "reports" not in phases and "manifest" not in phases, e
    for rank in (0, 1):  # a report carries again only what changed since the last committed save: here the
        # file's record and the tree (the scheduler's and the loop's values), not the tensors' metadata
        # nor where each rank's parts of the replicated tensors are (a third less for this small state)
        sent = [e["report_bytes"] for e in events if e["event"] == "save_committed" and e["rank"] == rank]
        assert len(sent) == 6 and all(0 < later < 0.8 * sent[0] for later in sent[1:]), sent
