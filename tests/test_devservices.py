"""The development etcd server dies with the process that started it, however that ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from resilient.launch._orphan_guard import dies_with_this_thread

pytestmark = pytest.mark.timeout(60)

# starts a real etcd, says its pid, then leaves without any clean-up (as a killed script would)
_STARTER = """
import os
from resilient.devservices import EtcdServer
server = EtcdServer().start()
print(server.proc.pid, server.data_dir, flush=True)
os._exit(0)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_etcd_started_by_a_script_that_exits_abruptly_does_not_outlive_it():
    out = subprocess.run([sys.executable, "-c", _STARTER], capture_output=True, text=True, timeout=40)
    assert out.returncode == 0, out.stderr[-2000:]
    pid, data_dir = int(out.stdout.split()[0]), out.stdout.split()[1]
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    shutil.rmtree(data_dir, ignore_errors=True)  # the script left it, as a killed one would: 120 MB a run
    assert not alive, f"etcd (pid {pid}) still served 10 s after the script that started it exited"


def test_the_guard_is_armed_only_from_the_main_thread():
    # the signal follows the thread that forked: a helper thread's end would kill the server
    assert callable(dies_with_this_thread())
    seen: list[object] = []
    helper = threading.Thread(target=lambda: seen.append(dies_with_this_thread()))
    helper.start()
    helper.join()
    assert seen == [None]
