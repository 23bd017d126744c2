"""What a save's manifest costs as the job grows: its size, rank 0's work to assemble it, and
each restoring rank's work to read it and plan its reads.

    python -m benchmarks.bench_manifest [--ranks 128,1024,8192] [--tensors 100]
                                        [--rng distinct] [--rng-in file] [--repeats 3] [--tp 1]
                                        [--json PATH] [--render PATH]
                                        [--no-netns]

Every rank of an FSDP job reports what ``bench_commit_scale`` has it report (a shard of each
of ``--tensors`` parameters and their two Adam moments, about 1 GB, a chunk per shard in its
data file, as resilient writes them, the chunk table after them; its tree; with ``--tp``, on a 2-D mesh: FSDP over row-wise tensor parallel), plus its random
generators' state as ``capture_rng`` takes it: ``--rng distinct``
seeds each rank's generators differently (the larger manifest), ``same`` seeds them alike
(what most data-parallel scripts do); ``--rng-in file`` puts them where resilient does, in the
rank's data file, ``manifest`` where format 2 did. Measured in this process, CPU time, median of
``--repeats``: **encode** (one rank's ``encode_report``: its report encoded and deflated),
**assemble** (rank 0's ``published_manifest``: every report inflated, the manifest assembled
and deflated), at a job's first save, when every report comes whole, and at every save
after it, when each rank leaves out what rank 0 holds from the save before: its tensors,
tree and boxes (``resilient/_report_memo.py``; the two manifests are checked alike but for
their step; the JSON also has the figures for trees holding a value that changes at every
save, ``*_again_tree_*``: those trees are sent again), the **manifest** (bytes each node's
disk holds, and deflated, what the store sends to each leader), **decode** (``decode_manifest``: parse and
validate, on every restoring rank) and **plan** (one restoring rank finding, for each of its
tensors, the saved boxes its shard meets: what ``_restore._fill`` does before it reads).
The last two are what every rank of a restore spends before the first byte is read; with
eight ranks a node, eight times that of the node's CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any, Callable

from benchmarks.bench_commit_scale import fsdp_report, rng_state, as_sent
from benchmarks.bench_scale import add_run_options, rendered_or_moved
from resilient._commit import encode_report, published_manifest, received_manifest
from resilient._format import decode_manifest
from resilient._report_memo import HeldPieces, SentPieces
from resilient._layout import Box, intersect
from resilient._restore import _along_first_dim


def cpu_s(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median CPU seconds of ``fn()`` over ``repeats`` runs, and its last result."""
    samples, out = [], None
    for _ in range(repeats):
        out = None
        gc.collect()
        start = time.process_time()
        out = fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples), out


def same_but_step(first: bytes, later: bytes) -> bool:
    """Two saves' manifests alike but for their step and the time they were made."""
    a, b = json.loads(first), json.loads(later)
    return {**a, "step": 0, "created": 0} == {**b, "step": 0, "created": 0}


def plan(manifest: dict[str, Any], rank: int, world: int, tp: int = 1) -> int:
    """How many saved boxes rank ``rank`` of ``world`` reads from, planning its shard of
    every tensor (on the same mesh) as ``_restore._fill`` does."""
    met = 0
    dp_index, tp_index = divmod(rank, tp)
    for meta in manifest["tensors"].values():
        rows, cols = meta["shape"][0] // (world // tp), meta["shape"][1] // tp
        target = Box((rows * dp_index, cols * tp_index), (rows, cols))
        for saved in _along_first_dim(meta["boxes"], target):
            if intersect(Box(tuple(saved["offsets"]), tuple(saved["sizes"])), target) is not None:
                met += 1
    return met


