"""Multi-process runs for tests: real processes, gloo on 127.0.0.1, real signals.

``run_ranks`` starts ``world_size`` copies of ``python -m tests.workers SCENARIO ARGS`` with
the environment torchrun would give them, waits with a deadline, and kills whatever is
left, so that a hung collective fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from resilient.devservices import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def start_ranks(
    scenario: str, world_size: int, args: dict, env: dict | None = None, module: str = "tests.workers"
) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        penv = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "RESILIENT_COMMIT_TIMEOUT": "30",
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, scenario, json.dumps(args)],
                cwd=REPO,
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[RankResult]:
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[killed by the test harness after {timeout} s]"
        results.append(RankResult(rank, proc.returncode, out))
    return results


def run_ranks(
    scenario: str, world_size: int, args: dict, *, timeout: float = 90, env: dict | None = None,
    expect_ok: bool = True, module: str = "tests.workers",
) -> list[RankResult]:
    results = finish(start_ranks(scenario, world_size, args, env, module), timeout)
    if expect_ok:
        bad = [r for r in results if r.returncode != 0]
        assert not bad, "\n".join(f"--- rank {r.rank} exited {r.returncode}:\n{r.output[-3000:]}" for r in bad)
    return results
