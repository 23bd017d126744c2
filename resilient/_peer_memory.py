"""Copies of committed checkpoint files in the host memory of a peer on another node.

With node-local disks, losing a node loses its ranks' files for every step until the
object store has them, and the object store is the slowest tier to restore from. After each
commit every rank sends its data file (and the manifest) to one peer on another node,
which holds the newest ``keep`` steps in RAM. An in-process recovery then restores the lost
node's share from a survivor's memory, at network speed, with the remote tier unused.

Each process runs a small TCP server bound to the interface that reaches the gang's store
(loopback in tests). Requests carry the gang's token, so only members read or write. A
server refuses a copy that would leave less than ``reserve_bytes`` of host memory
available (peer copies are a cache: refusing one costs nothing but a slower restore).

Wire format: a 4-byte big-endian header length, a JSON header, then ``length`` payload
bytes. Requests: ``put`` (step, name, length + bytes), ``get`` (step, name), ``steps``.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ._format import MANIFEST

__all__ = ["PeerMemory", "available_memory", "interface_towards"]

log = logging.getLogger("resilient")

_HEADER = struct.Struct(">I")


def available_memory() -> int | None:
    """Bytes of host memory available to new allocations (Linux), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(raw)) + raw)
    if payload:
        sock.sendall(payload)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    header = json.loads(_recv_exact(sock, size))
    payload = _recv_exact(sock, int(header.get("length", 0))) if header.get("length") else b""
    return header, payload


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class PeerMemory:
    """This process's memory tier: a server holding peers' files, and a client of theirs."""

    def __init__(self, token: str, host: str, *, keep: int = 2, reserve_bytes: int = 2 << 30) -> None:
        self.token, self.keep, self.reserve_bytes = token, keep, reserve_bytes
        self._files: dict[int, dict[str, bytes]] = {}   # step -> file name -> bytes (peers')
        self._own: dict[int, dict[str, str]] = {}       # step -> file name -> local path (ours)
        self._lock = threading.Lock()
        self._peer_source: list[str] | Callable[[], list[str]] = []  # every member's address (ours included)
        self._peers_known: list[str] | None = None
        self._partner: str | None = None   # where our own files go
        self._send_lock = threading.Lock()
        self._pending: tuple[int, dict[str, str]] | None = None
        self._sender_wake = threading.Event()
        self._closed = False
        memory = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    header, payload = _recv(self.request)
                    _send(self.request, *memory._answer(header, payload))
                except (ConnectionError, ValueError, OSError) as exc:
                    log.debug("resilient: peer memory request failed: %s", exc)

        self._server = _Server((host, 0), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="resilient-peer-memory", daemon=True).start()
        threading.Thread(target=self._send_loop, name="resilient-peer-copy", daemon=True).start()

    # -- server side ---------------------------------------------------------------------------
    def _answer(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        if header.get("token") != self.token:
            return {"ok": False, "error": "bad token"}, b""
        op = header.get("op")
        if op == "put":
            return self._put(int(header["step"]), str(header["name"]), payload), b""
        if op == "get":
            data = self._lookup(int(header["step"]), str(header["name"]))
            return ({"ok": True, "length": len(data)}, data) if data is not None else ({"ok": False}, b"")
        if op == "steps":
            with self._lock:
                steps = {s for s, files in self._files.items() if MANIFEST in files}
                steps |= {s for s, files in self._own.items() if MANIFEST in files}
            return {"ok": True, "steps": sorted(steps)}, b""
        return {"ok": False, "error": f"unknown op {op!r}"}, b""

    def _lookup(self, step: int, name: str) -> bytes | None:
        """A peer's copy from memory, or our own file of a recent step (page cache)."""
        with self._lock:
            data = self._files.get(step, {}).get(name)
            path = self._own.get(step, {}).get(name)
        if data is None and path is not None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:  # deleted by retention meanwhile
                return None
        return data

    def _put(self, step: int, name: str, data: bytes) -> dict[str, Any]:
        if "/" in name or name.startswith("."):
            return {"ok": False, "error": f"bad file name {name!r}"}
        free = available_memory()
        if free is not None and free - len(data) < self.reserve_bytes:
            log.warning("resilient: not keeping a peer copy of %s (step %d): %d MiB of host memory available",
                        name, step, free >> 20)
            return {"ok": False, "error": "memory is short"}
        with self._lock:
            self._files.setdefault(step, {})[name] = data
            for old in sorted(self._files)[:-self.keep]:
                del self._files[old]
        return {"ok": True}

    # -- client side ---------------------------------------------------------------------------
    def set_peers(self, addresses: list[str] | Callable[[], list[str]], partner: str | None) -> None:
        """The gang's memory servers, and the one (on another node) that keeps our copies.

        ``addresses`` may be a function: a gang of thousands then reads its member list only
        if a restore really has to look for files in peers' memory.
        """
        self._peer_source, self._partner = addresses, partner
        self._peers_known: list[str] | None = None

    @property
    def _peers(self) -> list[str]:
        if self._peers_known is None:
            source = self._peer_source
            self._peers_known = list(source() if callable(source) else source)
        return self._peers_known

    def _request(self, address: str, header: dict[str, Any], payload: bytes = b"",
                 timeout: float = 30.0) -> tuple[dict[str, Any], bytes]:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            _send(sock, {**header, "token": self.token, "length": len(payload)}, payload)
            return _recv(sock)

    def replicate(self, step: int, files: dict[str, str]) -> None:
        """Serve ``files`` (name -> local path) of committed ``step`` to the gang, and send
        them to our partner in the background (only the newest step waiting is sent)."""
        with self._lock:
            self._own[step] = dict(files)
            for old in sorted(self._own)[:-self.keep]:
                del self._own[old]
        if self._partner is None:
            return
        with self._send_lock:
            self._pending = (step, dict(files))
        self._sender_wake.set()

    def _send_loop(self) -> None:
        while self._sender_wake.wait():
            self._sender_wake.clear()
            if self._closed:
                return
            with self._send_lock:
                job, self._pending = self._pending, None
            partner = self._partner
            if job is None or partner is None:
                continue
            step, files = job
            try:
                for name, path in sorted(files.items(), key=lambda kv: kv[0] == MANIFEST):  # manifest last
                    with open(path, "rb") as f:
                        data = f.read()
                    answer, _ = self._request(partner, {"op": "put", "step": step, "name": name}, data)
                    if not answer.get("ok"):
                        log.info("resilient: peer %s kept no copy of step %d: %s", partner, step, answer.get("error"))
                        break
            except OSError as exc:  # includes a file deleted by retention meanwhile, a gone peer
                log.info("resilient: peer copy of step %d to %s failed: %s", step, partner, exc)

    def steps(self) -> set[int]:
        """Steps whose manifest some live member holds in memory."""
        found: set[int] = set()
        for address in self._peers:
            try:
                answer, _ = self._request(address, {"op": "steps"}, timeout=2.0)
                found.update(int(s) for s in answer.get("steps", []))
            except OSError:
                continue
        return found

    def fetch(self, step: int, names: list[str]) -> dict[str, bytes]:
        """Whatever of ``names`` (files of ``step``) some live member holds."""
        def one(name: str) -> tuple[str, bytes | None]:
            for address in self._peers:
                try:
                    answer, data = self._request(address, {"op": "get", "step": step, "name": name})
                except OSError:
                    continue
                if answer.get("ok"):
                    return name, data
            return name, None

        if not names:
            return {}
        with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
            return {name: data for name, data in pool.map(one, names) if data is not None}

    def close(self) -> None:
        self._closed = True
        self._sender_wake.set()
        self._server.shutdown()
        self._server.server_close()


def interface_towards(host: str, port: int) -> str:
    """The local address this host uses to reach ``host`` (where peers can reach us)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
