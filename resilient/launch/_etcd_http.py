"""The request/response half of the etcd client: JSON over HTTP/1.1 to etcd's gateway.

Why not ``requests`` (which ``etcd3gw`` uses): every request through it looks for a
``~/.netrc``, checks the CA bundle's path on disk, merges proxy settings from the
environment and, from several threads sharing one session, often opens a new TCP
connection. That is ~0.7 ms of CPU per call, against ~0.2 ms here; a lease keep-alive is
the one call every agent makes every few seconds for the whole run, and a thousand
simulated agents on a small machine starved their own keep-alives on it (leases expired,
agents re-registered, rounds churned). Here each thread keeps one persistent connection
per endpoint, and nothing is read from the environment: an ``HTTP_PROXY`` set machine-wide
has no business between an agent and its etcd.

Errors keep ``etcd3gw``'s exception types, so that callers tell "could not talk to etcd"
(:class:`Unreachable`: move to the next member) from "etcd said no" (``Etcd3Exception``).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception, InternalServerError

#: HTTP statuses that mean "this member cannot serve now": the request goes to the next one
RETRY_ELSEWHERE = {503: ConnectionFailedError, 408: ConnectionTimeoutError, 504: ConnectionTimeoutError}
#: a reused connection the server closed while idle fails with one of these before etcd saw
#: the request: sent again once on a fresh connection
STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class Unreachable(ConnectionError):
    """The endpoint could not be reached (refused, reset, timed out, TLS failed)."""


class JsonTransport:
    """POSTs JSON bodies to ``/v3/<path>`` of one of several endpoints."""

    def __init__(self, endpoints: list[tuple[str, str, int]], *, timeout: float, cacert: str | None = None,
                 cert: str | None = None, key: str | None = None) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self.headers: dict[str, str] = {"Content-Type": "application/json"}  # plus Authorization, once known
        self._tls: ssl.SSLContext | None = None
        if any(protocol == "https" for protocol, _, _ in endpoints):
            self._tls = ssl.create_default_context(cafile=cacert)
            if cert and key:
                self._tls.load_cert_chain(cert, key)
        self._local = threading.local()

    def _connection(self, index: int) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to endpoint ``index``; whether it was used before."""
        pool: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("pool", {})
        conn = pool.get(index)
        if conn is not None:
            return conn, True
        conn = pool[index] = self._new_connection(index)
        return conn, False

    def _new_connection(self, index: int) -> http.client.HTTPConnection:
        protocol, host, port = self.endpoints[index]
        if protocol == "https":
            return http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=self.timeout)

    def _drop(self, index: int) -> None:
        conn = self._local.__dict__.get("pool", {}).pop(index, None)
        if conn is not None:
            conn.close()

    def post(self, index: int, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """etcd's answer to ``body`` at endpoint ``index``, and the bytes sent and received."""
        payload = json.dumps(body).encode()
        for attempt in (0, 1):
            conn, reused = self._connection(index)
            try:
                conn.request("POST", "/v3" + path, payload, self.headers)
                response = conn.getresponse()
                data = response.read()
            except STALE as exc:
                self._drop(index)
                if reused and attempt == 0:
                    continue
                raise Unreachable(f"{self.url(index)}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:  # refused, timed out, TLS
                self._drop(index)
                raise Unreachable(f"{self.url(index)}: {exc}") from exc
            if response.will_close:
                self._drop(index)
            self._check(index, response, data)
            return json.loads(data), len(payload) + len(data)
        raise AssertionError("unreachable")  # the loop returns or raises

    def stream(self, index: int, path: str, body: dict[str, Any]) -> "Stream":
        """Open a long-lived response (a watch) on a connection of its own: connecting is
        bounded by the timeout, waiting for the next event is not."""
        conn = self._new_connection(index)
        try:
            conn.connect()
            conn.request("POST", "/v3" + path, json.dumps(body).encode(), self.headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise Unreachable(f"{self.url(index)}: {exc}") from exc
        if response.status != 200:
            data = response.read()
            conn.close()
            self._check(index, response, data)
        if conn.sock is not None:
            conn.sock.settimeout(None)
        return Stream(conn, response)

    def _check(self, index: int, response: http.client.HTTPResponse, data: bytes) -> None:
        """Raise what a status other than 200 means: next member, or etcd's refusal."""
        if response.status == 200:
            return
        text = data.decode(errors="replace")
        if response.status in RETRY_ELSEWHERE:
            raise Unreachable(f"{self.url(index)}: HTTP {response.status} {text[:200]}") \
                from RETRY_ELSEWHERE[response.status](text, response.reason)
        if response.status == 500:
            raise InternalServerError(text, response.reason)
        raise Etcd3Exception(text, response.reason)

    def url(self, index: int) -> str:
        protocol, host, port = self.endpoints[index]
        return f"{protocol}://{host}:{port}"


class Stream:
    """The lines of one long-lived response, read as they come: one read per chunk etcd
    flushes, up to 64 kB. (``requests`` reads 512 bytes at a time: a 60 kB event, a large
    gang's membership, took 120 trips through the interpreter lock, ~5 ms of CPU per
    watcher, 1.4 s for 256 agents in one process.)"""

    READ_BYTES = 1 << 16

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self._conn = conn
        self._response = response

    def lines(self) -> Iterator[bytes]:
        pending = b""
        while True:
            try:
                data = self._response.read1(self.READ_BYTES)
            except (OSError, http.client.HTTPException, ValueError) as exc:  # reset, or closed by close()
                raise Unreachable(f"watch stream broke: {exc}") from exc
            if not data:
                return
            pending += data
            *complete, pending = pending.split(b"\n")
            yield from complete

    def interrupt(self) -> None:
        """From another thread: shutting the socket down wakes the reader at once (closing
        the response there would wait for the lock the reader holds)."""
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """By the reading thread, when it is done with the stream."""
        self.interrupt()
        self._conn.close()
