"""A small etcd v3 client for the rendezvous: key-value, transactions, leases, one watch.

Speaks etcd's JSON gateway (``/v3/``): no gRPC or protobuf (the ``etcd3`` package fails to
import with protobuf 4+), at the cost of base64 in the payloads. Requests go through
:mod:`._etcd_http` (persistent connections, a fraction of ``requests``' CPU per call), watch
streams too, and errors are ``etcd3gw``'s exception types. What this module adds is what
a long training run needs and a thin client does not give:

* **several endpoints**: a request that cannot connect moves to the next member, so one
  etcd member down does not stop anyone;
* **a lease kept alive with retries** (:class:`LeaseKeeper`): a transient error or an etcd
  restart is retried; a lease not refreshed for a whole TTL is *overdue* (a running node
  is then fenced), and only a lease the server says is gone is *lost* (register again);
* **a watch that survives** (:class:`PrefixMirror`): list, then watch from the next
  revision; when the stream breaks (etcd restarted, connection reset) it lists again and
  resumes, so a local mirror of the prefix is always eventually right;
* **a watch on deletions only** (:class:`DeletionWatch`): etcd filters out every put on
  the server, so an agent learns of lost leases without receiving the O(N) registrations of
  a large gang;
* **request accounting** (:attr:`Etcd.stats`): requests and bytes per call path, which the
  scale benchmark reports per agent per round.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from etcd3gw.exceptions import Etcd3Exception

from .._background import spread
from ._etcd_http import JsonTransport, Stream, Unreachable

log = logging.getLogger(__name__)

T = TypeVar("T")


class EtcdUnavailable(ConnectionError):
    """No configured etcd endpoint answered."""


class EtcdSecurityError(PermissionError):
    """TLS or authentication with etcd failed: a configuration error, not retried."""


#: environment variables with the etcd user and its password (or a file holding it): never
#: on a command line, where every user of the machine can read it
USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV = "RESILIENT_ETCD_USER", "RESILIENT_ETCD_PASSWORD", "RESILIENT_ETCD_PASSWORD_FILE"
#: ``--rdzv-conf`` keys for TLS (torch's etcd rendezvous uses the same names)
TLS_KEYS = ("protocol", "cacert", "cert", "key")


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a production etcd: TLS (``cacert`` to verify the server, ``cert`` and
    ``key`` to prove the client) and a user with a password (etcd's authentication)."""

    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_conf(cls, conf: dict[str, Any], env: Mapping[str, str] = os.environ) -> "EtcdSecurity":
        """From ``--rdzv-conf`` keys (paths only) and the environment (credentials)."""
        tls = {k: str(conf[k]) for k in TLS_KEYS if conf.get(k) not in (None, "")}
        for name in ("cacert", "cert", "key"):
            if name in tls and not os.path.isfile(tls[name]):
                raise EtcdSecurityError(f"--rdzv-conf {name}={tls[name]}: no such file")
        if ("cert" in tls) != ("key" in tls):
            raise EtcdSecurityError("--rdzv-conf needs both cert= and key= (the client certificate and its key)")
        protocol = tls.pop("protocol", "https" if tls else "http")
        if protocol not in ("http", "https"):
            raise EtcdSecurityError(f"--rdzv-conf protocol={protocol}: expected http or https")
        password = env.get(PASSWORD_ENV)
        if password is None and env.get(PASSWORD_FILE_ENV):
            with open(env[PASSWORD_FILE_ENV]) as f:
                password = f.read().strip()
        user = env.get(USER_ENV) or None
        if (user is None) != (password is None):
            raise EtcdSecurityError(f"set both {USER_ENV} and {PASSWORD_ENV} (or {PASSWORD_FILE_ENV}), or neither")
        return cls(protocol, tls.get("cacert"), tls.get("cert"), tls.get("key"), user, password)

    def to_conf(self) -> dict[str, str]:
        """What workers need to reach etcd the same way: paths, never the password (they
        inherit the environment it came from)."""
        return {k: v for k, v in (("protocol", self.protocol), ("cacert", self.cacert), ("cert", self.cert),
                                  ("key", self.key)) if v}


