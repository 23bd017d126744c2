"""The agent's half of in-process recovery (the workers' half is ``resilient._elastic``).

Per rendezvous round the rank-0 agent hosts a small TCPStore in which the round's worker
processes re-form their gang without being restarted, and every agent learns its address
through the round's rendezvous store. The address ends in a random round id, so that workers
of an earlier round never read this round's keys. Its values are sealed with a secret that
does not travel through that store (see ``for_round``). Agents write into it what they know
first (that one of their workers died, that a node was lost) and speak for their node's
liveness: one heartbeat per node, not one per worker.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.multiprocessing.api import RunProcsResult

from .._peer_memory import interface_towards
from .._regroup import HEARTBEAT_S, NODE_ENV, connect, mark_dead, raise_failed
from .._sealed import JOB_SECRET_ENV, new_secret

__all__ = ["InProcessRecovery", "NODE_ENV"]

log = logging.getLogger(__name__)

KEY = "resilient/regroup_store"
UNGUARDED_SECRET_KEY = "resilient/regroup_secret"  # only without etcd and without a job secret
PROBE_S = HEARTBEAT_S  # the probe is also the node's heartbeat


def _tcp_store(store: Store) -> Any:
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


class InProcessRecovery:
    def __init__(self, address: str, server: TCPStore | None, node: str = "", *, secret: str) -> None:
        self.address = address
        self.secret = secret
        self.node = node
        self._server = server  # held by the rank-0 agent: the store lives as long as it does
        self._store = connect(address, secret, 5.0)
        self._marked: set[int] = set()
        # The agent's monitor loop asks ``active`` every 0.1 s and must never block on a
        # store that a partition made silent: a thread keeps the answer fresh instead.
        self._elastic = False
        self._last_ok = time.monotonic()
        self._broken = False  # the store's host is gone: in-process recovery is over this round
        self._closed = threading.Event()
        self._prober = connect(address, secret, 5.0)
        self._probe_thread = threading.Thread(target=self._probe, name="resilient-regroup-probe", daemon=True)
        self._probe_thread.start()

    def _probe(self) -> None:
        while not self._closed.wait(PROBE_S):
            if not self._answers(self._prober):
                return
            self._last_ok = time.monotonic()

    def _answers(self, store: Any) -> bool:
        """Heartbeat for the node and ask the store (``elastic`` is set by the workers); False
        for good when it is gone."""
        try:
            if self.node:
                store.set(f"hb/{self.node}", repr(time.time()))  # its age is what counts
            self._elastic = self._elastic or store.check(["elastic"])
            return True
        except Exception:
            if not self._broken:
                log.warning("the regroup store is gone: in-process recovery is over for this round")
            self._broken = True
            return False

    def reachable(self) -> bool:
        """Ask now (on a failure path, where a few seconds of waiting are acceptable)."""
        return not self._broken and self._answers(self._store)

    @classmethod
    def for_round(cls, round_store: Store, group_rank: int, node: str = "",
                  secret: str | None = None) -> "InProcessRecovery":
        """Host (rank 0) or look up this round's regroup store; heartbeat there for ``node``.

        ``secret`` seals the store's values: the round's secret from etcd, or the job's
        (``RESILIENT_JOB_SECRET``). Without either (torch's c10d rendezvous), rank 0 makes
        one and publishes it in the round's store, which anyone who reaches that store can
        read: said once in the log, as the trust it leaves."""
        if secret is None:
            log.warning("in-process recovery: no authenticated way to share its secret (use --rdzv-backend=%s "
                        "or set %s); it goes through the rendezvous store, readable by whoever reaches it",
                        "etcd-v3", JOB_SECRET_ENV)
        if group_rank == 0:
            base = _tcp_store(round_store)
            host = interface_towards(getattr(base, "host", "127.0.0.1"), getattr(base, "port", 1))
            server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            address = f"{host}:{server.port}/{secrets.token_hex(8)}"
            if secret is None:
                secret = new_secret()
                round_store.set(UNGUARDED_SECRET_KEY, secret)
            round_store.set(KEY, address)
            return cls(address, server, node, secret=secret)
        address = round_store.get(KEY).decode()
        if secret is None:
            secret = round_store.get(UNGUARDED_SECRET_KEY).decode()
        return cls(address, None, node, secret=secret)

    def active(self) -> bool:
        """Whether this round's workers recover in-process: they said so when they started,
        and the store they recover through answered recently."""
        return self._elastic and not self._broken and time.monotonic() - self._last_ok < 3 * PROBE_S + 1.0

    def mark_dead(self, pid: int) -> None:
        """Tell the survivors at once (they would otherwise wait for its heartbeat to stop)."""
        if pid in self._marked:
            return
        self._marked.add(pid)
        try:
            mark_dead(self._store, f"{socket.gethostname()}:{pid}")
        except Exception as exc:
            log.warning("could not mark worker %d dead in the regroup store: %s", pid, exc)

    def fail_nodes(self, nodes: list[str]) -> None:
        """Nodes were lost: if the running generation still counts workers of theirs, its
        members stop their step and re-form (they may have noticed already)."""
        try:
            if not self._store.check(["latest"]):
                return
            latest = self._store.get("latest").decode()
            members = json.loads(self._store.get(f"members/{latest}"))["members"]
            lost = [m["id"] for m in members if m["node"] in nodes]
            for member in lost:  # a closer then need not wait for their heartbeat to go stale
                mark_dead(self._store, member)
            if lost:
                raise_failed(self._store, int(latest), f"lost node(s) {', '.join(nodes)}")
        except Exception as exc:
            log.warning("could not tell the workers to re-form: %s", exc)

    def nodes_left(self) -> int | None:
        """Nodes with workers in the last generation, once the job finished (else None)."""
        try:
            if not (self.finished() and self._store.check(["latest"])):
                return None
            latest = self._store.get("latest").decode()
            return len({m["node"] for m in json.loads(self._store.get(f"members/{latest}"))["members"]})
        except Exception:
            return None

    def finished(self) -> bool:
        try:
            return self._store.check(["finished"])
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
        """Stop the probe (and so the node's heartbeat). ``wait`` (before the agent exits):
        wait for it, since a thread inside a store call when the interpreter exits can
        abort the process; not between rounds, where the store of the round that ended may
        be on a frozen node and a call to it takes its 5 s timeout."""
        self._closed.set()
        if wait:
            self._probe_thread.join(timeout=PROBE_S + 6.0)
        self._server = None
