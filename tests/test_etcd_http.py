"""The etcd client's own HTTP/1.1 reading, against answers a real etcd gives rarely or never:
chunked bodies split anywhere, a keep-alive connection the server closed while idle, a
length past the limit, garbage, a connection cut mid-answer. A loopback server replays
the bytes each case needs; the happy path against a real etcd is every rendezvous test."""

import json
import socket
import threading
import time

import pytest
from etcd3gw.exceptions import Etcd3Exception

from resilient.launch._etcd_http import MAX_BODY, JsonTransport, Unreachable

pytestmark = pytest.mark.timeout(30)

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


class Replayer:
    """Accepts connections on loopback; for each request read, sends the next scripted answer.
    An answer of None closes the connection instead (after reading the request); a tuple
    ``(bytes,)`` sends the bytes, then closes."""

    def __init__(self, answers: list[bytes | tuple[bytes] | None]) -> None:
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            conn, _ = self._listener.accept()
            self.connections += 1
            with conn:
                while self.answers:
                    request = self._read_request(conn)
                    if request is None:
                        break
                    self.requests.append(request)
                    answer = self.answers.pop(0)
                    if answer is None:
                        break  # close it, as a server does with an idle keep-alive connection
                    conn.sendall(answer[0] if isinstance(answer, tuple) else answer)
                    if isinstance(answer, tuple):
                        break

    @staticmethod
    def _read_request(conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return None
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body) < length:
            body += conn.recv(65536)
        return head + b"\r\n\r\n" + body

    def transport(self) -> JsonTransport:
        return JsonTransport([("http", "127.0.0.1", self.port)], timeout=5.0)


def _json_answer(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return OK_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _chunked(*pieces: bytes, trailer: bytes = b"") -> bytes:
    return (OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailer + b"\r\n")


def test_a_request_carries_the_path_headers_and_body_and_its_answer_is_parsed():
    server = Replayer([_json_answer({"header": {"revision": "7"}, "count": "1"})])
    transport = server.transport()
    transport.headers["Authorization"] = "token-1"
    answer, nbytes = transport.post(0, "/kv/range", {"key": "YQ=="})
    assert answer == {"header": {"revision": "7"}, "count": "1"}
    request = server.requests[0]
    assert request.startswith(b"POST /v3/kv/range HTTP/1.1\r\n")
    assert b"\r\nAuthorization: token-1\r\n" in request and b"\r\nContent-Type: application/json\r\n" in request
    assert request.endswith(b'{"key": "YQ=="}')
    assert nbytes == len(b'{"key": "YQ=="}') + len(json.dumps(answer))


def test_a_chunked_answer_is_joined_across_chunks_extensions_and_trailers():
    body = json.dumps({"result": {"TTL": "5"}}).encode()
    server = Replayer([_chunked(body[:3], body[3:10], body[10:], trailer=b"X-Trailer: 1\r\n")])
    assert server.transport().post(0, "/lease/keepalive", {"ID": 1})[0] == {"result": {"TTL": "5"}}


def test_a_connection_the_server_closed_while_idle_is_replaced_and_the_request_sent_again():
    server = Replayer([_json_answer({"n": 1}), None, _json_answer({"n": 2})])
    transport = server.transport()
    assert transport.post(0, "/kv/put", {})[0] == {"n": 1}
    assert transport.post(0, "/kv/put", {})[0] == {"n": 2}  # the first try met a closed connection
    assert server.connections == 2


def test_connection_close_is_honoured():
    closing = OK_HEAD + b"Connection: close\r\nContent-Length: 2\r\n\r\n{}"
    server = Replayer([closing, _json_answer({"n": 2})])
    transport = server.transport()
    assert transport.post(0, "/kv/put", {})[0] == {}
    assert transport.post(0, "/kv/put", {})[0] == {"n": 2}
    assert server.connections == 2


def test_an_answer_ended_by_the_server_closing_is_read_whole_and_its_connection_not_reused():
    server = Replayer([(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"n": 1}',),
                       _json_answer({"n": 2})])
    transport = server.transport()
    assert transport.post(0, "/kv/range", {})[0] == {"n": 1}
    assert transport.post(0, "/kv/range", {})[0] == {"n": 2}
    assert server.connections == 2


@pytest.mark.parametrize("answer, words", [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP/1.1 answer"),
    (OK_HEAD + b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1), "Content-Length"),
    (OK_HEAD + b"Content-Length: -1\r\n\r\n", "Content-Length"),
    (OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (MAX_BODY + 1), "chunk of"),
    (OK_HEAD + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n", "a line of over"),
    (OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20)) * 65,
     "a chunked answer of over"),
])
def test_a_broken_or_oversized_answer_is_refused_naming_what_is_wrong(answer, words):
    server = Replayer([answer])
    with pytest.raises(Unreachable, match=words):
        server.transport().post(0, "/kv/range", {})


def test_an_answer_cut_mid_body_is_unreachable_not_a_short_read():
    cut = OK_HEAD + b"Content-Length: 100\r\n\r\n{\"a\": 1"
    server = Replayer([(cut,)])
    with pytest.raises(Unreachable, match="closed after 7 of 100 body bytes"):
        server.transport().post(0, "/kv/range", {})


def test_statuses_split_into_next_member_and_etcd_said_no():
    unavailable = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 8\r\n\r\nno lead."
    error = b'{"error": "lease not found"}'
    refused = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)
    server = Replayer([unavailable, refused])
    transport = server.transport()
    with pytest.raises(Unreachable, match="HTTP 503 no lead"):
        transport.post(0, "/kv/put", {})
    with pytest.raises(Etcd3Exception) as refusal:
        transport.post(0, "/kv/put", {})
    assert "lease not found" in refusal.value.detail_text


def test_a_stream_yields_whole_lines_however_the_chunks_fall_and_wakes_on_interrupt():
    lines = [json.dumps({"result": {"events": [{"n": i}]}}).encode() + b"\n" for i in range(3)]
    blob = b"".join(lines)
    head = OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    pieces = [blob[:5], blob[5:len(lines[0]) + 9], blob[len(lines[0]) + 9:]]  # split inside lines
    server = Replayer([head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)])
    stream = server.transport().stream(0, "/watch", {"create_request": {}})
    got = stream.lines()
    assert [json.loads(next(got))["result"]["events"][0]["n"] for _ in range(3)] == [0, 1, 2]
    threading.Timer(0.3, stream.interrupt).start()  # no more chunks come: the reader waits
    started = time.monotonic()
    with pytest.raises(Unreachable, match="watch stream broke"):
        next(got)
    assert time.monotonic() - started < 5
    stream.close()


def test_nothing_listening_is_unreachable_naming_the_endpoint():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again: nothing listens there now
    transport = JsonTransport([("http", "127.0.0.1", port)], timeout=2.0)
    with pytest.raises(Unreachable, match=f"http://127.0.0.1:{port}"):
        transport.post(0, "/kv/range", {})
