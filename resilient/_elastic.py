"""``@resilient.elastic``: recover from a lost peer without restarting the survivors.

Restarting a worker costs seconds before its first step (2.2 s of torchrun's 3.5 s is
importing torch again; CUDA adds its context). The decorated function is instead *re-run*
in the surviving processes: on a failure the process group is torn down (which also
unblocks peers stuck in a collective with us), the gang re-forms in-process at whatever
size is left (``_regroup``), torch.distributed is initialised again with the new rank and
world size, and the function is called again with a fresh :class:`Checkpointer`, whose
``restore`` takes the lost ranks' files from peers' memory (``_peer_memory``).

Three ways to run, chosen from the environment:

* under ``resilient-run`` (``RESILIENT_REGROUP_STORE`` set by its agent): in-process
  recovery, as above; when it cannot work (both of the round's stores are gone, recoveries exhausted)
  the process exits with the error and the agent's process restart takes over;
* under another launcher (``WORLD_SIZE`` set): the process group is initialised from the
  environment and a failure ends the process, for the launcher to restart;
* alone: the function is re-run after a failure, restoring from the checkpoint (saves in
  flight are finished first: they need no peer).

A failure is an exception from the function (a collective's "connection closed", an error
of the user's own), a hang (``RESILIENT_HANG_TIMEOUT``: the step is interrupted) or a peer's
failure (noticed through the store while this rank computes). Errors that no retry can fix
(a state that does not fit the checkpoint) are raised at once.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from ._checkpointer import Checkpointer
from ._env import env_seconds
from ._errors import GangChange, ResilientError, StateError, UnsupportedStateError
from ._events import EventLog
from ._peer_memory import PeerMemory, interface_towards
from ._regroup import (AGENT_HEARTBEAT_ENV, ENV, NODE_ENV, STANDBY_ENV, Generation, Regroup, RegroupError, parse_address,
                       peer_token, secret_from_env)
from ._watchdog import HANG_EXIT_CODE

__all__ = ["elastic", "PeerFailure", "HangError"]

log = logging.getLogger("resilient")

F = TypeVar("F", bound=Callable[..., Any])
_INTERRUPT = signal.SIGUSR2
_FATAL = (StateError, UnsupportedStateError, RegroupError, KeyboardInterrupt, SystemExit)


def _sockets() -> set[tuple[int, str]]:
    """This process's open sockets as (fd, inode) (Linux; empty elsewhere)."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add((int(name), target))
    return found


class _GroupConnections:
    """The connections a gloo process group opened, so that they can be cut.

    A rank blocked in a gloo collective cannot be woken from another thread (``abort`` and
    ``shutdown`` leave the wait alone), and destroying the group closes nothing while the
    user's model still references it. Shutting down the group's connected sockets makes
    every pending and future operation on them fail at once, here and on every peer. The
    listening socket is left alone (gloo aborts the process when its accept fails)."""

    def __init__(self) -> None:
        self._before: set[tuple[int, str]] = set()
        self.sockets: set[tuple[int, str]] = set()

    def __enter__(self) -> "_GroupConnections":
        self._before = _sockets()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sockets = _sockets() - self._before

    def cut(self) -> None:
        for fd, inode in self.sockets:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != inode:
                    continue  # closed, and the number reused by something else
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue
        self.sockets = set()


class PeerFailure(ResilientError):
    """Another member of the gang failed; this rank's step was interrupted to re-form."""


class HangError(ResilientError):
    """This rank made no progress for longer than the hang limit; its step was interrupted."""


def elastic(fn: F | None = None, *, root: str | os.PathLike[str], remote: str | None = None,
            every: int | None = None, max_recoveries: int = 20, peer_copies: bool = True,
            backend: str | None = None, timeout: float = 1800.0, **options: Any) -> Any:
    """Decorate ``train(ckpt, *args, **kwargs)`` so that it survives lost peers in-process.

    ``train`` receives a :class:`Checkpointer` (``root``, ``remote``, ``every`` and any other
    ``options`` are its arguments) and must rebuild its model and call ``ckpt.restore``
    itself: it is called again after every recovery, possibly at a smaller world size.
    ``peer_copies``: keep a copy of each rank's newest checkpoint file in the memory of a
    peer on another node (each server refuses copies when host memory is short).
    ``backend``: torch.distributed backend (default nccl with CUDA, else gloo).
    ``timeout``: collective timeout of the process groups it creates.
    """
    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            runtime = ElasticRuntime(os.fspath(root), dict(options, remote=remote, every=every),
                                     max_recoveries=max_recoveries, peer_copies=peer_copies,
                                     backend=backend, timeout=timeout)
            return runtime.run(f, args, kwargs)
        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


