"""The regroup store and the peer-memory tier trust nobody who lacks the job's secret: the
secret never passes through a store a neighbour can read, every value is sealed, and a
peer's copy of a manifest is accepted only if it is the one committed."""

import json
import logging
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from resilient import CheckpointCorruptError, Checkpointer
from resilient._format import MANIFEST
from resilient._peer_memory import PeerMemory
from resilient._regroup import Regroup, connect, peer_token, raise_failed
from resilient._sealed import ForgedValueError, derive, new_secret
from resilient.launch._inprocess import KEY, UNGUARDED_SECRET_KEY, InProcessRecovery
from resilient.launch.rendezvous import create_handler

from .test_rendezvous import rendezvous_all

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def store_server():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server, f"127.0.0.1:{server.port}/round7"


def _raw_client(port: int) -> dist.TCPStore:
    """What a network neighbour has: the store's port and a client."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_values_written_without_the_secret_are_refused_naming_the_key(store_server):
    server, address = store_server
    secret = new_secret()
    ours = connect(address, secret, 5.0)
    ours.set("latest", "3")
    ours.append("dead", "host:1")
    assert ours.get("latest") == b"3" and ours.read_log("dead", 0) == (["host:1"], len(ours.inner.inner.get("dead")))

    # a neighbour who watched the traffic knows the namespace, not the secret
    namespace = derive(secret, "regroup-store:round7")[:32]
    sniffer = dist.PrefixStore(f"{namespace}/", _raw_client(server.port))
    sniffer.set("members/0", json.dumps({"number": 0, "members": []}))
    with pytest.raises(ForgedValueError, match="'members/0' holds a value not written by this job"):
        ours.get("members/0")
    sniffer.set("failed/1", sniffer.get("latest"))  # a genuine sealed value, moved to another key
    with pytest.raises(ForgedValueError, match="'failed/1'"):
        ours.get("failed/1")
    sniffer.append("dead", b"0" * 32 + b" victim:2\n")
    with pytest.raises(ForgedValueError, match="log 'dead'"):
        ours.read_log("dead", 0)
    # another round's store, same secret: its values do not open here either
    other = connect(f"127.0.0.1:{server.port}/round8", secret, 5.0)
    other.inner.inner.set("x", ours.inner.inner.get("latest"))
    with pytest.raises(ForgedValueError):
        other.get("x")
    # a first-writer-wins key already taken by a forgery: the real write fails loudly
    sniffer.set("failed/2", "forged")
    with pytest.raises(ForgedValueError):
        raise_failed(ours, 2, "a real failure")
    # without the namespace a neighbour does not even find the keys
    assert not _raw_client(server.port).check(["latest", "round7/latest", "members/0"])


def test_a_member_with_another_secret_never_joins_the_gang(store_server):
    _, address = store_server
    secret = new_secret()
    member = Regroup(address, secret=secret, node="n0", rank=0, initial_world_size=1, heartbeat=False, timeout=20)
    intruder = Regroup(address, secret=new_secret(), node="evil", rank=0, initial_world_size=1, heartbeat=False,
                       timeout=20)
    try:
        gen = member.form(None)
        assert gen.world_size == 1 and [m.id for m in member.members(gen)] == [member.me]
        # the intruder forms a "gang" of its own in a namespace nobody else reads
        assert intruder.form(None).world_size == 1
        assert [m.node for m in member.members(gen)] == ["n0"]
    finally:
        member.close()
        intruder.close()


def test_with_etcd_the_secret_is_never_in_the_round_store(etcd_server):
    """The round's secret travels in etcd (behind its TLS and authentication); the TCPStore
    that anyone can reach holds only the regroup store's address."""
    handlers = [create_handler(RendezvousParameters("etcd-v3", etcd_server.endpoint, "sealed-run", 2, 2,
                                                    local_addr="127.0.0.1", lease_ttl=3, last_call_timeout=1))
                for _ in range(2)]
    try:
        infos = rendezvous_all(handlers)
        secrets_seen = {h.round_secret for h in handlers}
        assert len(secrets_seen) == 1 and None not in secrets_seen
        secret = secrets_seen.pop()
        by_rank = sorted(zip(infos, handlers), key=lambda p: p[0].rank)
        recoveries = [InProcessRecovery.for_round(info.store, info.rank, h.node, h.round_secret) for info, h in by_rank]
        try:
            assert not infos[0].store.check([UNGUARDED_SECRET_KEY])
            assert secret not in infos[0].store.get(KEY).decode()
            assert all(r.secret == secret for r in recoveries)
            recoveries[1].mark_dead(4242)  # the agents share one sealed store
            opened = connect(recoveries[0].address, secret, 5.0)
            assert opened.read_log("dead", 0)[0][0].endswith(":4242")
        finally:
            for r in recoveries:
                r.close(wait=True)
    finally:
        for h in handlers:
            h.shutdown()


