"""Measurements shared by the benchmarks: the machine's limits and a peak-RSS sampler.

Every benchmark measures these in the same run as the figures it reports, because the
machines are noisy: ratios against the limits are what carry over between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import psutil
import torch

GB = 1e9


class TokenIds(torch.utils.data.Dataset):
    """``n`` fixed random sequences of GPT-2 token ids, each its own labels: a language
    model's batches, the same in every run."""

    def __init__(self, n: int, length: int) -> None:
        self.ids = torch.randint(0, 50257, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def memcpy_seconds(nbytes: int, repeats: int = 3, sync: Callable[[], None] = lambda: None,
                  chunk: int = 1 << 30) -> float:
    """Median time to copy ``nbytes`` into an already touched buffer (the CPU stall floor).

    ``sync`` runs before each copy (a barrier), so that ranks copy at the same time and the
    floor includes their competition for memory bandwidth, as during a save. The bytes go
    through buffers of at most ``chunk`` (far larger than any cache, so the rate is DRAM's):
    several ranks measuring a large state at once must not need twice that state's RAM each.
    """
    size = min(nbytes, chunk)
    src = torch.empty(size, dtype=torch.uint8).fill_(1)
    dst = torch.zeros(size, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for start in range(0, nbytes, size):
            n = min(size, nbytes - start)
            dst[:n].copy_(src[:n])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


#: the guest's free page reporting counter (Firecracker's balloon; absent on bare metal)
PAGE_REPORTING_KIB = "/sys/module/page_reporting/parameters/reported_kib"


def _reported_kib() -> int | None:
    try:
        with open(PAGE_REPORTING_KIB) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def settle_memory(quiet_s: float = 2.5, limit_s: float = 30.0) -> float:
    """Wait until the VM has stopped handing freed memory back to its host; return the
    seconds waited (0 where the machine reports no such thing).

    Why: on this VM, a copy that follows the freeing of gigabytes runs slower for seconds
    while the guest reports the free pages in passes about 2 s apart (4 GB in 24 tensors,
    3 copies each: 0.32-0.36 s undisturbed, 0.47-0.75 s within 4 s of freeing 4 GB; 1.1
    of the 4 GB reported after 10 s). Every method frees its buffers when its turn ends,
    so without this wait each one's saves ran in the wake of the one before.
    """
    last = _reported_kib()
    if last is None:
        return 0.0
    start = quiet_since = time.monotonic()
    while time.monotonic() - start < limit_s:
        time.sleep(0.25)
        now = _reported_kib()
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
    return time.monotonic() - start


def drop_cache(path: str) -> None:
    """Evict a file (or every file under a directory) from the page cache: the next read is cold."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:  # a file being recycled or removed in the background meanwhile
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def probe_block(block: int = 64 << 20) -> torch.Tensor:
    """A block of random bytes on huge pages, as resilient's staging buffer is (direct I/O
    needs the page alignment; huge pages let it send large segments: 1 GB direct and
    fsync'd took 0.60-0.64 s here from 4 KiB pages and 0.42 s from huge pages, so a probe
    without them understates the disk).

    Why random: a probe of constant bytes measured 4 GB/s cold reads here while the same
    code read a checkpoint's random floats at 1.1-1.6 GB/s (the virtual disk's host side
    gains from uniform pages), so a constant probe sets limits no real state can reach.
    """
    from resilient._hostmem import page_aligned_empty

    data = page_aligned_empty(block)
    data.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    return data


def _stamped(block: torch.Tensor, index: int) -> memoryview:
    """``block`` with every 4 KiB page's first 8 bytes set to a number no other page of the
    file carries: the block is written many times, and repeated pages could be merged."""
    pages = block.numel() // 4096
    block[: pages * 4096].view(torch.int64).view(pages, 512)[:, 0] = torch.arange(index * pages, (index + 1) * pages)
    return memoryview(block.numpy())


def write_file(path: str, nbytes: int, block: int = 64 << 20, direct: bool = False,
               data: torch.Tensor | None = None, in_place: bool = False) -> float:
    """Write ``nbytes`` of random bytes sequentially and fsync; the seconds it took. ``direct``:
    with direct I/O (page cache bypassed; whole pages only), or inf where the file system
    refuses it. The disk's write limit is the faster of the two: the writer uses direct I/O
    where it can. ``data``: a block from ``probe_block`` made beforehand, so that a probe
    taken while a method's peak RSS is sampled does not count its own block. ``in_place``:
    overwrite the first ``nbytes`` of an existing file of at least that size, as a recycled
    checkpoint file is written (no blocks to allocate), instead of a new file."""
    data = probe_block(block) if data is None else data
    block = data.numel()
    flags = os.O_WRONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    if in_place:
        size = os.path.getsize(path)
        if size < nbytes:
            raise ValueError(f"{path}: an overwrite in place of {nbytes} bytes needs a file that large, "
                             f"it holds {size}")
    else:
        flags |= os.O_CREAT | os.O_TRUNC
    first = int.from_bytes(os.urandom(3), "little") << 6  # fresh stamps: an overwrite never rewrites a page's bytes
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return float("inf")
    t = time.perf_counter()
    try:
        done = 0
        while done < nbytes:
            n = min(block, nbytes - done)
            stamped = _stamped(data, first + done // block)
            done += os.pwrite(fd, stamped[: n - n % 4096 or 4096 if direct else n], done)
        os.fsync(fd)
    except OSError:
        if not direct:
            raise
        return float("inf")
    finally:
        os.close(fd)
    return time.perf_counter() - t


def read_range_seconds(path: str, start: int, end: int, threads: int = 1, block: int = 64 << 20) -> float:
    """Seconds to read bytes [start, end) of ``path``, split into ``threads`` contiguous runs read
    at once (each sequential, so the kernel's readahead works for each)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(lo: int, hi: int) -> None:
        buf = bytearray(min(block, max(hi - lo, 1)))
        fd = os.open(path, os.O_RDONLY)
        try:
            while lo < hi:
                got = os.preadv(fd, [memoryview(buf)[: min(block, hi - lo)]], lo)
                if got <= 0:
                    raise EOFError(f"{path}: nothing to read at byte {lo} of [{start}, {end})")
                lo += got
        finally:
            os.close(fd)

    step = -(-(end - start) // threads)
    runs = [(lo, min(lo + step, end)) for lo in range(start, end, step)]
    t = time.perf_counter()
    with ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(lambda r: run(*r), runs))
    return time.perf_counter() - t


def disk_seconds(directory: str, nbytes: int, in_place: bool = False) -> tuple[float, float]:
    """(sequential write + fsync, cold sequential read) seconds for ``nbytes`` in ``directory``.

    ``in_place``: the write is the faster of a new file and an overwrite of it in place,
    each with direct I/O where the file system takes it: the limit of a writer that reuses
    its files, as resilient's do (this disk allocates a new file's blocks slowly)."""
    path = os.path.join(directory, "disk-probe.bin")
    try:
        write = write_file(path, nbytes)
        if in_place:
            direct = write_file(path, nbytes, direct=True)
            overwrite = write_file(path, nbytes, direct=direct != float("inf"), in_place=True)
            write = min(write, direct, overwrite)
        drop_cache(path)
        return write, read_range_seconds(path, 0, nbytes)
    finally:
        os.unlink(path)


class PeakRSS:
    """Samples this process's RSS every few ms; ``extra`` is the peak above the start."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.base = self._proc.memory_info().rss
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def step_samples(until: Callable[[], bool], limit: int, n: int = 1024) -> list[tuple[float, float]]:
    """(start, seconds) of each n×n matmul (a stand-in training step), repeated until
    ``until()`` or ``limit`` steps."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    samples: list[tuple[float, float]] = []
    while len(samples) < limit and not until():
        t = time.perf_counter()
        torch.mm(a, b)
        samples.append((t, time.perf_counter() - t))
    return samples


def mean_step_seconds(until: Callable[[], bool], limit: int, n: int = 1024) -> float:
    """Mean time of an n×n matmul, repeated until ``until()`` or ``limit`` steps."""
    return mean_or_nan(seconds for _, seconds in step_samples(until, limit, n))


def mean_or_nan(values: Iterable[float]) -> float:
    got = list(values)
    return sum(got) / len(got) if got else float("nan")  # nan: it ended before one step


def rendered(path: str | None, table: Callable[[Any], str]) -> bool:
    """``--render JSON``: print the table of an earlier run's JSON (True), or do nothing
    (False) when no path was given."""
    if not path:
        return False
    with open(path) as f:
        print(table(json.load(f)))
    return True


def reported(results: Any, out: str | None, table: Callable[[Any], str]) -> None:
    """The end of a run: ``results`` kept as JSON at ``out`` (when given; ``rendered``
    prints its table again later) and its table printed."""
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))


