"""resilient-run with the etcd-v3 rendezvous: two or three agents on one machine stand for
nodes; a real etcd; real SIGKILL / SIGSTOP. Each test reads the workers' event file to
see who trained, when, and at which world size."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from .nodes import alive, assert_recovered_within, etcd_v3_flags

pytestmark = pytest.mark.timeout(150)
# steps of a run that only has to outlast one fault and its restart (the default, 200, leaves
# a late joiner or a spare time to come in)
SHORT_RUN = 120


def first_steps(cluster, after: float) -> list[dict]:
    return [e for e in cluster.events() if e["event"] == "start" and e["t"] > after]


def test_lone_node_starts_at_once_and_finishes(cluster):
    cluster.steps = 20
    t0 = time.time()
    node = cluster.start("a", script_args=["--log", "kept-for-the-script"])
    assert node.wait(90) == 0, node.log()
    start = cluster.wait_for(lambda e: e["event"] == "start", 1, "the start")
    assert start["world"] == 1
    assert start["t"] - t0 < 15, "a lone agent with --nnodes=1:2 must not wait for a last call"
    assert start["log"] == "kept-for-the-script"  # options after the script belong to the script
    assert cluster.wait_for(lambda e: e["event"] == "done", 1, "done")


def test_killed_node_survivor_resumes_from_checkpoint(cluster):
    cluster.steps = SHORT_RUN  # enough to outlast the fault and a restart; not a late join
    nodes = {"a": cluster.start("a"), "b": cluster.start("b")}
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30 and e["world"] == 2, 60, "training at world 2")
    # the victim is the rank-0 node: it hosts the round's store (fatal with torchrun's c10d)
    host = next(e["node"] for e in cluster.events() if e["event"] == "start" and e["rank"] == 0)
    survivor = "b" if host == "a" else "a"
    a, b = nodes[survivor], nodes[host]
    orphans = cluster.workers_of(host)
    killed_at = time.time()
    b.kill()  # the agent only: its workers live in sessions of their own
    resumed = cluster.wait_for(lambda e: e["event"] == "start" and e["t"] > killed_at, 30, "a resumed start")
    assert resumed["world"] == 1 and resumed["node"] == survivor
    assert resumed["restored"] >= 25, "the survivor must resume from the last consistent step, not from 0"
    assert_recovered_within(resumed["t"] - killed_at, 4)
    time.sleep(0.5)
    assert not [p for p in orphans if alive(p)], "the dead agent's workers must not outlive it"
    assert a.wait(90) == 0, a.log()


def test_repeated_worker_restarts_do_not_hang(cluster):
    """torchrun's shared store made 6 of 10 restarts hang here (stale peer addresses)."""
    cluster.max_restarts = 5
    # each resumed gang must still be training at the next kill (the test kills the nodes at
    # its end, so the run's tail costs nothing); a gang cut to 30 steps could finish first
    cluster.steps_after_resume = 0
    a, b = cluster.start("a"), cluster.start("b")
    cluster.wait_for(lambda e: e["event"] == "step" and e["world"] == 2 and e["step"] >= 10, 60, "world 2")
    for _ in range(3):
        before = {e["pid"] for e in cluster.events()}
        victim = [e["pid"] for e in cluster.events() if e["event"] == "start" and e["node"] == "b"][-1]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        resumed = cluster.wait_for(lambda e: e["event"] == "step" and e["world"] == 2 and e["pid"] not in before,
                                   30, "a resumed step")
        assert_recovered_within(resumed["t"] - killed_at, 4)
    a.kill()
    b.kill()


