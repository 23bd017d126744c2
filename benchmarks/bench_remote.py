"""The remote tier against plain s3fs transfers and DCP's fsspec reader, on moto's S3 server
(loopback), at 1 and 2 ranks on this one node.

    python -m benchmarks.bench_remote [--gb 0.5] [--worlds 1,2] [--rounds 3] [--json PATH] [--render PATH]

Upload: time from a committed local checkpoint to the remote commit record (``flush``),
against one plain ``s3fs`` put of the same bytes (the upload limit). Restore on a node
with an empty disk (download + load, every rank until the slowest is done) against the
faster of two plain downloads of the same bytes (one get; 8 concurrent ranged gets): the
download limit, since the node needs each byte once; and against
``torch.distributed.checkpoint.load`` with its fsspec reader from the same server. The
methods take turns in each round, in a rotating order, because the server shares this
machine's cores and its speed drifts. At one rank, also the slowdown of a matmul training
step while an upload runs, against its slowdown while a plain put of the same bytes runs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import fsspec
import torch
import torch.distributed as dist

from benchmarks.bench_checkpoint import _barrier, _on_rank0, _rotated, _timed_together, build_state, zero_state
from benchmarks.common import GB, mean_step_seconds, rendered, worker_results
from resilient.devservices import free_port

PLAIN, PLAIN_RANGES, RESILIENT, DCP = "plain get", "plain ranged gets", "resilient", "dcp.load (FsspecReader)"
PUT, UPLOAD = "plain put", "resilient flush"
#: concurrent ranged GETs of the second download limit (resilient fetches a step's files, and
#: the spans of each, with up to 8 requests in flight)
STREAMS = 8


def _state_bytes(state: dict[str, Any]) -> list[torch.Tensor]:
    return [*state["model"].values(), *(v for s in state["optim"]["state"].values() for v in s.values())]


def _fingerprint(state: dict[str, Any]) -> float:
    """A sum over every tensor: a restore that missed or garbled bytes changes it."""
    return float(sum(t.double().sum() for t in _state_bytes(state)))


def worker(args: dict[str, Any]) -> None:
    """One rank: ``rounds`` rounds of the two uploads, then of the four restores (with the
    plain downloads)."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from resilient import Checkpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    opts, work = args["options"], args["work"]
    fs = fsspec.filesystem("s3", **opts)
    state = build_state(int(args["gb"] * GB), world, "replicated")
    expected = _fingerprint(state)
    blob, plain = os.path.join(work, "blob.bin"), f"{args['bucket']}/plain-{world}/blob.bin"

    def write_blob() -> None:
        with open(blob, "wb") as f:
            for t in _state_bytes(state):
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    _on_rank0(rank, write_blob)
    out: dict[str, Any] = {"rank": rank, "world": world, "gb": args["gb"], "rounds": args["rounds"],
                           "nbytes": os.path.getsize(blob)}
    url, dcp_url = args["url"], args["dcp_url"]  # the same on every rank
    node_root = os.path.join(work, "node")  # one directory: the ranks share this node's disk
    uploads: dict[str, list[float]] = {PUT: [], UPLOAD: []}
    with Checkpointer(node_root, remote=url, storage_options=opts, rng=False) as ckpt:

        def upload(step: int) -> float:
            ckpt.save(step, state).result()  # committed locally; the upload is what is timed
            return _timed_together(ckpt.flush)

        for rnd in range(args["rounds"]):
            for name in _rotated(list(uploads), rnd):
                uploads[name].append(_timed_together(lambda: _on_rank0(rank, lambda: fs.put_file(blob, plain)))
                                     if name == PUT else upload(rnd + 1))
        if world == 1:
            out.update(_step_slowdowns(ckpt, state, args["rounds"], lambda: fs.put_file(blob, plain)))
    out["put_s"], out["upload_s"] = statistics.median(uploads[PUT]), statistics.median(uploads[UPLOAD])
    out["upload_samples_s"] = uploads
    save(state, storage_writer=FsspecWriter(dcp_url, **opts))

    def restore_resilient(where: str) -> None:
        with Checkpointer(where, remote=url, storage_options=opts, rng=False) as ckpt:
            ckpt.restore(state)

    times: dict[str, list[float]] = {PLAIN: [], PLAIN_RANGES: [], RESILIENT: [], DCP: []}
    for rnd in range(args["rounds"]):
        empty = os.path.join(work, f"empty-{rnd}")
        runs: dict[str, Callable[[], None]] = {
            PLAIN: lambda: _on_rank0(rank, lambda: fs.get_file(plain, blob)),
            PLAIN_RANGES: lambda: _on_rank0(rank, lambda: _ranged_get(fs, plain, blob, out["nbytes"])),
            RESILIENT: lambda: restore_resilient(empty),
            DCP: lambda: load(state, storage_reader=FsspecReader(dcp_url, **opts)),
        }
        for name in _rotated(list(runs), rnd):
            zero_state(state)
            _barrier()
            times[name].append(_timed_together(runs[name]))
            if name in (RESILIENT, DCP) and abs(_fingerprint(state) - expected) > 1e-6 * abs(expected) + 1e-3:
                sys.exit(f"rank {rank}: {name} restored different values in round {rnd}")
        _barrier()
        _on_rank0(rank, lambda: shutil.rmtree(empty, ignore_errors=True))
    out["restore_s"] = {name: statistics.median(ts) for name, ts in times.items()}
    out["restore_samples_s"] = times
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _step_slowdowns(ckpt: Any, state: dict[str, Any], rounds: int, put: Callable[[], None]) -> dict[str, Any]:
    """A matmul step's slowdown while resilient uploads a step, and while a plain put of
    the same bytes runs (in a thread, as the uploader does): how much of the first the
    transfer itself costs, since the S3 server shares this machine's cores. Medians of
    ``rounds``, the two taking turns."""
    slowdowns: dict[str, list[float]] = {UPLOAD: [], PUT: []}
    for rnd in range(rounds):
        for name in _rotated(list(slowdowns), rnd):
            if name == UPLOAD:
                ckpt.save(1000 + rnd, state).result()
                idle = mean_step_seconds(lambda: False, 20)
                busy = mean_step_seconds(lambda: not ckpt._uploader.pending(), 10_000)
                ckpt.flush()
            else:
                idle = mean_step_seconds(lambda: False, 20)
                with ThreadPoolExecutor(1) as pool:
                    putting = pool.submit(put)
                    busy = mean_step_seconds(putting.done, 10_000)
                    putting.result()
            slowdowns[name].append(busy / idle)
    return {"slowdown": statistics.median(slowdowns[UPLOAD]), "put_slowdown": statistics.median(slowdowns[PUT]),
            "slowdown_samples": slowdowns}


