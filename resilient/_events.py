"""A structured event log: one JSON object per line, one file per run, shared by every rank.

What happened and when, for people and tools after the fact (timelines, goodput), without
parsing log text. Each line is written with a single ``write`` on a file opened with
``O_APPEND``, so lines from concurrent ranks on one machine never interleave. Off unless a
path is given (``events=`` or ``RESILIENT_EVENT_LOG``). Never holds credentials: fields
are steps, sizes, durations, tier names and error messages.

Events are also what the Prometheus metrics are made of (``_metrics.record``): one call
site per happening, whether or not a log file is open.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from ._metrics import record

__all__ = ["EventLog"]


class EventLog:
    """``rank`` is the worker's rank (agents: -1); ``fields`` go into every line (pid, node)."""

    def __init__(self, path: str | None, rank: int, **fields: Any) -> None:
        self.path = path
        self.rank = rank
        self.fields = {"pid": os.getpid(), **fields}
        self._fd: int | None = None
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        """Append ``{"t", "event", "rank", **fields}`` (when the log is on); update metrics."""
        record(event, fields)
        if self._fd is None:
            return
        line = json.dumps({"t": round(time.time(), 6), "event": event, "rank": self.rank, **self.fields, **fields},
                          default=str).encode() + b"\n"
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
