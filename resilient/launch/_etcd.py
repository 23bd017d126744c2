"""A small etcd v3 client for the rendezvous: key-value, transactions, leases, one watch.

Built on ``etcd3gw`` (etcd's JSON gateway, ``/v3/``): it is maintained, needs no gRPC or
protobuf (the ``etcd3`` package fails to import with protobuf 4+), and its only cost is
base64 in the payloads. What this module adds is what a long training run needs and a
thin client does not give:

* **several endpoints**: a request that cannot connect moves to the next member, so one
  etcd member down does not stop anyone;
* **a lease kept alive with retries** (:class:`LeaseKeeper`): a transient error or an etcd
  restart is retried within the lease's TTL; only a lease the server says is gone, or one
  not refreshed for a whole TTL, counts as lost (the node is then fenced);
* **a watch that survives** (:class:`PrefixMirror`): list, then watch from the next
  revision; when the stream breaks (etcd restarted, connection reset) it lists again and
  resumes, so a local mirror of the prefix is always eventually right.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

log = logging.getLogger(__name__)

#: Errors meaning "could not talk to etcd", as opposed to "etcd said no".
UNREACHABLE: tuple[type[BaseException], ...] = (
    ConnectionFailedError, ConnectionTimeoutError, requests.ConnectionError, requests.Timeout)


class EtcdUnavailable(ConnectionError):
    """No configured etcd endpoint answered."""


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


def parse_endpoints(spec: str) -> list[tuple[str, str, int]]:
    """``"h1:2379,http://h2:2379"`` → [(protocol, host, port), ...]; port defaults to 2379."""
    endpoints = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        protocol = "http"
        if "://" in item:
            protocol, item = item.split("://", 1)
        host, _, port = item.rstrip("/").rpartition(":")
        if not host:
            host, port = port, "2379"
        try:
            endpoints.append((protocol, host.strip("[]"), int(port)))
        except ValueError:
            raise ValueError(f"bad etcd endpoint {item!r} in --rdzv-endpoint {spec!r}: "
                             "expected HOST:PORT[,HOST:PORT...]") from None
    if not endpoints:
        raise ValueError("--rdzv-endpoint is empty: the etcd-v3 backend needs HOST:PORT of etcd")
    return endpoints


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(_unb64(raw["key"]).decode(), _unb64(raw.get("value")),
                    int(raw.get("mod_revision", 0)), int(raw.get("lease", 0)))


class Etcd:
    """The operations the rendezvous uses, with endpoint failover."""

    def __init__(self, endpoints: str, *, timeout: float = 5.0) -> None:
        self.spec = endpoints
        self.timeout = timeout
        self._endpoints = parse_endpoints(endpoints)
        self._clients = [Etcd3Client(host=h, port=p, protocol=proto, timeout=timeout, api_path="/v3/")
                         for proto, h, p in self._endpoints]
        self._current = 0
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: BaseException | None = None
        for attempt in range(len(self._clients)):
            with self._lock:
                index = (self._current + attempt) % len(self._clients)
            client = self._clients[index]
            try:
                result = client.post(client.get_url(path), json=body)
            except UNREACHABLE as exc:
                last = exc
                continue
            with self._lock:
                self._current = index
            return result
        raise EtcdUnavailable(f"etcd at {self.spec} is unreachable: {last}")

    def watch_url(self) -> str:
        protocol, host, port = self._endpoints[self._current]
        return f"{protocol}://{host}:{port}/v3/watch"

    def local_address(self) -> str:
        """The address of this machine's interface that routes to etcd (what peers can reach)."""
        _, host, port = self._endpoints[self._current]
        with socket.create_connection((host, port), timeout=self.timeout) as sock:
            return sock.getsockname()[0]

    # -- key-value --------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> tuple[dict[str, KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        result = self._call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = {kv.key: kv for kv in map(_kv, result.get("kvs", []))}
        return kvs, int(result["header"]["revision"])

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self._call("/kv/put", body)

    def transact(self, compares: Iterable[dict[str, Any]], puts: Iterable[tuple[str, bytes | str, int]]) -> bool:
        """Apply every put (key, value, lease) iff every compare holds; True when applied.

        Compares are built with :func:`same_revision` and :func:`exists`: a revision is the
        fencing token, so a writer holding a stale view can never overwrite a newer one.
        """
        success = []
        for key, value, lease in puts:
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                put["lease"] = lease
            success.append({"request_put": put})
        result = self._call("/kv/txn", {"compare": list(compares), "success": success, "failure": []})
        return bool(result.get("succeeded", False))

    # -- leases -----------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        return int(self._call("/lease/grant", {"TTL": int(ttl), "ID": 0})["ID"])

    def refresh(self, lease: int) -> int:
        """Seconds left on the lease after refreshing it; -1 when the server says it is gone."""
        result = self._call("/lease/keepalive", {"ID": lease}).get("result", {})
        return int(result.get("TTL", -1))

    def revoke(self, lease: int) -> None:
        try:
            self._call("/kv/lease/revoke", {"ID": lease})
        except Etcd3Exception:  # already expired: nothing to revoke
            pass


