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
import sys

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

from .rendezvous import BACKEND, EtcdV3RendezvousHandler, create_handler

log = logging.getLogger(__name__)

GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_orphan_guard.py")


class ResilientAgent(LocalElasticAgent):
    """torch's local agent, plus orphan-proof workers and peer-loss-aware failure handling."""

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        handler = self._worker_group.spec.rdzv_handler
        if isinstance(handler, EtcdV3RendezvousHandler):
            handler.close_on_shutdown = False
        result = super().run(role)
        if isinstance(handler, EtcdV3RendezvousHandler):
            handler.close_on_shutdown = not result.is_failed()
        return result

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, object]:
        spec = worker_group.spec
        if isinstance(spec.entrypoint, str) and not getattr(spec, "_orphan_guarded", False):
            spec.args = ("-S", GUARD, str(os.getpid()), spec.entrypoint, *spec.args)
            spec.entrypoint = sys.executable
            spec._orphan_guarded = True  # type: ignore[attr-defined]
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        handler = worker_group.spec.rdzv_handler
        if not isinstance(handler, EtcdV3RendezvousHandler):
            return result
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
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.event_log:
        os.environ["RESILIENT_EVENT_LOG"] = os.path.abspath(args.event_log)
    if args.metrics_port is not None:
        serve_metrics(args.metrics_port, args.event_log)
    install()
    run(args)


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


if __name__ == "__main__":
    main()
