"""Deliberate damage for tests."""


def flip_byte(path: str, offset: int, mask: int = 0x80) -> None:
    """XOR one byte of a file in place: the smallest corruption a checksum must catch."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


class TcpProxy:
    """A loopback TCP relay that can be cut: a network partition between one client and a
    server, with no root and no namespaces. ``cut()`` closes every connection and refuses
    new ones, as a dropped link looks to both ends; ``mend()`` listens again on the same
    port. ``hold()`` delays every answer (requests still reach the server) until
    ``release()``: a client too slow to read its replies."""

    def __init__(self, target_host: str, target_port: int) -> None:
        import socket
        import threading

        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._open: list = []
        self._lock = threading.Lock()
        self._cut = False
        self._answers_flow = threading.Event()
        self._answers_flow.set()
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut:
                    client.close()
                    upstream.close()
                    continue
                self._open += [client, upstream]
            for src, dst, gate in ((client, upstream, None), (upstream, client, self._answers_flow)):
                threading.Thread(target=self._pump, args=(src, dst, gate), daemon=True).start()

    @staticmethod
    def _pump(src, dst, gate=None) -> None:
        try:
            while data := src.recv(65536):
                if gate is not None:
                    gate.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def hold(self) -> None:
        self._answers_flow.clear()

    def release(self) -> None:
        self._answers_flow.set()

    def cut(self) -> None:
        import socket

        with self._lock:
            self._cut = True
            self._listener.close()
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass

    def mend(self) -> None:
        import socket
        import threading

        with self._lock:
            self._listener = socket.create_server(("127.0.0.1", self.port))
            self._open = []
            self._cut = False
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()
