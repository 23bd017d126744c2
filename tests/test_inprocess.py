"""``@resilient.elastic``: in-process recovery under ``resilient-run``, and alone.

Real agents (simulated nodes), real etcd, real SIGKILLs. The training script
(``tests/inprocess_train.py``) trains every rank on the same batch per step, so its weights
do not depend on the world size; each run's final weight digest is compared with the digest
of one uninterrupted single-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .launch import REPO
from .nodes import TRAIN_IN_PROCESS, c10d_flags
from resilient.devservices import free_port

pytestmark = pytest.mark.timeout(240)

STEPS = 100


def run_alone(root: str, events: str, env: dict[str, str] | None = None, steps: int = STEPS,
              extra: tuple[str, ...] = ("--step-time", "0.01")) -> None:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("WORLD_SIZE", "RANK", "RESILIENT_REGROUP_STORE", "RESILIENT_REGROUP_SECRET"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, TRAIN_IN_PROCESS, "--root", root, "--events", events,
                           "--steps", str(steps), *extra],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    """Weight digest after every step of an uninterrupted single-process run."""
    tmp = tmp_path_factory.mktemp("reference")
    run_alone(str(tmp / "ckpt"), str(tmp / "events.jsonl"))
    return {e["step"]: e["digest"] for e in read(str(tmp / "events.jsonl")) if e["event"] == "step"}


def in_process_cluster(cluster, *, nodes: int = 2, use_remote: bool = False):
    cluster.script = TRAIN_IN_PROCESS
    cluster.steps, cluster.every, cluster.step_time = STEPS, 5, 0.05
    cluster.steps_after_resume = 0  # its workers recover in their processes: no resumed start to cut short
    cluster.use_remote = use_remote
    cluster.nnodes = f"1:{nodes}"
    return cluster


def resilient_events(path: str) -> list[dict]:
    return read(path) if os.path.exists(path) else []


def check_against_reference(events: list[dict], reference: dict[int, str]) -> None:
    """Every step any incarnation reported, and every restore, has the reference weights."""
    for e in events:
        if e["event"] == "step":
            assert e["digest"] == reference[e["step"]], f"step {e['step']} on rank {e['rank']} differs"
        if e["event"] == "start" and e["restored"]:
            assert e["digest"] == reference[e["restored"]], f"restored step {e['restored']} differs"
    done = [e for e in events if e["event"] == "done"]
    assert done and all(e["digest"] == reference[STEPS] for e in done)


def start_nodes(cluster, env: dict[str, str], rdzv: list[str] | None = None, names=("a", "b")) -> list:
    log = os.path.join(cluster.tmp, "resilient-events.jsonl")
    env = {"RESILIENT_EVENT_LOG": log, "RESILIENT_FAULT_DIR": os.path.join(cluster.tmp, "faults"), **env}
    return [cluster.start(n, env=env, rdzv=rdzv) for n in names]


def test_killed_worker_recovers_in_process_from_peer_memory(cluster, reference):
    """Rank 1's only worker is SIGKILLed at step 12: rank 0's process carries on at world 1
    without restarting, restoring step 10 with rank 1's file from its own memory (no remote
    tier); node b's agent then starts a new worker that joins the running gang."""
    in_process_cluster(cluster)
    nodes = start_nodes(cluster, {"RESILIENT_FAULT": "kill:rank=1,step=12"})
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    events = cluster.events()
    check_against_reference(events, reference)
    starts = [e for e in events if e["event"] == "start"]
    first_pid = {e["rank"]: e["pid"] for e in starts if e["restored"] == 0}
    survivor = [e for e in starts if e["pid"] == first_pid[0] and e["restored"] == 10]
    assert survivor, f"rank 0's process did not recover in-process: {starts}"
    assert any(e["world"] == 1 for e in survivor), starts
    log = resilient_events(os.path.join(cluster.tmp, "resilient-events.jsonl"))
    restored = [e for e in log if e["event"] == "restored" and e["pid"] == first_pid[0] and e["step"] == 10]
    assert restored and restored[0]["source"] == "memory", restored
    # the replacement on node b joined the running gang: world 2 again, a new pid
    assert any(e["world"] == 2 and e["pid"] not in first_pid.values() for e in starts), starts
    # the timeline tells the in-process recovery apart: detected, re-formed, restored
    from resilient import _timeline

    recoveries = _timeline.summary(_timeline.build(log))["recoveries"]
    first = recoveries[0]
    assert first["restored"] == 10 and first["source"] == "memory", recoveries
    assert first["detected_at"] and first["round_formed_at"] and first["nodes_after"] == 1, first


