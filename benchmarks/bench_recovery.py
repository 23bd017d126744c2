"""Recovery after faults: resilient-run + etcd-v3 against torchrun + c10d, in one run.

Two (or three) agents on this machine stand for nodes; each runs the same small DDP
script (gloo, a checkpoint every 5 steps, 0.05 s per step): ``tests/elastic_train.py``, or,
for the in-process rows, ``tests/inprocess_train.py`` (the same loop inside
``@resilient.elastic``: survivors are not restarted, a lost worker's agent starts a new one
that joins later).
Faults, injected after training settles at world size 2:

* ``worker``: SIGKILL one worker process (its agent lives);
* ``node``:   SIGKILL a node: its agent and its workers;
* ``frozen``: SIGSTOP a node: agent and workers (no TCP reset; peers just block);
* ``spare``:  SIGKILL a node while a third agent waits as a spare (``--nnodes=1:2``);
* ``storehost``: SIGKILL the node of rank 0, whose agent hosts the in-process regroup store
  (and, under c10d, the rendezvous store): in-process, the survivor re-forms through the
  standby store that its own agent hosts;
* ``storehost-frozen``: SIGSTOP that node instead (no TCP reset: the survivor's ranks sit in
  a collective and in a wait on the frozen store until told);
* ``hung``:   rank 1 stops inside step 60 (``RESILIENT_FAULT=hang``): no crash, no lost node.
* ``midsave``: rank 1 is SIGKILLed in its background writer during step 70's save
  (``RESILIENT_FAULT=kill:...,phase=write``): its file is written, its report never sent,
  so rank 0's commit of that step waits for it while rank 0 recovers.
  resilient-run's runs set ``RESILIENT_HANG_TIMEOUT=5``; torchrun's keep its defaults.

Reported per launcher and scenario (median over the runs that resumed):

* detection: fault → the surviving node's worker is stopped or fails (it is then known
  that the gang must re-form);
* resumed:   fault → the first training step completed after the fault;
* redone:    steps the old gang completed that the new one had to train again;
* world:     the world size training resumed at.

Both launchers use their defaults except ``--max-restarts=3`` (torchrun's default of 0 ends
the job at the first failure) and, for the spare scenario, a third agent. A run that does
not resume within ``--give-up`` seconds is reported as such.

    python benchmarks/bench_recovery.py [--repeats 2] [--scenarios worker,node,frozen,spare,hung,midsave,storehost,storehost-frozen]
"""

from __future__ import annotations

import argparse
import json
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
from tests.nodes import TRAIN, TRAIN_IN_PROCESS, Cluster, c10d_flags, etcd_v3_flags  # noqa: E402
from benchmarks.fault_runs import add_output_flags, render_or_run  # noqa: E402
from resilient.devservices import EtcdServer  # noqa: E402

HUNG_AT, HANG_TIMEOUT, STEP_TIME = 60, 5, 0.05
MIDSAVE_AT = 70  # a save step (every 5), ~1.5 s after the bench sees step 40 at world 2
IN_PROCESS = "resilient-run + etcd-v3 + @resilient.elastic"
LAUNCHERS = {
    IN_PROCESS: [sys.executable, "-m", "resilient.launch.run"],
    "resilient-run + etcd-v3": [sys.executable, "-m", "resilient.launch.run"],
    "torchrun + c10d": [sys.executable, "-m", "torch.distributed.run"],
}


