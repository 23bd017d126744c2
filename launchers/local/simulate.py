"""Run N simulated nodes on this machine: one etcd, one resilient-run agent per node.

For demos and chaos tests: every node has its own agent (its own lease, its own workers)
and its own local tier; faults are real signals at given times (``b@20``: 20 s in) or
steps (``b@step:40``: once rank 0 reports step 40, whatever the machine's speed); at the
end the run's timeline and goodput are printed from the shared event log.

    python launchers/local/simulate.py --nodes 3 --nnodes 1:2 --kill b@step:40 --freeze a@40 \\
        -- examples/train.py --root runs/sim/{node} --steps 400

``{node}`` in the script's arguments becomes the node's name (a, b, c, ...); the node's
local directory is also in ``$NODE_ROOT``. ``--netns`` puts every node in a network
namespace of its own, joined by a bridge (root and iproute2 needed), so that
``--partition b@30`` cuts a node off for real.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import string
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from resilient._events import EventLog
from resilient.devservices import EtcdServer

BRIDGE, SUBNET = "rsim0", "10.231.0"


@dataclass
class Fault:
    """A fault and its trigger: a time (seconds after the last agent started) or a training
    step. A step trigger is what a test or a demo usually means ("once training has saved a
    few checkpoints"): a time means that only on a machine of known speed."""

    kind: str   # kill, freeze, partition
    node: str
    at: float | None = None          # NODE@SECONDS
    after_step: int | None = None    # NODE@step:N, once rank 0 reports step N

    @classmethod
    def parse(cls, kind: str, spec: str) -> "Fault":
        node, _, when = spec.partition("@")
        try:
            if when.startswith("step:"):
                step = int(when[len("step:"):])
                if step < 0:
                    raise ValueError(step)
                return cls(kind, node, after_step=step)
            return cls(kind, node, at=float(when))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--{kind} {spec!r}: expected NODE@SECONDS or NODE@step:N, e.g. b@20 or b@step:40") from None

    def due(self, elapsed: float, step: int) -> bool:
        if self.after_step is not None:
            return step >= self.after_step
        return elapsed >= (self.at or 0.0)


class StepFollower:
    """The highest step rank 0 has reported in the run's event log, read incrementally (the
    log grows by a line a step; reading it whole at every poll would grow quadratically)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.step = -1
        self._offset = 0
        self._partial = b""

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.step
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            if b'"step"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "step" and isinstance(event.get("step"), int):
                self.step = max(self.step, event["step"])
        return self.step


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True)


class Netns:
    """Each node in its own namespace, all on one bridge with the host (where etcd listens)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.close()  # leftovers of an earlier run that was killed
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        names = self.names
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        for i, name in enumerate(names):
            ns, host_end = f"rsim-{name}", f"rsim-{name}-h"
            run(["ip", "netns", "add", ns])
            run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns])
            run(["ip", "link", "set", host_end, "master", BRIDGE, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def address(self, index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", f"rsim-{name}"]

    def cut(self, name: str) -> None:
        run(["ip", "link", "set", f"rsim-{name}-h", "down"])

    def close(self) -> None:
        for name in self.names:
            # a namespace (and its veth pair) lives on while any process is inside it
            pids = subprocess.run(["ip", "netns", "pids", f"rsim-{name}"], capture_output=True, text=True).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "link", "del", f"rsim-{name}-h"], check=False, capture_output=True)
            subprocess.run(["ip", "netns", "del", f"rsim-{name}"], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], check=False, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: simulate.py [options] -- SCRIPT [ARGS...]   (see --help)"
                         if "-h" not in argv and "--help" not in argv else __doc__)
    ours, script = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="agents to start (default: %(default)s)")
    p.add_argument("--nnodes", default=None, help="MIN:MAX of the gang (default: 1:NODES)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--dir", default="runs/simulate", help="event log and node directories (default: %(default)s)")
    p.add_argument("--kill", action="append", default=[], type=lambda s: Fault.parse("kill", s),
                   help="SIGKILL a node's agent and workers at a time or a step: NODE@SECONDS or NODE@step:N")
    p.add_argument("--freeze", action="append", default=[], type=lambda s: Fault.parse("freeze", s),
                   help="SIGSTOP a node (agent and workers) at a time or a step: NODE@SECONDS or NODE@step:N")
    p.add_argument("--partition", action="append", default=[], type=lambda s: Fault.parse("partition", s),
                   help="cut a node's network at a time or a step (needs --netns): NODE@SECONDS or NODE@step:N")
    p.add_argument("--netns", action="store_true", help="one network namespace per node (root)")
    p.add_argument("--rdzv-conf", default="lease_ttl=5")
    p.add_argument("--timeout", type=float, default=1800, help="stop everything after this many seconds")
    args = p.parse_args(ours)
    if not script:
        p.error("give the training script after --")
    names = list(string.ascii_lowercase[:args.nodes])
    faults = args.kill + args.freeze + args.partition
    for fault in faults:
        if fault.node not in names:
            p.error(f"--{fault.kind} names node {fault.node!r}; nodes are {', '.join(names)}")
        if fault.kind == "partition" and not args.netns:
            p.error("--partition needs --netns")
    os.makedirs(args.dir, exist_ok=True)
    events = os.path.abspath(os.path.join(args.dir, "events.jsonl"))
    if os.path.exists(events):
        os.remove(events)
    netns = Netns(names) if args.netns else None
    # with namespaces, etcd listens on the bridge, where every node can reach it
    etcd = EtcdServer(os.path.join(args.dir, "etcd"), host=f"{SUBNET}.1" if netns else "127.0.0.1").start()
    run_id = f"sim-{int(time.time())}"
    agents: dict[str, subprocess.Popen] = {}
    try:
        for i, name in enumerate(names):
            root = os.path.abspath(os.path.join(args.dir, name))
            env = {**os.environ, "NODE_NAME": name, "NODE_ROOT": root, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "resilient.launch.run", f"--nnodes={args.nnodes or f'1:{args.nodes}'}",
                   f"--nproc-per-node={args.nproc_per_node}", "--max-restarts=3",
                   "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
                   f"--rdzv-conf={args.rdzv_conf}", f"--event-log={events}"]
            if netns:
                cmd = netns.prefix(name) + cmd + [f"--local-addr={netns.address(i)}"]
                env["GLOO_SOCKET_IFNAME"] = "eth0"
            cmd += [a.replace("{node}", name) for a in script]
            log = open(os.path.join(args.dir, f"{name}.log"), "wb")
            agents[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            print(f"node {name}: agent {agents[name].pid}, log {log.name}", flush=True)
            if i + 1 < len(names):
                # one by one, so that node a holds rank 0: its agent hosts the rounds' stores,
                # and a demo that kills node b shows in-process recovery, not the fallback
                time.sleep(1.0)
        started = time.monotonic()
        deadline = started + args.timeout
        log = EventLog(events, -1, node=f"simulate.py ({run_id})")
        progress = StepFollower(events)
        pending = list(faults)
        while time.monotonic() < deadline and any(a.poll() is None for n, a in agents.items()
                                                  if n not in {f.node for f in faults}):
            step = progress.poll() if pending else -1
            for fault in [f for f in pending if f.due(time.monotonic() - started, step)]:
                pending.remove(fault)
                log.emit("fault", kind=fault.kind, target=f"node {fault.node}")
                inject(fault, agents[fault.node], netns)
            time.sleep(0.1)
        log.close()
        for fault in pending:
            print(f"fault never injected (its trigger did not come): {fault.kind} node {fault.node}", flush=True)
        codes = {n: a.poll() for n, a in agents.items()}
        print(f"agents exited: {codes}", flush=True)
    finally:
        for agent in agents.values():
            stop(agent)
        etcd.stop()
        if netns:
            netns.close()
    subprocess.run([sys.executable, "-m", "resilient.ckpt", "timeline", events,
                    "--png", os.path.join(args.dir, "timeline.png")], check=False)
    survivors = [n for n in names if n not in {f.node for f in faults}]
    return 0 if all(codes[n] == 0 for n in survivors) else 1


def inject(fault: Fault, agent: subprocess.Popen, netns: Netns | None) -> None:
    print(f"{time.strftime('%H:%M:%S')} fault: {fault.kind} node {fault.node}", flush=True)
    if fault.kind == "partition":
        assert netns is not None
        netns.cut(fault.node)
        return
    sig = signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP
    for proc in [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def stop(agent: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    agent.wait()


if __name__ == "__main__":
    sys.exit(main())
