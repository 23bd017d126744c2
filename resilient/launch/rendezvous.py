"""The ``etcd-v3`` rendezvous: rounds of a gang agreed in etcd, liveness by lease.

Keys under ``/resilient/<run>/`` (what each agent writes, reads and watches, per round):

* ``nodes/<id>``: one per agent, under the agent's lease: its liveness. Written once.
* ``state/round``: the round: number, phase (``joining`` or ``running``), the agent that
  opened it and closes it (the *closer*) and, once running, the members in rank order and
  the address of the round's store (the membership compressed: every agent receives it).
  Written twice per round (opened, closed), each time by a transaction guarded by the
  revision the writer read; the revision of the closing write is the fencing token handed
  to workers. Every agent watches this one key.
* ``rounds/<round>/previous``: the members of the round before, written with the opening
  and read by the closer alone (they rank the new round); not under the watched ``state/``,
  so a re-forming gang of N does not receive N names twice.
* ``state/closed``: the run finished or was abandoned.
* ``joins/<round>/<id>``: an agent's join, under its lease (its host name). Joins are
  separate keys, so N agents joining never race on one value (joining is commutative);
  only the closer watches them.

So per agent per round: one join put, one watched write of ``state/round`` when it opens and
one when it closes (the membership, read once), and at most one losing open attempt. Lost
nodes are learned from their lease's expiry: every agent watches ``nodes/`` for deletions
only (etcd filters the puts out), so the registrations of a large gang cost it nothing. The
closer alone lists and watches ``nodes/`` and the round's joins while the round is open; if
the closer itself is lost, the first agent to see it opens the next round and closes it.

Why a handler of our own rather than torch's ``DynamicRendezvousHandler`` over an etcd
backend: torch's handler finds dead nodes by a heartbeat sweep (3 x 5 s) and always waits
its last-call timeout (30 s) for stragglers; here a node's liveness *is* its lease, so a
round closes the moment every live node has joined, and the agent's own
``num_nodes_waiting()`` poll learns of a lost member as soon as etcd expires its lease.
Each round gets a fresh TCPStore hosted by its closer (started as it closes the round, its
address written with the membership, so no second exchange): nothing stale from an earlier
round can be read by restarted workers, and losing the node that hosted the previous store
loses nothing.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import socket
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from etcd3gw.exceptions import Etcd3Exception
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from .._events import EventLog
from .._metrics import mark_agent
from .._sealed import new_secret
from ._etcd import (TLS_KEYS, Changes, DeletionWatch, Etcd, EtcdSecurity, EtcdSecurityError, KeyValue, LeaseKeeper,
                    Outage,
                    PrefixMirror, exists, same_revision)
from .gang import GANG_ENV

log = logging.getLogger(__name__)

BACKEND = "etcd-v3"

#: ``--rdzv-conf`` keys and their defaults (seconds).
DEFAULTS: dict[str, float] = {
    "lease_ttl": 5,           # a node silent this long is lost (etcd expires its lease)
    "join_timeout": 600,      # longest wait for a gang of at least MIN nodes
    "last_call_timeout": 10,  # once MIN have joined, longest wait for other live nodes
    "store_timeout": 60,      # connecting to the round's store
    "closed_ttl": 600,        # how long a finished run's "closed" mark outlives it
}


#: how long a survivor other than the first waits for the first to open the next round
OPEN_GRACE_S = 1.0
#: while etcd stays unreachable during a join, how often to say so again
OUTAGE_REMINDER_S = 10.0


@dataclass
class Round:
    """The content of the ``state/round`` key."""

    number: int
    phase: str                                             # "joining" or "running"
    closer: str = ""                                       # opened the round; closes it
    members: list[str] = field(default_factory=list)       # rank order, once running
    store: str = ""                                        # the round's store, once running
    previous: list[str] = field(default_factory=list)      # the last running round's members (read apart)
    opened: int = 0  # etcd revision at which the round opened (running: kept in the value)
    # seals the round's regroup store and peer-memory channel (``resilient._sealed``): etcd,
    # behind its TLS and authentication, is the one place every agent trusts
    secret: str = field(default="", repr=False)

    def encode(self) -> str:
        """The key's value. ``previous`` is not in it (see :func:`rounds_prefix`): only the
        closer needs it, and every agent receives this key; the membership is compressed."""
        data: dict[str, Any] = {"number": self.number, "phase": self.phase, "closer": self.closer}
        if self.phase == "running":
            data.update(members_z=pack_names(self.members), store=self.store, opened=self.opened,
                        secret=self.secret)
        return json.dumps(data)

    @classmethod
    def decode(cls, kv: KeyValue) -> "Round":
        try:
            data = kv.json()
            phase = str(data["phase"])
            members = unpack_names(data["members_z"]) if "members_z" in data else data.get("members", [])
            state = cls(int(data["number"]), phase, str(data.get("closer", "")),
                        [str(m) for m in members], str(data.get("store", "")),
                        [str(m) for m in data.get("previous", [])],
                        int(data["opened"]) if phase == "running" else kv.mod_revision, str(data.get("secret", "")))
        except (ValueError, KeyError, TypeError, AttributeError, zlib.error) as exc:
            raise RendezvousStateError(f"etcd key {kv.key!r} does not hold a rendezvous round "
                                       f"({type(exc).__name__}: {exc}); was it written by another tool?") from None
        if state.phase not in ("joining", "running"):
            raise RendezvousStateError(f"etcd key {kv.key!r}: unknown round phase {state.phase!r}")
        if state.phase == "running" and not (state.members and state.store):
            raise RendezvousStateError(f"etcd key {kv.key!r}: a running round without members or store")
        return state


#: largest membership a round may hold once inflated (a hostile value cannot exhaust memory)
MAX_MEMBERS_BYTES = 64 << 20


def pack_names(names: list[str]) -> str:
    """A list of node names as compressed text: every agent receives the membership of each
    round, and names in one job share most of their characters (1,024 simulated agents:
    ~40 kB of JSON, ~5 kB packed)."""
    return base64.b64encode(zlib.compress(json.dumps(names).encode(), 6)).decode()


def unpack_names(text: str) -> list[str]:
    inflater = zlib.decompressobj()
    raw = inflater.decompress(base64.b64decode(text, validate=True), MAX_MEMBERS_BYTES)
    if inflater.unconsumed_tail:
        raise ValueError(f"a packed membership inflates beyond {MAX_MEMBERS_BYTES} bytes")
    names = json.loads(raw)
    if not isinstance(names, list):
        raise TypeError("a packed membership is not a list of names")
    return [str(n) for n in names]


def rounds_prefix(prefix: str, number: int) -> str:
    """Where what only the closer of round ``number`` reads is kept (outside the watched
    ``state/``): the previous round's members, which rank the new one."""
    return f"{prefix}rounds/{number}/"


