"""Peer copies in memory: the server's contract, over real sockets on loopback."""

from __future__ import annotations

import os

import pytest

from resilient._format import MANIFEST
from resilient._peer_memory import PeerMemory
from resilient._regroup import RegroupError, parse_address

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    a, b = PeerMemory("tok", "127.0.0.1", reserve_bytes=0), PeerMemory("tok", "127.0.0.1", reserve_bytes=0)
    yield a, b
    a.close()
    b.close()


def wait_until(predicate, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


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


def test_only_the_newest_steps_are_kept(pair):
    a, b = pair
    for step in (1, 2, 3):
        assert b._answer({"token": "tok", "op": "put", "step": step, "name": "f"}, b"d")[0]["ok"]
    assert sorted(b._files) == [2, 3]


def test_a_wrong_token_or_a_path_in_the_name_is_refused(pair):
    _, b = pair
    assert b._answer({"token": "nope", "op": "get", "step": 1, "name": "f"}, b"")[0] == {"ok": False, "error": "bad token"}
    header, _ = b._answer({"token": "tok", "op": "put", "step": 1, "name": "../etc/passwd"}, b"x")
    assert not header["ok"] and "bad file name" in header["error"]
    intruder = PeerMemory("other", "127.0.0.1")
    try:
        intruder.set_peers([b.address], partner=None)
        assert intruder.fetch(1, ["f"]) == {}
    finally:
        intruder.close()


def test_a_copy_is_refused_when_host_memory_is_short():
    short = PeerMemory("tok", "127.0.0.1", reserve_bytes=1 << 60)  # never enough
    try:
        header, _ = short._answer({"token": "tok", "op": "put", "step": 1, "name": "f"}, b"x")
        assert header == {"ok": False, "error": "memory is short"} and not short._files
    finally:
        short.close()


def test_a_malformed_store_address_names_the_variable():
    with pytest.raises(RegroupError, match="RESILIENT_REGROUP_STORE='nohost' is not HOST:PORT/TOKEN"):
        parse_address("nohost")
    assert parse_address("127.0.0.1:29500/abc") == ("127.0.0.1", 29500, "abc")
