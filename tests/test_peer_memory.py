"""Peer copies in memory: the server's contract, over real sockets on loopback."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from resilient._format import MANIFEST
from resilient._peer_memory import PeerMemory
from resilient._regroup import RegroupError, parse_address

from .waiting import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    a, b = PeerMemory("tok", "127.0.0.1", reserve_bytes=0), PeerMemory("tok", "127.0.0.1", reserve_bytes=0)
    yield a, b
    a.close()
    b.close()


def write(tmp_path, name: str, data: bytes) -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_a_committed_file_reaches_the_partner_and_any_member_can_fetch_it(tmp_path, pair):
    a, b = pair
    a.set_peers([a.address, b.address], partner=b.address)
    b.set_peers([a.address, b.address], partner=a.address)
    files = {"rank-00000.data": write(tmp_path, "r0", b"x" * 100_000), MANIFEST: write(tmp_path, "m", b"{}")}
    a.replicate(7, files)
    wait_until(lambda: 7 in b._files and MANIFEST in b._files[7])
    os.remove(files["rank-00000.data"])  # a's own copy gone (its node lost): b's memory still has it
    a.set_peers([b.address], partner=None)
    assert a.fetch(7, ["rank-00000.data", "rank-00009.data"]) == {"rank-00000.data": b"x" * 100_000}
    assert b.steps() == {7}


def test_own_files_are_served_from_the_local_tier(tmp_path, pair):
    a, b = pair
    a.replicate(3, {"rank-00000.data": write(tmp_path, "r0", b"own"), MANIFEST: write(tmp_path, "m", b"{}")})
    b.set_peers([a.address], partner=None)
    assert b.fetch(3, ["rank-00000.data"]) == {"rank-00000.data": b"own"}
    assert b.steps() == {3}


def _put(client, server, step, name, data):
    return client._request(server.address, {"op": "put", "step": step, "name": name}, data)[0]


def test_only_the_newest_steps_are_kept(pair):
    a, b = pair
    for step in (1, 2, 3):
        assert _put(a, b, step, "f", b"d")["ok"]
    assert sorted(b._files) == [2, 3]


def test_a_wrong_token_or_a_path_in_the_name_is_refused(pair):
    a, b = pair
    assert _put(a, b, 1, "../etc/passwd", b"x") == {"ok": False, "error": "bad file name '../etc/passwd'"}
    intruder = PeerMemory("other", "127.0.0.1")
    try:
        intruder.set_peers([b.address], partner=None)
        assert intruder.fetch(1, ["f"]) == {}
        with pytest.raises(ConnectionError):
            _put(intruder, b, 1, "f", b"x")
        assert 1 not in b._files
    finally:
        intruder.close()


def test_a_copy_is_refused_when_host_memory_is_short(pair):
    a, _ = pair
    short = PeerMemory("tok", "127.0.0.1", reserve_bytes=1 << 60)  # never enough
    try:
        assert _put(a, short, 1, "f", b"x" * 1000) == {"ok": False, "error": "memory is short"}
        assert not short._files
    finally:
        short.close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_unauthenticated_connections_cost_nothing(pair, request):
    """Claims of huge headers or payloads, garbage, idle sockets and floods: the server reads
    at most 48 bytes from a client that cannot prove the token, allocates nothing it claims,
    times idle sockets out, serves a bounded number at once, and still serves members."""
    import resource

    from resilient import _peer_memory

    a, _ = pair
    b = PeerMemory("tok", "127.0.0.1", reserve_bytes=0, idle_timeout=1.0)
    request.addfinalizer(b.close)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for attack in (struct.pack(">I", 0xFFFFFFFF), b"\x00" * 48, b"x" * 4096, struct.pack(">I", 1 << 30) + b"{"):
        sock = _connect(b.address)
        sock.recv(16)  # the server's nonce
        try:
            sock.sendall(attack)
        except OSError:
            pass
        assert _closed_by_server(sock), attack[:8]
        sock.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    flood = [_connect(b.address) for _ in range(_peer_memory.MAX_CONNECTIONS + 8)]
    try:
        time.sleep(0.5)
        refused = 0
        for sock in flood:
            sock.settimeout(0.2)
            try:
                first = sock.recv(16)
            except socket.timeout:
                continue
            refused += first == b""
        assert refused >= 8  # beyond the bound: closed unread
    finally:
        for sock in flood:
            sock.close()
    assert _put(a, b, 6, "g", b"fine")["ok"]  # members are served once the flood is gone


def test_a_malformed_store_address_names_the_variable():
    with pytest.raises(RegroupError, match="RESILIENT_REGROUP_STORE='nohost' is not HOST:PORT/TOKEN"):
        parse_address("nohost")
    assert parse_address("127.0.0.1:29500/abc") == ("127.0.0.1", 29500, "abc")