def with_tensor_parallel(report: dict[str, Any], world: int, tp: int) -> dict[str, Any]:
    """``fsdp_report``'s rank on a 2-D mesh instead: FSDP over ``world // tp`` ranks, row-wise
    tensor parallel over ``tp`` (rank r = dp * tp + its tp index): its box is the rows of its
    dp index and the columns of its tp index."""
    dp_index, tp_index = divmod(report["rank"], tp)
    for meta in report["meta"].values():
        rows, cols = meta["shape"][0] // world, meta["shape"][1]
        meta["shape"] = [rows * (world // tp), cols * tp]
    for shard in report["shards"]:
        rows, cols = shard[2]
        shard[1] = [rows * dp_index, cols * tp_index]
    report["signature"] += f"-tp{tp}"
    return report


def run_case(world: int, tensors: int, distinct: bool, repeats: int, tp: int = 1,
             rng_in: str = "file") -> dict[str, Any]:
    reports = []
    for r in range(world):
        report = fsdp_report(r, world, tensors)
        if tp > 1:
            report = with_tensor_parallel(report, world, tp)
        reports.append(as_sent(report, rng_state(r, distinct), rng_in))
    encode_s, _ = cpu_s(lambda: encode_report(reports[world // 2]), repeats)
    # what each rank sends rank 0 at a job's first save: encoded, deflated, whole
    sent, held = [SentPieces() for _ in range(world)], HeldPieces()
    raws = [encode_report(r, s) for r, s in zip(reports, sent)]
    report_kb = len(raws[world // 2]) / 1e3
    assemble, outcome = cpu_s(lambda: published_manifest(7, raws, "none", held), repeats)
    for memo in (held, *sent):  # save 7 committed everywhere
        memo.settled(True)
    # every save after it: the same tensors, tree and boxes, left out (the file's record,
    # which does change, is sent as at the first)
    raws = [encode_report(r, s) for r, s in zip(reports, sent)]
    again_kb = len(raws[world // 2]) / 1e3
    assemble_again, again = cpu_s(lambda: published_manifest(8, raws, "none", held), repeats)
    # the same, but every rank's tree holds a value that changes at every save (a step
    # counter, a scheduler's state): the tree is sent whole again
    for report in reports:
        report["tree"]["items"].append(["step", {"t": "v", "v": 8}])
    raws = [encode_report(r, s) for r, s in zip(reports, sent)]
    tree_kb = len(raws[world // 2]) / 1e3
    assemble_tree, _ = cpu_s(lambda: published_manifest(8, raws, "none", held), repeats)
    del raws, held, reports, sent
    manifest, deflated = received_manifest(outcome), len(outcome) - 1
    assert same_but_step(manifest, received_manifest(again)), "the manifest of a save sent in part differs"
    decode, decoded = cpu_s(lambda: decode_manifest(manifest, "bench"), repeats)
    planned, met = cpu_s(lambda: plan(decoded, world // 2, world, tp), repeats)
    assert met == 3 * tensors, f"rank {world // 2} met {met} saved boxes, expected {3 * tensors}"
    return {"ranks": world, "tp": tp, "tensors": 3 * tensors, "rng": "distinct" if distinct else "same",
            "rng_in": rng_in, "report_kb": round(report_kb, 1), "report_again_kb": round(again_kb, 2),
            "encode_ms": round(encode_s * 1e3, 2), "assemble_s": round(assemble, 3),
            "assemble_again_s": round(assemble_again, 3),
            "report_again_tree_kb": round(tree_kb, 2), "assemble_again_tree_s": round(assemble_tree, 3),
            "manifest_mb": round(len(manifest) / 1e6, 2), "deflated_mb": round(deflated / 1e6, 2),
            "decode_s": round(decode, 3), "plan_s": round(planned, 4)}


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| ranks | manifest (deflated) | rank 0: assemble, first save / every save after | every restoring rank:"
             " decode + plan | a rank: encode its report (its size, deflated: first save / after) |",
             "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["ranks"]):
        if "error" in r:
            lines.append(f"| {r['ranks']} | {r['error'][:80]} | | | |")
            continue
        again = f" / {r['assemble_again_s']:.3f} s" if "assemble_again_s" in r else ""
        size = f"{r['report_kb']:.1f} kB" if "report_kb" in r else ""
        size += f" / {r['report_again_kb']:.2f} kB" if "report_again_kb" in r else ""
        lines.append(f"| {r['ranks']} | {r['manifest_mb']:.2f} MB ({r['deflated_mb']:.2f} MB) | "
                     f"{r['assemble_s']:.3f} s{again} | {r['decode_s']:.3f} + {r['plan_s']:.3f} s | "
                     f"{r['encode_ms']:.1f} ms" + (f" ({size})" if size else "") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_manifest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="128,1024,8192")
    p.add_argument("--tensors", type=int, default=100, help="parameters per rank (each with two Adam moments)")
    p.add_argument("--rng", choices=("distinct", "same"), default="distinct")
    p.add_argument("--rng-in", choices=("file", "manifest"), default="file",
                   help="where the generator states go: the rank's data file (format 3) or the manifest (format 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="row-wise tensor parallel degree (a 2-D mesh with FSDP)")
    add_run_options(p)  # --no-netns: nothing here uses the network, but the options are one set
    args = p.parse_args(argv)
    if rendered_or_moved(args, render, "benchmarks.bench_manifest", argv):
        return
    results: list[dict[str, Any]] = []
    for world in (int(x) for x in args.ranks.split(",") if x):
        try:
            result = run_case(world, args.tensors, args.rng == "distinct", args.repeats, args.tp, args.rng_in)
        except MemoryError as exc:  # a size this machine cannot hold
            result = {"ranks": world, "error": f"MemoryError: {exc}"}
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(render(results))


if __name__ == "__main__":
    main()
