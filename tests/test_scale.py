"""Coordination at scale, simulated: many rendezvous agents and regrouping ranks in this
process (threads), against a real etcd and a real TCPStore. What a large job relies on:
one round for everyone, a loss seen through the lease and re-formed without the lost node,
a spare taking the lost node's ranks, a late joiner taken in, a cut-off node fenced, and a
constant number of etcd requests / store operations per agent (or rank) per round."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from resilient._regroup import Regroup
from resilient.launch._etcd import Etcd
from resilient._sealed import new_secret
from resilient.launch._inprocess import InProcessRecovery
from resilient.launch.gang import FencedError, Gang
from resilient.launch.rendezvous import EtcdV3RendezvousHandler

pytestmark = pytest.mark.timeout(240)

AGENTS = 64
TTL = 2


class Agent:
    """The loop torch's elastic agent runs around its handler: rendezvous, then poll
    ``num_nodes_waiting()`` every monitor interval and re-join when it says so."""

    def __init__(self, endpoint: str, run_id: str, min_nodes: int, max_nodes: int) -> None:
        self.handler = EtcdV3RendezvousHandler(Etcd(endpoint), run_id, min_nodes, max_nodes,
                                               local_addr="127.0.0.1", lease_ttl=TTL, join_timeout=120)
        self.handler.close_on_shutdown = False
        self.rounds: list[tuple[int, int, int]] = []  # (round, rank, world)
        self.errors: list[BaseException] = []
        self.frozen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._join()
            while not self._stop.wait(0.1):
                if not self.frozen and self.handler.num_nodes_waiting() > 0:
                    self._join()
        except BaseException as exc:  # noqa: BLE001 - the test asserts there were none
            if not (self.frozen or self._stop.is_set()):
                self.errors.append(exc)

    def _join(self) -> None:
        info = self.handler.next_rendezvous()
        self.rounds.append((self.handler._running.number, info.rank, info.world_size))

    @property
    def seat(self) -> tuple[int, int, int] | None:
        return self.rounds[-1] if self.rounds else None

    def freeze(self) -> None:
        """Stop answering, as a frozen or partitioned node does: no lease refresh, no watch."""
        self.frozen = True
        self.handler._keeper.close(revoke=False)
        self.handler._state.close()

    def stop(self) -> None:
        self._stop.set()
        if not self.frozen:
            self.handler.shutdown()


def wait_gang(agents: list[Agent], world: int, timeout: float) -> int:
    """Every agent ranked in one round of ``world``; that round's number."""
    deadline = time.monotonic() + timeout
    while True:
        errors = [e for a in agents for e in a.errors]
        assert not errors, errors[:3]
        seats = [a.seat for a in agents]
        rounds = {s[0] for s in seats if s is not None}
        if None not in seats and len(rounds) == 1 and all(s[2] == world for s in seats):
            return rounds.pop()
        assert time.monotonic() < deadline, f"no round of {world}: {sorted(set(seats), key=str)[:8]}"
        time.sleep(0.1)


def requests_per_agent(agents: list[Agent], before: list[int]) -> float:
    now = [sum(v for k, v in a.handler.etcd.stats.items() if k.endswith("requests") and "keepalive" not in k)
           for a in agents]
    return sum(n - b for n, b in zip(now, before)) / len(agents)


def request_counts(agents: list[Agent]) -> list[int]:
    return [sum(v for k, v in a.handler.etcd.stats.items() if k.endswith("requests") and "keepalive" not in k)
            for a in agents]