def same_revision(key: str, mod_revision: int) -> dict[str, Any]:
    """Compare: ``key`` was last modified at ``mod_revision`` (0: the key does not exist)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def exists(key: str) -> dict[str, Any]:
    """Compare: ``key`` exists (its version is above 0)."""
    return {"key": _b64(key), "target": "VERSION", "result": "GREATER", "version": 0}


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread, retrying through etcd hiccups.

    The lease is refreshed every TTL/3. A failed refresh is retried quickly; the lease is
    declared lost only when etcd answers that it no longer exists, or when no refresh has
    succeeded for a whole TTL (from then on etcd may have expired it, so this node must act
    as if it had: stop its workers, commit nothing).
    """

    def __init__(self, etcd: Etcd, ttl: int) -> None:
        self.etcd = etcd
        self.ttl = ttl
        self.lease = etcd.grant(ttl)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="resilient-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        while not self._stop.wait(interval if self._healthy() else 0.2):
            try:
                left = self.etcd.refresh(self.lease)
            except (EtcdUnavailable, Etcd3Exception) as exc:
                log.warning("etcd lease refresh failed (%s); retrying", exc)
                left = None
            if left is not None and left > 0:
                self._last_ok = time.monotonic()
            elif left is not None or time.monotonic() - self._last_ok >= self.ttl:
                self._declare_lost()
                return

    def _healthy(self) -> bool:
        return time.monotonic() - self._last_ok < self.ttl / 3.0 + 0.5

    def _declare_lost(self) -> None:
        log.error("etcd lease %x lost: this node is fenced out of the gang", self.lease)
        self.lost.set()

    def close(self, revoke: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if revoke and not self.lost.is_set():
            try:
                self.etcd.revoke(self.lease)
            except EtcdUnavailable:
                pass


class PrefixMirror:
    """A local, eventually exact copy of every key under a prefix, fed by one etcd watch.

    Readers call :meth:`snapshot` (no network) or :meth:`wait_change` to sleep until the
    mirror moves. Any break of the watch stream leads to a fresh list + watch, so etcd
    restarts and member failovers are absorbed without the caller noticing.
    """

    def __init__(self, etcd: Etcd, prefix: str) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self._kvs: dict[str, KeyValue] = {}
        self._version = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._response: requests.Response | None = None
        self._thread = threading.Thread(target=self._loop, name="resilient-watch", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, KeyValue]:
        with self._cond:
            return dict(self._kvs)

    @property
    def version(self) -> int:
        """Bumped on every change; pass it to :meth:`wait_change`."""
        with self._cond:
            return self._version

    def wait_change(self, version: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._version != version or self._stop.is_set(), timeout)
            return self._version

    def resync(self) -> None:
        """Break the current stream (it may sit on a dead connection); the loop lists again.

        The stream's socket is shut down rather than the response closed: closing from
        another thread blocks on the lock the reading thread holds.
        """
        response = self._response
        if response is None:
            return
        try:
            with socket.fromfd(response.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError, ValueError):  # already closed or not a socket any more
            pass

    def _replace(self, kvs: dict[str, KeyValue]) -> None:
        with self._cond:
            self._kvs = kvs
            self._version += 1
            self._cond.notify_all()

    def _apply(self, events: list[dict[str, Any]]) -> None:
        with self._cond:
            for event in events:
                kv = _kv(event["kv"])
                if event.get("type") == "DELETE":
                    self._kvs.pop(kv.key, None)
                else:
                    self._kvs[kv.key] = kv
            self._version += 1
            self._cond.notify_all()

    def _loop(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            try:
                kvs, revision = self.etcd.get_prefix(self.prefix)
                self._replace(kvs)
                self._stream(session, revision + 1)
            except Exception as exc:  # noqa: BLE001 - any break means: list and watch again
                if not self._stop.is_set():
                    log.debug("etcd watch on %s broke (%s); resyncing", self.prefix, exc)
            self._stop.wait(0.2)

    def _stream(self, session: requests.Session, start_revision: int) -> None:
        request = {"create_request": {
            "key": _b64(self.prefix), "range_end": _b64(prefix_end(self.prefix)),
            "start_revision": start_revision}}
        with session.post(self.etcd.watch_url(), json=request, stream=True,
                          timeout=(self.etcd.timeout, None)) as response:
            self._response = response
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("compact_revision") or result.get("canceled"):
                    return  # history compacted or watch cancelled: list again
                if result.get("events"):
                    self._apply(result["events"])

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self.resync()
        self._thread.join(timeout=2)