class ElasticRuntime:
    def __init__(self, root: str, options: dict[str, Any], *, max_recoveries: int, peer_copies: bool,
                 backend: str | None, timeout: float) -> None:
        if max_recoveries < 0:
            raise ValueError(f"max_recoveries must be >= 0, got {max_recoveries}")
        self.root, self.options = root, options
        self.max_recoveries, self.peer_copies = max_recoveries, peer_copies
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout = timeout
        self.recoveries = 0
        self._events = EventLog(options.get("events") or os.environ.get("RESILIENT_EVENT_LOG") or None,
                                int(os.environ.get("RANK", "0")))
        self._armed = False                    # interruptions may raise in the main thread
        self._pending: BaseException | None = None
        self._lock = threading.Lock()
        self._connections = _GroupConnections()

    # -- the three modes -----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            if os.environ.get(ENV):
                return self._run_in_process(fn, args, kwargs)
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
                return self._run_once(fn, args, kwargs)
            return self._run_alone(fn, args, kwargs)
        finally:
            self._events.close()

    def _run_once(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Another launcher restarts processes; nothing to do in-process."""
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group(self.backend, timeout=timedelta(seconds=self.timeout))
        try:
            with Checkpointer(self.root, **self.options) as ckpt:
                return fn(ckpt, *args, **kwargs)
        finally:
            if owned:
                dist.destroy_process_group()

    def _run_alone(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        while True:
            ckpt = Checkpointer(self.root, **self.options, _on_hang=self._on_hang)
            try:
                with self._interruptible():
                    result = fn(ckpt, *args, **kwargs)
            except BaseException as exc:
                if _retryable(exc):
                    # Alone, a save in flight needs no peer: finish it, so that the re-run
                    # restores the newest step instead of racing its commit.
                    ckpt.close()
                else:
                    ckpt.abandon()
                self._count_recovery(exc)
                continue
            ckpt.close()
            return result

    def _run_in_process(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        address, secret = os.environ[ENV], secret_from_env()
        host, port, _ = parse_address(address)
        memory = PeerMemory(peer_token(address, secret), interface_towards(host, port)) if self.peer_copies else None
        node = os.environ.get(NODE_ENV) or f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"
        group = Regroup(address, secret=secret, node=node,
                        rank=int(os.environ.get("RANK", "0")),
                        initial_world_size=int(os.environ.get("WORLD_SIZE", "1")),
                        standby=os.environ.get(STANDBY_ENV, ""),
                        memory_address=memory.address if memory else "",
                        stale_s=env_seconds("RESILIENT_HEARTBEAT_TIMEOUT", 1.0),
                        # one heartbeat per node: the agent's, else the node's first worker's
                        heartbeat=os.environ.get(AGENT_HEARTBEAT_ENV) != "1"
                        and os.environ.get("LOCAL_RANK", "0") == "0")
        if memory is not None:
            memory.ledger = group  # committed manifests' digests, sealed in the regroup store
        try:
            gen = group.form(None)
            while gen is not None:
                self._init_process_group(group, gen)
                if memory is not None:
                    memory.set_peers(lambda gen=gen: [m.address for m in group.members(gen) if m.address],
                                     gen.partner or None)
                ckpt = Checkpointer(self.root, **self.options, _memory=memory, _on_hang=self._on_hang,
                                    _generation=gen.number, _join_pending=lambda: group.join_pending)
                group.watch(gen, lambda reason: self._fail(PeerFailure(f"the gang failed: {reason}")))
                try:
                    with self._interruptible():
                        result = fn(ckpt, *args, **kwargs)
                except BaseException as exc:
                    started = time.time()
                    self._abort_group()  # first: peers blocked in a collective with us fail now
                    ckpt.abandon()
                    _destroy_process_group()
                    group.report_failure(gen, f"{type(exc).__name__}: {exc}")
                    self._count_recovery(exc, rank=gen.rank, gen=gen.number)
                    gen = group.form(gen)
                    if gen is None:
                        break
                    self._events.emit("regrouped", rank=gen.rank, gen=gen.number, world_size=gen.world_size,
                                      seconds=round(time.time() - started, 6))
                    continue
                ckpt.close()
                group.finish(gen)
                _destroy_process_group()
                return result
            log.info("resilient: the gang finished the job before this process could join it")
            return None
        finally:
            _destroy_process_group()
            group.close()
            if memory is not None:
                memory.close()

    # -- pieces --------------------------------------------------------------------------------
    def _count_recovery(self, exc: BaseException, **fields: Any) -> None:
        """Raise ``exc`` when no retry can help; else log and count a recovery."""
        if not _retryable(exc):
            raise exc
        if isinstance(exc, GangChange):  # planned: a process joins; not a failure
            self._events.emit("failure_detected", detail=f"GangChange: {exc}", **fields)
            return
        if self.recoveries >= self.max_recoveries:
            raise RegroupError(f"giving up after {self.recoveries} in-process recoveries") from exc
        self.recoveries += 1
        detail = f"{type(exc).__name__}: {exc}"
        log.warning("resilient: recovering in-process (%d of at most %d) from %s",
                    self.recoveries, self.max_recoveries, detail[:300])
        self._events.emit("failure_detected", detail=detail[:300], **fields)

    def _init_process_group(self, group: Regroup, gen: Generation) -> None:
        os.environ.update(RANK=str(gen.rank), WORLD_SIZE=str(gen.world_size))
        if self.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        with self._connections:
            dist.init_process_group(self.backend, store=group.process_group_store(gen), rank=gen.rank,
                                    world_size=gen.world_size, timeout=timedelta(seconds=self.timeout))

    def _abort_group(self) -> None:
        """Make every collective of the current group fail now, here and on the peers."""
        if self.backend == "gloo":
            self._connections.cut()
        elif dist.is_initialized():
            dist.get_default_group().abort()

    def _fail(self, exc: BaseException) -> None:
        """From another thread: end the current training step with ``exc``, whether it is
        computing (interrupted) or blocked in a collective (its group aborted)."""
        with self._lock:
            armed = self._armed
        if armed:
            self._interrupt(exc)
            self._abort_group()

    # -- interrupting the training step ----------------------------------------------------------
    def _interruptible(self) -> "_Armed":
        return _Armed(self)

    def _interrupt(self, exc: BaseException) -> None:
        """From another thread: raise ``exc`` in the main thread's training step (at its next
        Python instruction; a rank blocked in a collective gets its peers' error first)."""
        with self._lock:
            if not self._armed:
                return
            self._pending = exc
        signal.pthread_kill(threading.main_thread().ident, _INTERRUPT)

    def _raise_pending(self, signum: int, frame: Any) -> None:
        with self._lock:
            exc, self._pending = self._pending, None
            if exc is None or not self._armed:
                return
            self._armed = False
        raise exc

    def _on_hang(self, idle: float, limit: float) -> None:
        """Watchdog thread: interrupt the step; if it cannot be interrupted (stuck in native
        code), exit as the plain watchdog does, so that the launcher restarts the process."""
        self._events.emit("hang_detected", idle_s=round(idle, 3), limit_s=round(limit, 3))
        before = self.recoveries
        self._fail(HangError(f"no progress for {idle:.1f} s (limit {limit:.1f} s)"))

        def escalate() -> None:
            if self.recoveries == before:
                log.error("resilient: the hung step could not be interrupted; exiting with status %d",
                          HANG_EXIT_CODE)
                logging.shutdown()
                os._exit(HANG_EXIT_CODE)

        timer = threading.Timer(max(5.0, limit), escalate)
        timer.daemon = True
        timer.start()


class _Armed:
    """While the user's function runs: interruptions raise in it."""

    def __init__(self, runtime: ElasticRuntime) -> None:
        self.runtime = runtime
        self.previous: Any = None

    def __enter__(self) -> None:
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            self.previous = signal.signal(_INTERRUPT, self.runtime._raise_pending)
        with self.runtime._lock:
            self.runtime._armed = on_main
            self.runtime._pending = None

    def __exit__(self, *exc: object) -> None:
        with self.runtime._lock:
            self.runtime._armed = False
            self.runtime._pending = None
        if self.previous is not None:
            signal.signal(_INTERRUPT, self.previous)


def _retryable(exc: BaseException) -> bool:
    """Whether re-running the function can help: not an interrupt, an exit, or a state that
    will never fit the checkpoint."""
    return isinstance(exc, Exception) and not isinstance(exc, _FATAL)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group may fail to shut down cleanly; it is gone anyway
            log.debug("resilient: destroying the process group: %s", exc)