def test_peer_killed_while_a_save_commits_costs_the_survivor_no_commit_timeout(cluster, reference):
    """Rank 1 dies in its background writer at step 30 (its file written, its report never
    sent), so rank 0's commit of step 30 waits for it, here up to 60 s. That wait must not
    hold rank 0's re-forming: it did while both shared one store connection (20.1 s with a
    20 s timeout, where a kill between saves costs 0.1 s)."""
    in_process_cluster(cluster)
    nodes = start_nodes(cluster, {"RESILIENT_FAULT": "kill:rank=1,step=30,phase=write",
                                  "RESILIENT_COMMIT_TIMEOUT": "60"})
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    events = cluster.events()
    check_against_reference(events, reference)
    log = resilient_events(os.path.join(cluster.tmp, "resilient-events.jsonl"))
    fault = next(e for e in log if e["event"] == "fault" and e.get("kind") == "kill")
    survivor = next(e["pid"] for e in events if e["event"] == "start" and e["rank"] == 0 and e["restored"] == 0)
    regrouped = [e for e in log if e["event"] == "regrouped" and e["pid"] == survivor and e["t"] > fault["t"]]
    assert regrouped and regrouped[0]["t"] - fault["t"] < 15, (fault, regrouped)
    resumed = [e for e in events if e["event"] == "start" and e["pid"] == survivor and e["restored"] > 0]
    assert resumed and resumed[0]["restored"] == 25, "step 30 was never committed: 25 is the last consistent one"


def same_processes(events: list[dict]) -> set[int]:
    return {e["pid"] for e in events if e["event"] in ("start", "step", "done")}


def test_raise_recovers_in_process_at_the_same_world_size_under_c10d(cluster, reference):
    """An exception on rank 1 at step 12 (c10d rendezvous this time): both processes
    re-form at world 2 and restore step 10; no process is restarted."""
    in_process_cluster(cluster)
    rdzv = c10d_flags(f"127.0.0.1:{free_port()}", cluster.run_id)
    a = cluster.start("a", env={"RESILIENT_FAULT": "raise:rank=1,step=12",
                                "RESILIENT_FAULT_DIR": os.path.join(cluster.tmp, "faults")},
                      rdzv=rdzv + ["--rdzv-conf=is_host=1"])
    b = cluster.start("b", env={"RESILIENT_FAULT": "raise:rank=1,step=12",
                                "RESILIENT_FAULT_DIR": os.path.join(cluster.tmp, "faults")},
                      rdzv=rdzv + ["--rdzv-conf=is_host=0"])
    for node in (a, b):
        assert node.wait(180) == 0, node.log()[-3000:]
    events = cluster.events()
    check_against_reference(events, reference)
    assert len(same_processes(events)) == 2, "a process was restarted"
    restarts = [e for e in events if e["event"] == "start" and e["restored"] == 10]
    assert sorted(e["world"] for e in restarts) == [2, 2], restarts
    # without etcd or a job secret, the secret went through the rendezvous store: said once
    for node in (a, b):
        assert node.log().count("no authenticated way to share its secret") == 1, node.log()[-3000:]


def test_hung_rank_is_interrupted_and_recovers_in_process(cluster, reference):
    """Rank 1 stops making progress at step 12 (RESILIENT_HANG_TIMEOUT=2): its step is
    interrupted, its peer's collective is cut, and both re-form at world 2 in-process."""
    in_process_cluster(cluster)
    nodes = start_nodes(cluster, {"RESILIENT_FAULT": "hang:rank=1,step=12", "RESILIENT_HANG_TIMEOUT": "2"})
    for node in nodes:
        assert node.wait(180) == 0, node.log()[-3000:]
    events = cluster.events()
    check_against_reference(events, reference)
    assert len(same_processes(events)) == 2, "a process was restarted"
    log = resilient_events(os.path.join(cluster.tmp, "resilient-events.jsonl"))
    assert any(e["event"] == "hang_detected" for e in log)
    details = [e["detail"] for e in log if e["event"] == "failure_detected"]
    assert any(d.startswith("HangError") for d in details), details


