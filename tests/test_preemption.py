"""Preemption: SIGTERM (Kubernetes eviction, spot reclaim) to a training process, and
SIGUSR1 (Slurm's --signal) to resilient-run: the step in progress is saved, committed on
both tiers within the grace period, and the processes exit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resilient import Checkpointer

from .launch import REPO

pytestmark = pytest.mark.timeout(180)


def _events(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _wait_for_steps(path: str, proc: subprocess.Popen, count: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while sum(e["event"] == "step" for e in _events(path)) < count:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)


def _start(cmd: list[str], events: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "RESILIENT_EVENT_LOG": events, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _check_durable(root: str, remote: str, events: list[dict], world: int) -> None:
    preempted = [e for e in events if e["event"] == "preempted"]
    assert len(preempted) == world, events[-10:]
    step = preempted[0]["step"]
    assert all(e["step"] == step for e in preempted), preempted  # every rank, the same step
    assert step % 1000 != 0  # not a periodic checkpoint: the step the signal interrupted
    with Checkpointer(root) as ckpt:
        assert ckpt.latest() == step
    with Checkpointer(root + "-check", remote=remote) as ckpt:
        assert ckpt.latest() == step  # on the remote tier too
    seconds = max(e["remote_s"] for e in preempted)
    print(f"signal -> step {step} durable on both tiers: {seconds:.2f} s")


def test_sigterm_saves_the_current_step_on_both_tiers_and_exits_cleanly(tmp_path):
    root, remote, events = str(tmp_path / "ckpt"), f"file://{tmp_path / 'remote'}", str(tmp_path / "events.jsonl")
    proc = _start([sys.executable, "examples/train.py", "--root", root, "--remote", remote, "--every", "1000",
                   "--steps", "100000", "--width", "64", "--step-time", "0.01"], events)
    try:
        _wait_for_steps(events, proc, 20)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM received" in out
    _check_durable(root, remote, _events(events), 1)


def test_sigusr1_to_resilient_run_preempts_every_rank_at_one_step(tmp_path):
    root, remote, events = str(tmp_path / "ckpt"), f"file://{tmp_path / 'remote'}", str(tmp_path / "events.jsonl")
    proc = _start([sys.executable, "-m", "resilient.launch.run", "--standalone", "--nproc-per-node", "2",
                   "--shutdown-timeout", "40", "examples/train.py", "--root", root, "--remote", remote,
                   "--every", "1000", "--steps", "100000", "--width", "64", "--step-time", "0.01"], events)
    try:
        _wait_for_steps(events, proc, 20)
        proc.send_signal(signal.SIGUSR1)  # what Slurm's --signal=USR1@N sends to the job step
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "SIGUSR1 received" in out, out[-3000:]
    _check_durable(root, remote, _events(events), 2)
