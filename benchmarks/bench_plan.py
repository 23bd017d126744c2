"""Planning a save's layout at scale, against DCP's global plan, in one process.

    python -m benchmarks.bench_plan [--ranks 64,256,1024] [--tensors 300,26800]
                                    [--layouts replicated,sharded] [--rounds 3] [--json PATH]
                                    [--render PATH ...]

The first save of a layout (and the first after it changes) is planned together: every
rank describes what it holds, the descriptions are gathered, and every rank works out the
same global decisions from them (which rank writes which bytes, the manifest's tensors,
the checks that refuse state that differs by rank). What that costs grows with ranks x
tensors, so it is measured here where a real job cannot be: ``--ranks`` descriptions made
as ``gather_descriptions`` gives them to a rank (ranks holding the same list of plain
tensors share one object), and rank 0's ``plan_rank`` over them, timed.

Layouts: ``replicated`` (DDP: every rank holds every tensor whole), ``sharded`` (FSDP2:
every rank a row shard of every tensor, as DTensors). Each tensor is 64 x 64 fp32 globally.

The anchor, in the same run: DCP's planning of the same state, ``DefaultSavePlanner
.create_global_plan`` over every rank's local plan (what its coordinator runs, deduplicating
replicated items), timed the same way. Also given: the bytes the planning's gathers bring
to a rank (resilient: every rank's boxes and a digest, then each distinct list of plain
tensors once; DCP: every rank's pickled local plan, to its coordinator).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from typing import Any

import torch

from resilient import _plan
from resilient._plan import plan_rank

SIDE = 64


def _descriptions(ranks: int, tensors: int, layout: str) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], int]:
    """(rank 0's tensors, every rank's description as gathered, the bytes gathered to a rank)."""
    rows = max(1, SIDE // ranks) if layout == "sharded" else SIDE
    own = {f"model/layers.{i}.weight": torch.zeros(rows, SIDE) for i in range(tensors)}
    empty: dict[str, Any] = {"own": [], "aliases": []}
    if layout == "replicated":
        plain = [[name, 1234567, "float32", [SIDE, SIDE]] for name in own]
        descriptions = [{**empty, "sharded": [], "boxes": [], "plain": plain} for _ in range(ranks)]
    else:  # every rank's list is one object, as gather_descriptions hands it out; one class
        sharded = [[name, "float32", [rows * ranks, SIDE], 0] for name in own]
        descriptions = [{**empty, "sharded": sharded, "boxes": [[[r * rows, 0], [rows, SIDE]]], "plain": []}
                        for r in range(ranks)]
    digest = "0" * 64
    heads = [{**d, "sharded": digest, "plain": digest} for d in descriptions]
    lists = [{"sharded": descriptions[0]["sharded"], "plain": descriptions[0]["plain"]}] + [{}] * (ranks - 1)
    moved = len(pickle.dumps(heads)) + len(pickle.dumps(lists))
    return own, descriptions, moved


def _dcp_plans(ranks: int, tensors: int, layout: str) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    rows = max(1, SIDE // ranks) if layout == "sharded" else SIDE
    properties = TensorProperties(dtype=torch.float32)

    def item(i: int, rank: int) -> WriteItem:
        offset = torch.Size([rank * rows if layout == "sharded" else 0, 0])
        chunk = ChunkStorageMetadata(offsets=offset, sizes=torch.Size([rows, SIDE]))
        size = torch.Size([rows * ranks if layout == "sharded" else SIDE, SIDE])
        kind = WriteItemType.SHARD if layout == "sharded" else WriteItemType.TENSOR
        return WriteItem(index=MetadataIndex(f"model.layers.{i}.weight", offset), type=kind,
                         tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=size))

    return [SavePlan([item(i, r) for i in range(tensors)], planner_data={}) for r in range(ranks)]


def _timed(fn: Any, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _mark_dtensors(layout: str) -> None:
    """The sharded layout's tensors stand for DTensors (their boxes are in the descriptions)."""
    real = _plan.__dict__.setdefault("_real_is_dtensor", _plan.is_dtensor)
    _plan.is_dtensor = (lambda t: True) if layout == "sharded" else real  # type: ignore[assignment]


def run_case(ranks: int, tensors: int, layout: str, rounds: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    own, descriptions, moved = _descriptions(ranks, tensors, layout)
    _mark_dtensors(layout)
    try:
        ours = _timed(lambda: plan_rank(own, set(), descriptions, 0, ranks), rounds)
    finally:
        _mark_dtensors("replicated")
    plans = _dcp_plans(ranks, tensors, layout)
    dcp_moved = len(pickle.dumps(plans))
    dcp = _timed(lambda: DefaultSavePlanner(flatten_state_dict=False).create_global_plan(list(plans)), rounds)
    return {"ranks": ranks, "tensors": tensors, "layout": layout, "plan_s": ours, "dcp_plan_s": dcp,
            "gathered_bytes": moved, "dcp_gathered_bytes": dcp_moved}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| ranks | tensors | layout | resilient: plan (rank 0) | DCP: global plan | resilient: gathered to a rank "
             "| DCP: gathered to its coordinator |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['ranks']} | {r['tensors']:,} | {r['layout']} | {r['plan_s']:.3f} s "
                     f"({r['plan_s'] / r['dcp_plan_s']:.2f}×) | {r['dcp_plan_s']:.3f} s "
                     f"| {_mb(r['gathered_bytes'])} | {_mb(r['dcp_gathered_bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="64,256,1024")
    p.add_argument("--tensors", default="300,26800")
    p.add_argument("--layouts", default="replicated,sharded")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--render", nargs="+", default=None, metavar="PATH", help="print the table of earlier --json files")
    a = p.parse_args(argv)
    if a.render:
        rows = []
        for path in a.render:
            with open(path) as f:
                rows += json.load(f)
        print(render(rows))
        return 0
    results = []
    for layout in a.layouts.split(","):
        for tensors in map(int, a.tensors.split(",")):
            for ranks in map(int, a.ranks.split(",")):
                try:
                    results.append(run_case(ranks, tensors, layout, a.rounds))
                except MemoryError:
                    print(f"{ranks} ranks x {tensors} tensors ({layout}): out of memory here", file=sys.stderr)
                    continue
                print(render(results[-1:]).splitlines()[-1], flush=True)
                if a.json:  # after every case: a size that runs out of memory keeps the others'
                    with open(a.json, "w") as f:
                        json.dump(results, f, indent=1)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