def in_rounds(methods: Sequence[str], rounds: int, run: Callable[[str, str], dict[str, Any]],
              said: Callable[[dict[str, Any]], str], prefix: str, parent: str | None = None) -> list[dict[str, Any]]:
    """Every method run once a round, the order rotated by round (so that none always goes
    first on a machine that warms up or slows down), as ``run(method, directory)`` in a
    scratch directory (``prefix``, under ``parent``) removed at the end; ``said`` prints
    each run's line."""
    scratch = tempfile.mkdtemp(prefix=prefix, dir=parent)
    runs = []
    try:
        for round_ in range(rounds):
            shift = round_ % len(methods)
            for method in (*methods[shift:], *methods[:shift]):
                runs.append(run(method, scratch))
                print(f"round {round_ + 1}: {method}: {said(runs[-1])}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return runs


def stall_cell(samples: Sequence[float], memcpy_s: float) -> str:
    """A table cell: the median stall, as a multiple of a memcpy, and the range."""
    stall = statistics.median(samples)
    return f"{stall:.3f} s ({stall / memcpy_s:.1f}x memcpy; {min(samples):.3f}-{max(samples):.3f})"


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a model's and its optimizer's tensors: what a checkpoint of them holds."""
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return nbytes + sum(v.numel() * v.element_size() for s in optimizer.state_dict()["state"].values()
                        for v in s.values() if isinstance(v, torch.Tensor))


def committed_seconds(events: str) -> list[float]:
    """Seconds from each save's call to its local commit, from a Checkpointer's event log."""
    if not os.path.exists(events):
        return []
    with open(events) as f:
        return [e["seconds"] for e in map(json.loads, f) if e.get("event") == "save_committed"
                and e.get("tier") == "local"]


def save_cells(runs: Sequence[dict[str, Any]], memcpy_s: float) -> tuple[str, str, str, str]:
    """Table cells of one method's runs of a training loop that saves now and then: the
    first saves' stalls, the later ones' (``stall_cell``), the median time to commit (or
    "not fsync'd"), and each run's wall time."""
    firsts = ", ".join(f"{r['save_s'][0]:.2f}" for r in runs) + " s"
    later = stall_cell([s for r in runs for s in r["save_s"][1:]], memcpy_s)
    committed = [s for r in runs for s in r["committed_s"]]
    durable = f"{statistics.median(committed):.2f} s" if committed else "not fsync'd"
    return firsts, later, durable, ", ".join(f"{r['train_s']:.1f}" for r in runs) + " s"


def gpt2_saves_main(argv: list[str] | None, doc: str, methods: Sequence[str],
                    run: Callable[[str, int, int, str], dict[str, Any]], table: Callable[[Any], str],
                    said: Callable[[dict[str, Any]], str], prefix: str) -> None:
    """The command line of a benchmark of GPT-2 training loops that save every 2 steps:
    ``run(method, layers, saves, directory)`` for each method and round, a memcpy of the
    saved bytes as the floor, the table printed (and the samples kept with ``--out``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--saves", type=int, default=3, help="saves per method and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--root", default=None, help="where the checkpoints go (a temporary directory by default)")
    p.add_argument("--out", default=None, help="keep the samples as JSON here")
    p.add_argument("--render", default=None, help="print the table of a results file and exit")
    a = p.parse_args(argv)
    if rendered(a.render, table):
        return
    runs = in_rounds(methods, a.rounds, lambda method, root: run(method, a.layers, a.saves, root), said, prefix,
                     a.root)
    results = {"layers": a.layers, "saves": a.saves, "rounds": a.rounds, "runs": runs,
               "memcpy_s": memcpy_seconds(runs[0]["bytes"])}
    reported(results, a.out, table)


def worker_results(module: str, world: int, args: dict[str, Any], timeout: float = 3600) -> list[Any]:
    """Runs ``module``'s ``worker`` on ``world`` gloo ranks (``tests.launch``, each with its
    share of the cores as torch threads) and returns what each rank printed after
    ``RESULT `` as JSON (None for a rank that printed nothing); a rank that failed ends the
    benchmark with its output."""
    from tests.launch import finish, start_ranks

    threads = max(1, (os.cpu_count() or 1) // world)
    results = []
    for r in finish(start_ranks("worker", world, args, module=module, env={"OMP_NUM_THREADS": str(threads)}),
                    timeout=timeout):
        if r.returncode != 0:
            sys.exit(f"worker rank {r.rank} failed ({r.returncode}):\n{r.output[-4000:]}")
        lines = [ln for ln in r.output.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
    return results
