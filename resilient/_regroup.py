"""Re-forming a gang of live worker processes without restarting them.

Worker processes of an elastic job (see ``_elastic``) agree on who is in the gang through a
key-value store that outlives any of them (``resilient-run``'s agent hosts it, and exports
its address as ``RESILIENT_REGROUP_STORE``). The gang passes through numbered
*generations*; generation ``g``'s member list is written once, by its *closer*, with a
compare-and-set, so every process reads the same list.

What each process does per generation is a constant number of store operations, whatever
the size of the gang: it counts itself in (``arrivals/<g>``; the first to arrive is the
closer), appends its record to ``joins/<g>``, then *waits on a key* (its seat,
``seat/<g>/<id>``, then ``go/<g>``: one blocking read each) instead of polling: seven to
nine operations per rank per regroup. Only the closer reads the member list and looks at
everyone: it reads the append-only logs (joins, deaths, finishes), and closes generation
``g+1`` once every member of ``g`` has joined it, finished, or is known dead. Dead is
learned three ways, fastest first: the member's agent appends it to ``dead`` (it saw the
process exit: within the agent's monitor interval); its *node's* heartbeat (``hb/<node>``,
one per node: the agent's, or the first local worker's without an agent) stopped moving
for ``stale_s`` (a whole node gone); it has
not joined ``join_grace_s`` after the first joiner (alive but stuck; it can join a later
generation). The closer looks at heartbeats only of the nodes it still waits for. If the
closer itself dies, a waiter that finds the closer's node silent (or the closer marked
dead) takes its place; only the first ``DEPUTIES`` to arrive look at it often, so that
thousands of waiters do not poll the store. The closer writes the member list, every seat in
one request, then ``seated/<g>``: a waiter without a seat then knows it was left out, without
reading the list (O(N) bytes each would be O(N^2) for the gang). Generation 0 closes when the
launcher's whole world has joined.

A generation's failure is one key, ``failed/<g>``, announced through ``notice/<g>``, which
carries the reason: every member's watcher thread blocks in one read of ``notice/<g>`` (one
operation, answered by the store when the key appears) rather than polling. A process that arrives after its
generation closed (a replacement started by the agent) registers for the next one and sets
``joining/<g>`` and the notice. The members
see it at their next checkpoint (``Checkpointer.save`` that is due; one tiny collective
there makes them agree), commit that step and re-form with the newcomer, which restores
it: growing loses no steps and costs the other steps nothing. If no checkpoint comes for
``NEWCOMER_PATIENCE_S``, the newcomer raises the *failed* flag instead.

The store lives in the rank-0 agent; a second, empty one (the *standby*, in another node's
agent) receives copies of what the gang needs to go on: each generation's member list, the
latest generation, the committed manifests' digests. When the first store's node is lost, its
workers' store calls fail; each waits in the standby until the agents, told by etcd's lease
expiry, set ``primary_lost`` there, then re-forms from the generation it ran, through the
standby: the in-process path survives the loss of either store's node.

Every value is sealed (``_sealed``): written and read with an HMAC under the job's secret
(``RESILIENT_REGROUP_SECRET``, handed to workers by their agent), in a namespace derived
from it, so that whoever else reaches the store can neither name nor forge a key.

Keys (all under the namespace): ``hb/<node>``, ``dead`` and ``dead/<id>`` (by agents),
``done`` (log) and ``done/<g>`` (count), ``arrivals/<g>``, ``joins/<g>``, ``closer/<g>``,
``members/<g>``, ``seat/<g>/<id>``, ``seated/<g>``, ``readylog/<g>``, ``ready/<g>``,
``go/<g>``, ``latest``, ``failed/<g>``, ``joining/<g>``, ``notice/<g>``, ``finished``,
``elastic``.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ._errors import ResilientError
from ._sealed import SealedStore, derive

__all__ = ["Member", "Generation", "Regroup", "RegroupError", "parse_address", "raise_failed", "ENV", "NODE_ENV",
           "AGENT_HEARTBEAT_ENV", "HEARTBEAT_S", "SECRET_ENV", "STANDBY_ENV", "PRIMARY_LOST", "connect", "peer_token",
           "secret_from_env"]

log = logging.getLogger("resilient")

ENV = "RESILIENT_REGROUP_STORE"  # host:port/round-id, set by resilient-run's agent
# A second store, hosted by another node's agent, that takes over when the first one's node is
# lost (see ``Regroup._fail_over``); "" when the round has one node
STANDBY_ENV = "RESILIENT_REGROUP_STANDBY"
# set in the standby by the agents once etcd says the first store's node is lost: the one
# signal every worker waits for before it moves, so that the gang never splits between stores
PRIMARY_LOST = "primary_lost"
# how long a worker that lost the store waits for its agents to confirm the loss (a lease
# TTL and a few seconds is what it takes)
FAILOVER_WAIT_S = 60.0
SECRET_ENV = "RESILIENT_REGROUP_SECRET"  # the round's secret: never in the store, never in argv
NODE_ENV = "RESILIENT_NODE_ID"   # the agent's name in the rendezvous: how workers name their node
# set by resilient-run's agent, which heartbeats for its node: its workers then need not
AGENT_HEARTBEAT_ENV = "RESILIENT_AGENT_HEARTBEAT"
HEARTBEAT_S = 0.25
# How long a watcher that does not heartbeat sleeps in one wait. The store wakes it early
# for the notice it waits on, and watch()/close() never need it sooner, so this only sets the
# idle load: at 8,192 ranks, 5 s would be ~1,600 store operations a second, all job long.
IDLE_WAIT_S = 30.0
# a newcomer waits this long for the members' next checkpoint before interrupting them
NEWCOMER_PATIENCE_S = 600.0
POLL_S = 0.01
# waiters that watch the closer's health closely (see Regroup._waiter_timeout)
DEPUTIES = 32
CONNECT_ATTEMPTS = 3  # see connect(): a whole gang's workers connect at one instant
FAILED = "failed: "  # how a generation's notice begins when it failed (else: "joining")


class RegroupError(ResilientError):
    """The gang could not be re-formed in-process; the launcher's process restart takes over."""


