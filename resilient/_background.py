"""Background work yields the CPU to training.

The writer, its encode threads and the uploader run while the training loop computes. On
a machine whose cores training keeps busy (a CPU step, data-loader workers, the GPU
driver's threads), they would take cycles from the step: measured here (a 1024² matmul
on both cores), a step ran 1.6-1.9x slower while a save was written, 1.2-1.45x with this
module's default. Linux gives every thread its own nice value: raising ours by
``RESILIENT_BACKGROUND_NICE`` (default 19, the most; 0 turns it off; 10 measured no
better than 0) makes the scheduler serve the training thread first, while idle cores
still run the background work at full speed, so a save written between steps, or while
the GPU computes, is not slower. Threads a background thread starts inherit its value.
What remains is the kernel's own writeback work and memory bandwidth, which no nice value
reaches.

Yielding is for the work that costs cores (zstd, copies into the page cache, uploads), and
for a save's writes it is bounded, since it has a price: a thread at nice 19 gets about
1.5% of a core that a process at the default priority keeps busy, and data-loader workers
often keep every core busy. Measured here beside two
spinning processes (``bench_busy_cores``, 1 GB), a save written through the page cache took
123 s to become durable, with zstd 135 s, and a direct one 8.1 s, when every write yielded;
0.67 s direct at the default priority. So a
``YieldingPool`` stops yielding once the work is late: when a thread waits for it
(``waiting``: training gains nothing from work it is blocked on) or once the save it serves
is older than ``RESILIENT_BACKGROUND_YIELD_S`` (default 10). A thread cannot take its own
nice value back without privileges, so the waiter runs the queued tasks itself, at its own
priority. Direct writes of raw chunks and their CRCs do not yield at all: they are too
little CPU to slow a step (measured: 1.0-1.1x either way), and yielding made them 12x slower
to become durable beside busy cores. An upload is one long job rather than many tasks, so
its checksums and copies go in bounded pieces (``Handover``, ``in_pieces``): a yielding
thread does them until the upload is late (a thread waits for it, ``flush``, or a newer step
is queued behind it), and then the thread that drives the upload does the rest. The first
touch of a staging buffer (``Staging.prewarm``) does not yield: it is done once, and mostly
in the kernel, where a niced thread can hold a lock the training thread's page faults need.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
from concurrent.futures import Executor, Future, InvalidStateError
from concurrent.futures import wait as wait_for
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator

from ._env import env_float

__all__ = ["jitter", "spread", "yield_to_training", "NICE_ENV", "YIELD_LIMIT_ENV", "YieldingPool", "waiting",
           "someone_waits", "yield_limit", "finished", "Handover", "in_pieces", "drain"]

log = logging.getLogger("resilient")

NICE_ENV = "RESILIENT_BACKGROUND_NICE"
DEFAULT_NICE = 19
YIELD_LIMIT_ENV = "RESILIENT_BACKGROUND_YIELD_S"
DEFAULT_YIELD_LIMIT_S = 10.0

# Python's global generator is the training's: its state is saved with every checkpoint and
# restored with it, so that a resumed run draws what an uninterrupted one does. A backoff
# drawn from it at times the network decides would make the two differ.
_own = random.Random()


def jitter(low: float, high: float) -> float:
    """A number for spreading retries and polls, drawn from a generator of our own."""
    return _own.uniform(low, high)


def spread(n: int) -> int:
    """A start index in ``range(n)`` for spreading clients over servers (own generator)."""
    return _own.randrange(n)


def yield_to_training() -> None:
    """Lower the calling thread's CPU priority; call first thing in a background thread."""
    raw = os.environ.get(NICE_ENV, str(DEFAULT_NICE))
    try:
        nice = int(raw)
    except ValueError:
        log.warning("resilient: %s=%r is not an integer; using %d", NICE_ENV, raw, DEFAULT_NICE)
        nice = DEFAULT_NICE
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted or not Linux: run at the process's priority
        pass


def yield_limit() -> float:
    """Seconds a save's work may yield to training before it runs at the job's priority."""
    return env_float(YIELD_LIMIT_ENV, DEFAULT_YIELD_LIMIT_S)


_waiters = 0
_waiters_lock = threading.Lock()


@contextmanager
def waiting() -> Iterator[None]:
    """The calling thread is blocked on background work meanwhile (a save's buffer, a
    ``wait``): while any thread is, background work does not yield."""
    global _waiters
    with _waiters_lock:
        _waiters += 1
    try:
        yield
    finally:
        with _waiters_lock:
            _waiters -= 1


def someone_waits() -> bool:
    """Whether any thread is inside ``waiting`` now: a save's work is then late."""
    return _waiters > 0