def read_previous(etcd: Etcd, prefix: str, number: int) -> list[str]:
    kv = etcd.get(rounds_prefix(prefix, number) + "previous")
    if kv is None:
        return []
    try:
        return unpack_names(kv.value.decode())
    except (ValueError, TypeError, zlib.error, UnicodeDecodeError) as exc:
        raise RendezvousStateError(f"etcd key {kv.key!r} does not hold a packed membership "
                                   f"({type(exc).__name__}: {exc}); was it written by another tool?") from None


def assign_ranks(joined: list[str], previous: list[str], size: int) -> list[str]:
    """Order the gang: a node keeps its previous rank when it still fits, newcomers fill gaps.

    Survivors of the previous round are chosen before newcomers when more joined than fit.
    Keeping ranks keeps each node next to the checkpoint files it wrote on its local tier;
    a spare replacing a lost node takes exactly the lost node's ranks.
    """
    survivors = [node for node in previous if node in joined]
    chosen = (survivors + [node for node in joined if node not in survivors])[:size]
    order: list[str | None] = [None] * size
    for node in chosen:
        if node in previous and previous.index(node) < size:
            order[previous.index(node)] = node
    newcomers = iter(node for node in chosen if node not in order)
    return [slot if slot is not None else next(newcomers) for slot in order]


class _Closing:
    """What the closer of one round watches while it is open: the joins and the live nodes."""

    def __init__(self, etcd: Etcd, prefix: str, number: int, changes: Changes) -> None:
        self.number = number
        self.joins_prefix = f"{prefix}joins/{number}/"
        self.nodes_prefix = prefix + "nodes/"
        self.previous = read_previous(etcd, prefix, number)
        self.joins = PrefixMirror(etcd, self.joins_prefix, changes=changes)
        self.nodes = PrefixMirror(etcd, self.nodes_prefix, changes=changes)
        self.min_reached_at: float | None = None

    def ready(self) -> bool:
        return self.joins.listed.is_set() and self.nodes.listed.is_set()

    def joined(self) -> dict[str, str]:
        """Live joiners in the order they joined -> their host names."""
        alive = self.alive()
        joins = sorted(self.joins.snapshot().values(), key=lambda kv: kv.mod_revision)
        out = {kv.key[len(self.joins_prefix):]: kv.value.decode() for kv in joins}
        return {node: address for node, address in out.items() if node in alive}

    def alive(self) -> set[str]:
        return {key[len(self.nodes_prefix):] for key in self.nodes.snapshot()}

    def close(self) -> None:
        self.joins.close()
        self.nodes.close()


