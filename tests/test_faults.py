"""RESILIENT_FAULT: kill, hang and raise at a rank and step, once per run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from resilient import Checkpointer, CommitError
from resilient._faults import FaultInjector, InjectedFault, parse

from .launch import REPO

pytestmark = pytest.mark.timeout(90)

TRAIN = textwrap.dedent("""
    import json, sys, torch
    from resilient import Checkpointer
    root, steps = sys.argv[1], int(sys.argv[2])
    state = {"w": torch.zeros(4)}
    with Checkpointer(root, every=2, state=state) as ckpt:
        start = ckpt.restore()
        for step in range(start, steps):
            state["w"] += 1
            ckpt.save(step + 1)
    print(json.dumps({"start": start, "w": state["w"][0].item()}))
""")


def committed_steps(root) -> list[int]:
    return sorted(int(d.split("-")[1]) for d in os.listdir(root) if d.startswith("step-"))


def run(root, steps, fault, timeout=60):
    env = {**os.environ, "RESILIENT_FAULT": fault, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", TRAIN, str(root), str(steps)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_kill_fires_once_then_the_rerun_resumes_and_finishes(tmp_path):
    first = run(tmp_path / "ckpt", 10, "kill:rank=0,step=5")
    assert first.returncode == -signal.SIGKILL and "injected fault: kill on rank 0 at step 5" in first.stdout
    second = run(tmp_path / "ckpt", 10, "kill:rank=0,step=5")  # the same step again: no second kill
    assert second.returncode == 0, second.stderr
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["start"] in (2, 4) and result["w"] == 10.0  # step 4 may not have been committed yet


def test_kill_while_writing_leaves_that_step_uncommitted_and_the_one_before_it_restorable(tmp_path):
    """``phase=write``: the process dies in the background writer with step 4's file on disk
    and its commit never made: the rerun resumes from step 2 and finishes."""
    first = run(tmp_path / "ckpt", 10, "kill:rank=0,step=4,phase=write")
    assert first.returncode == -signal.SIGKILL and "injected fault: kill on rank 0 at step 4" in first.stdout
    assert 4 not in committed_steps(tmp_path / "ckpt") and 2 in committed_steps(tmp_path / "ckpt")
    second = run(tmp_path / "ckpt", 10, "kill:rank=0,step=4,phase=write")
    assert second.returncode == 0, second.stderr
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result == {"start": 2, "w": 10.0}


def test_raise_while_writing_fails_that_save_and_not_the_training_step(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_FAULT", "raise:rank=0,step=2,phase=write")
    state = {"w": torch.ones(2)}
    with Checkpointer(tmp_path / "c", state=state) as ckpt:
        ckpt.save(1).result()
        handle = ckpt.save(2)  # the training thread goes on: the fault is the writer's
        with pytest.raises(CommitError, match="injected fault on rank 0 at step 2"):
            handle.result()
        ckpt.save(3).result()
    assert committed_steps(tmp_path / "c") == [1, 3]
    with Checkpointer(tmp_path / "c", state=state) as ckpt:
        assert ckpt.restore() == 3


def test_hang_stops_progress(tmp_path):
    """The fault's marker appears, then the process stays alive and saves nothing after step 3."""
    import time

    env = {**os.environ, "RESILIENT_FAULT": "hang:rank=0,step=3", "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(tmp_path / "ckpt"), "10"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        marker = tmp_path / "ckpt" / ".faults" / "fault-0-hang-rank0-step3"
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the hang never fired"
            time.sleep(0.05)
        time.sleep(2.0)  # 10 steps take milliseconds: a live run would have finished by now
        assert proc.poll() is None, "a hung run must not exit"
        saved = [int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*")]
        assert saved and max(saved) <= 3, saved  # a save in flight may land; nothing after the hang
        assert os.listdir(tmp_path / "ckpt" / ".faults") == ["fault-0-hang-rank0-step3"]
    finally:
        proc.kill()
        proc.communicate()


def test_raise_and_other_ranks_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_FAULT", "raise:rank=0,step=2;kill:rank=1,step=1")
    state = {"w": torch.ones(2)}
    with pytest.raises(InjectedFault, match="step 2"):
        with Checkpointer(tmp_path / "c", state=state) as ckpt:
            ckpt.save(1)  # rank 1's fault is not ours
            ckpt.save(2)


def test_random_faults_agree_across_ranks_and_fire_on_one(tmp_path):
    injectors = [FaultInjector("raise:random=10-20,seed=3", r, 4, str(tmp_path / f"r{r}")) for r in range(4)]
    armed = [(r, i._armed) for r, i in enumerate(injectors) if i._armed]
    assert len(armed) == 1
    rank, [(_, _, step, _)] = armed[0]
    assert 10 <= step <= 20
    again = FaultInjector("raise:random=10-20,seed=3", rank, 4, str(tmp_path / "again"))
    assert again._armed[0][2] == step, "the seed decides"
    with pytest.raises(InjectedFault):
        injectors[rank].check(step)


@pytest.mark.parametrize("spec, message", [
    ("explode:rank=0,step=1", "must start with one of kill, hang, raise"),
    ("kill:rank=0", "needs rank=R and step=S"),
    ("kill:rank=0,step=x", "needs rank=R and step=S"),
    ("kill:random=9-3", "random=LO-HI"),
    ("kill:rank=0,step=1,when=now", "unknown key(s) when"),
    ("kill:rank=0,step=1,phase=later", "phase='later' in 'kill:rank=0,step=1,phase=later' must be one of step, write"),
    ("kill rank=0", "must start with one of"),
    ("corrupt:rank=0,step=1", "corrupt damages the file a save writes; add phase=write"),
])
def test_bad_specs_name_the_part_at_fault(spec, message):
    with pytest.raises(ValueError) as err:
        parse(spec)
    assert message in str(err.value) and "RESILIENT_FAULT" in str(err.value)
