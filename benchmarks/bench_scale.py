"""Coordination at scale, simulated on one machine: N rendezvous agents against a real etcd.

    python -m benchmarks.bench_scale [--agents 8,32,128,512,1024] [--procs 8]
                                     [--backends etcd-v3,c10d] [--etcd single,cluster3]
                                     [--json PATH] [--render PATH]

Each agent is the real rendezvous handler of its backend (``EtcdV3RendezvousHandler``, or
torch's ``DynamicRendezvousHandler`` on a c10d store built through torch's registry), with
no training workers; the agents of one size are spread over ``--procs`` processes, one
thread each, and started at one instant. Both backends run with ``--nnodes=N-1:N`` (so
that they can re-form without the lost agent) and their default timeouts, except the
etcd lease TTL (``--lease-ttl``). Figures per (backend, N):

* **formation**: from the common start until every agent is ranked in one round of N;
* **re-form after a loss**: one agent freezes (stops its lease keep-alive or its c10d
  heartbeats, answers nothing); from then until every survivor is ranked in a round of N-1.
  The etcd-v3 survivors learn of it themselves (lease expiry, the agent's own
  ``num_nodes_waiting()`` poll every ``--monitor-interval``); the c10d survivors are told to
  re-join at the instant of the freeze, as if their workers' collectives had failed at once
  (more than a real torchrun gets: its only other signal is a worker failure);
* **etcd requests and bytes per agent per round** (request and response bodies, watch
  events included; lease keep-alives, which are per second, not per round, apart).

The store and etcd run in this process's children; torch's c10d store is hosted by this
process (as one agent's process hosts it in a real job). ``--json PATH`` writes one object
per (backend, etcd, N). Where a size cannot run here (threads, ports, memory), the error
says which limit stopped it and the table shows the sizes up to there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shlex
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

ROUND_TIMEOUT_S = 180.0
DEFAULT_LEASE_TTL_S = 5  # the tables' lease TTL; rows run with another one say so
SIM_SECRET = "the simulated job's secret"  # seals the regroup store, as the agent's round secret does
#: Set once the benchmark runs in a network namespace of its own with only loopback up.
#: Why: torch's TCPStore client looks up the reverse name of every address it connects to,
#: and this sandbox's resolver drops some queries (a 5 s stall, 1 connection in ~25, seen with
#: strace: the query for 1.0.0.127.in-addr.arpa); with no route to any resolver the lookup
#: fails at once. Both backends connect to TCPStores, so both run there.
NETNS_ENV = "RESILIENT_BENCH_NETNS"
#: How the rendezvous agents' processes run (both backends alike). A real agent is one process
#: per node with a handful of threads; here ~128 agents (~500 threads) share one interpreter
#: lock, and at Python's default 5 ms switch interval every thread waiting for it forced a
#: hand-off every few milliseconds: most of the CPU went to the kernel, a lease keep-alive
#: waited over 5 s for its turn, leases expired and 1,024 agents never formed a round. With a
#: 50 ms interval threads still hand over at every blocking call. The lower priority keeps etcd
#: and torch's store (hosted by the driver), which in a real job have machines of their own,
#: from queueing behind the agents. The regroup simulation keeps the defaults.
AGENT_NICENESS = 10
AGENT_SWITCH_INTERVAL_S = 0.05


@dataclass
class Spec:
    backend: str
    endpoint: str
    run_id: str
    total: int
    indices: list[int]
    lease_ttl: int
    monitor_interval: float


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options every simulation at scale takes (this one, ``bench_commit_scale``)."""
    p.add_argument("--no-netns", dest="netns", action="store_false",
                   help="run in this network namespace (see NETNS_ENV) rather than a loopback-only one")
    p.add_argument("--json", default=None, help="write the results here (one object per case)")
    p.add_argument("--render", default=None, help="print the table of an earlier --json file and exit")