class EtcdV3RendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` contract over etcd's v3 API (see module docstring)."""

    def __init__(self, etcd: Etcd, run_id: str, min_nodes: int, max_nodes: int, *,
                 local_addr: str | None = None, **timeouts: float) -> None:
        if not 0 < min_nodes <= max_nodes:
            raise ValueError(f"--nnodes must be MIN:MAX with 0 < MIN <= MAX, got {min_nodes}:{max_nodes}")
        unknown = set(timeouts) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown --rdzv-conf key(s) for etcd-v3: {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(DEFAULTS)}")
        self.etcd = etcd
        self.run_id = run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.conf = {**DEFAULTS, **{k: float(v) for k, v in timeouts.items()}}
        self.node = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.prefix = f"/resilient/{run_id}/"
        self._round_key = self.prefix + "state/round"
        self._closed_key = self.prefix + "state/closed"
        self._local_addr = local_addr
        self._keeper: LeaseKeeper | None = None
        self._changes = Changes()
        self._state = PrefixMirror(etcd, self.prefix + "state/", changes=self._changes)
        self._gone: DeletionWatch | None = None     # started at the first round this node sees
        self._closing: _Closing | None = None       # while this node closes an open round
        self._joined: int | None = None             # the round our join key is for
        self._deferred_open: tuple[int, float] | None = None  # (round, since) we leave to its first survivor
        self._decoded: tuple[int, Round] | None = None
        self._lost_cache: tuple[tuple[int, int, str, int], list[str]] | None = None
        self._server: TCPStore | None = None        # the store this agent hosts (as a closer)
        self._hosting = ""                          # its address
        # set by the agent while its workers re-form in-process without the lost nodes:
        # a lost member is then theirs to handle (``on_lost`` tells them), not a new round's
        self.ignore_lost = False
        self.on_lost: Callable[[list[str]], None] | None = None
        self._running: Round | None = None          # the round our workers run in
        self.last_change: str = ""                  # why num_nodes_waiting() last said "restart"
        self._detected_at: float | None = None      # when last_change was first seen
        self._reported_lost: set[str] = set()
        self.gang_info: dict[str, Any] = {}
        mark_agent()  # the handler lives in the agent (resilient-run or torchrun)
        self.events = EventLog(os.environ.get("RESILIENT_EVENT_LOG") or None, -1, node=self.node)
        # torch's contract: shutdown() closes the run for every node. resilient-run's agent
        # clears this unless its workers succeeded: a node that gives up leaves the gang
        # (spares and survivors carry on) instead of ending the job for everyone.
        self.close_on_shutdown = True
        self._shut_down = False  # a join in progress (another thread) gives up instead of registering again

    # -- RendezvousHandler -------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def use_agent_store(self) -> bool:
        return True  # a fresh store per round: safe to share with workers

    def is_closed(self) -> bool:
        return self.etcd.get(self._closed_key) is not None

    def set_closed(self) -> None:
        lease = self.etcd.grant(int(self.conf["closed_ttl"]))
        self.etcd.put(self._closed_key, json.dumps({"by": self.node, "at": time.time()}), lease=lease)

    def shutdown(self) -> bool:
        self._shut_down = True
        if self.close_on_shutdown:
            try:
                self.set_closed()
            except Exception as exc:  # noqa: BLE001 - shutting down must not raise
                log.warning("could not mark run %s closed in etcd: %s", self.run_id, exc)
        if self._keeper is not None:
            self._keeper.close()
        self._stop_closing()
        for watch in (self._state, self._gone):
            if watch is not None:
                watch.close()
        self._server = None
        self.events.close()
        return True

    def num_nodes_waiting(self) -> int:
        """Nonzero when the running gang must re-form: the agent then restarts its workers.

        Counts a lost lease of our own (fenced), a newer round opened by someone (a lost
        member's survivor, a newcomer while the gang is below MAX, a member whose workers
        failed) and members of our round whose lease expired. Reads only the local watches:
        the agent calls this every monitor interval.
        """
        if self._running is None or self._keeper is None:
            return 0
        if self._keeper.overdue():  # etcd may have expired it: our workers must not go on
            return self._restart("fenced", "this node lost its etcd lease (or no refresh was confirmed "
                                 f"for {self.conf['lease_ttl']:.0f} s)", 1)
        kvs = self._state.snapshot()
        if self._closed_key in kvs or self._round_key not in kvs:
            return 0
        current = self._decode(kvs[self._round_key])
        if current.number != self._running.number:
            return self._restart("new_round", f"round {current.number} opened", 1)
        lost = self._report_lost()
        if lost and not self.ignore_lost:
            return self._restart("lost", f"lost {', '.join(lost)}", len(lost))
        return 0

    def _restart(self, cause: str, detail: str, count: int) -> int:
        if detail != self.last_change:
            log.warning("[%s] gang must re-form: %s", self.node, detail)
            self.last_change = detail
            self._detected_at = time.monotonic()
            if cause != "lost":  # lost members are reported by _report_lost, wherever seen first
                self.events.emit("membership_change", cause=cause, detail=detail,
                                 round=self._running.number if self._running else None)
        return count

    def _lost(self, state: Round) -> list[str]:
        """Members of ``state`` whose lease expired since the round opened (worked out again
        only when a deletion arrived or the round changed: the agent asks every 0.1 s, and
        once a node is lost the answer is a pass over a gang of thousands)."""
        gone = self._gone
        if gone is None:
            return []
        key = (gone.epoch, state.number, state.phase, state.opened)
        if self._lost_cache is None or self._lost_cache[0] != key:
            self._lost_cache = (key, gone.gone_among(state.members, state.opened))
        return self._lost_cache[1]

    def _report_lost(self) -> list[str]:
        """Members of our round whose lease expired; each is reported once, when first seen
        (while training, or while re-forming after our workers failed first)."""
        lost = self._lost(self._running) if self._running else []
        new = [m for m in lost if m not in self._reported_lost]
        if new:
            self._reported_lost.update(new)
            # a lost node was silent for up to one lease TTL before etcd expired it
            self.events.emit("membership_change", cause="lost", detail=f"lost {', '.join(new)}",
                             round=self._running.number if self._running else None,
                             detection_s=self.conf["lease_ttl"])
            if self.on_lost is not None:
                self.on_lost(new)
        return lost

    def wait_membership_change(self, timeout: float) -> bool:
        """Whether the running round is over (or ends within ``timeout`` s) for reasons
        outside this node's workers: a lost member, a new round, our own lease lost."""
        deadline = time.monotonic() + timeout
        while True:
            version = self._changes.version
            if self.num_nodes_waiting() > 0:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changes.wait(version, timeout=min(left, 0.5))

    def next_rendezvous(self) -> RendezvousInfo:
        self._joining_since = time.monotonic()
        deadline = self._joining_since + self.conf["join_timeout"]
        outage: Outage | None = None  # etcd unreachable since: a line per outage, not per retry
        while True:
            if self._shut_down:
                raise RendezvousClosedError(f"the rendezvous handler of {self.node} for run {self.run_id!r} "
                                            "was shut down")
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"no gang of at least {self.min_nodes} node(s) formed for run {self.run_id!r} within "
                    f"join_timeout={self.conf['join_timeout']:.0f} s (etcd {self.etcd.spec})")
            version = self._changes.version
            try:
                # only a lease etcd says is gone calls for a new one: one merely overdue is
                # still refreshed, and a write under it, if it did expire, fails (see below)
                if self._keeper is None or self._keeper.lost.is_set():
                    self._register()
                info = self._advance() if self._state.listed.is_set() else None
            except EtcdSecurityError:  # TLS or credentials: retrying cannot fix a configuration
                raise
            except OSError as exc:   # etcd unreachable for now: wait and try again
                outage = outage or Outage(f"rendezvous for {self.run_id}", OUTAGE_REMINDER_S)
                outage.failed(exc, f"{max(0.0, deadline - time.monotonic()):.0f} s left of join_timeout")
                time.sleep(0.5)
                continue
            except Etcd3Exception as exc:
                # etcd refused a write under our lease ("lease not found": it expired while
                # this node could not refresh it): join again under a fresh lease
                log.warning("rendezvous for %s: etcd refused a request (%s); registering again",
                            self.run_id, exc)
                if self._keeper is not None:
                    self._keeper.lost.set()
                time.sleep(0.2)
                continue
            if outage is not None:
                outage.over()
                outage = None
            if info is not None:
                return info
            self._changes.wait(version, timeout=0.5)

    # -- the round protocol ------------------------------------------------------------------
    def _advance(self) -> RendezvousInfo | None:
        """One step towards a running round that includes this node; None: wait and retry."""
        kvs = self._state.snapshot()
        if self._closed_key in kvs:
            raise RendezvousClosedError(f"run {self.run_id!r} is closed (finished or abandoned)")
        kv = kvs.get(self._round_key)
        if kv is None:
            self._open(1, [], 0)
            return None
        state, revision = self._decode(kv), kv.mod_revision
        if self._gone is None:
            # every later event matters from the first round we see on: deletions since it opened
            self._gone = DeletionWatch(self.etcd, self.prefix + "nodes/", state.opened, changes=self._changes)
        if not self._gone.listed.is_set():
            return None
        me = self.node
        self._report_lost()  # our previous round's members, while we re-form without them

        if state.phase == "running":
            self._stop_closing()
            ours = self._running is not None and self._running.number == state.number
            if me in state.members and not ours:
                return self._finish(state, revision)
            lost = self._lost(state)
            if lost and not self._opens_first(state, lost):
                return None  # the first survivor opens the next round; the others join it
            if ours or lost or len(state.members) < self.max_nodes:
                self._open(state.number + 1, state.members, revision)
            return None  # otherwise: a spare, waiting for a place

        if self._gone.gone(state.closer, state.opened) and state.closer != me:
            # the closer was lost: the round it did not close ranks by the same previous members
            self._open(state.number + 1, read_previous(self.etcd, self.prefix, state.number), revision)
            return None
        if self._joined != state.number:
            self.etcd.put(f"{self.prefix}joins/{state.number}/{me}", socket.gethostname(), lease=self._lease())
            self._joined = state.number
        if state.closer == me:
            self._close(state, revision)
        return None

    def _opens_first(self, state: Round, lost: list[str]) -> bool:
        """Whether this node opens the round after ``state`` lost members now: the first
        survivor in rank order does at once, any other node only if no round was opened
        within ``OPEN_GRACE_S`` (the first survivor may be frozen too). All survivors see
        a loss at the same instant; a thousand racing opens would cost etcd a thousand
        transactions for one winner."""
        gone = set(lost)
        first = next((m for m in state.members if m not in gone), None)
        if first == self.node:
            return True
        if self._deferred_open is None or self._deferred_open[0] != state.number:
            self._deferred_open = (state.number, time.monotonic())
        return time.monotonic() - self._deferred_open[1] >= OPEN_GRACE_S

    def _open(self, number: int, previous: list[str], expected_revision: int) -> None:
        """Open round ``number`` with this node as its closer, unless someone changed the
        round first (then the watch brings their version). Our lease must be alive: the
        others learn of our loss from its deletion after this write."""
        state = Round(number, "joining", self.node, previous=previous)
        puts = [(self._round_key, state.encode(), 0)]
        if previous:
            puts.append((rounds_prefix(self.prefix, number) + "previous", pack_names(previous), 0))
        self.etcd.transact([same_revision(self._round_key, expected_revision),
                            exists(self.prefix + "nodes/" + self.node)], puts)

    def _close(self, state: Round, revision: int) -> None:
        """As closer: once enough live nodes joined, write the membership (once)."""
        if self._closing is None or self._closing.number != state.number:
            self._stop_closing()
            self._closing = _Closing(self.etcd, self.prefix, state.number, self._changes)
        closing = self._closing
        if not closing.ready():
            return
        joined = closing.joined()
        if len(joined) < self.min_nodes:
            return
        if closing.min_reached_at is None:
            closing.min_reached_at = time.monotonic()
        everyone = closing.alive() <= set(joined)
        late = time.monotonic() - closing.min_reached_at >= self.conf["last_call_timeout"]
        if not (len(joined) >= self.max_nodes or everyone or late):
            return
        members = assign_ranks(list(joined), closing.previous, min(len(joined), self.max_nodes))
        running = Round(state.number, "running", self.node, members, self._host_store(),
                        closing.previous, state.opened, new_secret())
        if self.etcd.transact([same_revision(self._round_key, revision)],
                              [(self._round_key, running.encode(), 0)]):
            self._stop_closing()
            # nobody reads a closed round's joins or its previous membership
            self.etcd.delete_prefix(closing.joins_prefix)
            self.etcd.delete_prefix(rounds_prefix(self.prefix, state.number))

    def _stop_closing(self) -> None:
        if self._closing is not None:
            self._closing.close()
            self._closing = None

    def _finish(self, state: Round, revision: int) -> RendezvousInfo:
        """Our place in a running round: rank, world size and the round's store."""
        rank = state.members.index(self.node)
        address = state.store
        host, _, port = address.rpartition(":")
        if self._server is not None and address == self._hosting:
            store: Any = self._server
        else:
            # another agent hosts this round's store. Forget ours and its address: an agent on
            # the same host may later get that port for a round it closes, and this agent took
            # such a store for its own, found none, and crashed ("store argument cannot be None")
            self._server, self._hosting = None, ""
            store = TCPStore(host, int(port), is_master=False,
                             timeout=timedelta(seconds=self.conf["store_timeout"]))
        self._running = state
        since = self._detected_at or self._joining_since
        self.events.emit("round_formed", round=state.number, nodes=len(state.members), group_rank=rank,
                         members=state.members, reform_s=round(time.monotonic() - since, 6))
        self.last_change, self._detected_at = "", None
        #: what this node's workers get as their gang (``RESILIENT_GANG``): their commit fence
        self.gang_info = {"endpoints": self.etcd.spec, "tls": self.etcd.security.to_conf(),
                          "prefix": self.prefix, "round": state.number,
                          "revision": revision, "node": self.node, "members": state.members,
                          "lease_ttl": self.conf["lease_ttl"]}
        os.environ[GANG_ENV] = json.dumps(self.gang_info)
        log.info("[%s] round %d: rank %d of %d nodes, store %s", self.node, state.number,
                 rank, len(state.members), address)
        return RendezvousInfo(PrefixStore(f"/round-{state.number}", store), rank, len(state.members),
                              RendezvousStoreInfo(host, int(port)))

    # -- helpers -------------------------------------------------------------------------------
    @property
    def round_secret(self) -> str | None:
        """The running round's secret (for its regroup store); None before a round ran."""
        return self._running.secret if self._running is not None and self._running.secret else None

    def _decode(self, kv: KeyValue) -> Round:
        """The round in ``kv``, decoded once per revision (a gang of thousands is a large value
        and the agent polls every monitor interval)."""
        if self._decoded is None or self._decoded[0] != kv.mod_revision:
            self._decoded = (kv.mod_revision, Round.decode(kv))
        return self._decoded[1]

    def _lease(self) -> int:
        assert self._keeper is not None
        return self._keeper.lease

    def _register(self) -> None:
        """(Re)join etcd: a fresh lease, and our node key attached to it."""
        if self._keeper is not None:
            self._keeper.close(revoke=False)
        self._keeper = LeaseKeeper(self.etcd, int(self.conf["lease_ttl"]))
        self._joined = None  # a join under the old lease is gone with it
        self.etcd.put(self.prefix + "nodes/" + self.node,
                      json.dumps({"host": socket.gethostname(), "pid": os.getpid()}),
                      lease=self._keeper.lease)

    def _host_store(self) -> str:
        """Start the store of the round this agent closes (it hosts it for the round's life).

        The closer hosts it rather than the future rank 0: only one agent per round starts
        a server, and closing still needs no second exchange (the address goes out with the
        membership). A fresh store per round: restarted workers never read stale keys.
        """
        addr = self._local_addr or self.etcd.local_address()
        self._server = TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=self.conf["store_timeout"]))
        self._hosting = f"{addr}:{self._server.port}"
        return self._hosting


def create_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """Build the handler from torchrun's ``--rdzv-*`` flags (``--rdzv-conf`` holds timeouts)."""
    if not params.endpoint:
        raise ValueError("the etcd-v3 rendezvous needs --rdzv-endpoint=HOST:PORT of etcd")
    timeouts = {key: params.config[key] for key in list(params.config)
                if key not in ("local_addr", "timeout", *TLS_KEYS)}
    etcd = Etcd(params.endpoint, security=EtcdSecurity.from_conf(dict(params.config)))
    etcd.authenticate()
    return EtcdV3RendezvousHandler(etcd, params.run_id, params.min_nodes, params.max_nodes,
                                   local_addr=params.local_addr, **timeouts)