def test_64_agents_form_lose_replace_grow_and_fence(etcd_server):
    run_id = f"scale-{time.time_ns()}"
    agents = [Agent(etcd_server.endpoint, run_id, AGENTS - 2, AGENTS) for _ in range(AGENTS)]
    extra: list[Agent] = []
    try:
        first = wait_gang(agents, AGENTS, 90)
        assert sorted(a.seat[1] for a in agents) == list(range(AGENTS))
        per_agent = requests_per_agent(agents, [0] * AGENTS)
        assert per_agent <= 12, f"{per_agent:.1f} etcd requests per agent to form one round"
        ranks = {a.handler.node: a.seat[1] for a in agents}

        # a spare: the gang is full and nobody is lost, so it waits and the gang runs on
        spare = Agent(etcd_server.endpoint, run_id, AGENTS - 2, AGENTS)
        extra.append(spare)
        time.sleep(2 * TTL)
        assert spare.seat is None and {a.seat[0] for a in agents} == {first}
        assert all(a.handler.num_nodes_waiting() == 0 for a in agents)

        # one agent freezes: its lease expires, the spare takes its ranks, the others keep theirs
        lost = agents[7]
        lost_info = dict(lost.handler.gang_info)
        before = request_counts(agents)
        t0 = time.monotonic()
        lost.freeze()
        gang = [a for a in agents if a is not lost] + [spare]
        second = wait_gang(gang, AGENTS, TTL + 60)
        reform_s = time.monotonic() - t0
        assert second > first
        assert spare.seat[1] == ranks[lost.handler.node], "the spare did not take the lost node's ranks"
        assert all(a.seat[1] == ranks[a.handler.node] for a in gang if a is not spare)
        survivors = [a for a in agents if a is not lost]
        per_agent = requests_per_agent(survivors, [b for a, b in zip(agents, before) if a is not lost])
        assert per_agent <= 6, f"{per_agent:.1f} etcd requests per survivor to re-form"
        print(f"64 agents: re-formed in {reform_s:.1f} s after a freeze (lease TTL {TTL} s)")

        # the frozen node is fenced: its workers can no longer commit a checkpoint
        with pytest.raises(FencedError):
            Gang.from_info(lost_info).authorize_commit(100)
        Gang.from_info(survivors[0].handler.gang_info).authorize_commit(100)

        # another loss with no spare left: the gang shrinks (MIN allows it) ...
        second_lost = gang[3]
        second_lost.freeze()
        gang = [a for a in gang if a is not second_lost]
        wait_gang(gang, AGENTS - 1, TTL + 60)
        shrunk = {a.handler.node: a.seat[1] for a in gang}
        assert sorted(shrunk.values()) == list(range(AGENTS - 1))
        # ... and a late joiner brings it back to MAX in the next round, in the free rank
        late = Agent(etcd_server.endpoint, run_id, AGENTS - 2, AGENTS)
        extra.append(late)
        wait_gang(gang + [late], AGENTS, 60)
        assert all(a.seat[1] == shrunk[a.handler.node] for a in gang)
        assert late.seat[1] == AGENTS - 1
    finally:
        for a in agents + extra:
            a.stop()


def test_regroup_of_16_nodes_x_8_ranks_loses_a_node_with_constant_store_operations():
    nodes, per = 16, 8
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    address = f"127.0.0.1:{server.port}/scale"
    secret = new_secret()
    agents = {n: InProcessRecovery(address, [], f"node{n}", secret=secret) for n in range(nodes)}  # heartbeats
    ranks: dict[tuple[int, int], Regroup] = {}
    gens: dict[tuple[int, int], object] = {}
    failures: dict[tuple[int, int], str] = {}
    errors: list[BaseException] = []

    def form(key):
        try:
            if key not in ranks:
                ranks[key] = Regroup(address, secret=secret, node=f"node{key[0]}", rank=key[0] * per + key[1],
                                     initial_world_size=nodes * per, heartbeat=False, stale_s=1.0,
                                     member_id=f"node{key[0]}-rank{key[1]}", timeout=60)
            gens[key] = gen = ranks[key].form(gens.get(key))
            ranks[key].watch(gen, lambda reason: (failures.__setitem__(key, reason),
                                                  threading.Thread(target=form, args=(key,), daemon=True).start()))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def settle(keys, world, timeout):
        deadline = time.monotonic() + timeout
        while not (all(k in gens and gens[k].world_size == world for k in keys)
                   and len({gens[k].number for k in keys}) == 1):
            assert not errors, errors[:3]
            assert time.monotonic() < deadline, f"no generation of {world}"
            time.sleep(0.05)

    try:
        threads = [threading.Thread(target=form, args=((n, r),)) for n in range(nodes) for r in range(per)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        everyone = list(ranks)
        settle(everyone, nodes * per, 30)
        assert sorted(gens[k].rank for k in everyone) == list(range(nodes * per))
        ops_before = {k: r.ops for k, r in ranks.items()}

        # node 5 is lost (its agent and its 8 ranks stop); a survivor's collective breaks
        agents.pop(5).close()
        for r in range(per):
            ranks[(5, r)].close()
        survivors = [k for k in everyone if k[0] != 5]
        t0 = time.monotonic()
        ranks[(0, 0)].report_failure(gens[(0, 0)], "a collective with node 5 failed")
        threading.Thread(target=form, args=((0, 0),), daemon=True).start()
        settle(survivors, (nodes - 1) * per, 30)
        regroup_s = time.monotonic() - t0
        assert gens[survivors[0]].number == 1
        assert sorted(gens[k].rank for k in survivors) == list(range((nodes - 1) * per))
        assert len(failures) == len(survivors) - 1  # every other survivor was told, none polled
        ops = sum(ranks[k].ops - ops_before[k] for k in survivors) / len(survivors)
        assert ops <= 40, f"{ops:.1f} store operations per rank for one regroup"
        # peer-copy partners are on another node
        members = ranks[survivors[0]].members(gens[survivors[0]])
        by_address = {m.id: m for m in members}
        assert all(gens[k].partner == "" for k in survivors)  # no peer-memory servers here
        assert len(by_address) == len(survivors)
        print(f"16 x 8 ranks: regrouped in {regroup_s:.2f} s, {ops:.1f} store operations per rank")
    finally:
        for r in ranks.values():
            r.close()
        for a in agents.values():
            a.close()