def run_once(launcher: str, scenario: str, etcd: EtcdServer, give_up: float) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="bench-recovery-")
    run_id = f"{scenario}-{time.time_ns()}"
    if launcher.startswith("resilient"):
        rdzv = etcd_v3_flags(etcd.endpoint, run_id, conf=None)  # the backend's defaults
    else:
        rdzv = c10d_flags(f"127.0.0.1:{free_port()}", run_id)
    in_process = launcher == IN_PROCESS
    cluster = Cluster(tmp, etcd.endpoint, run_id, steps=100_000, rdzv=rdzv, launcher=LAUNCHERS[launcher],
                      script=TRAIN_IN_PROCESS if in_process else TRAIN)
    log = os.path.join(tmp, "resilient-events.jsonl")
    env = {"RESILIENT_EVENT_LOG": log}
    if scenario == "hung":  # rank 1 stops inside step 60; only resilient-run's runs watch for hangs
        env["RESILIENT_FAULT"] = f"hang:rank=1,step={HUNG_AT}"
        if launcher.startswith("resilient"):
            env["RESILIENT_HANG_TIMEOUT"] = str(HANG_TIMEOUT)
    if scenario == "midsave":
        env["RESILIENT_FAULT"] = f"kill:rank=1,step={MIDSAVE_AT},phase=write"
    try:
        nodes = {"a": cluster.start("a", env=env)}
        time.sleep(1.0)  # "a" first: with c10d it hosts the store, and it is the victim only in storehost
        nodes["b"] = victim = cluster.start("b", env=env)
        if scenario == "spare":
            cluster.wait_for(lambda e: e["event"] == "step" and e["world"] == 2, 120, "world 2")
            cluster.start("c")
        cluster.wait_for(lambda e: e["event"] == "step" and e["world"] == 2 and e["step"] >= 40, 120,
                         "training at world 2")
        time.sleep(3 if scenario == "spare" else 0.5)  # the spare registers
        if scenario.startswith("storehost") or scenario == "midsave":
            victim = nodes[next(e["node"] for e in reversed(cluster.events()) if e["event"] == "start"
                                and e["rank"] == (1 if scenario == "midsave" else 0))]
        survivor = "b" if victim.name == "a" else "a"
        survivor_workers = [psutil.Process(p) for p in cluster.workers_of(survivor) if psutil.pid_exists(p)]
        old_workers = set(cluster.workers_of("a") + cluster.workers_of("b") + cluster.workers_of("c"))
        fault = time.time()
        if scenario == "hung":  # the fault is the step that never finished
            before = cluster.wait_for(lambda e: e["event"] == "step" and e["rank"] == 1 and e["step"] == HUNG_AT - 1,
                                      60, "the step before the hang")
            fault = before["t"] + STEP_TIME
            survivor_workers = [psutil.Process(p) for p in old_workers if psutil.pid_exists(p)]
        elif scenario == "midsave":  # the fault is the kill in rank 1's writer
            fired = _first_event(log, "fault", fault - 60, fault + give_up)
            fault = fired if fired is not None else fault
        elif scenario == "worker":
            os.kill(cluster.workers_of("b")[-1], signal.SIGKILL)
        elif scenario in ("node", "spare", "storehost"):
            victim.signal_all(signal.SIGKILL, cluster.workers_of(victim.name))
        elif scenario in ("frozen", "storehost-frozen"):
            victim.signal_all(signal.SIGSTOP, cluster.workers_of(victim.name))
        # the gang knows it must re-form: a worker of the survivors is stopped or fails, or
        # (in-process) reports the failure and stays
        detected = _first_event(log, "failure_detected", fault, fault + give_up) if in_process else \
            _wait_gone(survivor_workers, fault + give_up)
        try:
            restart = cluster.wait_for(lambda e: e["event"] == "start" and e["t"] > fault,
                                       max(1.0, fault + give_up - time.time()), "a restored gang")
            first = cluster.wait_for(lambda e: e["event"] == "step" and e["t"] > restart["t"]
                                     and e["pid"] == restart["pid"], 30, "a resumed step")
            start = [e for e in cluster.events() if e["event"] == "start" and e["t"] > fault]
            restored = min(e["restored"] for e in start) if start else None
            # the furthest the old gang got, faults' last steps included
            last_before = max(e["step"] for e in cluster.events() if e["event"] == "step" and e["pid"] in old_workers)
        except AssertionError:
            first, restored = None, None
        return {
            "launcher": launcher, "scenario": scenario,
            "detection_s": None if detected is None else detected - fault,
            "resumed_s": None if first is None else first["t"] - fault,
            "lost_steps": None if restored is None else last_before - restored,
            "world": None if first is None else first["world"],
        }
    finally:
        cluster.close()


def _first_event(log: str, event: str, after: float, deadline: float) -> float | None:
    """When the resilient event log first shows ``event`` at or after ``after``."""
    while time.time() < deadline:
        if os.path.exists(log):
            with open(log) as f:
                times = [e["t"] for e in map(json.loads, f) if e["event"] == event and e["t"] >= after]
            if times:
                return min(times)
        time.sleep(0.05)
    return None


def _wait_gone(procs: list[psutil.Process], deadline: float) -> float | None:
    """When the first surviving worker exits (stopped by its agent, or failed)."""
    while time.time() < deadline:
        for p in procs:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                return time.time()
        time.sleep(0.02)
    return None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, launcher): medians over the runs that resumed, and how many did."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        rows.setdefault((r["scenario"], r["launcher"]), []).append(r)
    out = []
    for (scenario, launcher), group in rows.items():
        ok = [r for r in group if r["resumed_s"] is not None]
        detected = [r["detection_s"] for r in group if r["detection_s"] is not None]
        out.append({
            "scenario": scenario, "launcher": launcher, "runs": len(group), "resumed_runs": len(ok),
            "detection_s": statistics.median(detected) if len(detected) == len(group) else None,
            "resumed_s": statistics.median(r["resumed_s"] for r in ok) if ok else None,
            "lost_steps": statistics.median(r["lost_steps"] for r in ok) if ok else None,
            "world": ok[0]["world"] if ok else None,
        })
    return out


def table(runs: list[dict[str, Any]], give_up: float) -> str:
    def cell(v: float | None, fmt: str = "{:.1f} s") -> str:
        return fmt.format(v) if v is not None else f"not within {give_up:.0f} s"

    lines = ["| scenario | launcher | detection | fault → first step | steps redone | world after |",
             "|---|---|---|---|---|---|"]
    for r in summarize(runs):
        resumed = cell(r["resumed_s"])
        if 0 < r["resumed_runs"] < r["runs"]:
            resumed += f" ({r['runs'] - r['resumed_runs']} of {r['runs']} runs never resumed)"
        elif r["resumed_runs"] == 0:
            resumed = f"never, in {r['runs']} of {r['runs']} runs (> {give_up:.0f} s)"
        lines.append(f"| {r['scenario']} | {r['launcher']} | {cell(r['detection_s'])} | {resumed} | "
                     f"{cell(r['lost_steps'], '{:.0f}')} | {cell(r['world'], '{:.0f}')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--scenarios", default="worker,node,frozen,spare,hung")
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--give-up", type=float, default=70.0, help="seconds after the fault (default: %(default)s)")
    add_output_flags(p)
    args = p.parse_args()

    def runs(etcd: EtcdServer):
        for scenario in args.scenarios.split(","):
            for launcher in args.launchers.split(","):
                for _ in range(args.repeats):
                    yield run_once(launcher, scenario, etcd, args.give_up)

    render_or_run(args, lambda done: table(done, args.give_up), runs)

if __name__ == "__main__":
    main()