def _tls_failure(exc: BaseException) -> str | None:
    """The TLS error behind a failed request, if that is what it was: the transport wraps
    the socket's error, so the SSL reason may sit in the exception's chain."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        text = str(seen)
        if any(mark in text for mark in ("SSL", "CERTIFICATE", "certificate", "TLS")):
            return text
        seen = seen.__cause__ or seen.__context__
    return None


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


def parse_endpoints(spec: str, default_protocol: str = "http") -> list[tuple[str, str, int]]:
    """``"h1:2379,https://h2:2379"`` → [(protocol, host, port), ...]; port defaults to 2379."""
    endpoints = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        protocol = default_protocol
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

    def __init__(self, endpoints: str, *, timeout: float = 5.0, security: EtcdSecurity | None = None) -> None:
        self.spec = endpoints
        self.timeout = timeout
        self.security = security or EtcdSecurity()
        self._endpoints = parse_endpoints(endpoints, self.security.protocol)
        try:
            self._transport = JsonTransport(self._endpoints, timeout=timeout, cacert=self.security.cacert,
                                            cert=self.security.cert, key=self.security.key)
        except (ssl.SSLError, OSError) as exc:  # not a certificate, or a key that does not match it
            raise EtcdSecurityError(f"--rdzv-conf cacert={self.security.cacert} cert={self.security.cert} "
                                    f"key={self.security.key}: cannot be loaded for TLS ({exc})") from None
        # a large gang spreads its requests over the members instead of all loading the first
        self._current = spread(len(self._endpoints))
        self._lock = threading.Lock()
        #: ``"<path> requests"`` and ``"<path> bytes"`` (request + response bodies) per call
        #: path (``/kv/txn``, ``/watch``...): what the scale benchmark divides by agents and rounds
        self.stats: Counter[str] = Counter()

    # -- plumbing ---------------------------------------------------------------------------
    def stats_snapshot(self) -> dict[str, int]:
        """A copy of :attr:`stats` (other threads keep counting meanwhile)."""
        with self._lock:
            return dict(self.stats)

    def count(self, path: str, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.stats[f"{path} requests"] += requests
            self.stats[f"{path} bytes"] += nbytes

    def watch(self, request: dict[str, Any]) -> Stream:
        """A watch stream (``/watch``) from the member requests go to, or the next that answers."""
        return self._on_a_member(lambda index: self._transport.stream(index, "/watch", request))

    def authenticate(self) -> None:
        """Get (or renew) the auth token etcd checks on every request; no-op without a user."""
        if self.security.user is None:
            return
        self._transport.headers.pop("Authorization", None)
        try:
            reply = self._call("/auth/authenticate", {"name": self.security.user, "password": self.security.password},
                               authenticate=False)
        except Etcd3Exception as exc:
            raise EtcdSecurityError(f"etcd at {self.spec} refused user {self.security.user!r}: "
                                    f"{getattr(exc, 'detail_text', exc)}") from None
        self._transport.headers["Authorization"] = reply["token"]

    def _call(self, path: str, body: dict[str, Any], *, authenticate: bool = True) -> dict[str, Any]:
        try:
            return self._call_once(path, body)
        except Etcd3Exception as exc:
            detail = str(getattr(exc, "detail_text", "")) + str(exc)
            if not authenticate or not any(m in detail for m in ("invalid auth token", "user name is empty",
                                                                   "permission denied", "Unauthenticated")):
                raise
            if self.security.user is None:
                raise EtcdSecurityError(f"etcd at {self.spec} requires authentication: set {USER_ENV} and "
                                        f"{PASSWORD_ENV} (or {PASSWORD_FILE_ENV})") from None
            self.authenticate()  # an expired token: renew it once, then try again
            return self._call_once(path, body)

    def _call_once(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result, nbytes = self._on_a_member(lambda index: self._transport.post(index, path, body))
        self.count(path, nbytes)
        return result

    def _on_a_member(self, attempt: Callable[[int], T]) -> T:
        """``attempt(index)`` on the member requests go to, else on the next ones in turn;
        the one that answered gets the following requests."""
        last: BaseException | None = None
        for offset in range(len(self._endpoints)):
            with self._lock:
                index = (self._current + offset) % len(self._endpoints)
            try:
                answer = attempt(index)
            except Unreachable as exc:
                reason = _tls_failure(exc)
                if reason:
                    raise EtcdSecurityError(
                        f"TLS with etcd at {self._transport.url(index)} failed ({reason[-300:]}); check --rdzv-conf "
                        "cacert= (the CA that signed etcd's certificate), cert= and key= (this client's)"
                    ) from None
                last = exc
                continue
            with self._lock:
                self._current = index
            return answer
        raise EtcdUnavailable(f"etcd at {self.spec} is unreachable: {last}")

    def local_address(self) -> str:
        """The address of this machine's interface that routes to etcd (what peers can reach)."""
        _, host, port = self._endpoints[self._current]
        with socket.create_connection((host, port), timeout=self.timeout) as sock:
            return sock.getsockname()[0]

    # -- key-value --------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, *, keys_only: bool = False) -> tuple[dict[str, KeyValue], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        return self.range(prefix, prefix=True, keys_only=keys_only)

    def range(self, key: str, *, prefix: bool, keys_only: bool = False) -> tuple[dict[str, KeyValue], int]:
        """``key`` (or every key under it) and the store revision it was read at."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        if keys_only:
            body["keys_only"] = True
        result = self._call("/kv/range", body)
        kvs = {kv.key: kv for kv in map(_kv, result.get("kvs", []))}
        return kvs, int(result["header"]["revision"])

    def delete_prefix(self, prefix: str) -> None:
        self._call("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> None:
        self._call("/kv/put", _put_ops([(key, value, lease)])[0]["request_put"])

    def transact(self, compares: Iterable[dict[str, Any]], puts: Iterable[tuple[str, bytes | str, int]]) -> bool:
        """Apply every put (key, value, lease) iff every compare holds; True when applied.

        Compares are built with :func:`same_revision` and :func:`exists`: a revision is the
        fencing token, so a writer holding a stale view can never overwrite a newer one.
        """
        result = self._call("/kv/txn", {"compare": list(compares), "success": _put_ops(puts), "failure": []})
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


def _put_ops(puts: Iterable[tuple[str, bytes | str, int]]) -> list[dict[str, Any]]:
    """Transaction operations for (key, value, lease) puts; lease 0: none."""
    ops = []
    for key, value, lease in puts:
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        ops.append({"request_put": put})
    return ops


def same_revision(key: str, mod_revision: int) -> dict[str, Any]:
    """Compare: ``key`` was last modified at ``mod_revision`` (0: the key does not exist)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def exists(key: str) -> dict[str, Any]:
    """Compare: ``key`` exists (its version is above 0)."""
    return {"key": _b64(key), "target": "VERSION", "result": "GREATER", "version": 0}