def _ranged_get(fs: Any, src: str, dst: str, nbytes: int) -> None:
    """Download ``src`` into ``dst`` as ``STREAMS`` concurrent ranged GETs."""
    part = -(-nbytes // STREAMS)
    with open(dst, "wb") as f:
        f.truncate(nbytes)

    def one(lo: int) -> None:
        data = fs.cat_file(src, start=lo, end=min(nbytes, lo + part))
        with open(dst, "r+b") as f:
            f.seek(lo)
            f.write(data)

    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(one, range(0, nbytes, part)))


def _seconds(action: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.5, help="state size in GB (default: %(default)s)")
    p.add_argument("--worlds", default="1,2", help="ranks on this node, comma separated (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the uploads, then of the restores (medians; default: %(default)s)")
    p.add_argument("--json", default=None, help="write the rows here as well")
    p.add_argument("--render", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    a = p.parse_args()
    if rendered(a.render, table):
        return
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    fsspec.filesystem("s3", **opts).mkdir("bench")
    rows = []
    try:
        for world in [int(w) for w in a.worlds.split(",")]:
            work = tempfile.mkdtemp(prefix="resilient-remote-")
            try:
                tag = f"{world}-{uuid.uuid4().hex[:6]}"
                args = {"gb": a.gb, "rounds": a.rounds, "options": opts, "bucket": "bench", "work": work,
                        "url": f"s3://bench/run-{tag}", "dcp_url": f"s3://bench/dcp-{tag}"}
                results = worker_results("benchmarks.bench_remote", world, args, timeout=1800)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if None in results:
                sys.exit(f"worker rank {results.index(None)} reported no result")
            rows.append(results[0])  # rank 0's: every timing is already the slowest rank's
            print(_rows(rows[-1]), flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        server.stop()
    print("\n" + table(rows))


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"state {rows[0]['gb']:g} GB, moto S3 server on 127.0.0.1, medians of {rows[0]['rounds']} rounds\n\n"
            "| ranks | figure | resilient | limit or anchor | ratio |\n|---|---|---|---|---|")
    return "\n".join([head, *(_rows(row) for row in rows)])


def _rows(row: dict[str, Any]) -> str:
    n, r = row["world"], row["restore_s"]
    rate = row["nbytes"] / GB
    get = min(r[PLAIN], r[PLAIN_RANGES])
    how = "one stream" if r[PLAIN] <= r[PLAIN_RANGES] else f"{STREAMS} ranged streams"
    lines = [
        f"| {n} | upload (`flush` of a committed step) vs one plain s3fs put | {row['upload_s']:.2f} s "
        f"| {row['put_s']:.2f} s | {row['put_s'] / row['upload_s'] * 100:.0f}% of the put's throughput |",
        f"| {n} | restore on an empty disk vs the faster plain s3fs download of the same bytes "
        f"(one get: {r[PLAIN]:.2f} s; {STREAMS} ranged gets: {r[PLAIN_RANGES]:.2f} s) | {r[RESILIENT]:.2f} s "
        f"({rate / r[RESILIENT]:.2f} GB/s) | {get:.2f} s ({how}) | {get / r[RESILIENT] * 100:.0f}% of its throughput |",
        f"| {n} | restore on an empty disk vs DCP's FsspecReader | {r[RESILIENT]:.2f} s | {r[DCP]:.2f} s "
        f"| {r[DCP] / r[RESILIENT]:.2f}× faster |",
    ]
    if "slowdown" in row:
        put = row.get("put_slowdown")
        anchor = "– | –" if put is None else f"{put:.2f}× (a plain s3fs put of the same bytes) | " \
            f"{(row['slowdown'] - 1) / max(put - 1, 1e-9):.2f}× the put's extra step time"
        lines.append(f"| {n} | matmul step slowdown while uploading | {row['slowdown']:.2f}× | {anchor} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
