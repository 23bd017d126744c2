"""The regroup store's node is lost: the gang moves to the standby store and re-forms there.

Real stores: the first one is served by a separate process, which is SIGKILLed (as its node
would be); the standby by this one. Agents are the real ``InProcessRecovery`` (heartbeats,
dead marks); ranks the real ``Regroup``, threads of this process. What etcd's lease expiry
tells the agents is the one call made here by hand (``fail_nodes``, as the launcher's
``on_lost`` does): tests/test_inprocess.py runs the same with real agents and etcd.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from resilient._regroup import Regroup, RegroupError
from resilient._sealed import new_secret
from resilient.launch._inprocess import InProcessRecovery

pytestmark = pytest.mark.timeout(120)

NODES, PER_NODE = 3, 2
HOST = "import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, " \
       "wait_for_workers=False); print(s.port, flush=True); time.sleep(600)"


def two_stores():
    """The first store in a process of its own (to be killed or frozen as its node would be),
    the standby in this one; their addresses, and a secret for both."""
    primary_host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    standby_server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
    primary = f"127.0.0.1:{int(primary_host.stdout.readline())}/first"
    return primary_host, standby_server, primary, f"127.0.0.1:{standby_server.port}/standby", new_secret()


def test_lost_store_node_moves_the_gang_to_the_standby_once_the_agents_confirm_it():
    primary_host, standby_server, primary, standby, secret = two_stores()
    agents = {n: InProcessRecovery(primary, [], f"node{n}", secret=secret, standby=standby, store_node="node0")
              for n in range(NODES)}
    keys = [(n, r) for n in range(NODES) for r in range(PER_NODE)]
    ranks = {k: Regroup(primary, secret=secret, node=f"node{k[0]}", rank=k[0] * PER_NODE + k[1],
                        initial_world_size=len(keys), heartbeat=False, stale_s=1.0, timeout=60,
                        member_id=f"node{k[0]}-rank{k[1]}", standby=standby) for k in keys}
    gens: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []

    def run(key, action):
        try:
            gens[key] = action()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def in_threads(action, which):
        threads = [threading.Thread(target=run, args=(k, lambda k=k: action(k))) for k in which]
        for t in threads:
            t.start()
        return threads

    try:
        for t in in_threads(lambda k: ranks[k].form(None), keys):
            t.join(60)
        assert not errors, errors
        assert sorted(g.rank for g in gens.values()) == list(range(len(keys)))
        first = dict(gens)
        ranks[(0, 0)].record_manifest(10, "digest-of-step-10")
        deadline = time.monotonic() + 10  # the copies to the standby go from a thread of their own
        while not all(agents[1]._standby.client.check([k]) for k in ("members/0", "latest", "manifest/10")):
            assert time.monotonic() < deadline, "the standby never got the member list, latest and the digest"
            time.sleep(0.05)
        time.sleep(3 * 0.25)  # the agents learn that the workers are elastic

        # node 0 is lost: its store's process, its agent and its ranks
        primary_host.kill()
        primary_host.wait(10)
        agents.pop(0).close()
        for r in range(PER_NODE):
            ranks.pop((0, r)).close()
        survivors = [k for k in keys if k[0] != 0]
        gens.clear()
        # their collective broke: each reports the failure, finds the store gone, and waits
        # for the agents' confirmation before it moves (no gang of its own in the standby)
        waiting = in_threads(lambda k: ranks[k].report_failure(first[k], "peer lost") or ranks[k].form(first[k]),
                             survivors)
        time.sleep(2.0)
        assert not gens and not errors, (gens, errors)
        assert all(agent.active() for agent in agents.values()), "an agent gave up while the standby answers"

        for agent in agents.values():  # what etcd's lease expiry triggers (the launcher's on_lost)
            agent.fail_nodes(["node0"])
        for t in waiting:
            t.join(60)
        assert not errors, errors
        assert sorted(g.rank for g in gens.values()) == list(range(len(survivors)))
        assert {(g.number, g.world_size) for g in gens.values()} == {(1, len(survivors))}
        assert all(ranks[k].address == standby for k in survivors)
        assert all(agent.address == standby and agent.standby == "" and agent.active() for agent in agents.values())
        # a peer's copy of step 10 can still be checked: its digest was copied before the loss
        assert ranks[survivors[0]].manifest_digest(10) == "digest-of-step-10"
    finally:
        primary_host.kill()
        for r in ranks.values():
            r.close()
        for agent in agents.values():
            agent.close()


def test_a_frozen_store_node_wakes_the_running_ranks_through_the_standby():
    """The first store's process is SIGSTOPped (a frozen node: no connection resets, a rank's
    watcher sits in a wait on it). Once the agents confirm the loss, every running rank is
    told its generation failed within seconds, and the gang re-forms through the standby."""
    primary_host, standby_server, primary, standby, secret = two_stores()
    agents = [InProcessRecovery(primary, [], f"node{n}", secret=secret, standby=standby, store_node="node0")
              for n in (1, 2)]
    ranks = {n: Regroup(primary, secret=secret, node=f"node{n}", rank=n - 1, initial_world_size=2,
                        heartbeat=False, stale_s=1.0, timeout=60, member_id=f"node{n}-rank0", standby=standby)
             for n in (1, 2)}
    gens, told, errors = {}, {}, []

    def form(n, previous=None):
        try:
            gens[n] = ranks[n].form(previous)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        threads = [threading.Thread(target=form, args=(n,)) for n in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(gens) == 2, errors
        first = dict(gens)
        for n, group in ranks.items():
            group.watch(first[n], lambda reason, n=n: told.setdefault(n, (time.monotonic(), reason)))
        time.sleep(1.0)  # the watchers sit in their waits on the first store
        primary_host.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        confirmed = time.monotonic()
        for agent in agents:
            agent.fail_nodes(["node0"])
        deadline = time.monotonic() + 10
        while len(told) < 2:
            assert time.monotonic() < deadline, f"running ranks not told of the lost store node: {told}"
            time.sleep(0.05)
        assert all(at - confirmed < 5 for at, _ in told.values()), told
        gens.clear()
        threads = [threading.Thread(target=lambda n=n: (ranks[n].report_failure(first[n], told[n][1]),
                                                        form(n, first[n]))) for n in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert {(g.number, g.world_size) for g in gens.values()} == {(1, 2)}
        assert all(r.address == standby for r in ranks.values())
    finally:
        primary_host.kill()
        for r in ranks.values():
            r.close()
        for agent in agents:
            agent.close()


def test_without_a_standby_a_lost_store_ends_the_in_process_path():
    """One node, so no standby: the worker says so (the launcher then restarts it)."""
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{int(host.stdout.readline())}/alone"
    secret = new_secret()
    group = Regroup(address, secret=secret, node="node0", rank=0, initial_world_size=1, heartbeat=False,
                    member_id="node0-rank0", timeout=30)
    try:
        gen = group.form(None)
        host.kill()
        host.wait(10)
        with pytest.raises(RegroupError, match="no standby"):
            group.report_failure(gen, "peer lost")
    finally:
        host.kill()
        group.close()


def test_a_round_whose_standby_never_appears_goes_on_without_one(caplog):
    """Rank 1's agent died as the round began and never published its standby store: rank 0's
    agent waits the bounded time, says so once, and hosts a store the workers can regroup in
    (the loss of that store's node then means a process restart, as the test above shows)."""
    round_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    started = time.monotonic()
    with caplog.at_level("WARNING"):
        recovery = InProcessRecovery.for_round(round_store, 0, "node0", secret=new_secret(), group_world_size=2,
                                               standby_wait_s=0.5)
    group = None
    try:
        assert 0.5 <= time.monotonic() - started < 10
        assert recovery.standby == ""
        assert "no standby regroup store was published within 0.5 s" in caplog.text
        group = Regroup(recovery.address, secret=recovery.secret, node="node0", rank=0, initial_world_size=1,
                        heartbeat=False, member_id="node0-rank0", timeout=30)
        gen = group.form(None)
        assert (gen.number, gen.rank, gen.world_size) == (0, 0, 1)
    finally:
        if group is not None:
            group.close()
        recovery.close(wait=True)