@dataclass(frozen=True)
class Member:
    id: str            # host:pid, also what the agent marks dead
    node: str          # members on one node share a fate; peer copies go to another node
    rank: int          # rank in the previous generation (launcher's RANK at first)
    address: str = ""  # this member's peer-memory server, host:port ("" when off)


@dataclass
class Generation:
    """One member's view of a generation: its seat (rank, world size, peer-copy partner),
    and the whole member list only when something needs it (it is O(N) bytes to read)."""

    number: int
    rank: int
    world_size: int
    partner: str = ""                      # the member on another node that keeps our peer copies
    members: list[Member] | None = None    # rank order; see Regroup.members()

    @staticmethod
    def encode_members(number: int, members: list[Member]) -> str:
        return json.dumps({"number": number, "members": [asdict(m) for m in members]})

    @classmethod
    def from_members(cls, raw: bytes | str, me: str) -> "Generation | None":
        """Our seat in a member list (None: not in it)."""
        data = json.loads(raw)
        members = [Member(**m) for m in data["members"]]
        rank = next((i for i, m in enumerate(members) if m.id == me), None)
        if rank is None:
            return None
        return cls(data["number"], rank, len(members), partner_of(members, rank), members)

    def seat(self) -> str:
        return json.dumps({"number": self.number, "rank": self.rank, "world_size": self.world_size,
                           "partner": self.partner})

    @classmethod
    def from_seat(cls, raw: bytes | str) -> "Generation":
        data = json.loads(raw)
        return cls(int(data["number"]), int(data["rank"]), int(data["world_size"]), str(data["partner"]))


def partner_of(members: list[Member], rank: int) -> str:
    """The next member on another node keeps a member's peer copies (none on a single node:
    the local disk already outlives a process)."""
    return partners(members, [rank])[0]


def partners(members: list[Member], ranks: list[int] | None = None) -> list[str]:
    """``partner_of`` for each of ``ranks`` (all by default), looking only at the members
    that serve peer copies: a closer seats thousands of members, and a scan of the whole
    list per member (every member, when peer copies are off) would cost it O(N^2)."""
    ranks = list(range(len(members))) if ranks is None else ranks
    holders = [i for i, m in enumerate(members) if m.address]
    per_node: dict[str, int] = {}
    for i in holders:
        per_node[members[i].node] = per_node.get(members[i].node, 0) + 1
    found = []
    for rank in ranks:
        node = members[rank].node
        if per_node.get(node, 0) == len(holders):  # nobody elsewhere serves copies
            found.append("")
            continue
        start = bisect.bisect_right(holders, rank)
        step = 0
        while members[holders[(start + step) % len(holders)]].node == node:
            step += 1  # at most the holders of our own node
        found.append(members[holders[(start + step) % len(holders)]].address)
    return found


