"""One job per checkpoint root: a second job's first save is refused with an error naming
the root and its holder (reading is allowed); a killed holder's claim dies with it; the
ranks of one job share the root."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from resilient import Checkpointer, StorageError

from .launch import REPO, run_ranks

pytestmark = pytest.mark.timeout(120)

HOLDER = """
import sys, time, torch
from resilient import Checkpointer
with Checkpointer(sys.argv[1], keep=None) as ckpt:
    for step in range(1, 1000):
        ckpt.save(step, {"w": torch.full((1000,), float(step))})
        if step == 1:
            print("holding", flush=True)
        time.sleep(0.05)
"""


def _holder(root: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, root], env={**os.environ, "PYTHONPATH": REPO},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "holding", proc.communicate()[0]
    return proc


def test_second_job_on_a_root_is_refused_and_the_first_goes_on(tmp_path):
    root = str(tmp_path / "ckpt")
    holder = _holder(root)
    try:
        with Checkpointer(root) as second:  # reading is harmless: no claim
            second.latest()
            with pytest.raises(StorageError, match=rf"checkpoint root '{root}' is in use by another job .*pid {holder.pid}"):
                second.save(10**6, {"w": torch.zeros(1000)})  # writing is refused, nothing touched
        before = len([n for n in os.listdir(root) if n.startswith("step-")])
        time.sleep(0.5)
        assert holder.poll() is None  # the first job is untouched and keeps committing
        assert len([n for n in os.listdir(root) if n.startswith("step-")]) >= min(before, 1)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    # a SIGKILLed holder's claim is gone with it: the next job takes the root and resumes
    with Checkpointer(root) as ckpt:
        target = {"w": torch.zeros(1000)}
        step = ckpt.restore(target)
        assert step >= 1 and torch.equal(target["w"], torch.full((1000,), float(step)))


def test_checkpointers_of_one_process_and_ranks_of_one_job_share_a_root(tmp_path):
    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as first:
        first.save(1, {"w": torch.full((1 << 20,), 1.0)})  # possibly still being written:
        with Checkpointer(root) as second:  # another Checkpointer of this process keeps it
            first.wait()
            assert second.latest() == 1
    run_ranks("train", 2, {"root": str(tmp_path / "ddp"), "every": 5, "total": 10, "dropout": 0.0})
    assert Checkpointer(str(tmp_path / "ddp")).latest() == 10
