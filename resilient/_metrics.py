"""Prometheus metrics: what checkpoints cost, how far uploads lag, how often the gang re-forms.

One registry per process, created on first use. Workers serve it when
``RESILIENT_METRICS_PORT`` is set (local rank *r* on that port + *r*, so the ranks of a node
never collide); ``resilient-run --metrics-port`` serves the agent's. Both bind to
``RESILIENT_METRICS_ADDR`` (``resilient-run --metrics-addr``; default 0.0.0.0, every
interface, where a cluster's Prometheus scrapes pods). Every metric starts
with ``resilient_``; the names and labels are documented in docs/observability.md.
prometheus-client is imported here only, so a process that never asks pays nothing.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("resilient")

_lock = threading.Lock()
_metrics: "Metrics | None" = None
_is_agent = False  # agents serve on --metrics-port only; RESILIENT_METRICS_PORT is their workers'

# seconds: from a memcpy of a small model to a slow object-store upload
_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        # checkpoints (workers)
        self.save_stall = Histogram("resilient_save_stall_seconds", "Training stall per save (snapshot into host memory)",
                                    buckets=_BUCKETS, registry=r)
        self.commit_seconds = Histogram("resilient_save_commit_seconds", "Save start to committed, per tier",
                                        ["tier"], buckets=_BUCKETS, registry=r)
        self.saves = Counter("resilient_saves_total", "Saves by outcome", ["outcome"], registry=r)
        self.bytes_written = Counter("resilient_bytes_written_total", "Checkpoint bytes written, per tier",
                                     ["tier"], registry=r)
        self.upload_lag_steps = Gauge("resilient_upload_lag_steps", "Committed local checkpoints not yet on the remote tier",
                                      registry=r)
        self.upload_lag_seconds = Gauge("resilient_upload_lag_seconds",
                                        "Age of the oldest committed checkpoint not yet on the remote tier", registry=r)
        self.upload_retries = Counter("resilient_upload_retries_total", "Retried remote-tier operations", registry=r)
        self.restore_seconds = Histogram("resilient_restore_seconds", "Restore duration, by where the files came from",
                                         ["source"], buckets=_BUCKETS, registry=r)
        self.restored_step = Gauge("resilient_restored_step", "Step of the last restore (0: fresh start)", registry=r)
        self.step = Gauge("resilient_step", "Latest training step reported to the Checkpointer", registry=r)
        # the gang (agents)
        self.rounds = Counter("resilient_rendezvous_rounds_total", "Rendezvous rounds this agent ran in", registry=r)
        self.membership_changes = Counter("resilient_membership_changes_total",
                                          "Reasons the gang had to re-form", ["cause"], registry=r)
        self.restarts = Counter("resilient_worker_restarts_total", "Worker group restarts, by reason", ["reason"],
                                registry=r)
        self.detection = Histogram("resilient_detection_seconds",
                                   "Fault to detection: lease TTL for a lost node, monitor interval for a worker exit",
                                   buckets=_BUCKETS, registry=r)
        self.reform = Histogram("resilient_reform_seconds", "Detection to the next round formed", buckets=_BUCKETS,
                                registry=r)
        # in-process recovery (workers under @resilient.elastic)
        self.regroups = Counter("resilient_inprocess_regroups_total",
                                "Gangs re-formed in-process (failures, and processes joining)", registry=r)
        self.regroup_seconds = Histogram("resilient_inprocess_regroup_seconds",
                                         "Failure detected to the gang re-formed, in-process", buckets=_BUCKETS,
                                         registry=r)
        self.world_size = Gauge("resilient_world_size", "Nodes in the current round", registry=r)
        self.round = Gauge("resilient_round", "Number of the current rendezvous round", registry=r)
        self.goodput = Gauge("resilient_goodput_ratio",
                             "Time in steps whose results were kept / wall time, from the event log", registry=r)

    def serve(self, port: int, addr: str | None = None) -> None:
        from prometheus_client import start_http_server

        addr = addr or bind_address()
        start_http_server(port, addr=addr, registry=self.registry)
        log.info("resilient: metrics on http://%s:%d/metrics", addr, port)


ADDR_ENV = "RESILIENT_METRICS_ADDR"


def bind_address() -> str:
    return os.environ.get(ADDR_ENV) or "0.0.0.0"


def metrics() -> Metrics:
    """This process's metrics (created, and served if configured, on first use)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = Metrics()
            port = os.environ.get("RESILIENT_METRICS_PORT")
            if port and not _is_agent:
                local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
                try:
                    _metrics.serve(int(port) + local_rank)
                except OSError as exc:  # a busy port must not stop training
                    log.warning("resilient: cannot serve metrics on port %s: %s", int(port) + local_rank, exc)
        return _metrics



def mark_agent() -> None:
    """This process is a launcher's agent: its workers, not it, own RESILIENT_METRICS_PORT."""
    global _is_agent
    _is_agent = True


def enabled() -> bool:
    """Whether anyone may scrape this process (else the registry is never even built)."""
    return _metrics is not None or (bool(os.environ.get("RESILIENT_METRICS_PORT")) and not _is_agent)


def record(event: str, fields: dict) -> None:
    """Update the metrics an event stands for (see ``EventLog.emit``)."""
    if not enabled():
        return
    m = metrics()
    if event == "step":
        m.step.set(fields["step"])
    elif event == "save_staged":
        m.save_stall.observe(fields["stall_s"])
    elif event == "save_committed":
        m.commit_seconds.labels(fields["tier"]).observe(fields["seconds"])
        m.bytes_written.labels(fields["tier"]).inc(fields.get("bytes", 0))
        if fields["tier"] == "local":
            m.saves.labels("committed").inc()
    elif event == "save_failed":
        m.saves.labels("failed").inc()
    elif event == "upload_retry":
        m.upload_retries.inc()
    elif event == "restored":
        m.restore_seconds.labels(fields["source"]).observe(fields["seconds"])
        m.restored_step.set(fields["step"])
    elif event == "membership_change":
        m.membership_changes.labels(fields["cause"]).inc()
        if fields.get("detection_s") is not None:
            m.detection.observe(fields["detection_s"])
    elif event == "round_formed":
        m.rounds.inc()
        m.round.set(fields["round"])
        m.world_size.set(fields["nodes"])
        if fields.get("reform_s") is not None:
            m.reform.observe(fields["reform_s"])
    elif event == "workers_restarted":
        m.restarts.labels(fields["reason"]).inc()
    elif event == "regrouped":
        m.regroups.inc()
        m.regroup_seconds.observe(fields["seconds"])

