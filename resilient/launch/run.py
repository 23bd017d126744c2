"""``resilient-run``: torchrun's command line and agent, with the etcd-v3 rendezvous built in.

Replacing ``torchrun`` by ``resilient-run`` keeps a working command working: the argument
parser *is* torch's (every flag, dash and underscore forms, ``PET_*`` variables) and so is
the agent that supervises workers. What changes:

* everything after the training script belongs to the script (torchrun's parser would take
  a script option such as ``--log`` as an ambiguous abbreviation of its own flags);
* the ``etcd-v3`` backend is registered, and the shared rendezvous TCPStore is off by
  default (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so restarted workers of the c10d
  backend never read a previous round's peer addresses;
* the agent (:class:`ResilientAgent`) ties each worker's life to its own (a dead agent
  leaves no orphaned workers in the gang), and does not give up on a worker failure that a
  lost peer explains.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

from .._exit import run_and_exit
from .._metrics import ADDR_ENV as METRICS_ADDR_ENV
from .._preempt import GRACE_ENV
from .._regroup import AGENT_HEARTBEAT_ENV
from .._regroup import ENV as REGROUP_ENV
from .._regroup import SECRET_ENV as REGROUP_SECRET_ENV
from .._regroup import STANDBY_ENV as REGROUP_STANDBY_ENV
from .._sealed import job_secret
from ._inprocess import NODE_ENV, InProcessRecovery
from .rendezvous import BACKEND, EtcdV3RendezvousHandler, create_handler

log = logging.getLogger(__name__)

GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_orphan_guard.py")


class ResilientAgent(LocalElasticAgent):
    """torch's local agent, plus orphan-proof workers and peer-loss-aware failure handling.

    For workers written with ``@resilient.elastic`` it also hosts (on the rank-0 node) the
    store in which they re-form in-process (see ``resilient._regroup``), and changes what a
    worker's death means: the survivors carry on (torch would kill them), the dead worker is
    marked dead in the store at once so that they need not wait for its heartbeat to go
    stale, and a node left without workers starts new ones that join the running gang,
    without a new rendezvous. Only when that store is unreachable does the usual restart
    of every worker through a new rendezvous happen.
    """

    _regroup: InProcessRecovery | None = None

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        handler = self._worker_group.spec.rdzv_handler
        if isinstance(handler, EtcdV3RendezvousHandler):
            handler.close_on_shutdown = False
        try:
            result = super().run(role)
        finally:
            if self._regroup is not None:
                self._regroup.close(wait=True)  # its probe thread must not outlive the interpreter
        if isinstance(handler, EtcdV3RendezvousHandler):
            handler.close_on_shutdown = not result.is_failed()
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Before a restart the gang is broken: SIGKILL, as SIGTERM's default action did. A
        worker handles SIGTERM as a preemption (save the step in progress), which a worker
        blocked in a collective with a dead peer would never reach."""
        self._shutdown(death_sig=signal.SIGKILL)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        if self._regroup is not None:
            self._regroup.close()
        handler = worker_group.spec.rdzv_handler
        node = handler.node if isinstance(handler, EtcdV3RendezvousHandler) else \
            f"{socket.gethostname()}/{worker_group.group_rank}"
        secret = handler.round_secret if isinstance(handler, EtcdV3RendezvousHandler) else job_secret()
        regroup = self._regroup = InProcessRecovery.for_round(self._store, worker_group.group_rank, node, secret,
                                                              worker_group.group_world_size)
        # workers inherit the agent's environment: its secret, their node's name, and that
        # the agent heartbeats for the node (where to re-form: when they start, below)
        os.environ.update({REGROUP_SECRET_ENV: regroup.secret, NODE_ENV: node, AGENT_HEARTBEAT_ENV: "1"})
        if isinstance(handler, EtcdV3RendezvousHandler):
            # a frozen node resets no connection: its peers wait in a collective until told
            handler.on_lost = lambda nodes: regroup.active() and regroup.fail_nodes(nodes)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, object]:
        spec = worker_group.spec
        if isinstance(spec.entrypoint, str) and not getattr(spec, "_orphan_guarded", False):
            spec.args = ("-S", GUARD, str(os.getpid()), spec.entrypoint, *spec.args)
            spec.entrypoint = sys.executable
            spec._orphan_guarded = True  # type: ignore[attr-defined]
        if self._regroup is not None:  # a replacement started after a failover goes to the standby
            os.environ.update({REGROUP_ENV: self._regroup.address, REGROUP_STANDBY_ENV: self._regroup.standby})
        ids = super()._start_workers(worker_group)
        if self._regroup is not None:
            self._regroup.keep_survivors(self._pcontext)
        return ids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        handler = worker_group.spec.rdzv_handler
        regroup = self._regroup
        if regroup is not None and isinstance(handler, EtcdV3RendezvousHandler):
            # a lost node's workers were already replaced in-process by the survivors
            handler.ignore_lost = regroup.active()
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        if regroup is not None and regroup.active():
            return self._absorb(worker_group, result, regroup)
        if not isinstance(handler, EtcdV3RendezvousHandler):
            return result
        return self._explained_by_membership(worker_group, handler, result)

    def _exit_barrier(self) -> None:
        # torch waits for every agent of the round; after an in-process recovery without a
        # new round, a lost node's agent never comes, and the job is already finished
        left = self._regroup.nodes_left() if self._regroup is not None else None
        if left is not None and left < self._worker_group.group_world_size:
            log.info("job finished by %d of %d nodes in-process; not waiting for the others at exit",
                     left, self._worker_group.group_world_size)
            return
        super()._exit_barrier()

    def _absorb(self, worker_group: WorkerGroup, result: RunResult, regroup: "InProcessRecovery") -> RunResult:
        """A worker died but the gang recovers in-process: keep the survivors."""
        running = regroup.running(self._pcontext)
        for failure in result.failures.values():
            regroup.mark_dead(failure.pid)
        if running:
            return RunResult(state=WorkerState.HEALTHY)
        if regroup.finished():  # the others completed the job without this node's workers
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in worker_group.workers})
        if self._remaining_restarts <= 0 or not regroup.reachable():
            return result  # the usual path: a restart through a new rendezvous round
        self._remaining_restarts -= 1
        log.warning("every local worker is gone; starting new ones to join the running gang (%d restarts left)",
                    self._remaining_restarts)
        self._stop_workers(worker_group)
        for local_rank, worker_id in self._start_workers(worker_group).items():
            worker_group.workers[local_rank].id = worker_id
        worker_group.state = WorkerState.HEALTHY
        return RunResult(state=WorkerState.HEALTHY)

    def _explained_by_membership(self, worker_group: WorkerGroup, handler: EtcdV3RendezvousHandler,
                                 result: RunResult) -> RunResult:
        # Workers fail at once when a peer's connection resets, seconds before etcd expires
        # the lost node's lease. With restarts left, the normal path re-forms the gang; with
        # none left, wait one lease TTL for the membership change that would explain it.
        grace = 0.0 if self._remaining_restarts > 0 else handler.conf["lease_ttl"] + 1.0
        if not handler.wait_membership_change(grace):
            return result
        log.warning("workers failed after a membership change (%s): re-forming the gang "
                    "without counting a restart", handler.last_change)
        self._restart_workers(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        if isinstance(handler, EtcdV3RendezvousHandler):
            failed = worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            handler.events.emit("workers_restarted", reason="failure" if failed else "membership",
                                detail=handler.last_change or None)
        super()._restart_workers(worker_group)


def install() -> None:
    """Make the etcd-v3 backend and :class:`ResilientAgent` what torch's launcher uses."""
    import torch.distributed.launcher.api as launcher_api

    if BACKEND not in rendezvous_handler_registry._registry:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    launcher_api.LocalElasticAgent = ResilientAgent  # type: ignore[misc]


def split_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher arguments up to and including the script, the script's own arguments)."""
    options = parser._option_string_actions
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return argv[:index + 2], argv[index + 2:]
        if not token.startswith("-") or token == "-":
            return argv[:index + 1], argv[index + 1:]
        name = token.split("=", 1)[0]
        action = options.get(name)
        if action is None:
            matches = {options[o] for o in options if o.startswith(name) and o.startswith("--")}
            if len(matches) != 1:
                parser.error(f"unrecognized or ambiguous launcher flag {token!r} before the training script")
            action = matches.pop()
        takes_value = action.nargs != 0
        index += 2 if takes_value and "=" not in token else 1
    return argv, []


def parse(argv: list[str]) -> argparse.Namespace:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "resilient-run"
    ours = parser.add_argument_group("resilient-run")
    ours.add_argument("--metrics-port", "--metrics_port", type=int, default=None, metavar="PORT",
                      help="serve this agent's Prometheus metrics on PORT (default: off)")
    ours.add_argument("--metrics-addr", "--metrics_addr", default=None, metavar="ADDR",
                      help="address the agent's and its workers' metrics bind to (sets RESILIENT_METRICS_ADDR; "
                           "default 0.0.0.0: every interface; 127.0.0.1 keeps them to this host)")
    ours.add_argument("--event-log", "--event_log", default=os.environ.get("RESILIENT_EVENT_LOG"), metavar="PATH",
                      help="JSON-lines event log shared by this run's agents and workers "
                           "(sets RESILIENT_EVENT_LOG; read it with `resilient-ckpt timeline`)")
    launcher_args, script_args = split_command_line(parser, argv)
    args = parser.parse_args(launcher_args)
    args.training_script_args = script_args
    return args


@record
def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import run

    args = parse(sys.argv[1:] if argv is None else argv)
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        # torchrun finds out only once it has joined the gang and its workers fail to start,
        # on every node and at every restart
        print(f"resilient-run: error: training script {args.training_script!r} is not a file "
              "(-m runs a module, --no-python a command)", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    prepare_preemption(args)
    if args.event_log:
        os.environ["RESILIENT_EVENT_LOG"] = os.path.abspath(args.event_log)
    if args.metrics_addr:
        os.environ[METRICS_ADDR_ENV] = args.metrics_addr  # the workers' endpoints too
    if args.metrics_port is not None:
        serve_metrics(args.metrics_port, args.event_log)
    install()
    run(args)


def prepare_preemption(args: argparse.Namespace) -> None:
    """SIGUSR1 (Slurm's ``--signal``) is a death signal for the agent like SIGTERM: the
    agent passes it to the workers and gives them ``--shutdown-timeout`` seconds (torch's
    flag; default 30, Kubernetes' default grace) before SIGKILL. The workers learn their
    share of it, minus a margin for the exit, as ``RESILIENT_PREEMPT_GRACE``."""
    handled = [name.strip() for name in (args.signals_to_handle or "").split(",") if name.strip()]
    if "SIGUSR1" not in handled:  # otherwise SIGUSR1's default action kills the agent at once
        args.signals_to_handle = ",".join(handled + ["SIGUSR1"])
    timeout = args.shutdown_timeout
    if timeout is None:
        timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        args.shutdown_timeout = timeout
    os.environ.setdefault(GRACE_ENV, str(max(1.0, timeout - 5.0)))


def serve_metrics(port: int, event_log: str | None) -> None:
    """The agent's metrics endpoint; goodput is recomputed from the event log on each scrape."""
    from .. import _timeline
    from .._metrics import mark_agent, metrics

    mark_agent()
    m = metrics()
    m.serve(port)
    if event_log:
        def goodput() -> float:
            try:
                return _timeline.build(_timeline.read_events(event_log)).goodput
            except (OSError, ValueError):
                return float("nan")

        m.goodput.set_function(goodput)


def entry() -> None:
    """The ``resilient-run`` command: ``main``, then exit without the interpreter's teardown
    (about a second with torch's agent loaded; see ``_exit``)."""
    run_and_exit(main)


if __name__ == "__main__":
    entry()