def parse_address(value: str) -> tuple[str, int, str]:
    """``host:port/token`` -> (host, port, token); errors name the variable."""
    try:
        where, token = value.split("/", 1)
        host, port = where.rsplit(":", 1)
        return host.strip("[]"), int(port), token
    except ValueError:
        raise RegroupError(f"{ENV}={value!r} is not HOST:PORT/TOKEN") from None


def connect(address: str, secret: str, timeout: float, attempts: int = 1) -> SealedStore:
    """A sealed, counting client of the regroup store at ``address`` (``host:port/round``).

    ``attempts``: when thousands of workers connect at one instant, the store host's listen
    queue overflows and the kernel drops connection requests, each retried only after 1, 3,
    7 s: a worker may wait longer than one ``timeout`` (the limit of every later request
    too, so not raised for that). Each attempt gets ``timeout`` again."""
    host, port, round_id = parse_address(address)
    namespace = derive(secret, f"regroup-store:{round_id}")[:32]
    for attempt in range(1, attempts + 1):
        try:
            client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                                   wait_for_workers=False)
            break
        except dist.DistNetworkError:
            if attempt == attempts:
                raise
            log.info("resilient: the regroup store at %s:%d did not answer within %.0f s; connecting again",
                     host, port, timeout)
    return SealedStore(CountingStore(dist.PrefixStore(f"{namespace}/", client)), secret, namespace)


def peer_token(address: str, secret: str) -> str:
    """The peer-memory servers' shared token for this round (derived: not the secret)."""
    return derive(secret, f"peer-memory:{parse_address(address)[2]}")


def secret_from_env() -> str:
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise RegroupError(f"{ENV} is set but {SECRET_ENV} is not: the regroup store's values are sealed with "
                           "the job's secret (resilient-run hands it to its workers)")
    return value


class CountingStore:
    """A store client that counts its operations (what the scale benchmark reports per rank)."""

    def __init__(self, store: dist.Store) -> None:
        self.inner = store
        self.ops = 0

    @property
    def timeout(self) -> timedelta:  # client-side settings: no request, not counted
        return self.inner.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return method(*args, **kwargs)

        return counted


class _Log:
    """An append-only store key read incrementally: each read parses only what is new."""

    def __init__(self, store: SealedStore, key: str) -> None:
        self.store, self.key = store, key
        self.entries: list[str] = []
        self._seen = 0

    def read(self) -> list[str]:
        if not self.store.check([self.key]):
            return self.entries
        new, self._seen = self.store.read_log(self.key, self._seen)
        self.entries += new
        return self.entries


class _Progress:
    """Whether a count (arrivals, ready members) stopped moving, and when to look closer."""

    STALL_S = 0.1     # no change for this long: look at who is missing
    LOOK_S = 0.1      # while stalled, look at most this often

    def __init__(self) -> None:
        self.count = -1
        self.changed = self.looked = time.monotonic()

    def update(self, count: int) -> bool:
        """Record the count; True when it has not moved for STALL_S."""
        now = time.monotonic()
        if count != self.count:
            self.count, self.changed = count, now
        return now - self.changed >= self.STALL_S

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.looked >= self.LOOK_S:
            self.looked = now
            return True
        return False

    def idle(self) -> bool:
        return time.monotonic() - self.changed >= 5 * self.STALL_S


