"""The agent's half of in-process recovery (the workers' half is ``resilient._elastic``).

Per rendezvous round the rank-0 agent hosts a small TCPStore in which the round's worker
processes re-form their gang without being restarted, and every agent learns its address
through the round's rendezvous store. The address ends in a random round id, so that workers
of an earlier round never read this round's keys. Its values are sealed with a secret that
does not travel through that store (see ``for_round``). Agents write into it what they know
first (that one of their workers died, that a node was lost) and speak for their node's
liveness: one heartbeat per node, not one per worker.

The rank-1 agent hosts a *standby* store, which the workers keep a copy of what they need in
(``resilient._regroup``). When etcd says the first store's node is lost, the agents set
``primary_lost`` in the standby, and the gang re-forms there instead of being restarted.
(torch's c10d rendezvous tells agents of no lost node: there, losing the first store's node
still means a restart.)
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, PrefixStore, Store, TCPStore
from torch.distributed.elastic.multiprocessing.api import RunProcsResult

from .._peer_memory import interface_towards
from .._regroup import HEARTBEAT_S, NODE_ENV, PRIMARY_LOST, connect, mark_dead, raise_failed
from .._sealed import JOB_SECRET_ENV, new_secret

__all__ = ["InProcessRecovery", "NODE_ENV"]

log = logging.getLogger(__name__)

KEY = "resilient/regroup_store"
STANDBY_KEY = "resilient/regroup_standby"
STANDBY_WAIT_S = 10.0  # rank 1's agent publishes it as soon as the round is formed
STORE_NODE_KEY = "resilient/regroup_store_node"
UNGUARDED_SECRET_KEY = "resilient/regroup_secret"  # only without etcd and without a job secret
PROBE_S = HEARTBEAT_S  # the probe is also the node's heartbeat


def _tcp_store(store: Store) -> Any:
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def _host_store(round_store: Store) -> tuple[TCPStore, str]:
    """A new regroup store on the interface the rendezvous is reached through, and its
    address (ending in a random round id: workers of another round never read its keys)."""
    base = _tcp_store(round_store)
    host = interface_towards(getattr(base, "host", "127.0.0.1"), getattr(base, "port", 1))
    server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return server, f"{host}:{server.port}/{secrets.token_hex(8)}"


def _standby_of(round_store: Store, wait_s: float = STANDBY_WAIT_S) -> str:
    """The standby's address, as rank 1's agent published it; "" if it did not within
    ``wait_s`` (it died as the round began): the round goes on without one."""
    try:
        round_store.wait([STANDBY_KEY], timedelta(seconds=wait_s))
        return round_store.get(STANDBY_KEY).decode()
    except DistStoreError:
        log.warning("no standby regroup store was published within %.1f s: losing the store's node will "
                    "mean a process restart this round", wait_s)
        return ""


class _Channel:
    """One regroup store as this agent sees it: the monitor loop's client, and a thread that
    heartbeats for the node there with a client of its own (a store client is not shared
    between threads, and a store on a frozen node must hold up neither the monitor loop nor
    the other store's heartbeat)."""

    def __init__(self, address: str, secret: str, node: str, closed: threading.Event) -> None:
        self.address, self.node = address, node
        self.client = connect(address, secret, 5.0)
        self._prober = connect(address, secret, 5.0)
        self._closed = closed
        self.alive, self.elastic = True, False  # elastic: the workers said they recover in-process
        self.last_ok = time.monotonic()
        self.thread = threading.Thread(target=self._probe, name="resilient-regroup-probe", daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        while self.alive and not self._closed.wait(PROBE_S):
            self.answers(self._prober)

    def answers(self, store: Any = None) -> bool:
        """Heartbeat for the node and ask whether the workers are elastic; False for good
        once the store is gone."""
        try:
            if self.node:
                (store or self.client).set(f"hb/{self.node}", repr(time.time()))  # its age is what counts
            if not self.elastic:  # once known, never asked again: a thousand agents ask 4 times a second
                self.elastic = (store or self.client).check(["elastic"])
            self.last_ok = time.monotonic()
        except Exception:
            if self.alive:
                log.warning("the regroup store at %s is gone", self.address.split("/")[0])
            self.alive = False
        return self.alive

    def recent(self) -> bool:
        return self.alive and time.monotonic() - self.last_ok < 3 * PROBE_S + 1.0


class InProcessRecovery:
    def __init__(self, address: str, servers: list[TCPStore], node: str = "", *, secret: str,
                 standby: str = "", store_node: str = "", unguarded: bool = False) -> None:
        self.secret = secret
        # the secret went through the rendezvous store: said once, when workers recover in-process
        self._trust_to_say = unguarded
        self.node = node
        self.store_node = store_node  # the node hosting the first store: its loss moves the gang
        self._servers = servers  # held by the hosting agents: a store lives as long as its agent
        # The agent's monitor loop asks ``active`` every 0.1 s and must never block on a
        # store that a partition made silent: the channels' threads keep the answer fresh.
        self._closed = threading.Event()
        self._primary = _Channel(address, secret, node, self._closed)
        self._standby = _Channel(standby, secret, node, self._closed) if standby else None
        self._failed_over = False
        self._marked: set[int] = set()

    @property
    def _in_use(self) -> _Channel:
        return self._standby if self._failed_over and self._standby is not None else self._primary

    def _waiting_to_move(self) -> bool:
        """The first store is silent but the standby answers: the gang is about to move there."""
        return self._standby is not None and not self._failed_over and self._standby.recent()

    @property
    def address(self) -> str:
        """The store the workers re-form in (the standby's, once the first store's node is lost)."""
        return self._in_use.address

    @property
    def standby(self) -> str:
        """Where the workers go on if the store's node is lost ("" when nowhere)."""
        return self._standby.address if self._standby is not None and not self._failed_over else ""

    def reachable(self) -> bool:
        """Ask now (on a failure path, where a few seconds of waiting are acceptable)."""
        return (self._in_use.alive and self._in_use.answers()) or self._waiting_to_move()

    @classmethod
    def for_round(cls, round_store: Store, group_rank: int, node: str = "", secret: str | None = None,
                  group_world_size: int = 1, standby_wait_s: float = STANDBY_WAIT_S) -> "InProcessRecovery":
        """Host (rank 0: the store; rank 1: its standby) or look up this round's regroup
        stores; heartbeat there for ``node``.

        ``secret`` seals the store's values: the round's secret from etcd, or the job's
        (``RESILIENT_JOB_SECRET``). Without either (torch's c10d rendezvous), rank 0 makes
        one and publishes it in the round's store, which anyone who reaches that store can
        read: said in the log (once a round), as the trust it leaves, when workers turn out to
        recover in-process (a job that does not use it has no secret at stake)."""
        unguarded = secret is None
        servers = []
        if group_rank in (0, 1) and (group_rank == 0 or group_world_size > 1):
            server, hosted = _host_store(round_store)
            servers.append(server)
            round_store.set(KEY if group_rank == 0 else STANDBY_KEY, hosted)
            if group_rank == 0:
                round_store.set(STORE_NODE_KEY, node)
                if secret is None:
                    secret = new_secret()
                    round_store.set(UNGUARDED_SECRET_KEY, secret)
        if secret is None:
            secret = round_store.get(UNGUARDED_SECRET_KEY).decode()
        standby = _standby_of(round_store, standby_wait_s) if group_world_size > 1 else ""
        return cls(round_store.get(KEY).decode(), servers, node, secret=secret, standby=standby,
                   store_node=round_store.get(STORE_NODE_KEY).decode(), unguarded=unguarded)

    def active(self) -> bool:
        """Whether this round's workers recover in-process: they said so when they started,
        and the store they recover through answered recently."""
        elastic = self._primary.elastic or (self._standby is not None and self._standby.elastic)
        if elastic and self._trust_to_say:
            self._trust_to_say = False
            log.warning("in-process recovery: no authenticated way to share its secret (use --rdzv-backend=%s "
                        "or set %s); it goes through the rendezvous store, readable by whoever reaches it",
                        "etcd-v3", JOB_SECRET_ENV)
        return elastic and (self._in_use.recent() or self._waiting_to_move())

    def mark_dead(self, pid: int) -> None:
        """Tell the survivors at once (they would otherwise wait for its heartbeat to stop)."""
        if pid in self._marked:
            return
        self._marked.add(pid)
        for channel in (self._primary, self._standby):  # either may be where the gang re-forms
            if channel is not None and channel.recent():
                try:
                    mark_dead(channel.client, f"{socket.gethostname()}:{pid}")
                except Exception as exc:
                    log.warning("could not mark worker %d dead in the regroup store: %s", pid, exc)

    def fail_nodes(self, nodes: list[str]) -> None:
        """Nodes were lost: if the running generation still counts workers of theirs, its
        members stop their step and re-form (they may have noticed already). If the first
        store's node is among them, the gang moves to the standby: this is what its workers
        wait for (``primary_lost``) before they follow."""
        try:
            if self.store_node in nodes and self.standby:
                self._standby.client.set(PRIMARY_LOST, ",".join(nodes))  # type: ignore[union-attr]
                self._failed_over = True
                log.warning("lost the regroup store's node %s: the workers re-form through the standby store",
                            self.store_node)
            store = self._in_use.client
            if not store.check(["latest"]):
                return
            latest = store.get("latest").decode()
            members = json.loads(store.get(f"members/{latest}"))["members"]
            lost = [m["id"] for m in members if m["node"] in nodes]
            for member in lost:  # a closer then need not wait for their heartbeat to go stale
                mark_dead(store, member)
            if lost:
                raise_failed(store, int(latest), f"lost node(s) {', '.join(nodes)}")
        except Exception as exc:
            log.warning("could not tell the workers to re-form: %s", exc)

    def nodes_left(self) -> int | None:
        """Nodes with workers in the last generation, once the job finished (else None)."""
        try:
            store = self._in_use.client
            if not (self.finished() and store.check(["latest"])):
                return None
            latest = store.get("latest").decode()
            return len({m["node"] for m in json.loads(store.get(f"members/{latest}"))["members"]})
        except Exception:
            return None

    def finished(self) -> bool:
        try:
            return self._in_use.client.check(["finished"])
        except Exception:
            return False

    @staticmethod
    def running(pcontext: Any) -> bool:
        return bool(getattr(pcontext, "_running_local_ranks", None))

    def keep_survivors(self, pcontext: Any) -> None:
        """torch's process context terminates every local worker as soon as one fails;
        while the workers recover in-process, report the failure and keep the others."""
        needed = ("_poll", "_capture_process_failures", "_running_local_ranks", "_failures")
        if not all(hasattr(pcontext, name) for name in needed):
            return  # not a subprocess context: the usual restart applies
        original = pcontext._poll

        def poll() -> RunProcsResult | None:
            if not self.active():
                return original()
            done: set[int] = set()
            pcontext._capture_process_failures(done)
            pcontext._running_local_ranks.difference_update(done)
            if not pcontext._running_local_ranks:
                return original()  # everyone is done: torch's bookkeeping and close
            if pcontext._failures:
                return RunProcsResult(failures=dict(pcontext._failures))
            return None

        pcontext._poll = poll

    def close(self, wait: bool = False) -> None:
        """Stop the probes (and so the node's heartbeat). ``wait`` (before the agent exits):
        wait for it, since a thread inside a store call when the interpreter exits can
        abort the process; not between rounds, where the store of the round that ended may
        be on a frozen node and a call to it takes its 5 s timeout."""
        self._closed.set()
        if wait:
            for channel in (self._primary, self._standby):
                if channel is not None:
                    channel.thread.join(timeout=PROBE_S + 6.0)
        self._servers = []