class Outage:
    """etcd failing for a while, told once when it starts, again every ``reminder_s`` (None:
    never) and once when it ends. Why: its callers retry every fraction of a second, and a
    line per retry (1,200 in a join's default 600 s) buries whatever else the agent says."""

    def __init__(self, what: str, reminder_s: float | None = None) -> None:
        self.what = what
        self.reminder_s = reminder_s
        self.since = time.monotonic()
        self._next_line: float | None = self.since

    def failed(self, exc: BaseException, note: str = "") -> None:
        now = time.monotonic()
        if self._next_line is None or now < self._next_line:
            return
        self._next_line = None if self.reminder_s is None else now + self.reminder_s
        log.warning("%s: %s; retrying (for %.0f s so far%s)", self.what, exc, now - self.since,
                    f", {note}" if note else "")

    def over(self) -> None:
        log.warning("%s: etcd answered again after %.1f s", self.what, time.monotonic() - self.since)


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread, retrying through etcd hiccups.

    The lease is refreshed every TTL/3; a failed refresh is retried quickly. Two states
    come out of it, because they call for different actions:

    * :attr:`lost`: etcd answered that the lease no longer exists. Whatever was written
      under it is gone; the node must register again under a fresh lease.
    * :meth:`overdue`: a refresh failed with none confirmed for a whole TTL (etcd
      unreachable or not answering in time). etcd may have expired the lease, so a node running
      workers must act as if it had (stop them, commit nothing). But a lease that a later
      refresh finds alive never expired: nobody saw this node leave, and registering again
      would only cost the whole gang a round. On a CPU-starved host (a simulation of
      thousands of agents on two cores) that is what turned late refreshes into a storm
      of re-registrations.
    """

    def __init__(self, etcd: Etcd, ttl: int) -> None:
        self.etcd = etcd
        self.ttl = ttl
        self._last_ok = time.monotonic()  # before the grant: etcd's clock starts after it
        self.lease = etcd.grant(ttl)
        self.lost = threading.Event()
        self._overdue = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resilient-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        outage: Outage | None = None  # one warning per outage, not one per retry
        while not self._stop.wait(interval if self._healthy() else 0.2 if not self.overdue() else 1.0):
            sent = time.monotonic()  # the lease lives TTL from when etcd saw the request at the latest
            try:
                left = self.etcd.refresh(self.lease)
            except (EtcdUnavailable, Etcd3Exception) as exc:
                outage = outage or Outage(f"etcd lease {self.lease:x} refresh")
                outage.failed(exc)
                if time.monotonic() - self._last_ok >= self.ttl:
                    self._overdue.set()
                continue
            if left <= 0:
                self._declare_lost()
                return
            if outage is not None:
                outage.over()
                outage = None
            self._last_ok = sent
            self._overdue.clear()

    def overdue(self) -> bool:
        """A refresh failed after a whole TTL without one confirmed: etcd may have expired
        the lease. Decided when a refresh fails, not while one is on its way: the first
        request to an etcd that just restarted waits for its leader (a second or two),
        and etcd's new leader extends every lease, so that wait must not fence anyone."""
        return self.lost.is_set() or self._overdue.is_set()

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