class Regroup:
    """One worker process's view of the gang: join generations, heartbeat, watch for failure."""

    def __init__(self, address: str, *, secret: str, node: str, rank: int, initial_world_size: int,
                 memory_address: str = "", stale_s: float = 2.0, join_grace_s: float = 30.0,
                 timeout: float = 300.0, heartbeat: bool = True, member_id: str = "", standby: str = "") -> None:
        host, port, _ = parse_address(address)
        self.host, self.address, self._secret = host, address, secret
        self._ledger: SealedStore | None = None
        self._ledger_lock = threading.Lock()
        self._standby = standby  # where the gang goes on if the store's node is lost ("" after)
        self._mirrors: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._mirror_thread: threading.Thread | None = None
        self._switch_lock = threading.Lock()
        # host:pid is what the agent marks dead; a simulation of many members in one process
        # names them itself
        self.me = member_id or f"{socket.gethostname()}:{os.getpid()}"
        self.node = node
        self.initial_world_size = initial_world_size
        self.memory_address = memory_address
        self.stale_s, self.join_grace_s, self.timeout = stale_s, join_grace_s, timeout
        try:
            # two clients: the watcher blocks in waits that must not hold up the main thread
            self._store = connect(address, secret, 10.0, attempts=CONNECT_ATTEMPTS)
            self._watch_store = connect(address, secret, 10.0, attempts=CONNECT_ATTEMPTS)
        except Exception as exc:
            raise RegroupError(f"cannot reach the regroup store at {host}:{port}: {exc}") from exc
        self._rank = rank
        self._heartbeat = heartbeat             # this process speaks for its node's liveness
        self._watching: int | None = None   # generation whose failed flag interrupts us
        self.join_pending = False           # a newcomer waits to join the running generation
        self._on_failure: Callable[[str], None] | None = None
        self._failure_known: int | None = None  # the last generation we know failed (reported or told)
        self._arrival = 0                    # our arrival order in the generation we are joining
        self._closer_of: int | None = None   # the generation we close (first to arrive, or replacing)
        self._stop = threading.Event()
        self._watch_changed = threading.Event()
        self._store.set("elastic", "1")
        self._watcher = threading.Thread(target=self._watch_loop, name="resilient-regroup-watch", daemon=True)
        self._watcher.start()
        if standby:
            threading.Thread(target=self._standby_loop, args=(standby,), name="resilient-regroup-standby",
                             daemon=True).start()

    @property
    def ops(self) -> int:
        """Store operations this process made (both clients)."""
        return self._store.ops + self._watch_store.ops

    # -- forming a generation -----------------------------------------------------------------
    def form(self, previous: Generation | None) -> Generation | None:
        """Join the next generation (the first one, or after ``previous`` failed); return it,
        or None when the job already finished (a replacement that arrived too late)."""
        return self._on_store(lambda: self._form(previous))

    def _form(self, previous: Generation | None) -> Generation | None:
        self._watching = None
        # a member of a failing generation has not finished, so the job has not either
        if previous is None and self._store.check(["finished"]):
            return None
        if previous is not None:
            target = previous.number + 1
            self._rank = previous.rank
        elif self._store.check(["latest"]):  # started after the gang formed: a replacement
            target = int(self._store.get("latest")) + 1
        else:
            target = 0
        deadline = time.monotonic() + self.timeout
        while True:
            gen = self._join(target, deadline, previous if previous and previous.number == target - 1 else None)
            if gen is None:  # closed without us: ask for the next one
                target += 1
                continue
            if self._ready(gen, deadline):
                return gen
            previous = None  # we were in it, but it never ran: the closer reads what it needs
            target = gen.number + 1  # a member died before the group was up: once more

    def _join(self, target: int, deadline: float, previous: Generation | None) -> Generation | None:
        me = Member(self.me, self.node, self._rank, self.memory_address)
        self._arrival = self._store.add(f"arrivals/{target}", 1)
        closer = self._arrival == 1
        self._store.append(f"joins/{target}", json.dumps(asdict(me)))
        if previous is None and target > 0:  # a replacement (or a retry): who ran before us?
            previous = self._generation(target - 1)
        newcomer = previous is not None and previous.rank < 0
        if newcomer:
            # members checkpoint at their next step and re-form (``join_pending``)
            self._store.set(f"joining/{target - 1}", self.me)
            self._store.compare_set(f"notice/{target - 1}", "", "joining")
        elif previous is not None and self._failure_known != target - 1:
            # a member that failed and did not say so: the others may not have noticed yet
            raise_failed(self._store, target - 1, f"{self.me} re-forms generation {target}")
        if closer:
            self._store.set(f"closer/{target}", self._closer_record())
            self._close(target, previous, deadline, newcomer)
        return self._wait_seat(target, deadline)

    def _waiter_timeout(self) -> float:
        """How long a waiter sleeps between looks at the closer's health. The first
        ``DEPUTIES`` to arrive look every ``2 * stale_s`` (one of them replaces a dead
        closer); the rest ten times less often, so that thousands of waiters cost the store
        little and still replace the closer if every deputy died with it."""
        base = max(2.0 * self.stale_s, 1.0)
        return base if self._arrival <= DEPUTIES + 1 else 10 * base

    def _closer_record(self) -> str:
        return json.dumps({"id": self.me, "node": self.node})

    def _wait_seat(self, target: int, deadline: float) -> Generation | None:
        """Wait on our seat in generation ``target`` (None: it closed without us); take over
        closing if the closer died meanwhile. A waiter never reads the member list: the
        closer seats every member and then says ``seated/<target>``."""
        key = f"seat/{target}/{self.me}"
        beats: dict[str, tuple[int, float]] = {}
        while True:
            seat = self._store.get_within(key, self._waiter_timeout())
            if seat is not None:
                return Generation.from_seat(seat)
            if self._store.check([f"seated/{target}"]):
                # closed: our seat was written just after the wait gave up, or we were left out
                return Generation.from_seat(self._store.get(key)) if self._store.check([key]) else None
            if time.monotonic() > deadline:
                raise RegroupError(f"generation {target} did not form within {self.timeout:.0f} s")
            if self._closer_dead(target, beats):
                log.warning("resilient: the closer of generation %d is gone; closing it here", target)
                previous = self._generation(target - 1) if target > 0 else None
                self._close(target, previous, deadline, False)

    def _closer_dead(self, number: int, beats: dict[str, tuple[int, float]]) -> bool:
        """Whether generation ``number``'s closer is known dead (marked, or its node silent);
        if so, this process becomes the closer (True) unless another waiter did first."""
        record = self._store.get(f"closer/{number}").decode()
        closer = json.loads(record)
        if closer["id"] == self.me:
            return False
        if not (self._store.check([f"dead/{closer['id']}"]) or self._node_silent(closer["node"], beats)):
            return False
        mine = self._closer_record()
        return self._store.compare_set(f"closer/{number}", record, mine).decode() == mine

    def _close(self, target: int, previous: Generation | None, deadline: float, newcomer: bool) -> None:
        """As the closer: wait until every member of ``previous`` is accounted for, then
        write the member list (once; whoever wins the compare-and-set, everyone reads it).

        It polls one counter; it reads the logs only when the count could suffice or
        arrivals stalled, and asks for heartbeats only once they stalled (then only the
        missing members' nodes): a gang of thousands arriving costs it little.
        """
        self._closer_of = target
        if previous is not None:
            self.members(previous)  # the closer looks at everyone: it reads the list once
        joins = _Log(self._store, f"joins/{target}")
        dead, done = _Log(self._store, "dead"), _Log(self._store, "done")
        beats: dict[str, tuple[int, float]] = {}
        first_join = time.monotonic()
        progress = _Progress()
        need = self.initial_world_size if previous is None else len(previous.members or [])
        joined: dict[str, Member] = {}
        while True:
            count = self._store.add(f"arrivals/{target}", 0)
            stalled = progress.update(count)
            if count >= need or (stalled and progress.due()):
                if self._store.check([f"members/{target}"]):
                    self._seat_listed(target)  # the closer before us died after writing the list
                    return
                joined = {m.id: m for m in map(_decode_member, joins.read())}
                gone = set(dead.read()) | set(done.read())
                if self._may_close(target, previous, joined, gone, beats, first_join, stalled):
                    self._seat(target, previous, list(joined.values()))
                    return
                if previous is not None:
                    need = len(joined) + sum(1 for m in previous.members or [] if m.id not in joined and m.id not in gone)
            if newcomer and time.monotonic() - first_join > NEWCOMER_PATIENCE_S:
                # the members are not taking steps (a long evaluation, a hang): interrupt them
                raise_failed(self._store, target - 1, f"{self.me} waits to join generation {target}")
                newcomer = False
            if time.monotonic() > deadline:
                missing = [m.id for m in previous.members or [] if m.id not in joined] if previous else []
                raise RegroupError(
                    f"generation {target} did not form within {self.timeout:.0f} s: {count} joined, "
                    f"waiting for " + (", ".join(missing[:10]) if previous else f"{self.initial_world_size} processes"))
            # a newcomer alone waits for the members' next checkpoint: nothing to count meanwhile
            time.sleep(POLL_S if not (newcomer and count <= 1) and not progress.idle() else 5 * POLL_S)

    def _seat(self, target: int, previous: Generation | None, joined: list[Member]) -> None:
        """Write the member list (the compare-and-set decides between rival closers), then
        every winner's member its own seat, all in one request."""
        order = {m.id: i for i, m in enumerate(previous.members or [])} if previous else {}
        members = sorted(joined, key=lambda m: (order.get(m.id, len(order)), m.rank, m.id))
        proposal = Generation.encode_members(target, members)
        if self._store.compare_set(f"members/{target}", "", proposal).decode() != proposal:
            return  # another closer won; it seats its members
        self._write_seats(target, members)

    def _write_seats(self, target: int, members: list[Member]) -> None:
        """Every member's seat in one request, then ``seated/<target>``: from then on a
        waiter without a seat knows it is not in the generation. The standby gets the member
        list first: a gang that moves there re-forms from the generation it ran."""
        self._mirror(f"members/{target}", Generation.encode_members(target, members))
        seats = [Generation(target, rank, len(members), partner).seat()
                 for rank, partner in enumerate(partners(members))]
        self._store.multi_set([f"seat/{target}/{m.id}" for m in members], seats)
        self._store.set(f"seated/{target}", "1")

    def _seat_listed(self, target: int) -> None:
        """Seat the members of a list another closer wrote (it may have died before seating
        them; seats are a function of the list, so writing them twice is harmless)."""
        if not self._store.check([f"seated/{target}"]):
            self._write_seats(target, self._list(target))

    def members(self, gen: Generation) -> list[Member]:
        """Generation ``gen``'s member list, read once (O(N) bytes) and kept."""
        if gen.members is None:
            gen.members = self._list(gen.number)
        return gen.members

    def _list(self, number: int) -> list[Member]:
        return [Member(**m) for m in json.loads(self._store.get(f"members/{number}"))["members"]]

    def _may_close(self, target: int, previous: Generation | None, joined: dict[str, Member],
                   gone: set[str], beats: dict[str, tuple[int, float]], first_join: float,
                   stalled: bool) -> bool:
        if previous is None:
            if target == 0:
                return len(joined) >= self.initial_world_size
            return bool(joined)  # the gang before us is gone entirely
        missing = [m for m in previous.members or [] if m.id not in joined and m.id not in gone]
        if not missing or time.monotonic() - first_join >= self.join_grace_s:
            return True
        # heartbeats matter only once arrivals stopped; then only the missing members' nodes
        return stalled and all(self._node_silent(node, beats) for node in {m.node for m in missing})

    def _node_silent(self, node: str, beats: dict[str, tuple[int, float]]) -> bool:
        """Whether ``node``'s heartbeat is older than ``stale_s``.

        A heartbeat is the wall-clock time of its writer (as in torch's dynamic rendezvous),
        so one read tells its age, even on the first look at a node: a closer that starts
        looking only once arrivals stalled still finds a node silent one ``stale_s`` after it
        died. Clocks skewed by more than a small fraction of ``stale_s`` would shift that; a
        node never seen beating counts from the first look.
        """
        now = time.monotonic()
        key = f"hb/{node}"
        if self._store.check([key]):
            try:
                return time.time() - float(self._store.get(key)) >= self.stale_s
            except ValueError:
                pass
        first = beats.setdefault(node, (0, now))
        return now - first[1] >= self.stale_s

    def _generation(self, number: int) -> Generation | None:
        """Generation ``number`` with its member list (whether or not we are in it)."""
        key = f"members/{number}"
        if not self._store.check([key]):
            return None
        raw = self._store.get(key)
        ours = Generation.from_members(raw, self.me)
        if ours is not None:
            return ours
        members = [Member(**m) for m in json.loads(raw)["members"]]
        return Generation(number, -1, len(members), "", members)  # rank -1: we were not in it

    def _ready(self, gen: Generation, deadline: float) -> bool:
        """Every member is still alive to set up the process group (no 30-minute hang on one
        that died in between); False when one died. The last to arrive says go; the closer
        says stop when a member is marked dead or its node goes silent first."""
        self._store.append(f"readylog/{gen.number}", self.me)
        if self._store.add(f"ready/{gen.number}", 1) == gen.world_size:
            self._store.compare_set(f"go/{gen.number}", "", "go")
            self._store.set("latest", str(gen.number))
            self._mirror("latest", str(gen.number))
        closing = self._closer_of == gen.number  # (or we replace a closer that died: below)
        beats: dict[str, tuple[int, float]] = {}
        dead, ready = _Log(self._store, "dead"), _Log(self._store, f"readylog/{gen.number}")
        key = f"go/{gen.number}"
        progress = _Progress()
        while True:
            said = self._store.get_within(key, POLL_S * 5 if closing else self._waiter_timeout())
            if said is not None:
                return said == b"go"
            closing = closing or self._closer_dead(gen.number, beats)
            # the closer looks at the members not ready yet, once readiness stopped coming
            if closing and progress.update(self._store.add(f"ready/{gen.number}", 0)) and progress.due():
                waiting = [m for m in self.members(gen) if m.id not in set(ready.read())]
                if set(dead.read()) & {m.id for m in waiting} or any(
                        self._node_silent(node, beats) for node in {m.node for m in waiting}):
                    self._store.compare_set(key, "", "stop")
            if time.monotonic() > deadline:
                raise RegroupError(f"generation {gen.number}: not every member became ready")

    def process_group_store(self, gen: Generation) -> dist.Store:
        """Where generation ``gen``'s process group meets (and the Checkpointer reports)."""
        return dist.PrefixStore(f"pg/{gen.number}/", self._store.inner.inner)  # under the namespace

    # -- the committed manifests (a peer's copy of one is accepted only if it matches) --------
    def record_manifest(self, step: int, digest: str) -> None:
        """Called by rank 0 after a commit (from the writer's thread: its own client)."""
        with self._ledger_lock:
            if self._ledger is None:
                self._ledger = connect(self.address, self._secret, 10.0)
            self._ledger.set(f"manifest/{step}", digest)
        self._mirror(f"manifest/{step}", digest)

    def manifest_digest(self, step: int) -> str | None:
        """The SHA-256 of step ``step``'s committed manifest, as rank 0 recorded it."""
        key = f"manifest/{step}"
        with self._ledger_lock:
            if self._ledger is None:
                self._ledger = connect(self.address, self._secret, 10.0)
            return self._ledger.get(key).decode() if self._ledger.check([key]) else None

    # -- while a generation runs -------------------------------------------------------------
    def watch(self, gen: Generation, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure(reason)`` (from the watcher thread) once if ``gen`` fails."""
        self._on_failure = on_failure
        self.join_pending = False
        self._watching = gen.number
        self._watch_changed.set()

    def report_failure(self, gen: Generation, reason: str) -> None:
        self._watching = None
        self._failure_known = gen.number
        try:
            self._on_store(lambda: raise_failed(self._store, gen.number, f"{self.me}: {reason}"))
        except RegroupError:
            raise
        except Exception as exc:
            raise RegroupError(f"cannot reach the regroup store: {exc}") from exc

    def finish(self, gen: Generation) -> None:
        """This member returned normally; with everyone done, the job is finished."""
        self._watching = None

        def count_out() -> None:
            self._store.append("done", self.me)
            if self._store.add(f"done/{gen.number}", 1) == gen.world_size:
                self._store.set("finished", "1")

        self._on_store(count_out)

    def close(self) -> None:
        """Stop heartbeating and watching. A heartbeating watcher is waited for (it wakes
        every HEARTBEAT_S): a thread inside a store call when the interpreter exits can
        abort the process. A silent one sits in one store wait (measured harmless at exit)
        and, once stopped, calls nothing back; it is not waited for."""
        self._stop.set()
        self._watch_changed.set()
        if self._mirror_thread is not None:  # let the last copies out (it is idle, not in a store call)
            self._mirrors.put(None)
            self._mirror_thread.join(timeout=1.0)
        if self._heartbeat:
            self._watcher.join(timeout=2 * HEARTBEAT_S + 1.0)

    def _watch_loop(self) -> None:
        """Heartbeat for the node (when this process speaks for it) and wait for the notice
        of the generation we run in: one blocking wait, woken by the store."""
        # a member that does not heartbeat is woken by the notice, or by watch()/close()
        interval = HEARTBEAT_S if self._heartbeat else IDLE_WAIT_S
        while not self._stop.is_set():
            store = self._watch_store  # (the standby's, once the gang moved there)
            try:
                if self._heartbeat:
                    store.set(f"hb/{self.node}", repr(time.time()))
                self._watch_changed.clear()
                watching = self._watching
                if watching is None:
                    self._watch_changed.wait(interval)
                    continue
                key = f"failed/{watching}" if self.join_pending else f"notice/{watching}"
                raw = store.get_within(key, interval)
                if raw is None:
                    continue  # nothing yet
                value = raw.decode()
                if self.join_pending or value.startswith(FAILED):
                    reason = value[len(FAILED):] if value.startswith(FAILED) else value
                    if self._watching == watching and self._on_failure is not None and not self._stop.is_set():
                        self._watching = None
                        self._failure_known = watching
                        self._on_failure(reason)
                elif self._watching == watching:
                    self.join_pending = True
            except dist.DistNetworkError as exc:  # the store's node is gone: follow the gang
                try:
                    self._fail_over(exc, store)
                except RegroupError as failed:  # no standby: the next form() says so
                    log.debug("resilient: regroup watcher stops: %s", failed)
                    return
            except Exception as exc:
                log.debug("resilient: regroup watcher failed: %s", exc)
                self._stop.wait(interval)

    # -- when the store's node is lost ----------------------------------------------------------
    def _on_store(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` (which uses the store in use); if that store's node is gone, once
        more on the standby."""
        used = self._store
        try:
            return action()
        except dist.DistNetworkError as exc:
            self._fail_over(exc, used)
            return action()

    def _fail_over(self, exc: BaseException, used: SealedStore) -> None:
        """Move both clients to the standby store once the agents confirm, from etcd's lease
        expiry, that the store's node is lost (``PRIMARY_LOST``). Every worker waits for that
        one confirmation rather than moving on its own error: a worker cut off from the store
        alone would otherwise wait for a gang in a store nobody else uses."""
        with self._switch_lock:
            if used is not self._store and used is not self._watch_store:
                return  # the other thread moved us already
            if not self._standby:
                raise RegroupError(f"the regroup store at {self.host} is gone ({exc}) and this round has no "
                                   "standby store") from exc
            standby, deadline = self._standby, time.monotonic() + FAILOVER_WAIT_S
            log.warning("resilient: the regroup store at %s is gone (%s); waiting for the agents to confirm "
                        "the loss, then re-forming through the standby store", self.host, str(exc)[:200])
            try:
                store = connect(standby, self._secret, 10.0, attempts=CONNECT_ATTEMPTS)
                watch_store = connect(standby, self._secret, 10.0, attempts=CONNECT_ATTEMPTS)
                while store.get_within(PRIMARY_LOST, 1.0) is None:
                    if self._stop.is_set() or time.monotonic() > deadline:
                        raise RegroupError(f"the regroup store at {self.host} is gone, and the agents did not "
                                           f"confirm its node lost within {FAILOVER_WAIT_S:.0f} s")
            except dist.DistError as error:
                raise RegroupError(f"the regroup store at {self.host} is gone, and so is the standby "
                                   f"({error})") from exc
            with self._ledger_lock:
                self._store, self._watch_store = store, watch_store
                self.address, self.host = standby, parse_address(standby)[0]
                self._standby, self._ledger = "", None
            log.warning("resilient: re-forming through the standby regroup store at %s", self.host)

    def _standby_loop(self, standby: str) -> None:
        """Wait in the standby for the agents' word that the store's node is lost, then move
        there and fail the running generation. A *frozen* node resets no connection: without
        this, a rank blocked in a collective with it, and its watcher blocked on its store,
        would wait for their timeouts. One idle wait per ``IDLE_WAIT_S``; the store wakes it."""
        try:
            store = connect(standby, self._secret, 10.0, attempts=CONNECT_ATTEMPTS)
            while store.get_within(PRIMARY_LOST, IDLE_WAIT_S) is None:
                if self._stop.is_set() or self._standby != standby:
                    return  # closed, moved already, or the standby is gone
            self._fail_over(dist.DistNetworkError("the agents say the regroup store's node is lost"), self._store)
        except Exception as exc:  # the standby is gone (or never answered): nothing to move to
            log.debug("resilient: regroup standby watcher stops: %s", exc)
            return
        watching = self._watching
        if watching is not None and self._on_failure is not None and not self._stop.is_set():
            self._watching = None
            self._failure_known = watching
            self._on_failure("the node of the regroup store was lost")

    def _mirror(self, key: str, value: str) -> None:
        """Copy to the standby what the gang needs to go on there (a member list, the latest
        generation, a manifest's digest), from a thread of its own: a standby on a lost or
        frozen node must not hold up the regroup in the store in use."""
        if not self._standby:
            return
        if self._mirror_thread is None:
            self._mirror_thread = threading.Thread(target=self._mirror_loop, args=(self._standby,),
                                                   name="resilient-regroup-mirror", daemon=True)
            self._mirror_thread.start()
        self._mirrors.put((key, value))

    def _mirror_loop(self, standby: str) -> None:
        """Best effort: a standby that is gone costs only the failover, so it is not tried again."""
        store: SealedStore | None = None
        while (item := self._mirrors.get()) is not None:
            try:
                store = store or connect(standby, self._secret, 10.0)
                store.set(*item)
            except Exception as exc:
                if self._standby == standby:
                    log.warning("resilient: the standby regroup store does not answer (%s); no failover this round",
                                str(exc)[:200])
                    self._standby = ""
                return


def raise_failed(store: Any, number: int, reason: str) -> None:
    """Fail generation ``number`` (the first reason stays) and wake its members' watchers;
    the notice carries the reason, so that a woken watcher reads one key."""
    first = store.compare_set(f"failed/{number}", "", reason[:500]).decode()
    store.compare_set(f"notice/{number}", "", FAILED + first)


def mark_dead(store: Any, member_id: str) -> None:
    """Record a member's death where both a closer's log read and a single check find it."""
    store.set(f"dead/{member_id}", "1")
    store.append("dead", member_id)


def _decode_member(entry: str) -> Member:
    return Member(**json.loads(entry))
