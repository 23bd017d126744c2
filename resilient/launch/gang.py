"""The worker's side of the gang: fence checkpoint commits with the round's revision.

Under the ``etcd-v3`` rendezvous the agent hands its workers (through ``RESILIENT_GANG``)
the round they run in, the revision of etcd's ``state/round`` key when it started, and their
node's name. A checkpoint may be committed only while that round is still the current
one and the node still holds its lease: a node cut off from etcd, or one whose gang has
already re-formed without it, can then never publish a checkpoint that the new gang
might mix with its own. The check and the record are one etcd transaction.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from .._errors import ResilientError
from ._etcd import Etcd, EtcdSecurity, EtcdUnavailable, exists, same_revision

#: Set by the rendezvous in the agent's environment, which every worker inherits.
GANG_ENV = "RESILIENT_GANG"


class FencedError(ResilientError):
    """This worker's round is over: it must not commit anything."""


@dataclass(frozen=True)
class Gang:
    etcd: Etcd
    prefix: str
    round: int
    revision: int
    node: str
    lease_ttl: float

    @classmethod
    def from_env(cls) -> "Gang | None":
        """The gang this process runs in, or None outside the etcd-v3 launcher."""
        raw = os.environ.get(GANG_ENV)
        return cls.from_info(json.loads(raw)) if raw else None

    @classmethod
    def from_info(cls, info: dict) -> "Gang":
        """From what the rendezvous handed the workers (``RESILIENT_GANG``'s content)."""
        etcd = Etcd(info["endpoints"], timeout=5.0, security=EtcdSecurity.from_conf(info.get("tls", {})))
        etcd.authenticate()  # credentials: the environment inherited from the agent
        return cls(etcd, info["prefix"], int(info["round"]),
                   int(info["revision"]), info["node"], float(info["lease_ttl"]))

    def authorize_commit(self, step: int) -> None:
        """Record ``step`` as committed by this round, or raise :class:`FencedError`."""
        record = json.dumps({"round": self.round, "node": self.node, "at": time.time()})
        # etcd restarting or failing over must not cost a checkpoint: keep trying for as
        # long as our lease could still be alive. This runs in the background writer.
        deadline = time.monotonic() + self.lease_ttl
        while True:
            try:
                ok = self.etcd.transact(
                    [same_revision(self.prefix + "state/round", self.revision), exists(self.prefix + "nodes/" + self.node)],
                    [(f"{self.prefix}commits/{step:010d}", record, 0)])
                break
            except EtcdUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise FencedError(f"cannot commit step {step}: etcd is unreachable ({exc}), so this node "
                                      f"cannot prove it still belongs to round {self.round}") from None
                time.sleep(0.2)
        if not ok:
            raise FencedError(f"cannot commit step {step}: round {self.round} of the gang is over "
                              f"or node {self.node} lost its etcd lease (fenced)")

    def committed_steps(self) -> list[int]:
        kvs, _ = self.etcd.get_prefix(self.prefix + "commits/")
        return sorted(int(key.rsplit("/", 1)[1]) for key in kvs)
