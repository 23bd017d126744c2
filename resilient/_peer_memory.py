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

Wire format (one request per connection): the server sends a 16-byte nonce; the client
answers with its own nonce and HMAC-SHA256(token, both nonces), and nothing else is read
from a client that fails that check (constant-time compare). The server proves the token
back the same way. Then each message is a 4-byte big-endian header length (at most 64 KiB),
a JSON header, ``length`` payload bytes (capped: a ``put`` is refused before its payload is
read when host memory is short), and an HMAC of all of it under the token and both nonces,
so a message cannot be forged, altered or replayed on another connection. Sockets time out
when idle; at most ``MAX_CONNECTIONS`` are served at once. Requests: ``put`` (step, name,
bytes), ``get`` (step, name; files are streamed from disk), ``steps``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from ._errors import CheckpointCorruptError
from ._format import MANIFEST

__all__ = ["PeerMemory", "available_memory", "interface_towards"]

log = logging.getLogger("resilient")

_HEADER = struct.Struct(">I")
_NONCE, _MAC = 16, 32
_MAX_HEADER = 64 << 10
_MAX_PAYLOAD = 1 << 40  # a ceiling only; puts are admitted against available memory first
_BLOCK = 4 << 20
MAX_CONNECTIONS = 32  # served at once; more are closed at once
IDLE_TIMEOUT = 10.0  # seconds a socket may sit without progress


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


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


class AuthError(ConnectionError):
    """The other end does not hold the gang's token, or a message was altered."""


