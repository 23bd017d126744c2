"""Multi-process runs for tests: real processes, gloo on 127.0.0.1, real signals.

``run_ranks`` starts ``world_size`` ranks, each running ``python -m tests.workers SCENARIO
ARGS`` as its ``__main__`` with the environment torchrun would give it, waits with a
deadline, and kills whatever is left, so that a hung collective fails the test instead of
the suite.

Why ranks are forked from a server that has imported torch already: a rank's own work in
these tests takes a fraction of a second, and importing torch took 2-3 s of CPU in every
one, so a test that starts 12 ranks on this machine's 2 cores spent most of its time in
imports. Each rank is still a process of its own (its own session, pid, store connections
and gloo sockets, killed by a real SIGKILL); only torch's modules are loaded before the fork.
resilient and the scenario are imported in the rank, as a fresh interpreter would, and the
rank's environment is set before either is.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from resilient.devservices import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What the fork server imports once: torch and the parts of it the workers use. Nothing
#: here reads a rank's environment at import (resilient, which might, is not preloaded).
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
           "torch.distributed.fsdp", "torch.nn.parallel"]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


@dataclass
class _Rank:
    process: multiprocessing.process.BaseProcess
    output_path: str


def _forkserver() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_rank(module: str, argv: list[str], env: dict[str, str], output_path: str) -> None:
    """In the forked rank: become what ``python -m module *argv`` with ``env`` would be (a
    session of its own, stdout and stderr to one file), run it, exit with its status."""
    os.setsid()
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the server's pool was sized before env was set
    sys.path.insert(0, REPO)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_ranks(
    scenario: str, world_size: int, args: dict, env: dict | None = None, module: str = "tests.workers"
) -> list[_Rank]:
    port = free_port()
    ctx = _forkserver()
    outputs = tempfile.mkdtemp(prefix="ranks-")
    ranks = []
    for rank in range(world_size):
        renv = {
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
        output_path = os.path.join(outputs, f"rank-{rank}.out")
        process = ctx.Process(target=_run_rank, args=(module, [scenario, json.dumps(args)], renv, output_path),
                              name=f"{scenario}-rank-{rank}")
        process.start()
        ranks.append(_Rank(process, output_path))
    return ranks


def finish(ranks: list[_Rank], timeout: float) -> list[RankResult]:
    deadline = time.monotonic() + timeout
    results = []
    for rank, r in enumerate(ranks):
        r.process.join(max(0.1, deadline - time.monotonic()))
        killed = r.process.exitcode is None
        if killed:
            try:
                os.killpg(r.process.pid, signal.SIGKILL)  # the rank's session: it and anything it started
            except ProcessLookupError:
                pass
            r.process.kill()
            r.process.join()
        with open(r.output_path, errors="replace") as f:
            output = f.read()
        if killed:
            output += f"\n[killed by the test harness after {timeout} s]"
        results.append(RankResult(rank, r.process.exitcode, output))
        os.unlink(r.output_path)
    os.rmdir(os.path.dirname(ranks[0].output_path))
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