class YieldingPool(Executor):
    """Worker threads that yield to training, whose queue the thread that waits for a task
    runs itself, at its own priority, once the work is late (``result``). ``pure``: a task
    gives the same result however often it runs (a chunk's encoding), so the waiter also
    runs the one it waits for when a worker has begun it: yielding, a worker took seconds
    over a 16 MB chunk that the waiter encodes in a tenth of a second."""

    def __init__(self, workers: int, name: str, pure: bool = False) -> None:
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._workers, self._name, self._pure = workers, name, pure
        self._threads: list[threading.Thread] = []
        self._running: dict[Future, _Task] = {}  # begun by a worker
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args, kwargs))
        with self._lock:
            if len(self._threads) < self._workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        yield_to_training()
        while (task := self._tasks.get()) is not None:
            if task[0].set_running_or_notify_cancel():
                with self._lock:
                    self._running[task[0]] = task
                try:
                    _outcome(task)
                finally:
                    with self._lock:
                        self._running.pop(task[0], None)

    def result(self, future: Future, late: Callable[[], bool]) -> Any:
        """``future``'s result. While it is not done and ``late()``, the caller takes queued
        tasks (this pool's, in order) and runs them itself; a task a worker has begun stays
        with it, unless the pool's tasks are ``pure`` (then the caller runs it too, and the
        first to finish gives the result)."""
        while not future.done():
            if late():
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    task = None
                else:
                    if task is None:
                        self._tasks.put(None)  # a worker's stop: not the waiter's to take
                    elif task[0].set_running_or_notify_cancel():
                        _outcome(task)
                        continue
                with self._lock:
                    begun = self._running.get(future) if self._pure else None
                if begun is not None:
                    _outcome(begun)
                    continue
            wait_for([future], timeout=0.05)
        return future.result()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
            self._workers = 0  # no new workers
        for _ in threads:
            self._tasks.put(None)
        if wait:
            for thread in threads:
                thread.join()


_Task = tuple[Future, Callable[..., Any], tuple, dict]


def _outcome(task: _Task) -> None:
    """Run a task and give its future the outcome, unless another run of it gave one first."""
    future, fn, args, kwargs = task
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the future carries it to its waiter
        with suppress(InvalidStateError):
            future.set_exception(exc)
    else:
        with suppress(InvalidStateError):
            future.set_result(value)


def finished(future: Future, pool: Executor, late: Callable[[], bool] | None) -> Any:
    """``future``'s result; a ``YieldingPool``'s is run by the caller once ``late()``."""
    if late is not None and isinstance(pool, YieldingPool):
        return pool.result(future, late)
    return future.result()


class Handover:
    """Work in bounded pieces (``pieces``: each step of the iterator does one) that a
    background thread does (``run``) until whoever needs it done takes the rest (``take``)
    and does it at its own priority, or stops it (``stop``: work that may run on beside its
    taker). Why: a thread cannot take its nice value back, so work begun on a yielding
    thread would stay at 1.5% of a busy core however long someone waits for it.
    Measured here beside two spinning processes (0.5 GB, a local-directory remote tier): a
    ``flush`` took 128 s, against 3.3 s with the cores idle, while one niced thread copied.
    The piece in hand when the work is taken is finished by the thread that began it."""

    def __init__(self, pieces: Iterator[object]) -> None:
        self._pieces = pieces
        self._lock = threading.Lock()
        self._stopped = False
        self._over = False
        self._error: BaseException | None = None

    def _advance(self) -> bool:
        """(Holding the lock.) One piece; False when there are no more (or one failed)."""
        if self._over:
            return False
        try:
            next(self._pieces)
        except StopIteration:
            self._over = True
        except BaseException as exc:  # noqa: BLE001 - ``take`` raises it in the thread that needs the work
            self._over, self._error = True, exc
        return not self._over

    def run(self) -> None:
        """The background thread's part: pieces until there are none or it is stopped."""
        while True:
            with self._lock:
                if self._stopped or not self._advance():
                    return

    def stop(self) -> None:
        """Have the background thread stop after the piece in hand (it does no other)."""
        self._stopped = True

    def take(self) -> None:
        """Do what is left in the calling thread (after the piece in hand); raise the work's
        error, wherever it happened."""
        self.stop()
        with self._lock:
            while self._advance():
                pass
            if self._error is not None:
                raise self._error

    def abandon(self) -> None:
        """Stop after the piece in hand; what is left is not done (the work is no longer wanted)."""
        self.stop()
        with self._lock:
            self._over = True
            close = getattr(self._pieces, "close", None)
            if close is not None:
                close()


def in_pieces(pieces: Iterator[object], pool: Executor, late: Callable[[], bool]) -> None:
    """Run ``pieces`` on one of ``pool``'s yielding threads until ``late()``, then the rest
    in the calling thread (``Handover``); return once all are done."""
    work = Handover(pieces)
    future = pool.submit(work.run)
    while not late() and not future.done():
        wait_for([future], timeout=0.05)
    future.cancel()  # not begun: nothing for a worker to do
    work.take()


def drain(pieces: Iterator[object]) -> None:
    """Run ``pieces`` in the calling thread (where nothing is to yield)."""
    for _ in pieces:
        pass
