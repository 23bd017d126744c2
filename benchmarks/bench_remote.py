"""The remote tier against plain s3fs and DCP's fsspec reader, on moto's S3 server (loopback).

    python -m benchmarks.bench_remote [--gb 0.5]

Upload: time from a committed local checkpoint to the remote commit record (``flush``),
against one plain ``s3fs`` put of the same bytes. Restore on a node with an empty disk
(download + load) against ``torch.distributed.checkpoint.load`` with its fsspec reader from
the same server. Plus the slowdown of a matmul training step while an upload runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid

import fsspec
import torch

from benchmarks.bench_checkpoint import build_state, zero_state
from benchmarks.common import GB, mean_step_seconds
from tests.launch import free_port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.5, help="state size in GB (default: %(default)s)")
    a = p.parse_args()
    from moto.server import ThreadedMotoServer

    from resilient import Checkpointer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    fs = fsspec.filesystem("s3", **opts)
    fs.mkdir("bench")
    state = build_state(int(a.gb * GB), 1, "replicated")
    nbytes = int(a.gb * GB)
    work = tempfile.mkdtemp(prefix="resilient-remote-")
    try:
        # plain put of the same bytes (one file)
        blob = os.path.join(work, "blob.bin")
        with open(blob, "wb") as f:
            for t in [*state["model"].values(), *(v for s in state["optim"]["state"].values() for v in s.values())]:
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        t0 = time.perf_counter()
        fs.put_file(blob, "bench/plain/blob.bin")
        put = time.perf_counter() - t0

        url = f"s3://bench/run-{uuid.uuid4().hex[:6]}"
        with Checkpointer(os.path.join(work, "a"), remote=url, storage_options=opts, rng=False) as ckpt:
            ckpt.save(1, state).result()
            t0 = time.perf_counter()
            ckpt.flush()
            upload = time.perf_counter() - t0
            # step slowdown while an upload runs
            ckpt.save(2, state).result()
            idle = mean_step_seconds(lambda: False, 20)
            busy = mean_step_seconds(lambda: not ckpt._uploader.pending(), 10_000)
            ckpt.flush()
        zero_state(state)
        t0 = time.perf_counter()
        with Checkpointer(os.path.join(work, "empty-disk"), remote=url, storage_options=opts, rng=False) as ckpt:
            ckpt.restore(state)
        restore = time.perf_counter() - t0

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        dcp_url = f"s3://bench/dcp-{uuid.uuid4().hex[:6]}"
        dcp.save(state, storage_writer=FsspecWriter(dcp_url, **opts), no_dist=True)
        zero_state(state)
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=FsspecReader(dcp_url, **opts), no_dist=True)
        dcp_restore = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()
    print(f"state {a.gb:g} GB, moto S3 server on 127.0.0.1\n")
    print("| figure | resilient | anchor | ratio |\n|---|---|---|---|")
    print(f"| upload (flush of a committed step) vs one s3fs put | {upload:.2f} s ({nbytes / upload / GB:.2f} GB/s) "
          f"| {put:.2f} s ({nbytes / put / GB:.2f} GB/s) | {put / upload * 100:.0f}% of the put's throughput |")
    print(f"| restore on an empty disk vs DCP FsspecReader | {restore:.2f} s | {dcp_restore:.2f} s "
          f"| {dcp_restore / restore:.2f}× faster |")
    print(f"| matmul step slowdown while uploading | {busy / idle:.2f}× | – | – |")


if __name__ == "__main__":
    main()