class Changes:
    """A version number that several watches bump: one waiter wakes on a change in any of them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def bump(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def wait(self, version: int, timeout: float) -> int:
        """Sleep until the version differs from ``version`` (or ``timeout`` s); the new version."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)
            return self._version


class _Watch:
    """One etcd watch stream on a prefix (or a single key), kept open by a daemon thread.

    Subclasses say where a stream resumes (:meth:`_resume`) and what events do
    (:meth:`_apply`); this class reopens the stream whenever it breaks (etcd restarted, a
    member failed over, the connection reset), so its owner never sees the break.
    """

    filters: tuple[str, ...] = ()

    def __init__(self, etcd: Etcd, key: str, *, prefix: bool = True, changes: Changes | None = None) -> None:
        self.etcd = etcd
        self.key = key
        self._range_end = prefix_end(key) if prefix else None
        self.changes = changes or Changes()
        self.listed = threading.Event()   # the first list (or resume point) is known
        self._stop = threading.Event()
        self._open_stream: Stream | None = None
        self._thread = threading.Thread(target=self._loop, name="resilient-watch", daemon=True)
        self._thread.start()

    def _resume(self) -> int:
        """Prepare a (re)start of the stream; the revision it starts from."""
        raise NotImplementedError

    def _apply(self, events: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _compacted(self) -> None:
        """etcd no longer holds the history the stream would resume from."""

    @property
    def version(self) -> int:
        """Bumped on every change; pass it to :meth:`wait_change`."""
        return self.changes.version

    def wait_change(self, version: int, timeout: float) -> int:
        return self.changes.wait(version, timeout)

    def _range(self, *, keys_only: bool = False) -> tuple[dict[str, KeyValue], int]:
        return self.etcd.range(self.key, prefix=self._range_end is not None, keys_only=keys_only)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._stream(self._resume())
            except Exception as exc:  # noqa: BLE001 - any break means: resume the stream
                if not self._stop.is_set():
                    log.debug("etcd watch on %s broke (%s); resuming", self.key, exc)
            self._stop.wait(0.2)

    def _stream(self, start_revision: int) -> None:
        create: dict[str, Any] = {"key": _b64(self.key), "start_revision": start_revision}
        if self._range_end is not None:
            create["range_end"] = _b64(self._range_end)
        if self.filters:
            create["filters"] = list(self.filters)
        request = {"create_request": create}
        self.etcd.count("/watch", len(json.dumps(request)))
        stream = self._open_stream = self.etcd.watch(request)  # with the current auth token
        try:
            for line in stream.lines():
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                self.etcd.count("/watch", len(line), requests=0)
                result = json.loads(line).get("result", {})
                if result.get("compact_revision"):
                    self._compacted()
                    return
                if result.get("canceled"):
                    return
                if result.get("events"):
                    self._apply(result["events"])
        finally:
            stream.close()

    def resync(self) -> None:
        """Break the current stream (it may sit on a dead connection); the loop resumes it."""
        stream = self._open_stream
        if stream is not None:
            stream.interrupt()

    def close(self) -> None:
        self._stop.set()
        self.changes.bump()
        self.resync()
        self._thread.join(timeout=2)


class PrefixMirror(_Watch):
    """A local, eventually exact copy of every key under a prefix (or of one key).

    Readers call :meth:`snapshot` (no network) or :meth:`wait_change` to sleep until the
    mirror moves. A broken stream leads to a fresh list + watch.
    """

    def __init__(self, etcd: Etcd, key: str, *, prefix: bool = True, changes: Changes | None = None) -> None:
        self._kvs: dict[str, KeyValue] = {}
        self._kvs_lock = threading.Lock()
        super().__init__(etcd, key, prefix=prefix, changes=changes)

    def snapshot(self) -> dict[str, KeyValue]:
        with self._kvs_lock:
            return dict(self._kvs)

    def _resume(self) -> int:
        kvs, revision = self._range()
        with self._kvs_lock:
            self._kvs = kvs
        self.listed.set()
        self.changes.bump()
        return revision + 1

    def _apply(self, events: list[dict[str, Any]]) -> None:
        with self._kvs_lock:
            for event in events:
                kv = _kv(event["kv"])
                if event.get("type") == "DELETE":
                    self._kvs.pop(kv.key, None)
                else:
                    self._kvs[kv.key] = kv
        self.changes.bump()


class DeletionWatch(_Watch):
    """Which keys under a prefix were deleted, and at which revision, from a start revision on.

    etcd drops every put on the server (the ``NOPUT`` filter), so in a gang of N agents each
    one receives only the deletions (lost leases), never the O(N) registrations. A key that
    was deleted may be written again later; :meth:`gone` therefore asks about deletions
    *since* a revision. If etcd compacted the history the stream needs, one keys-only list
    replaces it: anything absent from that list counts as deleted at the list's revision.
    """

    filters = ("NOPUT",)

    def __init__(self, etcd: Etcd, prefix: str, start_revision: int, *, changes: Changes | None = None) -> None:
        self._next = start_revision
        #: bumped whenever what :meth:`gone_among` can answer changes: callers cache on it
        self.epoch = 0
        self._deleted: dict[str, int] = {}
        self._present: tuple[set[str], int] | None = None
        self._relist = False
        self._lock = threading.Lock()
        super().__init__(etcd, prefix, changes=changes)

    def _resume(self) -> int:
        if self._relist:
            kvs, revision = self._range(keys_only=True)
            with self._lock:
                self._present = ({key[len(self.key):] for key in kvs}, revision)
                self._next = revision + 1
                self._relist = False
                self.epoch += 1
            self.changes.bump()
        self.listed.set()
        return self._next

    def _compacted(self) -> None:
        self._relist = True

    def _apply(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            for event in events:
                if event.get("type") != "DELETE":
                    continue
                kv = _kv(event["kv"])
                self._deleted[kv.key[len(self.key):]] = kv.mod_revision
                self._next = max(self._next, kv.mod_revision + 1)
                self.epoch += 1
        self.changes.bump()

    def gone(self, name: str, since: int) -> bool:
        """Whether key ``prefix + name`` was deleted after revision ``since``."""
        return bool(self.gone_among([name], since))

    def gone_among(self, names: list[str], since: int) -> list[str]:
        """Those of ``names`` whose key was deleted after revision ``since``, in order.

        Costs O(deletions seen), not O(names), while no history was compacted: the agent
        asks this about a gang of thousands every monitor interval.
        """
        with self._lock:
            deleted = {name for name, revision in self._deleted.items() if revision > since}
            present = self._present
        if present is not None and present[1] > since:
            return [name for name in names if name in deleted or name not in present[0]]
        return [name for name in names if name in deleted] if deleted else []
