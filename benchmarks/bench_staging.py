"""Overlapped staging: how long a save holds the training thread, and the step after it.

    python -m benchmarks.bench_staging --device cuda --sizes 8,32     # on a GPU machine
    python -m benchmarks.bench_staging --device cpu --sizes 0.5       # the same logic on the CPU

The state is a model of large fp32 matrices with Adam (parameters + two moments = the
size given). A training step reads every parameter (forward), runs a fixed amount of
compute (a matmul chain standing in for the rest of forward and backward) and then
``optimizer.step()``. For each method the script saves, then runs the next step at once,
and reports:

- ``stall``: time inside the save call (the training thread is held);
- ``gate``: time the next optimizer step waited for the copy (resilient's fence; for DCP,
  ``staging_completion``, which training must wait for before it writes the state);
- ``next step``: the step right after the save, against a step without one;
- ``durable``: from the call until the checkpoint is on disk (resilient: committed; DCP:
  its upload future done), the step after the save running meanwhile.

The limit is measured in the same run: the device-to-host copy of the whole state into
pinned memory (``d2h``; on the CPU a memcpy). Target: stall ≤ 0.1 × d2h.
Methods: resilient ``staging="overlap"``, resilient ``staging="sync"``, and DCP
``async_save`` with ``DefaultStager`` (pinned, asynchronous staging, non-blocking copies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.common import GB

N_MATRICES = 24


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(gb: float, device: str) -> tuple[torch.nn.ParameterList, torch.optim.Optimizer]:
    """Parameters of gb/3 bytes (fp32, in N_MATRICES matrices) and Adam with its moments."""
    cols = 4096
    rows = max(1, int(gb * GB / 3 / 4 / N_MATRICES / cols))
    params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(rows, cols, device=device) * 0.01) for _ in range(N_MATRICES)])
    optim = torch.optim.Adam(params.parameters(), lr=1e-4, foreach=True)
    return params, optim


def make_step(params: torch.nn.ParameterList, optim: torch.optim.Optimizer, device: str,
              compute: int) -> Callable[[], None]:
    n = 4096 if device == "cuda" else 256
    a = torch.randn(n, n, device=device)

    def step() -> None:
        optim.zero_grad(set_to_none=False)
        loss = sum((p * 1e-3).square().mean() for p in params)  # forward reads every parameter
        h = a
        for _ in range(compute):  # the rest of forward and backward
            h = torch.tanh(h @ a)
        (loss + h.mean() * 0).backward()
        optim.step()
    return step


def timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def d2h_seconds(optim: torch.optim.Optimizer, device: str) -> float:
    """The whole state (parameters and moments) copied once into touched host memory, of
    the kind resilient stages into (on CUDA: locked at exactly its size, and unlocked
    after, so the probe leaves nothing cached in torch's pinned allocator)."""
    from resilient._hostmem import HostBuffer

    tensors = [p for g in optim.param_groups for p in g["params"]]
    tensors += [t for st in optim.state.values() for t in st.values() if t.dim() > 0]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    memory = HostBuffer(nbytes, pin=device == "cuda")
    host = memory.tensor.fill_(0)

    def copy() -> None:
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            host[pos:pos + n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=device == "cuda")
            pos += n
    times = [timed(copy, device) for _ in range(3)]
    memory.release()
    del host, memory
    return statistics.median(times)


def checkpoints_on_disk(method: str) -> int:
    """How many checkpoints a method holds on disk at its peak: resilient keeps the last
    committed one while it writes the next; this script deletes DCP's after each save."""
    return 2 if method.startswith("resilient") else 1


def disk_room(base: str, state_bytes: int, method: str) -> str:
    """``"full"``: room for the method's peak; ``"one"``: for one checkpoint only (resilient
    then keeps none: this script deletes each committed step before the next save, so its
    files are written new instead of recycled); ``"none"``."""
    free = shutil.disk_usage(base).free
    margin = 1.05  # manifests, file-system overhead
    if free >= checkpoints_on_disk(method) * state_bytes * margin:
        return "full"
    return "one" if free >= state_bytes * margin else "none"


def measure(method: str, root: str, params: torch.nn.ParameterList, optim: torch.optim.Optimizer,
            step: Callable[[], None], device: str, repeats: int, room: str = "full") -> dict[str, float]:
    from resilient import Checkpointer
    from resilient._format import step_dir_name

    state = {"model": params, "optim": optim}
    ckpt = stager = None
    if method.startswith("resilient"):
        ckpt = Checkpointer(root, keep=1 if room == "full" else None, rng=False, staging=method.split(":")[1])
    else:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(device == "cuda", False, True, device == "cuda"))
    stalls, gates, nexts, durables = [], [], [], []
    for i in range(1 + repeats):  # the first save is a warm-up (buffers, threads)
        step()
        _sync(device)
        t0 = time.perf_counter()
        if ckpt is not None:
            waited = ckpt.stats["staging_wait_s"]
            handle = ckpt.save(i + 1, state, force=True)
            stall = time.perf_counter() - t0
            nxt = timed(step, device)
            gate = ckpt.stats["staging_wait_s"] - waited
            handle.result()
            durable = handle.committed_at - t0
            if room != "full":
                shutil.rmtree(os.path.join(root, step_dir_name(i + 1)))
        else:
            import torch.distributed.checkpoint as dcp

            response = dcp.async_save(state_dict_of(params, optim), checkpoint_id=os.path.join(root, f"s{i}"),
                                      async_stager=stager)
            stall = time.perf_counter() - t0
            uploaded: list[float] = []  # stamped by the thread that completes the upload
            response.upload_completion.add_done_callback(lambda _: uploaded.append(time.perf_counter()))

            def gated_step() -> float:
                g = time.perf_counter()
                response.staging_completion.result()  # before anything writes the state
                waited = time.perf_counter() - g
                step()
                return waited
            t1 = time.perf_counter()
            gate = gated_step()
            _sync(device)
            nxt = time.perf_counter() - t1
            response.upload_completion.result()
            durable = uploaded[0] - t0
            shutil.rmtree(os.path.join(root, f"s{i}"), ignore_errors=True)
        if i:
            stalls.append(stall)
            gates.append(gate)
            nexts.append(nxt)
            durables.append(durable)
    if ckpt is not None:
        ckpt.close()
    if stager is not None:
        stager.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"stall": statistics.median(stalls), "gate": statistics.median(gates), "next": statistics.median(nexts),
            "durable": statistics.median(durables)}