def test_lost_store_host_fails_over_to_the_standby_in_process(cluster, reference):
    """Node a (rank 0: its agent hosts the regroup store) is SIGKILLed: node b's worker
    waits until its agent, told by etcd, confirms the loss, then re-forms at world 1 through
    the standby store that b's agent hosts: the same process carries on, nothing is
    restarted, and the run ends with the reference weights."""
    in_process_cluster(cluster, use_remote=True)
    a, b = start_nodes(cluster, {})
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 12, 120, "step 12")
    starts = [e for e in cluster.events() if e["event"] == "start"]
    first = {e["node"]: e["pid"] for e in starts}
    host = next(e["node"] for e in starts if e["rank"] == 0)  # its agent hosts the regroup store
    survivor = b if host == "a" else a
    (a if host == "a" else b).kill()
    assert survivor.wait(180) == 0, survivor.log()[-3000:]
    events = cluster.events()
    check_against_reference(events, reference)
    late = [e for e in events if e["event"] == "start" and e["node"] == survivor.name and e["restored"] > 0]
    assert late and late[-1]["pid"] == first[survivor.name] and late[-1]["world"] == 1, late
    assert "re-forming through the standby regroup store" in survivor.log(), survivor.log()[-3000:]


def test_single_process_without_a_launcher_reruns_the_function(tmp_path, reference):
    """No launcher: an exception re-runs the function in the same process, from step 10."""
    events = str(tmp_path / "events.jsonl")
    run_alone(str(tmp_path / "ckpt"), events, env={"RESILIENT_FAULT": "raise:rank=0,step=12"})
    got = read(events)
    check_against_reference(got, reference)
    assert len(same_processes(got)) == 1
    assert [e["restored"] for e in got if e["event"] == "start"] == [0, 10]


def test_alone_a_failure_right_after_a_save_reruns_from_that_save(tmp_path):
    """The fault raises as step 11 ends, when step 10's save (64 MB, no step time) is still
    being written: alone, that save needs no peer, so it is finished before the re-run,
    which restores step 10 and not step 5. Retention keeps the three newest and step 10,
    the one restored from."""
    events, root = str(tmp_path / "events.jsonl"), tmp_path / "ckpt"
    run_alone(str(root), events, env={"RESILIENT_FAULT": "raise:rank=0,step=11"}, steps=25,
              extra=("--step-time", "0", "--width", "4096"))
    got = read(events)
    assert [e["restored"] for e in got if e["event"] == "start"] == [0, 10]
    steps = {e["step"]: e["digest"] for e in got if e["event"] == "step"}
    assert [e["digest"] for e in got if e["event"] == "start"][1] == steps[10]
    assert sorted(int(d.name.split("-")[-1]) for d in root.glob("step-*")) == [10, 15, 20, 25]


def test_without_an_agent_a_dead_member_is_found_by_its_silent_heartbeat(tmp_path):
    """Three processes and a regroup store, no agent to report deaths: rank 2 is SIGKILLed
    at step 12 and the two others re-form at world 2 once its heartbeat stops."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    events = str(tmp_path / "events.jsonl")
    procs = []
    for rank in range(3):
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "3",
               "GROUP_RANK": str(rank), "RESILIENT_REGROUP_STORE": f"127.0.0.1:{store.port}/test",
               "RESILIENT_REGROUP_SECRET": "a secret these three share",
               "RESILIENT_FAULT": "kill:rank=2,step=12", "RESILIENT_FAULT_DIR": str(tmp_path / "faults")}
        procs.append(subprocess.Popen([sys.executable, TRAIN_IN_PROCESS, "--root", str(tmp_path / f"node{rank}"),
                                       "--events", events, "--steps", str(STEPS), "--step-time", "0.01"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0, -9], [p.stdout.read()[-2000:] for p in procs]
    got = read(events)
    # (at world 3, DDP's average of three equal gradients is not bit-equal to one of them:
    # compare with this run's own steps instead of the single-process reference)
    before = {e["step"]: e["digest"] for e in got if e["event"] == "step" and e["world"] == 3}
    after = [e for e in got if e["event"] == "start" and e["restored"] > 0]
    assert after and all(e["digest"] == before[e["restored"]] for e in after)
    assert len({e["digest"] for e in got if e["event"] == "done"}) == 1
    assert len(after) == 2 and {e["world"] for e in after} == {2}, after
    assert {e["pid"] for e in after} <= {p.pid for p in procs[:2]}