def test_hung_rank_is_a_failed_rank(cluster):
    """A worker stuck in a step (no crash, no lost node) must not stall the gang for gloo's
    30 minutes: its watchdog and its peers' see no progress and exit; the gang restarts."""
    cluster.steps = SHORT_RUN  # enough to outlast the fault and a restart; not a late join
    env = {"RESILIENT_HANG_TIMEOUT": "3", "RESILIENT_FAULT": "hang:rank=1,step=40"}
    a, b = cluster.start("a", env=env), cluster.start("b", env=env)
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30 and e["world"] == 2, 60, "world 2")
    hung = cluster.wait_for(lambda e: e["event"] == "step" and e["step"] == 39, 30, "the last step before the hang")
    resumed = cluster.wait_for(lambda e: e["event"] == "start" and e["t"] > hung["t"], 40, "a restart after the hang")
    assert resumed["world"] == 2 and resumed["restored"] >= 30
    assert_recovered_within(resumed["t"] - hung["t"], 3 + 4)  # the hang timeout, then a restart
    assert a.wait(90) == 0 and b.wait(30) == 0


def test_frozen_node_is_detected_by_lease_expiry(cluster):
    cluster.steps = SHORT_RUN  # enough to outlast the fault and a restart; not a late join
    a, b = cluster.start("a"), cluster.start("b")
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30 and e["world"] == 2, 60, "training at world 2")
    frozen_at = time.time()
    b.signal_all(signal.SIGSTOP, cluster.workers_of("b"))  # no TCP reset: peers just block
    resumed = cluster.wait_for(lambda e: e["event"] == "start" and e["t"] > frozen_at, 30, "a resumed start")
    assert resumed["world"] == 1 and resumed["node"] == "a" and resumed["restored"] >= 25
    assert_recovered_within(resumed["t"] - frozen_at, 4)
    cluster.wait_for(lambda e: e["event"] == "step" and e["t"] > resumed["t"] and e["step"] >= resumed["restored"] + 10,
                     30, "steps after the resume")
    b.kill()
    assert a.wait(90) == 0, a.log()


def test_spare_takes_the_lost_nodes_place(cluster):
    a, b = cluster.start("a"), cluster.start("b")
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 20 and e["world"] == 2, 60, "training at world 2")
    ranks = {e["node"]: e["rank"] for e in cluster.events() if e["event"] == "start"}
    spare = cluster.start("c")
    time.sleep(4)  # the spare registers and waits; the gang must not re-form for it
    assert not [e for e in cluster.events() if e["event"] == "start" and e["node"] == "c"]
    assert len([e for e in cluster.events() if e["event"] == "start"]) == 2
    killed_at = time.time()
    b.kill()
    joined = cluster.wait_for(lambda e: e["event"] == "start" and e["node"] == "c", 30, "the spare's start")
    assert joined["world"] == 2, "a spare keeps the world size"
    assert joined["rank"] == ranks["b"], "the spare takes the lost node's ranks"
    survivor = cluster.wait_for(lambda e: e["event"] == "start" and e["node"] == "a" and e["t"] > killed_at, 5, "a")
    assert survivor["rank"] == ranks["a"], "a survivor keeps its ranks (its local files)"
    assert a.wait(90) == 0 and spare.wait(30) == 0


def test_late_node_is_taken_in_at_the_next_round(cluster):
    a = cluster.start("a")
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 20, 60, "a training alone")
    joined_at = time.time()
    b = cluster.start("b")
    start = cluster.wait_for(lambda e: e["event"] == "start" and e["node"] == "b", 40, "the late node's start")
    assert start["world"] == 2 and start["restored"] >= 15
    assert a.wait(90) == 0 and b.wait(30) == 0
    assert start["t"] - joined_at < 15


def train_through(cluster, disturb) -> None:
    """Two nodes train at world 2, ``disturb()`` hits etcd, the run finishes without any
    worker having been restarted."""
    a, b = cluster.start("a"), cluster.start("b")
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 20 and e["world"] == 2, 60, "world 2")
    disturb()
    assert a.wait(100) == 0 and b.wait(30) == 0, a.log()
    starts = [e for e in cluster.events() if e["event"] == "start"]
    assert len(starts) == 2, f"workers were restarted: {starts}"


