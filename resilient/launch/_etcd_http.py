"""The request/response half of the etcd client: JSON over HTTP/1.1 to etcd's gateway.

Why not ``requests`` (which ``etcd3gw`` uses): every request through it looks for a
``~/.netrc``, checks the CA bundle's path on disk, merges proxy settings from the
environment and, from several threads sharing one session, often opens a new TCP
connection. That is ~0.7 ms of CPU per call. Why not ``http.client`` either: it parses every
response's headers with the ``email`` package, ~0.2 ms of CPU per call of the ~0.3 ms it
took. The gateway speaks a narrow dialect (POST, a JSON body, ``Content-Length`` or chunked
answers), so this module writes the request and reads the answer itself: ~0.09 ms per call,
measured here. A lease keep-alive is the one call every agent makes every few seconds for
the whole run, and a thousand simulated agents on a small machine starved their own
keep-alives (leases expired, agents re-registered, rounds churned). Each thread keeps one
persistent connection per endpoint, and nothing is read from the environment: an
``HTTP_PROXY`` set machine-wide has no business between an agent and its etcd.

Errors keep ``etcd3gw``'s exception types, so that callers tell "could not talk to etcd"
(:class:`Unreachable`: move to the next member) from "etcd said no" (``Etcd3Exception``).
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception, InternalServerError

#: HTTP statuses that mean "this member cannot serve now": the request goes to the next one
RETRY_ELSEWHERE = {503: ConnectionFailedError, 408: ConnectionTimeoutError, 504: ConnectionTimeoutError}
#: the longest status or header line accepted (the gateway's are under 100 bytes)
MAX_LINE = 1 << 16
#: the largest answer accepted: a gang's packed membership is kilobytes, etcd's own request
#: limit is 1.5 MiB by default; a larger length is a broken or hostile peer
MAX_BODY = 64 << 20


class _Stale(ConnectionError):
    """A reused connection the server closed while idle: etcd never saw the request."""


class _BadResponse(ConnectionError):
    """What came back is not an HTTP/1.1 answer this client can read."""


class Unreachable(ConnectionError):
    """The endpoint could not be reached (refused, reset, timed out, TLS failed)."""


def chunked(headers: dict[bytes, bytes]) -> bool:
    """Whether an answer's body comes in chunks (etcd's streams and keep-alives do)."""
    return headers.get(b"transfer-encoding", b"").lower() == b"chunked"


class _Connection:
    """One HTTP/1.1 connection to one endpoint: a request, then its answer, in turn."""

    def __init__(self, host: str, port: int, *, timeout: float, tls: ssl.SSLContext | None) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one small write
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._reader = sock.makefile("rb")
        self.spent = False  # the server ends this connection after the answer being read
        self._host = f"{host}:{port}".encode()

    def send(self, path: str, payload: bytes, headers: dict[str, str]) -> None:
        lines = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in headers.items())
        self.sock.sendall(b"POST /v3%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self._host, lines, len(payload), payload))

    def _line(self) -> bytes:
        line = self._reader.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise _BadResponse(f"a line of over {MAX_LINE} bytes in the answer")
        return line

    def head(self) -> tuple[int, str, dict[bytes, bytes]]:
        """Status, reason and headers (names lower-cased) of the next answer."""
        status_line = self._line()
        if not status_line:
            raise _Stale("the server closed the connection before answering")
        version, _, rest = status_line.rstrip(b"\r\n").partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise _BadResponse(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
        headers: dict[bytes, bytes] = {}
        while (line := self._line()) not in (b"\r\n", b"\n"):
            if not line:
                raise _BadResponse("the connection closed inside the answer's headers")
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return int(code), reason.decode(errors="replace"), headers

    def body(self, headers: dict[bytes, bytes]) -> bytes:
        """The whole body of an answer whose headers were just read."""
        if chunked(headers):
            pieces, total = [], 0
            for piece in iter(self.chunk, b""):
                total += len(piece)
                if total > MAX_BODY:
                    raise _BadResponse(f"a chunked answer of over {MAX_BODY} bytes")
                pieces.append(piece)
            return b"".join(pieces)
        length = headers.get(b"content-length")
        if length is None:  # delimited by the server closing: the connection is spent
            self.spent = True
            data = self._reader.read(MAX_BODY + 1)
            if len(data) > MAX_BODY:
                raise _BadResponse(f"an answer of over {MAX_BODY} bytes")
            return data
        if not length.isdigit() or int(length) > MAX_BODY:
            raise _BadResponse(f"Content-Length {length[:40]!r} is not a length up to {MAX_BODY} bytes")
        data = self._reader.read(int(length))
        if len(data) != int(length):
            raise _BadResponse(f"the connection closed after {len(data)} of {int(length)} body bytes")
        return data

    def chunk(self) -> bytes:
        """The next chunk of a chunked body; b"" at its end (trailers skipped)."""
        size_line = self._line()
        if not size_line:
            raise _BadResponse("the connection closed inside a chunked answer")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _BadResponse(f"bad chunk size line {size_line[:40]!r}") from None
        if size > MAX_BODY:
            raise _BadResponse(f"a chunk of {size} bytes (more than {MAX_BODY})")
        if size == 0:
            while self._line() not in (b"\r\n", b"\n", b""):
                pass
            return b""
        data = self._reader.read(size)
        if len(data) != size or self._line() not in (b"\r\n", b"\n"):
            raise _BadResponse("the connection closed inside a chunk")
        return data

    def read_some(self) -> bytes:
        """What arrived of a body that ends when the server closes (b"" then), up to 64 kB."""
        return self._reader.read1(1 << 16)

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self.sock.close()


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

    def _connection(self, index: int) -> tuple[_Connection, bool]:
        """This thread's connection to endpoint ``index``; whether it was used before."""
        pool: dict[int, _Connection] = self._local.__dict__.setdefault("pool", {})
        conn = pool.get(index)
        if conn is not None:
            return conn, True
        conn = pool[index] = self._new_connection(index)
        return conn, False

    def _new_connection(self, index: int) -> _Connection:
        protocol, host, port = self.endpoints[index]
        try:
            return _Connection(host, port, timeout=self.timeout, tls=self._tls if protocol == "https" else None)
        except OSError as exc:  # refused, timed out, TLS handshake (ssl.SSLError is an OSError)
            raise Unreachable(f"{self.url(index)}: {exc}") from exc

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
                conn.send(path, payload, self.headers)
                status, reason, headers = conn.head()
                data = conn.body(headers)
            except (_Stale, ConnectionResetError, BrokenPipeError) as exc:
                self._drop(index)
                if reused and attempt == 0:
                    continue  # the server closed it while idle: etcd never saw the request
                raise Unreachable(f"{self.url(index)}: {exc}") from exc
            except OSError as exc:  # timed out, TLS, a broken answer
                self._drop(index)
                raise Unreachable(f"{self.url(index)}: {exc}") from exc
            if conn.spent or headers.get(b"connection", b"").lower() == b"close":
                self._drop(index)
            self._check(index, status, reason, data)
            return json.loads(data), len(payload) + len(data)
        raise AssertionError("unreachable")  # the loop returns or raises

    def stream(self, index: int, path: str, body: dict[str, Any]) -> "Stream":
        """Open a long-lived answer (a watch) on a connection of its own: connecting is
        bounded by the timeout, waiting for the next event is not."""
        conn = self._new_connection(index)
        try:
            conn.send(path, json.dumps(body).encode(), self.headers)
            status, reason, headers = conn.head()
            if status != 200:
                data = conn.body(headers)
                self._check(index, status, reason, data)
            conn.sock.settimeout(None)
        except Unreachable:  # a member that cannot serve now (from _check)
            conn.close()
            raise
        except OSError as exc:
            conn.close()
            raise Unreachable(f"{self.url(index)}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return Stream(conn, chunked=chunked(headers))

    def _check(self, index: int, status: int, reason: str, data: bytes) -> None:
        """Raise what a status other than 200 means: next member, or etcd's refusal."""
        if status == 200:
            return
        text = data.decode(errors="replace")
        if status in RETRY_ELSEWHERE:
            raise Unreachable(f"{self.url(index)}: HTTP {status} {text[:200]}") \
                from RETRY_ELSEWHERE[status](text, reason)
        if status == 500:
            raise InternalServerError(text, reason)
        raise Etcd3Exception(text, reason)

    def url(self, index: int) -> str:
        protocol, host, port = self.endpoints[index]
        return f"{protocol}://{host}:{port}"


class Stream:
    """The lines of one long-lived answer, read as etcd sends them: one read per chunk it
    flushes. (``requests`` reads 512 bytes at a time: a 60 kB event, a large gang's
    membership, took 120 trips through the interpreter lock, ~5 ms of CPU per watcher,
    1.4 s for 256 agents in one process.)"""

    def __init__(self, conn: _Connection, *, chunked: bool) -> None:
        self._conn = conn
        self._chunked = chunked

    def _pieces(self) -> Iterator[bytes]:
        if self._chunked:
            yield from iter(self._conn.chunk, b"")
            return
        while data := self._conn.read_some():  # an answer that ends when etcd closes
            yield data

    def lines(self) -> Iterator[bytes]:
        pending = b""
        try:
            for data in self._pieces():
                pending += data
                *complete, pending = pending.split(b"\n")
                yield from complete
        except (OSError, ValueError) as exc:  # reset, broken, or closed by close()
            raise Unreachable(f"watch stream broke: {exc}") from exc

    def interrupt(self) -> None:
        """From another thread: shutting the socket down wakes the reader at once (closing
        the reader there would wait for the lock the reading thread holds)."""
        try:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """By the reading thread, when it is done with the stream."""
        self.interrupt()
        self._conn.close()
