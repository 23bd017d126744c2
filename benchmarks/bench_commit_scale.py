"""The commit of a save at scale, simulated on one machine: nodes x ranks against one real store.

    python -m benchmarks.bench_commit_scale [--nodes 8,32,128] [--ranks-per-node 8]
                                            [--tensors 100] [--saves 5] [--procs 8]
                                            [--rng-in none] [--json PATH] [--render PATH]

What a save costs once every rank's file is written: the reports, the manifest, the
leaders' commits and the outcomes, which is all that grows with the number of ranks. Each
simulated rank is a thread running resilient's own commit protocol
(``resilient._commit.commit_together``) over a client connection of its own to one
``TCPStore``, hosted by this process as the rank-0 agent hosts it in a real job. The ranks
are spread over ``--procs`` processes; the first rank of each node is its leader (node-local
disks) and writes the manifest it commits to a file in /dev/shm (the disk's part of a commit
is measured by ``bench_checkpoint``). Each rank reports what an FSDP rank reports: a shard of
each of ``--tensors`` parameters and of their two Adam moments, about 1 GB, in a data file of
a chunk per shard as resilient writes them, its chunk table after them (format 4), and the
state's tree; with ``--rng-in``, its generator states too, each rank
seeded differently: in its data file (``file``, what resilient writes) or in the manifest
(``manifest``, where format 2 kept them).

Figures per size, medians over the saves after the first (a job's first save sends every
report whole; after it, each rank leaves out what rank 0 holds from the save before, its
tensors, tree and boxes: ``resilient/_report_memo.py``; the first save's figures are kept
apart, and ``--whole`` sends every report whole at every save, as before), every rank
starting its part at one instant: **commit** (from then until the last rank knows the
outcome), **reports** (what every rank's report weighed as it went through the store to
rank 0), **CPU per node** (the
CPU the simulated ranks' processes used over a save, divided by the nodes: what a node of a
real job spends, since here all nodes share this machine's cores and the commit time is
inflated by their taking turns), **a rank's commit CPU** (its thread's own CPU time in
``commit_together``, the largest of each role: rank 0, which assembles the manifest; another
node's leader, which commits it; any other rank), **store host CPU** (this process's CPU
over the saves: the store's thread, since the driver sleeps), and the **manifest** each
leader writes. Where a size cannot run here (threads, ports, memory), the error says which
limit stopped it and the table shows the sizes up to there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from isal.isal_zlib import crc32

from benchmarks.bench_scale import add_run_options, process_cpu_s, raise_fd_limit, rendered_or_moved
from resilient._chunk_table import with_footer
from resilient._rng import capture_rng, encode_rng

CHUNK = 16 << 20
RANK_BYTES = 1 << 30
TIMEOUT_S = 300.0
SHM = "/dev/shm/resilient-commit-bench"


@dataclass
class Case:
    port: int
    nodes: int
    per_node: int
    tensors: int
    indices: list[int]
    rng_in: str = "none"
    whole: bool = False  # every report sent whole at every save, as before _report_memo


def rng_state(rank: int, distinct: bool) -> dict[str, Any]:
    """Rank ``rank``'s generator states as ``capture_rng`` takes them, each rank seeded
    differently (``distinct``) or alike."""
    seed = rank if distinct else 0
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return capture_rng()


def as_sent(report: dict[str, Any], state: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """``report`` (``fsdp_report``'s) as the writer sends it, with its rank's generator
    ``state`` where the writer puts it: after its tensors in its data file, a raw chunk of
    its own (``file``, since format 3), or in the report for the manifest (``manifest``, as
    format 2 kept every rank's), or nowhere (``none``); then the file's chunk table after
    its chunks (format 4: the record gives its size and CRC)."""
    chunks = report["record"]["chunks"]
    end = chunks[-1][2] + chunks[-1][3]  # raw chunks: logical and stored offsets are the same
    if where == "manifest":
        report["rng"] = state
    elif where == "file":
        saved = encode_rng(state)
        chunks.append([end, len(saved), end, len(saved), crc32(saved), 0])
        report["rng"] = [end, len(saved)]
        end += len(saved)
    report["record"] = with_footer(chunks, end)[1]
    return report


def fsdp_report(rank: int, world: int, tensors: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` reports after writing an FSDP state of about 1 GB:
    every tensor sharded along dim 0, one slice per rank, parameters first and then the Adam
    moments, and the chunks resilient writes for them (``_chunkio``: a chunk never spans two
    tensors, so one at least per tensor, at most 16 MB)."""
    cols = 4096
    names = [f"{kind}/layers.{i}.weight" for kind in ("model", "optim.exp_avg", "optim.exp_avg_sq")
             for i in range(tensors)]
    rows = max(1, RANK_BYTES // (len(names) * cols * 4))
    nbytes = rows * cols * 4
    meta = {n: {"dtype": "float32", "shape": [rows * world, cols], "layout": "sharded"} for n in names}
    shards = [[n, [rows * rank, 0], [rows, cols], i * nbytes, nbytes] for i, n in enumerate(names)]
    # checksums as real ones look, not a pattern deflate would shrink (the store sends the
    # manifest deflated; 4 bytes a chunk of it are these)
    chunks = [[o, min(CHUNK, end - o), o, min(CHUNK, end - o), crc32(b"%d:%d" % (rank, o)), 0]
              for start in range(0, len(names) * nbytes, nbytes) for end in (start + nbytes,)
              for o in range(start, end, CHUNK)]
    tree = {"t": "dict", "items": [[n, {"t": "tensor", "name": n}] for n in names]}
    return {"rank": rank, "file": f"rank-{rank:05d}.data",
            "record": {"bytes": len(names) * nbytes, "chunks": chunks},
            "signature": f"fsdp-{tensors}", "meta": meta, "replicated": [], "shards": shards,
            "tree": tree, "rng": None, "chunk_bytes": CHUNK}


def serve(conn: Any, case: Case) -> None:
    """The simulated ranks ``case.indices``: one store connection and one thread each."""
    raise_fd_limit()
    from torch.distributed import PrefixStore, TCPStore

    from resilient._commit import commit_together
    from resilient._coord import StoreCoordinator
    from resilient._report_memo import HeldPieces, SentPieces

    world = case.nodes * case.per_node
    leaders = list(range(0, world, case.per_node))
    coords: dict[int, StoreCoordinator] = {}
    try:
        for r in case.indices:
            client = TCPStore("127.0.0.1", case.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
            coords[r] = StoreCoordinator(PrefixStore("resilient/bench/", client), rank=r, world_size=world,
                                         leader=r - r % case.per_node, leaders=leaders, session="bench")
        reports = {r: as_sent(fsdp_report(r, world, case.tensors), rng_state(r, True) if case.rng_in != "none"
                               else None, case.rng_in) for r in case.indices}
    except Exception as exc:  # noqa: BLE001 - a size this machine cannot hold
        conn.send(("error", f"rank {len(coords)} of {len(case.indices)} in one process: {type(exc).__name__}: {exc}"))
        return
    # kept across saves, as each rank's writer keeps them
    memos = {r: (None, None) if case.whole else (SentPieces(), HeldPieces() if r == 0 else None)
             for r in case.indices}
    conn.send(("ready", None))
    manifest_bytes: dict[int, int] = {}

    def one(r: int, seq: int, start_at: float) -> tuple[float, float, int]:
        time.sleep(max(0.0, start_at - time.time()))
        cpu = time.thread_time()

        def commit(manifest: bytes) -> None:
            path = os.path.join(SHM, f"node-{r // case.per_node}.json")
            with open(path, "wb") as f:
                f.write(manifest)
            manifest_bytes[r] = len(manifest)

        sent = commit_together(coords[r], seq, seq, reports[r], codec="none", timeout=TIMEOUT_S, commit=commit,
                               discard=lambda: None, mark=lambda phase: None, sent=memos[r][0], held=memos[r][1])
        return time.time(), time.thread_time() - cpu, sent

    with ThreadPoolExecutor(max_workers=len(case.indices)) as pool:
        while True:
            command, arg = conn.recv()
            if command == "stop":
                conn.send(("stopped", None))
                return
            seq, start_at = arg
            try:
                cpu = process_cpu_s()
                outcomes = dict(zip(case.indices, pool.map(lambda r: one(r, seq, start_at), case.indices)))
                leads = [c for r, (_, c, _) in outcomes.items() if r and r % case.per_node == 0]
                threads = {"rank0": outcomes[0][1] if 0 in outcomes else 0.0, "leader": max(leads, default=0.0),
                           "other": max([c for r, (_, c, _) in outcomes.items() if r % case.per_node], default=0.0)}
                conn.send(("done", (max(end for end, _, _ in outcomes.values()), max(manifest_bytes.values(), default=0),
                                    process_cpu_s() - cpu, threads, sum(sent for _, _, sent in outcomes.values()))))
            except Exception as exc:  # noqa: BLE001
                conn.send(("error", f"{type(exc).__name__}: {exc}"))


def run_case(nodes: int, per_node: int, tensors: int, saves: int, procs: int, rng_in: str = "none",
             whole: bool = False) -> dict[str, Any]:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    world = nodes * per_node
    result: dict[str, Any] = {"nodes": nodes, "ranks_per_node": per_node, "ranks": world, "tensors": tensors,
                              "rng_in": rng_in, "reports": "whole" if whole else "what changed"}
    ctx = mp.get_context("spawn")
    pipes, children = [], []
    try:
        for p in range(min(procs, world)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, Case(server.port, nodes, per_node, tensors,
                                                               list(range(p, world, procs)), rng_in, whole)),
                              daemon=True)
            proc.start()
            pipes.append(parent)
            children.append(proc)
        for pipe in pipes:
            kind, detail = pipe.recv()
            if kind == "error":
                raise RuntimeError(detail)
        seconds, ranks_cpu, host_cpu, reports_bytes, manifest = [], [], [], [], 0
        threads: dict[str, list[float]] = {"rank0": [], "leader": [], "other": []}
        for seq in range(1, saves + 1):
            cpu = process_cpu_s()
            start = time.time() + 0.5
            for pipe in pipes:
                pipe.send(("save", (seq, start)))
            answers = [pipe.recv() for pipe in pipes]
            errors = [detail for kind, detail in answers if kind == "error"]
            if errors:
                raise RuntimeError("; ".join(errors[:3]))
            seconds.append(max(end for _, (end, *_) in answers) - start)
            manifest = max([manifest] + [size for _, (_, size, *_) in answers])
            ranks_cpu.append(sum(used for _, (_, _, used, _, _) in answers))
            reports_bytes.append(sum(sent for _, (*_, sent) in answers))
            for role in threads:
                threads[role].append(max(t[role] for _, (_, _, _, t, _) in answers))
            host_cpu.append(process_cpu_s() - cpu)  # the store's thread: the driver sleeps meanwhile

        def figures(at: slice) -> dict[str, Any]:
            return {"commit_s": round(statistics.median(seconds[at]), 3),
                    "store_host_cpu_s_per_save": round(statistics.median(host_cpu[at]), 3),
                    "cpu_ms_per_node_per_save": round(statistics.median(ranks_cpu[at]) / nodes * 1e3, 1),
                    "reports_mb_per_save": round(statistics.median(reports_bytes[at]) / 1e6, 3),
                    "thread_cpu_ms": {role: round(statistics.median(v[at]) * 1e3, 1) for role, v in threads.items()}}

        # the first save sends every report whole; the figures are those of the saves after
        # it (of all, with --whole), and the first's are kept beside them
        later = slice(1, None) if saves > 1 and not whole else slice(None)
        result.update(figures(later), first_save=figures(slice(0, 1)), commit_samples_s=[round(s, 3) for s in seconds],
                      manifest_mb=round(manifest / 1e6, 2))
        return result
    finally:
        for pipe in pipes:
            try:
                pipe.send(("stop", None))
                if pipe.poll(20):
                    pipe.recv()
            except (EOFError, OSError):
                pass
        for proc in children:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        del server


def first_save(result: dict[str, Any]) -> str:
    """The first save's cell: its reports' bytes, its commit, rank 0's and the store host's
    CPU (a blank for a run that sent every report whole, or that predates the split)."""
    first = result.get("first_save")
    if not first or result.get("reports") == "whole":
        return "–"
    sent = f"{first['reports_mb_per_save']:.2f} MB, " if "reports_mb_per_save" in first else ""
    return (f"{sent}{first['commit_s']:.3f} s, {first['thread_cpu_ms']['rank0']:.0f} ms / "
            f"{first['store_host_cpu_s_per_save']:.3f} s")


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| nodes x ranks | reports | commit of a save (median) | CPU per node per save (its ranks' processes) "
             "| a rank's commit CPU: rank 0 / another leader / any other rank "
             "| store host CPU per save | manifest per leader | first save: reports, commit, rank 0 / store host CPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["ranks"]):
        cpu = r.get("thread_cpu_ms")
        cells = ([r.get("reports", "whole"), f"{r['commit_s']:.3f} s", f"{r['cpu_ms_per_node_per_save']:.0f} ms",
                  f"{cpu['rank0']:.0f} / {cpu['leader']:.0f} / {cpu['other']:.0f} ms" if cpu else "–",
                  f"{r['store_host_cpu_s_per_save']:.3f} s", f"{r['manifest_mb']:.1f} MB", first_save(r)]
                 if "commit_s" in r else ["", r.get("error", "?")[:80], "", "", "", "", ""])
        if "reports_mb_per_save" in r:
            cells[0] += f", {r['reports_mb_per_save']:.2f} MB"
        lines.append(f"| {r['nodes']} x {r['ranks_per_node']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_commit_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="8,32,128")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--tensors", type=int, default=100, help="parameters per rank (each with two Adam moments)")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--rng-in", choices=("none", "file", "manifest"), default="none",
                   help="each rank's generator states (seeded differently): none, in its data file, in the manifest")
    p.add_argument("--whole", action="store_true",
                   help="every rank sends its report whole at every save (as before resilient/_report_memo.py)")
    add_run_options(p)
    args = p.parse_args(argv)
    if rendered_or_moved(args, render, "benchmarks.bench_commit_scale", argv):
        return
    os.makedirs(SHM, exist_ok=True)
    results: list[dict[str, Any]] = []
    try:
        for nodes in (int(x) for x in args.nodes.split(",") if x):
            try:
                result = run_case(nodes, args.ranks_per_node, args.tensors, args.saves, args.procs, args.rng_in,
                                  args.whole)
            except Exception as exc:  # noqa: BLE001 - a size this machine cannot hold
                result = {"nodes": nodes, "ranks_per_node": args.ranks_per_node,
                          "ranks": nodes * args.ranks_per_node, "error": f"{type(exc).__name__}: {exc}"}
            results.append(result)
            print(json.dumps(result), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        for name in os.listdir(SHM):
            os.unlink(os.path.join(SHM, name))
        os.rmdir(SHM)
    print(render(results))


if __name__ == "__main__":
    main()