class _Channel:
    """One authenticated connection: nonces exchanged, then MAC'd messages both ways."""

    def __init__(self, sock: socket.socket, token: str, client_nonce: bytes, server_nonce: bytes,
                 client: bool) -> None:
        self.sock, self._key = sock, token.encode()
        self._context = client_nonce + server_nonce  # binds every MAC to this connection
        self._send_label, self._recv_label = (b"c", b"s") if client else (b"s", b"c")

    @classmethod
    def accept(cls, sock: socket.socket, token: str) -> "_Channel":
        """Server side: nothing but 48 bytes is read before the client proved the token."""
        nonce = secrets.token_bytes(_NONCE)
        sock.sendall(nonce)
        proof = _recv_exact(sock, _NONCE + _MAC)
        client_nonce = bytes(proof[:_NONCE])
        want = hmac.new(token.encode(), b"hello-c" + nonce + client_nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(bytes(proof[_NONCE:]), want):
            raise AuthError("client did not prove the token")
        sock.sendall(hmac.new(token.encode(), b"hello-s" + client_nonce + nonce, hashlib.sha256).digest())
        return cls(sock, token, client_nonce, nonce, client=False)

    @classmethod
    def connect(cls, sock: socket.socket, token: str) -> "_Channel":
        server_nonce = bytes(_recv_exact(sock, _NONCE))
        nonce = secrets.token_bytes(_NONCE)
        sock.sendall(nonce + hmac.new(token.encode(), b"hello-c" + server_nonce + nonce, hashlib.sha256).digest())
        want = hmac.new(token.encode(), b"hello-s" + nonce + server_nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(bytes(_recv_exact(sock, _MAC)), want):
            raise AuthError("server did not prove the token")
        return cls(sock, token, nonce, server_nonce, client=True)

    def _mac(self, label: bytes) -> "hmac.HMAC":
        return hmac.new(self._key, label + self._context, hashlib.sha256)

    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"", *, stream: str | None = None) -> None:
        """Send one message; ``stream``: a file whose bytes are the payload, read in blocks."""
        length = len(payload) if stream is None else os.path.getsize(stream)
        raw = json.dumps({**header, "length": length}).encode()
        mac = self._mac(self._send_label)
        head = _HEADER.pack(len(raw)) + raw
        mac.update(head)
        self.sock.sendall(head)
        if stream is None:
            mac.update(payload)
            if payload:
                self.sock.sendall(payload)
        else:
            sent = 0
            with open(stream, "rb") as f:
                while block := f.read(_BLOCK):
                    mac.update(block)
                    self.sock.sendall(block)
                    sent += len(block)
            if sent != length:
                raise OSError(f"{stream} changed while it was sent")
        self.sock.sendall(mac.digest())

    def recv(self, admit: Callable[[dict[str, Any]], None] = lambda header: None) -> tuple[dict[str, Any], bytes]:
        """One message. ``admit(header)`` runs before the payload is read and raises to
        refuse it (too big, memory short)."""
        prefix = _recv_exact(self.sock, _HEADER.size)
        (size,) = _HEADER.unpack(prefix)
        if size > _MAX_HEADER:
            raise AuthError(f"header of {size} bytes")
        raw = _recv_exact(self.sock, size)
        header = json.loads(raw)
        length = header.get("length", 0) if isinstance(header, dict) else None
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= _MAX_PAYLOAD:
            raise AuthError("malformed header")
        admit(header)
        payload = _recv_exact(self.sock, length)
        mac = self._mac(self._recv_label)
        mac.update(prefix)
        mac.update(raw)
        mac.update(payload)
        if not hmac.compare_digest(bytes(_recv_exact(self.sock, _MAC)), mac.digest()):
            raise AuthError("message failed its MAC")
        del header["length"]  # framing, not content
        return header, bytes(payload)


class _Refused(Exception):
    """A request refused before its payload was read (the reply says why)."""


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


class ManifestLedger(Protocol):
    """Where the digest of each committed manifest is kept, out of the peers' reach (the
    sealed regroup store): a peer's copy of a manifest is accepted only if it matches."""

    def record_manifest(self, step: int, digest: str) -> None: ...

    def manifest_digest(self, step: int) -> str | None: ...


class PeerMemory:
    """This process's memory tier: a server holding peers' files, and a client of theirs."""

    #: see ManifestLedger; without one, no manifest from a peer is accepted
    ledger: ManifestLedger | None = None

    def __init__(self, token: str, host: str, *, keep: int = 2, reserve_bytes: int = 2 << 30,
                 idle_timeout: float = IDLE_TIMEOUT) -> None:
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
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if not slots.acquire(blocking=False):
                    return  # too many at once: closed without reading a byte
                try:
                    self.request.settimeout(idle_timeout)
                    memory._serve(_Channel.accept(self.request, memory.token))
                except (ConnectionError, ValueError, KeyError, TypeError, OSError) as exc:
                    log.debug("resilient: peer memory request refused or failed: %s", exc)
                finally:
                    slots.release()

        self._server = _Server((host, 0), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="resilient-peer-memory", daemon=True).start()
        threading.Thread(target=self._send_loop, name="resilient-peer-copy", daemon=True).start()

    # -- server side ---------------------------------------------------------------------------
    def _serve(self, channel: _Channel) -> None:
        """One authenticated request: read (a put is admitted before its bytes are), answer."""
        try:
            header, payload = channel.recv(admit=self._admit)
        except _Refused as refused:
            channel.send({"ok": False, "error": str(refused)})
            return
        op = header.get("op")
        if op == "put":
            channel.send(self._put(int(header["step"]), str(header["name"]), payload))
        elif op == "get":
            found = self._lookup(int(header["step"]), str(header["name"]))
            if found is None:
                channel.send({"ok": False})
            elif isinstance(found, str):
                channel.send({"ok": True}, stream=found)  # our own file: streamed, not loaded
            else:
                channel.send({"ok": True}, found)
        elif op == "steps":
            with self._lock:
                steps = {s for s, files in self._files.items() if MANIFEST in files}
                steps |= {s for s, files in self._own.items() if MANIFEST in files}
            channel.send({"ok": True, "steps": sorted(steps)})
        else:
            channel.send({"ok": False, "error": f"unknown op {str(op)[:40]!r}"})

    def _admit(self, header: dict[str, Any]) -> None:
        """Before a put's bytes are read: refuse bad names and what memory cannot hold."""
        if header.get("op") != "put":
            if header.get("length"):
                raise _Refused("only a put carries bytes")
            return
        name, length = str(header.get("name")), header["length"]
        if "/" in name or name.startswith("."):
            raise _Refused(f"bad file name {name[:80]!r}")
        free = available_memory()
        if free is not None and free - length < self.reserve_bytes:
            log.warning("resilient: not keeping a peer copy of %s (step %s): %d MiB of host memory available",
                        name, header.get("step"), free >> 20)
            raise _Refused("memory is short")

    def _lookup(self, step: int, name: str) -> bytes | str | None:
        """A peer's copy from memory, or the path of our own file of a recent step."""
        with self._lock:
            data = self._files.get(step, {}).get(name)
            path = self._own.get(step, {}).get(name)
        if data is None and path is not None and os.path.exists(path):  # else deleted by retention
            return path
        return data

    def _put(self, step: int, name: str, data: bytes) -> dict[str, Any]:
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
                 timeout: float = 30.0, stream: str | None = None) -> tuple[dict[str, Any], bytes]:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            channel = _Channel.connect(sock, self.token)
            try:
                channel.send(header, payload, stream=stream)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before our bytes were read: the answer, already sent, says why
            return channel.recv()

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
                    answer, _ = self._request(partner, {"op": "put", "step": step, "name": name}, stream=path)
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

    def record_manifest(self, step: int, raw: bytes) -> None:
        """Rank 0, after a commit: the digest a peer's copy of this manifest must match."""
        if self.ledger is None:
            return
        try:
            self.ledger.record_manifest(step, hashlib.sha256(raw).hexdigest())
        except Exception as exc:  # the store is gone: peers' copies of this step will be refused
            log.warning("resilient: could not record step %d's manifest digest (%s); peers' copies of it "
                        "will not be accepted", step, exc)

    def check_manifest(self, step: int, raw: bytes, where: str) -> None:
        """Accept a manifest fetched from a peer only if it is the one committed: checksums
        that agree with the manifest they came with prove nothing when both come from the
        same peer."""
        expected = self.ledger.manifest_digest(step) if self.ledger is not None else None
        if expected is None:
            raise CheckpointCorruptError(f"{where}: no record of step {step}'s committed manifest to check a "
                                         "peer's copy against: not accepted")
        if not hmac.compare_digest(hashlib.sha256(raw).hexdigest(), expected):
            raise CheckpointCorruptError(f"{where}: differs from the manifest committed for step {step}: "
                                         "not accepted")

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
