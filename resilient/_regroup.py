"""Re-forming a gang of live worker processes without restarting them.

Worker processes of an elastic job (see ``_elastic``) agree on who is in the gang through a
key-value store that outlives any of them (``resilient-run``'s agent hosts it, and exports
its address as ``RESILIENT_REGROUP_STORE``). The gang passes through numbered
*generations*; generation ``g``'s member list is written once, by whichever joiner first
sees that it may close, with a compare-and-set, so every process reads the same list.

Generation ``g+1`` may close once every member of ``g`` has either joined it, finished,
or is known dead. Dead is learned three ways, fastest first: the member's agent marks it
(it saw the process exit: within the agent's monitor interval); its heartbeat counter
stopped moving for ``stale_s`` (a whole node gone); it has not joined ``join_grace_s``
after the first joiner (alive but stuck; it can join a later generation). Generation 0
closes when the launcher's whole world has joined.

A process that arrives after its generation closed (a replacement started by the agent)
registers for the next one and sets the running generation's *joining* key. The members
see it at their next checkpoint (``Checkpointer.save`` that is due; one tiny collective
there makes them agree), commit that step and re-form with the newcomer, which restores
it: growing loses no steps and costs the other steps nothing. If no checkpoint comes for
``NEWCOMER_PATIENCE_S``, the newcomer raises the *failed* flag instead, which each member's
heartbeat thread turns into an interruption.

Keys (all under ``<token>/``): ``hb/<id>`` heartbeat counter, ``dead/<id>``, ``done/<id>``,
``join/<g>`` arrival counter with ``join/<g>/<n>`` member records, ``members/<g>``,
``latest``, ``failed/<g>``, ``joining/<g>``, ``finished``, ``ready/<g>``, ``elastic``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ._errors import ResilientError

__all__ = ["Member", "Generation", "Regroup", "RegroupError", "parse_address", "ENV", "NODE_ENV"]

log = logging.getLogger("resilient")

ENV = "RESILIENT_REGROUP_STORE"  # host:port/token, set by resilient-run's agent
NODE_ENV = "RESILIENT_NODE_ID"   # the agent's name in the rendezvous: how workers name their node
HEARTBEAT_S = 0.25
# a newcomer waits this long for the members' next checkpoint before interrupting them
NEWCOMER_PATIENCE_S = 600.0
POLL_S = 0.01


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
    number: int
    members: list[Member]
    me: str = field(default="")

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return next(i for i, m in enumerate(self.members) if m.id == self.me)

    def encode(self) -> str:
        return json.dumps({"number": self.number, "members": [asdict(m) for m in self.members]})

    @classmethod
    def decode(cls, raw: bytes | str, me: str) -> "Generation":
        data = json.loads(raw)
        return cls(data["number"], [Member(**m) for m in data["members"]], me)


def parse_address(value: str) -> tuple[str, int, str]:
    """``host:port/token`` -> (host, port, token); errors name the variable."""
    try:
        where, token = value.split("/", 1)
        host, port = where.rsplit(":", 1)
        return host.strip("[]"), int(port), token
    except ValueError:
        raise RegroupError(f"{ENV}={value!r} is not HOST:PORT/TOKEN") from None


def _connect(host: str, port: int, timeout: float) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


class Regroup:
    """One worker process's view of the gang: join generations, heartbeat, watch for failure."""

    def __init__(self, address: str, *, node: str, rank: int, initial_world_size: int,
                 memory_address: str = "", stale_s: float = 2.0, join_grace_s: float = 30.0,
                 timeout: float = 300.0) -> None:
        host, port, token = parse_address(address)
        self.host = host
        self.me = f"{socket.gethostname()}:{os.getpid()}"
        self.node = node
        self.initial_world_size = initial_world_size
        self.memory_address = memory_address
        self.stale_s, self.join_grace_s, self.timeout = stale_s, join_grace_s, timeout
        try:
            # two clients: the heartbeat thread never waits behind the main thread's requests
            self._store = dist.PrefixStore(f"{token}/", _connect(host, port, 10.0))
            self._beat_store = dist.PrefixStore(f"{token}/", _connect(host, port, 10.0))
        except Exception as exc:
            raise RegroupError(f"cannot reach the regroup store at {host}:{port}: {exc}") from exc
        self._rank = rank
        self._watching: int | None = None   # generation whose failed flag interrupts us
        self.join_pending = False           # a newcomer waits to join the running generation
        self._on_failure: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._store.set("elastic", "1")
        self._beat = threading.Thread(target=self._heartbeat, name="resilient-regroup-heartbeat", daemon=True)
        self._beat.start()

    # -- forming a generation -----------------------------------------------------------------
    def form(self, previous: Generation | None) -> Generation | None:
        """Join the next generation (the first one, or after ``previous`` failed); return it,
        or None when the job already finished (a replacement that arrived too late)."""
        self._watching = None
        if self._store.check(["finished"]):
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
            gen = self._join(target, deadline)
            if gen is None:  # closed without us: ask for the next one
                target += 1
                continue
            if self._ready(gen, deadline):
                self._store.set("latest", str(gen.number))
                return gen
            target = gen.number + 1  # a member died before the group was up: once more

    def _join(self, target: int, deadline: float) -> Generation | None:
        me = Member(self.me, self.node, self._rank, self.memory_address)
        n = self._store.add(f"join/{target}", 1)
        self._store.set(f"join/{target}/{n}", json.dumps(asdict(me)))
        newcomer = False
        if target > 0:
            previous = self._members(target - 1)
            newcomer = previous is not None and all(m.id != self.me for m in previous.members)
            if newcomer:
                # members checkpoint at their next step and re-form (``join_pending``)
                self._store.set(f"joining/{target - 1}", self.me)
            else:  # a member that failed: the others may not have noticed yet
                self._store.compare_set(f"failed/{target - 1}", "", f"{self.me} re-forms generation {target}")
        else:
            previous = None
        first_join = time.monotonic()
        beats: dict[str, tuple[int, float]] = {}
        while True:
            if self._store.check([f"members/{target}"]):
                gen = Generation.decode(self._store.get(f"members/{target}"), self.me)
                return gen if any(m.id == self.me for m in gen.members) else None
            joined = self._joined(target)
            if self._may_close(target, previous, joined, beats, first_join):
                order = {m.id: i for i, m in enumerate(previous.members)} if previous else {}
                members = sorted(joined.values(), key=lambda m: (order.get(m.id, len(order)), m.rank, m.id))
                proposal = Generation(target, members).encode()
                self._store.compare_set(f"members/{target}", "", proposal)
                continue  # read back whatever won
            if newcomer and time.monotonic() - first_join > NEWCOMER_PATIENCE_S:
                # the members are not taking steps (a long evaluation, a hang): interrupt them
                self._store.compare_set(f"failed/{target - 1}", "", f"{self.me} waits to join generation {target}")
                newcomer = False
            if time.monotonic() > deadline:
                raise RegroupError(
                    f"generation {target} did not form within {self.timeout:.0f} s: "
                    f"{len(joined)} joined, waiting for "
                    + (", ".join(m.id for m in previous.members if m.id not in joined) if previous
                       else f"{self.initial_world_size} processes")
                )
            time.sleep(POLL_S)

    def _members(self, number: int) -> Generation | None:
        key = f"members/{number}"
        return Generation.decode(self._store.get(key), self.me) if self._store.check([key]) else None

    def _joined(self, target: int) -> dict[str, Member]:
        count = self._store.add(f"join/{target}", 0)
        keys = [f"join/{target}/{n}" for n in range(1, count + 1)]
        out: dict[str, Member] = {}
        if keys:
            self._store.wait(keys, timedelta(seconds=10))
            for raw in self._store.multi_get(keys):
                m = Member(**json.loads(raw))
                out[m.id] = m
        return out

    def _may_close(self, target: int, previous: Generation | None, joined: dict[str, Member],
                   beats: dict[str, tuple[int, float]], first_join: float) -> bool:
        if previous is None:
            if target == 0:
                return len(joined) >= self.initial_world_size
            return bool(joined)  # the gang before us is gone entirely
        now = time.monotonic()
        for m in previous.members:
            if m.id in joined or self._store.check([f"dead/{m.id}"]) or self._store.check([f"done/{m.id}"]):
                continue
            count = self._store.add(f"hb/{m.id}", 0)
            seen = beats.get(m.id)
            if seen is None or seen[0] != count:
                beats[m.id] = (count, now)
                seen = beats[m.id]
            if now - seen[1] >= self.stale_s or now - first_join >= self.join_grace_s:
                continue
            return False
        return True

    def _ready(self, gen: Generation, deadline: float) -> bool:
        """Every member is still alive to set up the process group (no 30-minute hang on one
        that died in between); False when one died."""
        self._store.add(f"ready/{gen.number}", 1)
        while self._store.add(f"ready/{gen.number}", 0) < gen.world_size:
            if any(self._store.check([f"dead/{m.id}"]) for m in gen.members):
                return False
            if time.monotonic() > deadline:
                raise RegroupError(f"generation {gen.number}: not every member became ready")
            time.sleep(POLL_S)
        return True

    def process_group_store(self, gen: Generation) -> dist.Store:
        """Where generation ``gen``'s process group meets (and the Checkpointer reports)."""
        return dist.PrefixStore(f"pg/{gen.number}/", self._store)

    # -- while a generation runs -------------------------------------------------------------
    def watch(self, gen: Generation, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure(reason)`` (from the heartbeat thread) once if ``gen`` fails."""
        self._on_failure = on_failure
        self._watching = gen.number

    def report_failure(self, gen: Generation, reason: str) -> None:
        self._watching = None
        try:
            self._store.compare_set(f"failed/{gen.number}", "", f"{self.me}: {reason}"[:500])
        except Exception as exc:
            raise RegroupError(f"cannot reach the regroup store: {exc}") from exc

    def finish(self, gen: Generation) -> None:
        """This member returned normally; with everyone done, the job is finished."""
        self._watching = None
        self._store.set(f"done/{self.me}", "1")
        if all(self._store.check([f"done/{m.id}"]) for m in gen.members):
            self._store.set("finished", "1")

    def close(self) -> None:
        self._stop.set()
        self._beat.join(timeout=2)

    def _heartbeat(self) -> None:
        store = self._beat_store
        while not self._stop.wait(HEARTBEAT_S):
            try:
                store.add(f"hb/{self.me}", 1)
                watching = self._watching
                self.join_pending = watching is not None and store.check([f"joining/{watching}"])
                if watching is not None and store.check([f"failed/{watching}"]):
                    reason = store.get(f"failed/{watching}").decode()
                    if self._watching == watching and self._on_failure is not None:
                        self._watching = None
                        self._on_failure(reason)
            except Exception as exc:  # the store's host is gone: the next form() says so
                log.debug("resilient: regroup heartbeat failed: %s", exc)
