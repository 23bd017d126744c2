"""Checkpoint save/restore: resilient against torch.save and torch.distributed.checkpoint.

    python -m benchmarks.bench_checkpoint                  # 1 and 4 GB, world sizes 1 and 2
    python -m benchmarks.bench_checkpoint --sizes 1 --worlds 1

For each state size (model + Adam moments: 26 fp32 parameter tensors and their two
moments), world size and layout (replicated as under DDP, sharded as DTensor Shard(0)), the
run goes in rounds. In each round the machine's limits are measured (memcpy into a touched
buffer; fsync'd sequential write, buffered and direct; cold read as one reader, one per rank
and four per rank), every method saves after two warm-up saves (``--saves`` measured, spaced a
second apart), and then every method restores from a cold page cache ``--restores`` times,
one second apart, with the read probes run as often, each pass in another order (rotated
and reversed in odd passes). ``resilient(buffered)`` is resilient with ``direct_io=False``
(its files go through the page cache, as the anchors' do). A round's figure is the median
of its samples (each the slowest rank's), as a ratio against that round's limits (each read
pattern's median; the fastest pattern); the table gives the medians
over rounds. Results go to stdout (markdown) and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, TypeVar

import psutil
import torch
import torch.distributed as dist

from benchmarks.common import (GB, PeakRSS, drop_cache, mean_or_nan, mean_step_seconds, memcpy_seconds,
                               probe_block, read_range_seconds, rendered, settle_memory, step_samples,
                               worker_results, write_file)

N_PARAMS = 26
RESILIENT = {"resilient": {"direct_io": True}, "resilient(buffered)": {"direct_io": False}}  # name: its options
#: resilient's other options, which ``bench_busy_cores`` weighs (not run here by default)
RESILIENT_MORE = {"resilient(zstd)": {"compress": "zstd"}}
METHODS = [*RESILIENT, "torch.save", "dcp.save", "dcp.async_save(thread)", "dcp.async_save(process)",
           "dcp.async_save+DefaultStager"]


# ---------------------------------------------------------------------------------------------
# worker side (one process per rank)
# ---------------------------------------------------------------------------------------------
def build_state(total_bytes: int, world: int, layout: str, seed: int = 0) -> dict[str, Any]:
    """Params + exp_avg + exp_avg_sq, as nested dicts (what model/optimizer state_dicts hold)."""
    per_param = total_bytes // 3 // 4  # fp32 elements for all parameters together
    weights = [i + 1 for i in range(N_PARAMS)]  # uneven sizes, like real layers
    g = torch.Generator().manual_seed(seed)
    mesh = None
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))

    def make(rows: int, cols: int) -> torch.Tensor:
        if mesh is None:
            return torch.randn(rows, cols, generator=g)
        from torch.distributed.tensor import DTensor, Shard

        local = torch.randn(rows // world, cols, generator=g)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model, optim = {}, {}
    cols = 1024
    for i, w in enumerate(weights):
        rows = max(world, per_param * w // sum(weights) // cols // world * world)
        model[f"layer{i}.weight"] = make(rows, cols)
        optim[i] = {"step": torch.tensor(10.0), "exp_avg": make(rows, cols), "exp_avg_sq": make(rows, cols)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(range(N_PARAMS))}]}}


def local_nbytes(state: dict[str, Any]) -> int:
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            total += t.numel() * t.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list):
            for v in obj:
                visit(v)

    visit(state)
    return total


def zero_state(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for per in [state["model"], *state["optim"]["state"].values()]:
            for t in per.values():
                (t.to_local() if hasattr(t, "to_local") else t).zero_()


class Method:
    """save(step) -> (stall seconds, seconds to durable); restore() -> seconds."""

    def __init__(self, name: str, root: str, state: dict[str, Any], rank: int, world: int, layout: str,
                 restore_only: bool = False) -> None:
        self.name, self.root, self.state, self.rank, self.world, self.layout = name, root, state, rank, world, layout
        self.stager = None
        self.ckpt = None
        self.phases: list[dict[str, float]] = []  # resilient's, per save: where its time to durable went
        options = {**RESILIENT, **RESILIENT_MORE}.get(name)
        if options is not None:
            from resilient import Checkpointer

            self.ckpt = Checkpointer(root, keep=1, rng=False, **options)
        if name == "dcp.async_save+DefaultStager" and not restore_only:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, True, False))

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def save(self, step: int, on_staged: Callable[[], None] = lambda: None, waited: bool = False) -> tuple[float, float]:
        """``on_staged``: called when the stall ends (the snapshot is in host memory).
        resilient's save is watched, not waited for, as a training loop that goes on does
        (a thread that waits for a save stops its background work's yielding to training,
        ``resilient/_background.py``), unless ``waited``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.perf_counter()
        if self.ckpt is not None:
            handle = self.ckpt.save(step, self.state)
            stall = time.perf_counter() - t0
            on_staged()
            while not waited and not handle.done():
                time.sleep(0.002)
            handle.result()
            durable = time.perf_counter() - t0
            self.phases.append(handle.phases)
            return stall, durable
        if self.name == "torch.save":
            if self.layout == "replicated" and self.rank != 0:
                return 0.0, 0.0
            os.makedirs(self.path(step), exist_ok=True)
            local = _local_tensors(self.state)
            with open(os.path.join(self.path(step), f"rank{self.rank}.pt"), "wb") as f:
                torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())
            took = time.perf_counter() - t0
            return took, took
        if self.name == "dcp.save":
            dcp.save(self.state, checkpoint_id=self.path(step))
            took = time.perf_counter() - t0
            return took, took
        kind = AsyncCheckpointerType.PROCESS if "process" in self.name else AsyncCheckpointerType.THREAD
        response = dcp.async_save(self.state, checkpoint_id=self.path(step), async_checkpointer_type=kind,
                                  async_stager=self.stager)
        if self.stager is not None:
            response.staging_completion.result()  # training may touch the state only after this
            stall = time.perf_counter() - t0
            on_staged()
            response.upload_completion.result()
        else:
            stall = time.perf_counter() - t0
            on_staged()
            response.result()
        return stall, time.perf_counter() - t0

    def restore(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        if self.name == "torch.save":
            rank_file = os.path.join(self.path(step), f"rank{0 if self.layout == 'replicated' else self.rank}.pt")
            drop_cache(rank_file)
            _barrier()
            t0 = time.perf_counter()
            loaded = torch.load(rank_file, weights_only=True)
            local = _local_tensors(self.state)
            with torch.no_grad():
                for k, v in loaded.items():
                    local[k].copy_(v)
            return time.perf_counter() - t0
        where = os.path.join(self.root, f"step-{step:010d}") if self.ckpt is not None else self.path(step)
        drop_cache(where)
        _barrier()
        t0 = time.perf_counter()
        if self.ckpt is not None:
            got = self.ckpt.restore(self.state)
            assert got == step, (got, step)
        else:
            dcp.load(self.state, checkpoint_id=self.path(step))
        return time.perf_counter() - t0

    def forget_before(self, step: int) -> None:
        """Delete the steps before ``step`` (resilient's ``keep=1`` does so itself): the
        rounds keep every method's last checkpoint on disk until all have restored."""
        _barrier()
        if self.rank == 0 and self.ckpt is None:
            for old in range(1, step):
                shutil.rmtree(self.path(old), ignore_errors=True)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.stager is not None:
            self.stager.close()


def _local_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in state["model"].items():
        out[f"model.{k}"] = t.to_local() if hasattr(t, "to_local") else t
    for i, per in state["optim"]["state"].items():
        for k, t in per.items():
            out[f"optim.{i}.{k}"] = t.to_local() if hasattr(t, "to_local") else t
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_slowdown(method: "Method", step: int) -> tuple[float, float]:
    """(while written, from the call): mean step time while ``method`` saves ``step`` in
    another thread, against the same step with no save.

    *While written* counts the steps that start once the snapshot is in host memory: in a
    training loop the stall holds the training thread, so no step runs beside the snapshot
    copy, and the stall has a column of its own. *From the call* counts those steps too
    (what this column measured until December 2026): a save that writes fast is then
    weighed mostly by its snapshot copy competing with the step, which no loop sees."""
    import threading

    idle = mean_step_seconds(lambda: False, 20)
    staged, done = [], threading.Event()
    threading.Thread(target=lambda: (method.save(step, on_staged=lambda: staged.append(time.perf_counter())),
                                     done.set()), daemon=True).start()
    samples = step_samples(done.is_set, 10_000)
    written = [s for t, s in samples if staged and t >= staged[0]]
    return mean_or_nan(written) / idle, mean_or_nan(s for _, s in samples) / idle


def _rotated(items: list[str], by: int) -> list[str]:
    """Round ``by``'s order: rotated by ``by``, and reversed in odd rounds, so that a method
    changes both its place and the method before it (whose I/O may still be settling
    under the virtual disk): a plain rotation kept every method's predecessor fixed."""
    by %= max(len(items), 1)
    order = items[by:] + items[:by]
    return order[::-1] if by % 2 else order


def _timed_together(action: Callable[[], None]) -> float:
    """Seconds from a barrier before ``action`` on every rank to a barrier after it: the time
    the slowest rank needed, as a job sees it."""
    _barrier()
    t0 = time.perf_counter()
    action()
    _barrier()
    return time.perf_counter() - t0


#: unmeasured saves before each method's measured ones. Two: resilient's third save is the
#: first to overwrite a deleted step's files (``LocalTier.reuse``), as every later save in a
#: training run does; measured from the second, one sample in two was a new file's (1 GB on 2
#: ranks: 0.63-0.65 s to durable against 0.38-0.43 s over a recycled file, same rounds).
WARM_UP_SAVES = 2

READ_PATTERNS = {"read_one_reader_s": (False, 1), "read_per_rank_s": (True, 1), "read_4_per_rank_s": (True, 4)}
READ_PROBE = "cold read (limit)"  # the read patterns' turn in the restores' rotation


T = TypeVar("T")


def _on_rank0(rank: int, action: Callable[[], T]) -> T:
    """``action``'s result on rank 0, given to every rank."""
    took: list[Any] = [action() if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(took, src=0)
    return took[0]


def _write_probes(directory: str, nbytes: int, rank: int, world: int) -> tuple[dict[str, float], dict[str, str]]:
    """The disk's write limit now (seconds for ``nbytes``, fsync'd: buffered and direct, as
    the writer uses direct I/O where it can), and one file per read pattern for later.

    Each read pattern gets a file of its own, written in the same round as the checkpoints
    and read once, as they are: a probe file read again and again stays in the caches
    under the virtual disk, while a checkpoint is read once."""
    patterns = [k for k in READ_PATTERNS if world > 1 or k != "read_per_rank_s"]
    files = {k: os.path.join(directory, f"probe-{k[5:-2]}.bin") for k in patterns}
    paths = list(files.values())  # every rank walks the same list: rank 0 alone writes

    def direct(path: str) -> float:
        took = write_file(path, nbytes, direct=True)
        if took == float("inf"):  # no direct I/O here: the read probe still needs its file
            write_file(path, nbytes)
        return took

    out = {"write_buffered_s": _on_rank0(rank, lambda: write_file(paths[0], nbytes)),
           "write_direct_s": _on_rank0(rank, lambda: direct(paths[1]))}
    for path in paths[2:]:  # a third pattern's file: one more buffered sample
        out["write_buffered_s"] = min(out["write_buffered_s"], _on_rank0(rank, lambda: write_file(path, nbytes)))
    out["write_s"] = min(out["write_buffered_s"], out["write_direct_s"])
    return out, files


def _probe_write(directory: str, nbytes: int, kind: str, block: Any) -> dict[str, float]:
    """Seconds for fsync'd writes of ``nbytes`` by kind. ``kind`` buffered: one write into a
    new file. ``kind`` direct: one into a new file (``direct``) and then one over the same
    file in place (``in_place``), as resilient's recycled files are written: this disk
    allocates a new file's blocks slowly (1 GB: 0.40-0.41 s new, 0.16-0.17 s in place), so
    the overwrite is the stricter limit. The file goes at once, so a method's turn holds
    one checkpoint's extra bytes on disk at most."""
    path = os.path.join(directory, "probe-near.bin")
    try:
        took = {kind: write_file(path, nbytes, direct=kind == "direct", data=block)}
        if kind == "direct" and took[kind] != float("inf"):
            took["in_place"] = write_file(path, nbytes, direct=True, data=block, in_place=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return took


def _read_probes(files: dict[str, str], nbytes: int, rank: int, world: int) -> dict[str, float]:
    """A cold read of each pattern's file (one reader, one per rank, four per rank: which
    one the disk serves fastest varies); the limit is the fastest pattern."""
    share = (nbytes * rank // world, nbytes * (rank + 1) // world)
    out = {}
    for key, path in files.items():
        per_rank, threads = READ_PATTERNS[key]
        if rank == 0:
            drop_cache(path)
        out[key] = _timed_together(lambda: (per_rank or rank == 0) and read_range_seconds(
            path, *(share if per_rank else (0, nbytes)), threads=threads))
    return out


def worker(args: dict[str, Any]) -> None:
    """Rounds in which every method saves (its own block: each holds its buffers only while it
    saves) and then all restore, interleaved, with the machine's limits measured in the same
    round. The disk drifts by 2-3× within minutes here, so each method is compared with
    limits measured minutes, not a quarter of an hour, apart, and the methods' order rotates."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")  # DCP's process executor needs one even for a single rank
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = build_state(int(args["gb"] * GB), world, args["layout"])
    nbytes, total = local_nbytes(state), int(args["gb"] * GB)
    os.makedirs(args["root"], exist_ok=True)
    records: list[dict[str, Any]] = []
    block = probe_block()  # made before any method's RSS is sampled
    roots = {name: os.path.join(args["root"], name.replace("+", "_").replace("(", "_").strip(")"))
             for name in args["methods"]}
    for rnd in range(args["rounds"]):
        writes, probes = _write_probes(args["root"], total, rank, world)
        limits = {"round": rnd, "memcpy_local_s": memcpy_seconds(nbytes, sync=_barrier), **writes}
        records.append({"limits": limits})
        last_step = {}
        for name in _rotated(args["methods"], rnd):
            settle_memory()  # the last method's freed buffers first
            _barrier()
            memcpy_near = memcpy_seconds(nbytes, sync=_barrier)  # seconds before this method's first save
            settled = settle_memory()  # and the probe's
            _barrier()
            writes_near: dict[str, list[float]] = {kind: [] for kind in WRITE_KINDS}

            def probe_write(kind: str) -> None:
                """fsync'd writes of the checkpoint's size, in the gap before each save
                (direct, new file then in place: they leave no page cache to free under
                the next save) and after the last (the same, then buffered): the method's
                write limit is measured seconds, not minutes, from its own writes."""
                for probed, took in _on_rank0(rank, lambda: _probe_write(args["root"], total, kind, block)).items():
                    writes_near[probed].append(took)

            with PeakRSS() as rss:  # from before the method exists: buffers it keeps count too
                method = Method(name, roots[name], state, rank, world, args["layout"])
                for step in range(1, 1 + WARM_UP_SAVES):  # buffers, daemons, first touch, recycled files
                    method.save(step)
                stalls, durables = [], []
                for step in range(1 + WARM_UP_SAVES, 1 + WARM_UP_SAVES + args["saves"]):
                    probe_write("direct")
                    time.sleep(args.get("gap", 1.0))  # saves are spaced by training steps, not back to back
                    _barrier()
                    stall, durable = method.save(step)
                    stalls.append(stall)
                    durables.append(durable)
                last_step[name] = WARM_UP_SAVES + args["saves"]
                slowdown = slowdown_from_call = None
                if args.get("slowdown") and name in (*RESILIENT, "dcp.async_save+DefaultStager"):
                    time.sleep(args.get("gap", 1.0))
                    last_step[name] += 1
                    slowdown, slowdown_from_call = step_slowdown(method, last_step[name])
                probe_write("direct")
                probe_write("buffered")
            method.close()
            method.forget_before(last_step[name])
            records.append({"round": rnd, "method": name, "stall": stalls, "durable": durables, "restore": [],
                            "memcpy_near_s": memcpy_near, "writes_near_s": writes_near,
                            "rss_extra": rss.extra, "slowdown": slowdown, "settled_s": settled,
                            "phases": method.phases[WARM_UP_SAVES:WARM_UP_SAVES + args["saves"]],
                            "slowdown_from_call": slowdown_from_call})
            method = None  # drop its buffers before the next method allocates its own
            gc.collect()
        reads: dict[str, list[float]] = {}
        # each pass in another order, and each round's first pass too: ordered by
        # ``rnd * restores + rep``, a run of two methods and 3 restores began every round's
        # restores with the same method (3 orders for 3 passes), right after the saves
        for rep in range(args["restores"]):
            for name in _rotated([*args["methods"], READ_PROBE], rnd + rep + 1):
                if name == READ_PROBE:
                    for key, took in _read_probes(probes, total, rank, world).items():
                        reads.setdefault(key, []).append(took)
                    continue
                reader = Method(name, roots[name], state, rank, world, args["layout"], restore_only=True)
                zero_state(state)
                if rank == 0:  # what the saves and probes wrote through the page cache is on disk
                    os.sync()  # before a restore is timed, not written back under it
                time.sleep(args.get("gap", 1.0))  # the last method's reads settle first
                _barrier()
                took = reader.restore(last_step[name])
                reader.close()
                next(r for r in records if r.get("round") == rnd and r.get("method") == name)["restore"].append(took)
        # each pattern's median over the passes, then the fastest pattern: the minimum of
        # single samples would set a limit below what any one read of that pattern gets
        limits.update({key: statistics.median(samples) for key, samples in reads.items()})
        limits["read_s"] = min(limits[key] for key in reads)
        limits["read_samples"] = reads
        _barrier()
        if rank == 0:
            for root in roots.values():
                shutil.rmtree(root, ignore_errors=True)
            for path in probes.values():
                os.unlink(path)
    print("RESULT " + json.dumps(records), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,4", help="state sizes in GB, comma separated (default: %(default)s)")
    p.add_argument("--worlds", default="1,2", help="world sizes (default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS), help="methods to run (default: all)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each with the limits, the measured saves and the restores of every method "
                        "(median; default: %(default)s)")
    p.add_argument("--saves", type=int, default=2,
                   help="measured saves per method and round, after two warm-up saves (median; default: %(default)s)")
    p.add_argument("--restores", type=int, default=3,
                   help="cold restores per method and round, each pass in another order, with the read probes "
                        "as often (median; default: %(default)s)")
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    p.add_argument("--out", default="bench-out/checkpoint.json", help="JSON results (default: %(default)s)")
    p.add_argument("--render", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    a = p.parse_args()
    if rendered(a.render, table):
        return
    base = a.dir or tempfile.mkdtemp(prefix="resilient-bench-")
    os.makedirs(base, exist_ok=True)
    methods = a.methods.split(",")
    sizes = [float(x) for x in a.sizes.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the clean-up below
    try:
        _check_free_space(base, max(sizes), len(methods))
        rows = _run_cells(base, sizes, [int(w) for w in a.worlds.split(",")], methods, a)
    finally:  # a failed or interrupted run must not leave its gigabytes behind
        shutil.rmtree(base if not a.dir else os.path.join(base, "ck"), ignore_errors=True)
    print("\n" + table(rows))


def _check_free_space(base: str, gb: float, methods: int) -> None:
    """Refuse to start a run the disk cannot hold, instead of failing in its last cells.
    At the peak every method's last checkpoint, the read probes' files (3), a DCP method's
    earlier steps (4, deleted after its turn) and a write probe's file are on disk at once."""
    need = gb * GB * (methods + 8)
    free = shutil.disk_usage(base).free
    if free < need:
        sys.exit(f"{base}: {free / GB:.1f} GB free, but {methods} method(s) at {gb:g} GB need about "
                 f"{need / GB:.0f} GB; pass --dir on a larger disk or fewer --methods/--sizes")


def _run_cells(base: str, sizes: list[float], worlds: list[int], methods: list[str],
               a: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for gb in sizes:
        for world in worlds:
            for layout in ("replicated", "sharded") if world > 1 else ("replicated",):
                runnable = [m for m in methods if _fits(m, gb, world, layout)]
                for m in sorted(set(methods) - set(runnable), key=methods.index):
                    print(f"# {gb:g} GB, {world} rank(s), {layout}: {m} skipped (its copies would not fit in RAM)")
                args = {"gb": gb, "layout": layout, "methods": runnable, "root": os.path.join(base, "ck"),
                        "slowdown": world == 1, "rounds": a.rounds,
                        "saves": a.saves, "restores": a.restores}
                per_rank = worker_results("benchmarks.bench_checkpoint", world, args)
                if None in per_rank:
                    sys.exit(f"worker rank {per_rank.index(None)} reported no result")
                cell = summarize(per_rank, gb, world, layout, runnable)
                print(_limits_line(cell[0]) + f" ({(time.monotonic() - started) / 60:.0f} min in)", flush=True)
                for row in cell:
                    print(_row(row), flush=True)
                rows += cell
                with open(a.out, "w") as f:  # after every cell: an interrupted run keeps what it measured
                    json.dump(rows, f, indent=1)
    return rows


def summarize(per_rank: list[list[dict[str, Any]]], gb: float, world: int, layout: str,
              methods: list[str]) -> list[dict[str, Any]]:
    """One row per method: in each round the median of the slowest rank's times over the
    round's samples, as ratios against that round's limits; then the median over rounds."""
    nbytes = gb * GB
    local_gb = gb / world if layout == "sharded" else gb
    rank0 = per_rank[0]
    limits = {x["limits"]["round"]: x["limits"] for x in rank0 if "limits" in x}
    memcpy = {rnd: max(x["limits"]["memcpy_local_s"] for pr in per_rank for x in pr
                       if "limits" in x and x["limits"]["round"] == rnd) for rnd in limits}
    med = statistics.median
    rows = []
    for name in methods:
        runs = []
        for rnd, lim in limits.items():
            mine = [x for pr in per_rank for x in pr if x.get("method") == name and x.get("round") == rnd]
            samples = {k: _slowest(mine, k) for k in ("stall", "durable", "restore")}
            worst = {k: med(v) for k, v in samples.items()}
            writing = _write_phase(mine)
            worst["rss_extra"] = max(x["rss_extra"] for x in mine)
            worst["settled_s"] = max(x.get("settled_s", 0.0) for x in mine)  # waited before the turn
            memcpy_near, write_near = _near_limits(mine)
            runs.append({"round": rnd, **worst, "samples": samples, "memcpy_local_s": memcpy_near,
                         "write_s": write_near, "write_new_file_s": _write_limit(mine, NEW_FILE_KINDS),
                         "round_memcpy_local_s": memcpy[rnd], "round_write_s": lim["write_s"],
                         "writes_near_s": mine[0]["writes_near_s"], "read_s": lim["read_s"],
                         "phases": [x.get("phases", []) for x in mine],  # each rank's, per sample (resilient)
                         "stall_x_memcpy": worst["stall"] / memcpy_near, "write_frac": write_near / worst["durable"],
                         # every rank restores at once from one disk: the checkpoint's bytes are
                         # read from it once (replicas share the page cache or a broadcast)
                         "restore_frac": lim["read_s"] / worst["restore"],
                         # resilient's: its background write alone, without the stall's copy
                         "write_phase_s": writing, "write_phase_frac": write_near / writing if writing else None})
        slowdown = {k: [x[k] for x in rank0 if x.get("method") == name and x.get(k)]
                    for k in ("slowdown", "slowdown_from_call")}
        row = {"gb": gb, "world": world, "layout": layout, "method": name, "rounds": len(runs),
               **{k: med(r[k] for r in runs) for k in ("stall", "durable", "restore", "stall_x_memcpy",
                                                       "write_frac", "restore_frac")},
               **{k: med(r[k] for r in runs) if all(r[k] for r in runs) else None
                  for k in ("write_phase_s", "write_phase_frac")},
               "near_gbps": {"memcpy": med(local_gb / r["memcpy_local_s"] for r in runs),
                             "write": med(nbytes / GB / r["write_s"] for r in runs),
                             "write_new_file": med(nbytes / GB / r["write_new_file_s"] for r in runs)},
               "rss_extra": max(r["rss_extra"] for r in runs),
               "limits": {"memcpy_gbps": med(nbytes / world / memcpy[r] / GB for r in limits)
                          if layout == "sharded" else med(nbytes / memcpy[r] / GB for r in limits),
                          **{k[:-2] + "_gbps": med(nbytes / lim[k] / GB for lim in limits.values())
                             for k in next(iter(limits.values())) if k.endswith("_s") and k != "memcpy_local_s"}},
               # medians over rounds (world size 1 only); every round's value kept
               **{k: med(v) if v else None for k, v in slowdown.items()},
               "slowdown_rounds": slowdown["slowdown"],
               "per_round": runs}  # what the medians come from, kept in the JSON
        rows.append(row)
    return rows


#: the kinds of fsync'd write probed in a method's turn (``_probe_write``), and those that
#: write a new file, as the limit was probed until December 2026
WRITE_KINDS = ("direct", "in_place", "buffered")
NEW_FILE_KINDS = ("direct", "buffered")


def _near_limits(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(memcpy, write) seconds probed within the method's own turn: the memcpy of every rank
    at once just before its first save (the slowest rank's), and the write limit."""
    return max(x["memcpy_near_s"] for x in records), _write_limit(records, WRITE_KINDS)


def _write_limit(records: list[dict[str, Any]], kinds: tuple[str, ...]) -> float:
    """The fastest of ``kinds`` of fsync'd write by its median over the probes between and
    after the method's saves (rank 0 writes them; runs from before the in-place probe have
    none of that kind)."""
    writes = records[0]["writes_near_s"]
    return min(statistics.median(v) for k, v in writes.items() if v and k in kinds)


def _write_phase(records: list[dict[str, Any]]) -> float | None:
    """Median over samples of the slowest rank's background write (phase ``copied`` to
    ``written``: its file written and fsync'd), or None for a method without phases. Why
    apart from the commit time: that counts from the call, so it includes the stall's copy
    of the state, which a write probe does not do."""
    per_rank = [x.get("phases") or [] for x in records]
    if not all(per_rank):
        return None
    return statistics.median(max(p["written"] - p["copied"] for p in sample) for sample in zip(*per_rank))


def _slowest(records: list[dict[str, Any]], key: str) -> list[float]:
    """Each sample's time as the job sees it: the slowest rank's (all ranks take the same
    number of samples, in the same order)."""
    return [max(t) for t in zip(*(x[key] for x in records))]


def _limits_line(row: dict[str, Any]) -> str:
    lim = row["limits"]
    reads = ", ".join(f"{k[5:-5].replace('_', ' ')} {v:.2f}" for k, v in lim.items()
                      if k.startswith("read_") and k != "read_gbps")
    return (f"# {row['gb']:g} GB, {row['world']} rank(s), {row['layout']}, medians of {row['rounds']} rounds: "
            f"at round start fsync'd write {lim['write_buffered_gbps']:.2f} GB/s buffered, "
            f"{lim['write_direct_gbps']:.2f} direct, memcpy {lim['memcpy_gbps']:.1f}; "
            f"within {row['method']}'s turn write {row['near_gbps']['write']:.2f} (best kind; "
            f"{row['near_gbps'].get('write_new_file', float('nan')):.2f} into a new file), "
            f"memcpy {row['near_gbps']['memcpy']:.1f}; cold read GB/s {reads}")


# host copies of the rank's local state each method holds at its peak, besides the state itself
_COPIES = {**dict.fromkeys(RESILIENT, 1.0), "torch.save": 0.2, "dcp.save": 0.2, "dcp.async_save(thread)": 1.0,
           "dcp.async_save(process)": 2.0, "dcp.async_save+DefaultStager": 1.0}


def _fits(method: str, gb: float, world: int, layout: str) -> bool:
    local = gb if layout == "replicated" else gb / world
    need = world * local * (1 + _COPIES[method]) + gb  # + page cache the writes pin while in flight
    return need * GB < 0.8 * psutil.virtual_memory().total


def _write_part(r: dict[str, Any]) -> str:
    """The background write alone, where the method times it (resilient)."""
    if not r.get("write_phase_s"):
        return ""
    return f"; its write {r['write_phase_s']:.2f} s ({r['write_phase_frac'] * 100:.0f}%)"


def _row(r: dict[str, Any], slowdown: bool = True) -> str:
    cells = (f"| {r['gb']:g} GB | {r['world']} | {r['layout']} | {r['method']} | {r['stall']:.3f} s "
             f"({r['stall_x_memcpy']:.2f}×) | {r['durable']:.2f} s ({r['write_frac'] * 100:.0f}%){_write_part(r)} | "
             f"{r['restore']:.2f} s ({r['restore_frac'] * 100:.0f}%) | {r['rss_extra'] / GB:.2f} GB |")
    if not slowdown:
        return cells
    if not r.get("slowdown"):
        return cells + " – |"
    call = f" ({r['slowdown_from_call']:.2f}× from the call)" if r.get("slowdown_from_call") else ""
    return cells + f" {r['slowdown']:.2f}×{call} |"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown; the slowdown column only when a row has one (world size 1 measures it)."""
    slowdown = any(r.get("slowdown") for r in rows)
    head = ("| state | ranks | layout | method | stall (× memcpy of rank's state) | committed (% of write bw) "
            "| restore (% of cold read bw) | peak extra RSS |" + (" step slowdown while writing |" if slowdown else "")
            + "\n|---|---|---|---|---|---|---|---|" + ("---|" if slowdown else ""))
    return "\n".join([head, *(_row(r, slowdown) for r in rows)])


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