def test_etcd_restart_does_not_stop_training(tmp_path):
    from .nodes import Cluster
    from resilient.devservices import EtcdServer

    server = EtcdServer(str(tmp_path / "etcd")).start()
    cluster = Cluster(str(tmp_path), server.endpoint, run_id="etcd-restart", steps=180)
    try:
        train_through(cluster, lambda: server.restart(down_for=1.0))
    finally:
        cluster.close()
        server.close()


def test_losing_the_etcd_leader_of_a_three_member_cluster_does_not_stop_training(tmp_path):
    import json as _json
    import urllib.request

    from resilient.devservices import EtcdCluster

    from .nodes import Cluster

    etcd = EtcdCluster(3, str(tmp_path / "etcd")).start()

    def is_leader(member) -> bool:
        request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}")
        with urllib.request.urlopen(request, timeout=2) as reply:
            status = _json.loads(reply.read())
        return status["leader"] == status["header"]["member_id"]

    cluster = Cluster(str(tmp_path), etcd.endpoints, run_id="member-down", steps=180,
                      rdzv=etcd_v3_flags(etcd.endpoints, "member-down", "lease_ttl=5,last_call_timeout=5"))
    try:
        # a new leader is elected among the other two members; clients move on
        train_through(cluster, lambda: next(m for m in etcd.members if is_leader(m)).stop())
    finally:
        cluster.close()
        etcd.close()


def test_plain_torchrun_finds_the_backend(cluster):
    cluster.launcher = [sys.executable, "-m", "torch.distributed.run"]
    cluster.steps = 10
    node = cluster.start("a")
    assert node.wait(90) == 0, node.log()
    assert cluster.wait_for(lambda e: e["event"] == "done", 1, "done")["world"] == 1


def test_partitioned_node_is_fenced(cluster):
    from resilient.launch._etcd import Etcd

    from .faults import TcpProxy

    host, port = cluster.endpoint.rsplit(":", 1)
    link = TcpProxy(host, int(port))  # node b reaches etcd only through this link
    agent_log = os.path.join(cluster.tmp, "agent-a.jsonl")
    a = cluster.start("a", extra=[f"--event-log={agent_log}"])
    b = cluster.start("b", rdzv=etcd_v3_flags(link.endpoint, cluster.run_id, "lease_ttl=3,last_call_timeout=5,join_timeout=8"))
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30 and e["world"] == 2, 60, "training at world 2")
    b_workers = cluster.workers_of("b")
    cut_at = time.time()
    link.cut()  # b still reaches its peers, but not etcd
    cut_done = time.time()  # a commit b stamped before this may have passed the link as it closed
    resumed = cluster.wait_for(lambda e: e["event"] == "start" and e["t"] > cut_at, 60, "a resumed start")
    assert resumed["node"] == "a" and resumed["world"] == 1
    # how soon a re-formed without b is set by b's lease (3 s), not by this machine's speed
    # (the restarted workers' start-up, which follows, is): bound that, not the resumed start
    with open(agent_log) as f:
        rounds = [e for e in map(json.loads, f) if e["event"] == "round_formed" and e["t"] > cut_at]
    assert rounds and rounds[0]["nodes"] == 1 and rounds[0]["t"] - cut_at < 10, rounds
    assert b.wait(60) != 0, "a node that cannot reach etcd must give up, not train on alone"
    assert "fenced" in b.log()
    assert not [p for p in b_workers if alive(p)], "the fenced node's workers must be stopped"
    assert a.wait(90) == 0, a.log()
    commits, _ = Etcd(cluster.endpoint).get_prefix(f"/resilient/{cluster.run_id}/commits/")
    late = [kv.json() for kv in commits.values()
            if f"-{b.proc.pid}-" in kv.json()["node"] and kv.json()["at"] > cut_done]
    assert not late, f"the fenced node committed after the cut: {late}"