def test_without_etcd_or_a_job_secret_the_agent_says_what_it_trusts(store_server, caplog):
    server, _ = store_server
    round_store = dist.PrefixStore("/round-1", server)
    with caplog.at_level(logging.WARNING):
        host = InProcessRecovery.for_round(round_store, 0, "a")
        other = InProcessRecovery.for_round(round_store, 1, "b")
    try:
        assert host.secret == other.secret
        # said once the workers turn out to recover in-process, not to every job
        assert not host.active() and "readable by whoever reaches it" not in caplog.text
        with caplog.at_level(logging.WARNING):
            connect(host.address, host.secret, 5.0).set("elastic", "1")  # what a worker's Regroup does
            deadline = time.monotonic() + 10
            while not host.active() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert host.active()
        assert caplog.text.count("readable by whoever reaches it") == 1 and "RESILIENT_JOB_SECRET" in caplog.text
    finally:
        host.close(wait=True)
        other.close(wait=True)


# -- a peer's copy of a manifest ---------------------------------------------------------------

def _state(step: int) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) + step, "meta": {"step": step}}


def test_a_peers_manifest_is_accepted_only_if_it_is_the_committed_one(tmp_path, store_server, caplog):
    """Node A commits step 5 and sends its file and manifest to B's memory; rank 0 records the
    manifest's digest in the sealed store. A fresh node restores from B's memory. When B
    serves a manifest of its own making (checksums consistent with the data it sends), the
    copy is refused and nothing is restored from it."""
    _, address = store_server
    secret = new_secret()
    ledger = Regroup(address, secret=secret, node="ledger", rank=0, initial_world_size=1, heartbeat=False)
    token = peer_token(address, secret)
    servers = {n: PeerMemory(token, "127.0.0.1", reserve_bytes=0) for n in "abcd"}
    for memory in servers.values():
        memory.ledger = ledger
    a, b = servers["a"], servers["b"]
    a.set_peers([a.address, b.address], partner=b.address)
    try:
        with Checkpointer(str(tmp_path / "a"), _memory=a) as ckpt:
            ckpt.save(5, _state(5))
            ckpt.wait()
        deadline = time.monotonic() + 10
        while MANIFEST not in b._files.get(5, {}):
            assert time.monotonic() < deadline, "the copy never reached b"
            time.sleep(0.02)
        committed = b._files[5][MANIFEST]

        servers["c"].set_peers([b.address], partner=None)
        target = _state(0)
        with Checkpointer(str(tmp_path / "c"), _memory=servers["c"]) as ckpt:
            assert ckpt.restore(target) == 5
        assert torch.equal(target["w"], _state(5)["w"])

        # B rewrites the manifest (same data, same checksums, a changed field): refused
        forged = json.loads(committed)
        forged["meta"] = {**forged.get("meta", {}), "note": "served by b"}
        b._files[5][MANIFEST] = json.dumps(forged).encode()
        servers["d"].set_peers([b.address], partner=None)
        with caplog.at_level(logging.WARNING, logger="resilient"):
            with Checkpointer(str(tmp_path / "d"), _memory=servers["d"]) as ckpt:
                # nothing else to load: refused, not a fresh start that would throw the run away
                with pytest.raises(CheckpointCorruptError, match="step\\(s\\) 5 are committed but cannot be loaded"):
                    ckpt.restore(_state(0))
        assert "differs from the manifest committed for step 5" in caplog.text
        assert not os.path.exists(tmp_path / "d" / "step-0000000005")
    finally:
        for memory in servers.values():
            memory.close()
        ledger.close()