def rendered_or_moved(args: argparse.Namespace, render: Any, module: str, argv: list[str] | None) -> bool:
    """True once ``--render``'s table is printed (nothing to run). Otherwise, unless told
    ``--no-netns`` or already there, run ``python -m module argv`` again in a network
    namespace of its own with only loopback up (see NETNS_ENV): this returns only where that
    cannot be done (not root, no ``unshare``), and the run goes on here."""
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return True
    if args.netns and os.environ.get(NETNS_ENV) != "1" and os.geteuid() == 0 and shutil.which("unshare"):
        env = {**os.environ, NETNS_ENV: "1"}
        command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", module, *(argv or sys.argv[1:])])
        os.execvpe("unshare", ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"], env)
    return False


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# -- the agents' side (child processes) ----------------------------------------------------------
def _make_handler(spec: Spec) -> Any:
    if spec.backend == "etcd-v3":
        from resilient.launch._etcd import Etcd
        from resilient.launch.rendezvous import EtcdV3RendezvousHandler

        handler = EtcdV3RendezvousHandler(Etcd(spec.endpoint), spec.run_id, spec.total - 1, spec.total,
                                          local_addr="127.0.0.1", lease_ttl=spec.lease_ttl,
                                          join_timeout=ROUND_TIMEOUT_S)
        handler.close_on_shutdown = False
        return handler
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters("c10d", spec.endpoint, spec.run_id, spec.total - 1, spec.total,
                                  is_host=False, join_timeout=str(int(ROUND_TIMEOUT_S)))
    return get_rendezvous_handler(params)


def _round_of(handler: Any) -> int:
    running = getattr(handler, "_running", None)
    if running is not None:
        return running.number
    return handler._state_holder.state.round


def _freeze(handler: Any) -> None:
    """The agent stops answering: no lease keep-alive (etcd) or heartbeat (c10d), no watch."""
    if hasattr(handler, "_keeper"):
        handler._keeper.close(revoke=False)
        for watch in (handler._state, handler._gone):
            if watch is not None:
                watch.close()
    else:
        handler._stop_heartbeats()


def serve(conn: Any, spec: Spec) -> None:
    raise_fd_limit()
    os.nice(AGENT_NICENESS)
    sys.setswitchinterval(AGENT_SWITCH_INTERVAL_S)
    import logging

    logging.disable(logging.WARNING)
    import torch.distributed.elastic.rendezvous.registry  # noqa: F401 - imported before the clock starts

    handlers: dict[int, Any] = {}
    records: list[tuple[int, int, int, int, float]] = []   # index, round, rank, world, time
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    frozen: set[int] = set()

    def rendezvous(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001
            if i not in frozen and not stop.is_set():
                with lock:
                    errors.append(f"agent {i}: {type(exc).__name__}: {exc}")
            return
        with lock:
            records.append((i, _round_of(handlers[i]), info.rank, info.world_size, time.time()))

    def agent(i: int, start_at: float) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        try:  # an agent starts: its handler, then its first rendezvous (what torchrun does)
            handlers[i] = _make_handler(spec)
        except Exception as exc:  # noqa: BLE001 - reported with the limit that failed
            with lock:
                errors.append(f"creating agent {i} ({len(handlers)} made in this process): "
                              f"{type(exc).__name__}: {exc}")
            return
        rendezvous(i)
        if spec.backend != "etcd-v3":
            return  # c10d agents re-join when told (see the module docstring)
        while not stop.is_set():   # what torch's agent does while healthy (a plain sleep, as there:
            time.sleep(spec.monitor_interval)  # here ~2/3 of the CPU of an Event wait per wake-up)
            if i not in frozen and not stop.is_set() and handlers[i].num_nodes_waiting() > 0:
                rendezvous(i)

    conn.send(("created", 0))
    while True:
        command, arg = conn.recv()
        if command == "form":
            for i in spec.indices:
                threading.Thread(target=agent, args=(i, arg), daemon=True).start()
        elif command == "kill":
            if arg in handlers:
                frozen.add(arg)
                _freeze(handlers[arg])
        elif command == "rejoin":
            for i in list(handlers):
                if i not in frozen:
                    threading.Thread(target=rendezvous, args=(i,), daemon=True).start()
        elif command == "report":  # arg: (records already sent, whether to add the etcd stats)
            sent, with_stats = arg
            stats: dict[str, int] = {"cpu_ms": int(process_cpu_s() * 1e3)} if with_stats else {}
            for h in list(handlers.values()) if with_stats else []:
                etcd = getattr(h, "etcd", None)
                for key, value in (etcd.stats_snapshot() if etcd is not None else {}).items():
                    stats[key] = stats.get(key, 0) + value
            with lock:
                conn.send(("report", records[sent:], stats, list(errors)))
        elif command == "stop":
            stop.set()
            for i, h in list(handlers.items()):
                if i not in frozen:
                    try:
                        h.shutdown()
                    except Exception:  # noqa: BLE001
                        pass
            conn.send(("stopped", None))
            return


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve_regroup(conn: Any, spec: Spec) -> None:
    """In-process regrouping: ``spec.indices`` are nodes, each an agent's heartbeat (the real
    ``InProcessRecovery``) and ``spec.lease_ttl`` ranks (the real ``Regroup``), one thread each."""
    raise_fd_limit()
    import logging

    logging.disable(logging.WARNING)
    from resilient._regroup import Regroup
    from resilient.launch._inprocess import InProcessRecovery

    per_node = spec.lease_ttl
    agents: dict[int, Any] = {}
    ranks: dict[tuple[int, int], Any] = {}
    gens: dict[tuple[int, int], Any] = {}
    records: list[tuple[int, int, int, int, float]] = []
    errors: list[str] = []
    ops_at: dict[str, dict[tuple[int, int], int]] = {}
    cpu_at: dict[str, float] = {}  # this process's CPU seconds at the same instants
    killed: set[int] = set()
    lock = threading.Lock()

    def form(key: tuple[int, int], start_at: float) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        if key[0] in killed:
            return
        try:
            if key not in ranks:
                ranks[key] = Regroup(spec.endpoint, secret=SIM_SECRET, node=f"node{key[0]}",
                                     rank=key[0] * per_node + key[1],
                                     initial_world_size=spec.total * per_node, heartbeat=False,
                                     member_id=f"node{key[0]}-rank{key[1]}", stale_s=1.0, timeout=ROUND_TIMEOUT_S)
            gen = gens[key] = ranks[key].form(gens.get(key))
        except Exception as exc:  # noqa: BLE001
            with lock:
                errors.append(f"rank {key}: {type(exc).__name__}: {exc}")
            return
        with lock:
            records.append((key[0] * per_node + key[1], gen.number, gen.rank, gen.world_size, time.time()))
        # as ``@resilient.elastic`` does: the watcher thread interrupts the step, which re-forms
        group = ranks.get(key)
        if group is not None:
            group.watch(gen, lambda reason: threading.Thread(target=form, args=(key, 0.0), daemon=True).start())

    try:
        for n in spec.indices:
            agents[n] = InProcessRecovery(spec.endpoint, [], f"node{n}", secret=SIM_SECRET)
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", f"creating node {len(agents)} of {len(spec.indices)} in one process: "
                            f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("created", len(agents)))
    while True:
        command, arg = conn.recv()
        if command == "form":
            for n in spec.indices:
                for r in range(per_node):
                    threading.Thread(target=form, args=((n, r), arg), daemon=True).start()
        elif command == "kill":  # the whole node: its agent's heartbeat and its ranks stop
            if arg in agents:
                killed.add(arg)
                agents.pop(arg).close()
                for key in [k for k in ranks if k[0] == arg]:
                    ranks.pop(key).close()
        elif command == "fail":  # a survivor's collective broke: it reports, the rest are told
            key = (arg, 0)
            if key in ranks:  # then it re-forms, as ``@resilient.elastic`` does after reporting
                ranks[key].report_failure(gens[key], "a collective with the lost node failed")
                threading.Thread(target=form, args=(key, 0.0), daemon=True).start()
        elif command == "ops":
            ops_at[arg] = {k: r.ops for k, r in ranks.items()}
            cpu_at[arg] = process_cpu_s()
        elif command == "report":
            stats: dict[str, int] = {}
            if "before" in ops_at and "after" in ops_at:
                survivors = [k for k in ops_at["after"] if k in ops_at["before"]]
                stats = {"ranks": len(survivors),
                         "ops": sum(ops_at["after"][k] - ops_at["before"][k] for k in survivors),
                         "cpu_s": cpu_at["after"] - cpu_at["before"]}  # type: ignore[dict-item]
            with lock:
                conn.send(("report", records[arg[0]:], stats, list(errors)))
        elif command == "stop":
            for r in ranks.values():
                r.close()
            for a in agents.values():
                a.close()
            conn.send(("stopped", None))
            return


# -- the driver ---------------------------------------------------------------------------------
class Gang:
    """The child processes of one (backend, N) case."""

    def __init__(self, spec: Spec, procs: int, target: Any = serve) -> None:
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        for p in range(procs):
            indices = list(range(p, spec.total, procs))
            if not indices:
                continue
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child, Spec(**{**spec.__dict__, "indices": indices})),
                               daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        self._records: list[list[tuple[int, int, int, int, float]]] = [[] for _ in self.pipes]
        for pipe in self.pipes:
            kind, detail = pipe.recv()
            if kind == "error":
                self.close()
                raise RuntimeError(detail)

    def send(self, command: str, arg: Any = None) -> None:
        for pipe in self.pipes:
            pipe.send((command, arg))

    def report(self, stats: bool = True) -> tuple[list[tuple[int, int, int, int, float]], dict[str, int], list[str]]:
        """Every record so far, the agents' etcd request counts (``stats``) and their errors.

        The driver polls this every 0.25 s while a round forms, so each poll fetches only the
        records it has not seen, and the counts only when asked: the agents' processes are
        what is measured, and the poll must not take their CPU.
        """
        totals: dict[str, int] = {}
        errors: list[str] = []
        for pipe, seen in zip(self.pipes, self._records):
            pipe.send(("report", (len(seen), stats)))
        for pipe, seen in zip(self.pipes, self._records):
            _, r, s, e = pipe.recv()
            seen += r
            errors += e
            for key, value in s.items():
                totals[key] = totals.get(key, 0) + value
        return [r for seen in self._records for r in seen], totals, errors

    def wait_ranked(self, agents: set[int], world: int, after: float, timeout: float
                    ) -> tuple[float | None, list[tuple[int, int, int, int, float]]]:
        """Last time an agent of ``agents`` was ranked in the one round of ``world`` they share."""
        deadline = time.time() + timeout
        while True:
            records, _, errors = self.report(stats=False)
            if errors:
                raise RuntimeError("; ".join(errors[:3]))
            by_round: dict[int, dict[int, float]] = {}
            for i, rnd, _rank, w, t in records:
                if t >= after and w == world and i in agents:
                    by_round.setdefault(rnd, {})[i] = t
            for members in by_round.values():
                if set(members) == agents:
                    return max(members.values()), records
            if time.time() > deadline:
                return None, records
            time.sleep(0.25)

    def form_all(self, size: int, result: dict[str, Any], what: str) -> list[tuple[int, int, int, int, float]] | None:
        """Start every agent at one instant; wait for one round of ``size``. Sets
        ``formation_s`` (or ``error``) in ``result``; the records, or None."""
        start = time.time() + 1.0
        self.send("form", start)
        done, records = self.wait_ranked(set(range(size)), size, start, ROUND_TIMEOUT_S)
        if done is None:
            result["error"] = f"{what} of {size} did not form within {ROUND_TIMEOUT_S:.0f} s"
            return None
        result["formation_s"] = round(done - start, 3)
        return records

    def reformed(self, size: int, since: float, result: dict[str, Any], what: str) -> None:
        """Wait for the survivors (the first ``size`` agents) to be ranked in one round of
        ``size`` after ``since``: sets ``reform_s`` (and ``error`` if they never are)."""
        done, _ = self.wait_ranked(set(range(size)), size, since, ROUND_TIMEOUT_S)
        result["reform_s"] = round(done - since, 3) if done is not None else None
        if done is None:
            result["error"] = f"no {what} of {size} within {ROUND_TIMEOUT_S:.0f} s of the loss"

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for pipe, proc in zip(self.pipes, self.procs):
            try:
                if pipe.poll(20):
                    pipe.recv()
            except (EOFError, OSError):
                pass
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def service_cpu_s(service: Any) -> float:
    """CPU seconds the coordination service has used so far: etcd's processes (every member
    of a cluster), or, for c10d, this driver process, whose thread hosts torch's store."""
    members = getattr(service, "members", None) or ([service] if hasattr(service, "proc") else [])
    if not members:
        return process_cpu_s()
    total = 0.0
    for member in members:
        try:
            with open(f"/proc/{member.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, AttributeError, IndexError, ValueError):
            continue  # not Linux, or a member that is gone: counted as nothing
    return total


def cpu_split(stats: dict[str, int], before: dict[str, int], service_s: float, agents: int) -> dict[str, float]:
    """Where the CPU of one phase went, per agent, and what it implies: on this machine's
    cores, the phase cannot take less than all that CPU divided by the cores."""
    agents_s = (stats.get("cpu_ms", 0) - before.get("cpu_ms", 0)) / 1e3
    return {"agents_ms": round(agents_s / agents * 1e3, 2), "service_ms": round(service_s / agents * 1e3, 2),
            "floor_s": round((agents_s + service_s) / (os.cpu_count() or 1), 2)}


def per_round(stats: dict[str, int], before: dict[str, int], agents: int, rounds: int) -> dict[str, float]:
    """Requests and bytes per agent per round between two stats snapshots, keep-alives apart."""
    delta = {k: stats.get(k, 0) - before.get(k, 0) for k in stats}
    requests = sum(v for k, v in delta.items() if k.endswith(" requests") and "keepalive" not in k)
    nbytes = sum(v for k, v in delta.items() if k.endswith(" bytes") and "keepalive" not in k)
    return {"requests": requests / agents / rounds, "bytes": nbytes / agents / rounds}


def run_case(backend: str, n: int, service: Any, endpoint: str, procs: int, lease_ttl: int,
             monitor_interval: float) -> dict[str, Any]:
    spec = Spec(backend, endpoint, f"scale-{backend}-{n}-{time.time_ns()}", n, [], lease_ttl, monitor_interval)
    gang = Gang(spec, min(procs, n))
    result: dict[str, Any] = {"backend": backend, "agents": n, "procs": len(gang.procs)}
    try:
        _, stats0, _ = gang.report()
        service0 = service_cpu_s(service)
        records = gang.form_all(n, result, "round")
        if records is None:
            return result
        result["formation_rounds"] = len({r[1] for r in records})
        _, stats1, _ = gang.report()
        result["formation_cpu"] = cpu_split(stats1, stats0, service_cpu_s(service) - service0, n)
        t1 = time.time()
        if backend == "etcd-v3":
            result["formation_per_agent"] = per_round(stats1, stats0, n, 1)
        time.sleep(1.0)  # steady state: only keep-alives
        _, stats_idle, _ = gang.report()
        service_idle = service_cpu_s(service)
        victim = n - 1
        killed = time.time()
        gang.send("kill", victim)
        if backend != "etcd-v3":
            gang.send("rejoin")
        gang.reformed(n - 1, killed, result, "round")
        _, stats2, _ = gang.report()
        result["reform_cpu"] = cpu_split(stats2, stats_idle, service_cpu_s(service) - service_idle, n - 1)
        if backend == "etcd-v3":
            result["reform_per_agent"] = per_round(stats2, stats_idle, n - 1, 1)
            keepalives = stats2.get("/lease/keepalive requests", 0) - stats1.get("/lease/keepalive requests", 0)
            result["keepalives_per_agent_s"] = round(keepalives / n / (time.time() - t1), 3)
        return result
    finally:
        gang.close()


def run_regroup_case(nodes: int, per_node: int, procs: int) -> dict[str, Any]:
    """In-process regrouping of ``nodes`` x ``per_node`` ranks through one store (hosted here,
    as the rank-0 agent hosts it): formation of generation 0, then one node lost."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    address = f"127.0.0.1:{server.port}/bench"
    spec = Spec("regroup", address, "", nodes, [], per_node, 0.0)
    gang = Gang(spec, min(procs, nodes), serve_regroup)
    ranks = nodes * per_node
    result: dict[str, Any] = {"backend": "regroup", "nodes": nodes, "ranks_per_node": per_node,
                              "agents": nodes, "procs": len(gang.procs)}
    try:
        if gang.form_all(ranks, result, "generation 0") is None:
            return result
        gang.send("ops", "before")
        host_cpu = process_cpu_s()  # the store's (and this driver's) CPU, over the same window
        victim = nodes - 1
        killed = time.time()
        gang.send("kill", victim)
        gang.send("fail", 0)  # node 0's first rank saw its collective break; the others are told
        gang.reformed((nodes - 1) * per_node, killed, result, "generation")
        gang.send("ops", "after")
        host_cpu = process_cpu_s() - host_cpu
        _, stats, _ = gang.report()
        if stats.get("ranks"):
            result["ops_per_rank"] = round(stats["ops"] / stats["ranks"], 2)
            # the machine's limit: what the re-form cost in CPU, per rank, the idle heartbeats of
            # every simulated agent included, and what the store's host spent meanwhile
            result["cpu_ms_per_rank"] = round(stats["cpu_s"] / stats["ranks"] * 1e3, 2)
            result["store_host_cpu_s"] = round(host_cpu, 2)
        return result
    finally:
        gang.close()
        del server


def _c10d_store(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(seconds=60))


def render_regroup(results: list[dict[str, Any]]) -> str:
    lines = ["| nodes x ranks | generation 0 formed | one node lost → re-formed | store operations per rank per regroup "
             "| CPU per rank per regroup (store host's CPU) |",
             "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["nodes"]):
        cpu = (f"{r['cpu_ms_per_rank']:.1f} ms ({r['store_host_cpu_s']:.1f} s)" if "cpu_ms_per_rank" in r else "–")
        cells = ([_short(r["error"]), "", "", ""] if "formation_s" not in r else
                 [_fmt(r["formation_s"]), _fmt(r.get("reform_s")), str(r.get("ops_per_rank", "–")), cpu])
        lines.append(f"| {r['nodes']} x {r['ranks_per_node']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(error: str) -> str:
    """A table cell for a failed case (the JSON keeps the whole message)."""
    if "did not form" in error or "RendezvousTimeoutError" in error:
        return f"no round within {ROUND_TIMEOUT_S:.0f} s"
    if error.startswith("EOFError"):
        return "an agent process died"
    return error[:60]


def _fmt(x: Any, unit: str = " s") -> str:
    return "–" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) else str(x)


def render(results: list[dict[str, Any]]) -> str:
    regroup = [r for r in results if r["backend"] == "regroup"]
    results = [r for r in results if r["backend"] != "regroup"]
    tables = [render_rendezvous(results)] if results else []
    return "\n\n".join(tables + ([render_regroup(regroup)] if regroup else []))


def render_rendezvous(results: list[dict[str, Any]]) -> str:
    fmt = _fmt

    sizes = sorted({r["agents"] for r in results})
    etcds = sorted({r.get("etcd", "single") for r in results if r["backend"] == "etcd-v3"})
    lines = ["| agents | " + " | ".join(f"etcd-v3 ({e}): ranked / re-formed" for e in etcds)
             + " | c10d: ranked / re-formed | etcd-v3 requests (bytes) per agent per round: formation / re-form "
             + f"| etcd-v3 formation CPU per agent: agents + etcd (floor on {os.cpu_count()} cores) |",
             "|---|" + "---|" * (len(etcds) + 3)]
    for n in sizes:
        row = [str(n)]
        per = cpu = ""
        for e in etcds:
            r = next((x for x in results if x["backend"] == "etcd-v3" and x["agents"] == n
                      and x.get("etcd", "single") == e), None)
            row.append("–" if r is None else _short(r["error"]) if "formation_s" not in r
                       else f"{fmt(r['formation_s'])} / {fmt(r.get('reform_s'))}")
            if r and "formation_per_agent" in r and (not per or e == "single"):  # single's figures first
                f, g = r["formation_per_agent"], r.get("reform_per_agent") or {}
                per = (f"{f['requests']:.1f} ({f['bytes'] / 1e3:.1f} kB) / "
                       + (f"{g['requests']:.1f} ({g['bytes'] / 1e3:.1f} kB)" if g else "–"))
                c = r.get("formation_cpu")
                cpu = f"{c['agents_ms']:.1f} + {c['service_ms']:.1f} ms ({c['floor_s']:.2f} s)" if c else ""
        c = next((x for x in results if x["backend"] == "c10d" and x["agents"] == n), None)
        row.append("–" if c is None else _short(c["error"]) if "formation_s" not in c
                   else f"{fmt(c['formation_s'])} / {fmt(c.get('reform_s'))}")
        row.append(per or "–")
        row.append(cpu or "–")
        runs = [x for x in results if x["agents"] == n and x["backend"] == "etcd-v3"]
        if runs and any(x.get("lease_ttl") != DEFAULT_LEASE_TTL_S for x in runs):
            row[0] += f" (TTL {runs[0].get('lease_ttl')} s)"  # the row shows the first run of that size
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="8,32,128,256,512,1024")
    p.add_argument("--procs", type=int, default=8, help="processes the agents are spread over")
    p.add_argument("--backends", default="etcd-v3,c10d")
    p.add_argument("--etcd", default="single", help="single, cluster3, or both: single,cluster3")
    p.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL_S)
    p.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun's default")
    p.add_argument("--regroup", default="", metavar="NODES",
                   help="also simulate in-process regrouping at these node counts (e.g. 8,128,1024)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    add_run_options(p)
    args = p.parse_args(argv)
    if rendered_or_moved(args, render, "benchmarks.bench_scale", argv):
        return
    hard = raise_fd_limit()
    from resilient.devservices import EtcdCluster, EtcdServer, free_port

    results: list[dict[str, Any]] = []

    def record(result: dict[str, Any]) -> None:
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if args.regroup:
        for nodes in (int(x) for x in args.regroup.split(",")):
            try:
                record(run_regroup_case(nodes, args.ranks_per_node, args.procs))
            except Exception as exc:  # noqa: BLE001 - a size this machine cannot hold
                record({"backend": "regroup", "nodes": nodes, "agents": nodes,
                        "ranks_per_node": args.ranks_per_node, "error": f"{type(exc).__name__}: {exc}"})
    sizes = [int(x) for x in args.agents.split(",") if x]
    print(f"# {os.cpu_count()} cores, open files limit {hard}, agents in {args.procs} processes", flush=True)
    for backend in args.backends.split(","):
        kinds = args.etcd.split(",") if backend == "etcd-v3" else ["-"]
        for kind in kinds:
            for n in sizes:
                service: Any = None
                try:
                    if backend == "etcd-v3":
                        service = (EtcdCluster(3) if kind == "cluster3" else EtcdServer()).start()
                        endpoint = service.endpoints if kind == "cluster3" else service.endpoint
                    else:
                        port = free_port()
                        service = _c10d_store(port)
                        endpoint = f"127.0.0.1:{port}"
                    result = run_case(backend, n, service, endpoint, args.procs, args.lease_ttl, args.monitor_interval)
                except Exception as exc:  # noqa: BLE001 - a size this machine cannot hold
                    result = {"backend": backend, "agents": n, "error": f"{type(exc).__name__}: {exc}"}
                finally:
                    if service is not None and hasattr(service, "close"):
                        service.close()
                    service = None
                if backend == "etcd-v3":
                    result["etcd"] = kind
                result["lease_ttl"] = args.lease_ttl
                record(result)
    print(render(results))


if __name__ == "__main__":
    sys.exit(main())
