"""Goodput under repeated faults: @resilient.elastic under resilient-run against torchrun + DCP.

Both runs train the same script (``benchmarks/goodput_train.py``: an MLP of 4 x 1024^2 with
momentum, 0.1 s of simulated accelerator work per step, a checkpoint every 50 steps) on two
simulated nodes (one agent and one worker each) of this machine, one run after the other,
for ``--minutes`` each. Every ``--fault-every`` seconds the harness SIGKILLs node b's
worker: the same wall-clock fault schedule for both.

* resilient: ``resilient-run`` (etcd-v3), ``@resilient.elastic``, node-local checkpoints
  with peer copies in memory; survivors recover in-process, node b's agent starts a new
  worker that joins the running gang;
* torchrun + DCP: ``torchrun`` (c10d, ``--max-restarts=100``), ``dcp.async_save`` to a
  shared directory, ``dcp.load`` of the newest complete checkpoint on start.

Reported per run: steps trained whose result survived (redone steps counted once),
goodput (time of those steps over wall time, from the first event to the end, start-up
included), steps redone, and per fault the time from the kill to the next step.

    python benchmarks/bench_goodput.py [--minutes 10] [--fault-every 120] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import free_port  # noqa: E402
from tests.nodes import Cluster, c10d_flags, etcd_v3_flags  # noqa: E402
from resilient import _timeline  # noqa: E402
from benchmarks.fault_runs import add_output_flags, render_or_run  # noqa: E402
from resilient.devservices import EtcdServer  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goodput_train.py")
MODES = {
    "resilient": ("resilient-run + etcd-v3 + @resilient.elastic", [sys.executable, "-m", "resilient.launch.run"]),
    "dcp": ("torchrun + c10d + DCP async_save", [sys.executable, "-m", "torch.distributed.run"]),
}


def workers_of(agent: psutil.Process) -> list[psutil.Process]:
    out = []
    for child in agent.children(recursive=False):
        try:
            if any("goodput_train.py" in part for part in child.cmdline()):
                out.append(child)
        except psutil.Error:
            continue
    return out


def run(mode: str, minutes: float, fault_every: float, etcd: EtcdServer, every: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix=f"bench-goodput-{mode}-")
    run_id = f"goodput-{mode}-{time.time_ns()}"
    label, launcher = MODES[mode]
    rdzv = etcd_v3_flags(etcd.endpoint, run_id, conf=None) if mode == "resilient" else \
        c10d_flags(f"127.0.0.1:{free_port()}", run_id)
    cluster = Cluster(tmp, etcd.endpoint, run_id, nnodes="1:2" if mode == "resilient" else "2",
                      steps=10**9, every=every, step_time=0.1, launcher=launcher, rdzv=rdzv, script=SCRIPT,
                      use_remote=False, max_restarts=100)
    script_args = ["--mode", mode] + (["--root", os.path.join(tmp, "shared")] if mode == "dcp" else [])
    faults: list[float] = []
    try:
        cluster.start("a", script_args=script_args)
        time.sleep(1.0)
        b = cluster.start("b", script_args=script_args)
        started = time.time()
        end = started + minutes * 60
        next_fault = started + fault_every
        while time.time() < end:
            time.sleep(0.2)
            if next_fault < end - 1.0 and time.time() >= next_fault:  # none at the very end
                victims = workers_of(psutil.Process(b.proc.pid))
                if victims:
                    faults.append(time.time())
                    os.kill(victims[0].pid, signal.SIGKILL)
                    print(f"[{mode}] fault {len(faults)}: killed node b's worker {victims[0].pid}",
                          file=sys.stderr, flush=True)
                next_fault += fault_every
        ended = time.time()
    finally:
        workers = [w for node in cluster.nodes if psutil.pid_exists(node.proc.pid)
                   for w in workers_of(psutil.Process(node.proc.pid))]
        cluster.close()
        for w in workers:  # torchrun's workers outlive a SIGKILLed agent
            try:
                w.kill()
            except psutil.Error:
                pass
    events = [e for e in cluster.events() if e["t"] <= ended]
    timeline = _timeline.build(events)
    steps = [e for e in events if e["event"] == "step"]
    # the first step of a gang incarnation that began after the fault (the old gang may
    # still finish a step in flight)
    resumed = []
    for fault in faults:
        after = [inc.steps[0][1] for inc in timeline.incarnations if inc.started > fault and inc.steps]
        resumed.append(round(min(after) - fault, 3) if after else None)
    summary = _timeline.summary(timeline)
    kept = len({e["step"] for e in steps})  # a redone step counts once
    return {
        "mode": mode, "label": label, "minutes": minutes, "fault_every_s": fault_every, "faults": len(faults),
        "wall_s": round(ended - timeline.start, 1), "kept_steps": kept,
        "goodput": round(timeline.useful_s / (ended - timeline.start), 4),
        "redone_steps": summary["redone_steps"], "fault_to_next_step_s": resumed,
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| run | faults | wall | steps kept | goodput | steps redone | fault → next step (median) |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        times = [t for t in r["fault_to_next_step_s"] if t is not None]
        median = f"{statistics.median(times):.2f} s" if times else "never"
        lines.append(f"| {r['label']} | {r['faults']} | {r['wall_s']:.0f} s | {r['kept_steps']} | "
                     f"{r['goodput']:.1%} | {r['redone_steps']} | {median} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--fault-every", type=float, default=120.0)
    p.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--modes", default="resilient,dcp")
    add_output_flags(p)
    args = p.parse_args()

    def runs(etcd: EtcdServer):
        for mode in args.modes.split(","):
            yield run(mode, args.minutes, args.fault_every, etcd, args.every)

    render_or_run(args, table, runs)

if __name__ == "__main__":
    main()
