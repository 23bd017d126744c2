"""Authenticated values in a key-value store that anyone on the network can reach.

The in-process recovery channel is a torch ``TCPStore``: no TLS, no authentication, and any
host that reaches its port can read and write keys. Replacing it would cost the store's
blocking ``wait`` and atomic counters, which the regroup protocol is built on; instead its
*values* are sealed. Everyone in the job holds one secret (from etcd, where TLS and etcd's
own authentication guard it, or from ``RESILIENT_JOB_SECRET``; never from the store), and:

* every key lives under a namespace derived from the secret and the round, so a neighbour
  who can connect but not watch the traffic cannot even name a key;
* every value (and every entry of an append-only log) carries an HMAC-SHA256 of the
  namespace, the key and the value, checked on every read in constant time, so a value
  written by anyone without the secret, or moved from another key or round, is refused
  with an error naming the key instead of being acted upon.

Counters (``add``) and waits cannot carry a MAC; the protocol uses them only as hints that
make a process look at sealed values (see docs/security.md for what an attacker who
watches the traffic can still do: delay, never forge).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError

from ._errors import ResilientError

__all__ = ["SealedStore", "ForgedValueError", "derive", "new_secret", "JOB_SECRET_ENV", "JOB_SECRET_FILE_ENV",
           "job_secret"]

#: a secret every process of a job shares (e.g. from a Kubernetes Secret), used when the
#: rendezvous has no authenticated place to hand one out (torch's c10d backend)
JOB_SECRET_ENV, JOB_SECRET_FILE_ENV = "RESILIENT_JOB_SECRET", "RESILIENT_JOB_SECRET_FILE"
_MAC_HEX = 32  # 128 bits of HMAC-SHA256: forging one is 2^128 tries, each a store round trip


class ForgedValueError(ResilientError):
    """A value in the regroup store was not written by a holder of the job's secret."""


def new_secret() -> str:
    return os.urandom(32).hex()


def derive(secret: str, purpose: str) -> str:
    """A separate key per use (store namespace, peer-memory token): one leaked derived value
    reveals neither the secret nor the others."""
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def job_secret(env: Any = os.environ) -> str | None:
    """The job-wide secret from the environment or the file it names (None: not set)."""
    if env.get(JOB_SECRET_ENV):
        return str(env[JOB_SECRET_ENV])
    path = env.get(JOB_SECRET_FILE_ENV)
    if path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as exc:
            raise ResilientError(f"{JOB_SECRET_FILE_ENV}={path}: cannot read the job secret ({exc.strerror})") from None
        if not value:
            raise ResilientError(f"{JOB_SECRET_FILE_ENV}={path}: the file is empty")
        return value
    return None


class SealedStore:
    """A store client whose ``set``/``get``/``compare_set``/``append`` values are sealed.

    ``inner`` must already be prefixed with the namespace (``derive(secret, ...)``); the
    namespace also enters every MAC, so a sealed value cannot be replayed into another
    round's store. Other operations (``add``, ``check``, ``wait``) pass through.
    """

    def __init__(self, inner: Any, secret: str, namespace: str) -> None:
        self.inner = inner
        self._key = secret.encode()
        self._namespace = namespace.encode()

    def __getattr__(self, name: str) -> Any:  # add, check, wait, ops, ...: unsealed by nature
        return getattr(self.inner, name)

    def _mac(self, key: str, payload: bytes) -> bytes:
        mac = hmac.new(self._key, self._namespace + b"\0" + key.encode() + b"\0" + payload, hashlib.sha256)
        return mac.hexdigest()[:_MAC_HEX].encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        payload = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, payload) + b":" + payload

    def open(self, key: str, raw: bytes) -> bytes:
        mac, sep, payload = bytes(raw).partition(b":")
        if not sep or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise ForgedValueError(f"regroup store key {key!r} holds a value not written by this job "
                                   "(its authentication code does not match): refused")
        return payload

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(key))

    def get_within(self, key: str, seconds: float) -> bytes | None:
        """``key``'s value once it exists, or None after ``seconds``: one blocking request,
        where a wait and then a get would be two (and two wake-ups of the waiting thread:
        thousands of waiters pay both, every regroup). Each client belongs to one thread, so
        the client's timeout can be set for this one request and put back."""
        default = self.inner.timeout
        self.inner.set_timeout(timedelta(seconds=seconds))
        try:
            return self.get(key)
        except DistStoreError:  # not there in time (a lost store raises DistNetworkError)
            return None
        finally:
            self.inner.set_timeout(default)

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self.inner.multi_set(keys, [self.seal(k, v) for k, v in zip(keys, values)])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As the store's compare-and-set (empty ``expected``: only if absent); returns the
        value now there, opened. MACs are deterministic, so a sealed ``expected`` matches
        the sealed value in the store exactly when the payloads match."""
        sealed_expected = self.seal(key, expected) if expected else b""
        return self.open(key, self.inner.compare_set(key, sealed_expected, self.seal(key, desired)))

    def append(self, key: str, entry: str) -> None:
        """Append one newline-free entry to the log at ``key``, sealed on its own line."""
        line = entry.rstrip("\n").encode()
        self.inner.append(key, self._mac(key, line) + b" " + line + b"\n")

    def read_log(self, key: str, offset: int) -> tuple[list[str], int]:
        """The log's entries after byte ``offset`` (complete lines only) and the new offset;
        a line that fails its check is refused like a forged value."""
        raw = bytes(self.inner.get(key))
        end = raw.rfind(b"\n") + 1
        entries = []
        for line in raw[offset:end].split(b"\n"):
            if not line:
                continue
            mac, sep, payload = line.partition(b" ")
            if not sep or not hmac.compare_digest(mac, self._mac(key, payload)):
                raise ForgedValueError(f"regroup store log {key!r} holds an entry not written by this job: refused")
            entries.append(payload.decode())
        return entries, max(end, offset)