def state_dict_of(params: torch.nn.ParameterList, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": params.state_dict(), "optim": optim.state_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="8,32", help="state sizes in GB (default: %(default)s)")
    p.add_argument("--methods", default="resilient:overlap,resilient:sync,dcp.async_save+DefaultStager")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compute", type=int, default=40, help="matmuls per step (default: %(default)s)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    base = a.dir or tempfile.mkdtemp(prefix="resilient-staging-")
    rows = []
    print("| state | method | stall | stall ÷ d2h | next optimizer step waited | next step ÷ plain step | durable |")
    print("|---|---|---|---|---|---|---|")
    for gb in [float(s) for s in a.sizes.split(",")]:
        params, optim = build(gb, a.device)
        step = make_step(params, optim, a.device, a.compute)
        for _ in range(2):  # warm-up: allocations, the optimizer's state
            step()
        d2h = d2h_seconds(optim, a.device)
        plain = statistics.median(timed(step, a.device) for _ in range(5))
        print(f"| {gb:g} GB | (limit) d2h copy of the state | {d2h:.3f} s | 1 | – | plain step {plain:.3f} s | – |",
              flush=True)
        state_bytes = sum(t.numel() * t.element_size() for t in params.parameters()) * 3
        for method in a.methods.split(","):
            room = disk_room(base, state_bytes, method)
            if room == "none":
                print(f"| {gb:g} GB | {method} | skipped: {shutil.disk_usage(base).free / GB:.1f} GB free at "
                      f"{base}, a checkpoint takes {state_bytes / GB:.1f} GB | | | | |", flush=True)
                continue
            r = measure(method, os.path.join(base, method.replace(":", "-").replace("+", "_")), params, optim,
                        step, a.device, a.repeats, room)
            rows.append({"gb": gb, "device": a.device, "method": method, "d2h": d2h, "plain_step": plain,
                         "disk_room": room, **r})
            note = "" if room == "full" else " (disk holds one checkpoint: files new, not recycled)"
            print(f"| {gb:g} GB | {method}{note} | {r['stall']:.4f} s | {r['stall'] / d2h:.3f} | {r['gate']:.3f} s | "
                  f"{r['next'] / plain:.2f} | {r['durable']:.3f} s |", flush=True)
            if a.json:  # after every row: a run cut short keeps what it measured
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
        del params, optim, step
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
