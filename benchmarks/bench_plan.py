"""Planning a save's layout at scale, against DCP's global plan, in one process.

    python -m benchmarks.bench_plan [--ranks 64,256,1024] [--tensors 300,26800] [--shapes 1]
                                    [--layouts replicated,sharded,hsdp] [--rounds 3]
                                    [--anchor-items N] [--json PATH]
                                    [--render PATH ...]

The first save of a layout (and the first after it changes) is planned together: every
rank describes what it holds, the descriptions are gathered, and every rank works out the
same global decisions from them (which rank writes which bytes, the manifest's tensors,
the checks that refuse state that differs by rank). What that costs grows with ranks x
tensors, so it is measured here where a real job cannot be: ``--ranks`` descriptions made
as ``gather_descriptions`` gives them to a rank (ranks holding the same list of tensors
share one object), and rank 0's ``plan_rank`` over them, timed.

Layouts: ``replicated`` (DDP: every rank holds every tensor whole), ``sharded`` (FSDP2:
every rank a row shard of every tensor, as DTensors), ``hsdp`` (each tensor sharded over 8
ranks and replicated over the rest: every shard's box has ranks / 8 holders, who share its
writing). Each tensor is 64 rows of fp32 globally (one row a rank where ranks outnumber
rows); ``--shapes`` N gives the tensors N shapes in turn (64, 65, ... columns), so N classes
of boxes (real models have tens: a layer's few shapes in two dtypes).

The anchor, in the same run: DCP's planning of the same state, ``DefaultSavePlanner
.create_global_plan`` over every rank's local plan (what its coordinator runs, deduplicating
replicated items), timed the same way. Also given: the bytes the planning's gathers bring
to a rank (resilient: every rank's boxes per class and digests, then each distinct list of
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


#: ranks over which the ``hsdp`` layout shards a tensor (the rest are its replicas)
HSDP_SHARDS = 8


def _box(layout: str, ranks: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows, global rows) of a tensor that ``rank`` holds in ``layout``."""
    if layout == "replicated":
        return 0, SIDE, SIDE
    over = ranks if layout == "sharded" else min(HSDP_SHARDS, ranks)
    rows = max(1, SIDE // over)
    return (rank % over) * rows, rows, rows * over


def _columns(i: int, shapes: int) -> int:
    """Tensor ``i``'s columns: ``shapes`` distinct shapes in turn (a class of boxes each)."""
    return SIDE + i % shapes


def _descriptions(ranks: int, tensors: int, layout: str,
                  shapes: int = 1) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], int]:
    """(rank 0's tensors, every rank's description as gathered, the bytes gathered to a rank)."""
    _, rows, total = _box(layout, ranks, 0)
    own = {f"model/layers.{i}.weight": torch.zeros(rows, _columns(i, shapes)) for i in range(tensors)}
    empty: dict[str, Any] = {"own": [], "aliases": []}
    if layout == "replicated":
        plain = [[name, 1234567, "float32", list(t.shape)] for name, t in own.items()]
        descriptions = [{**empty, "sharded": [], "boxes": [], "plain": plain} for _ in range(ranks)]
    else:  # every rank's list is one object, as gather_descriptions hands it out
        classes = min(shapes, tensors)
        sharded = [[name, "float32", [total, _columns(i, shapes)], i % shapes] for i, name in enumerate(own)]
        descriptions = [{**empty, "sharded": sharded, "plain": [],
                         "boxes": [[[_box(layout, ranks, r)[0], 0], [rows, _columns(c, shapes)]] for c in range(classes)]}
                        for r in range(ranks)]
    digest = "0" * 64
    heads = [{**d, "sharded": digest, "plain": digest} for d in descriptions]
    lists = [{"sharded": descriptions[0]["sharded"], "plain": descriptions[0]["plain"]}] + [{}] * (ranks - 1)
    moved = len(pickle.dumps(heads)) + len(pickle.dumps(lists))
    return own, descriptions, moved


def _dcp_plans(ranks: int, tensors: int, layout: str, shapes: int) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties(dtype=torch.float32)
    kind = WriteItemType.TENSOR if layout == "replicated" else WriteItemType.SHARD

    def item(i: int, rank: int) -> WriteItem:
        first, rows, total = _box(layout, ranks, rank)
        offset = torch.Size([first, 0])
        cols = _columns(i, shapes)
        chunk = ChunkStorageMetadata(offsets=offset, sizes=torch.Size([rows, cols]))
        return WriteItem(index=MetadataIndex(f"model.layers.{i}.weight", offset), type=kind,
                         tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=torch.Size([total, cols])))

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


def run_case(ranks: int, tensors: int, layout: str, rounds: int, anchor_items: int, shapes: int = 1) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    own, descriptions, moved = _descriptions(ranks, tensors, layout, shapes)
    _mark_dtensors(layout)
    try:
        ours = _timed(lambda: plan_rank(own, set(), descriptions, 0, ranks), rounds)
    finally:
        _mark_dtensors("replicated")
    result = {"ranks": ranks, "tensors": tensors, "shapes": shapes, "layout": layout, "plan_s": ours, "gathered_bytes": moved,
              "dcp_plan_s": None, "dcp_gathered_bytes": None}
    if ranks * tensors <= anchor_items:
        plans = _dcp_plans(ranks, tensors, layout, shapes)
        result["dcp_gathered_bytes"] = len(pickle.dumps(plans))
        result["dcp_plan_s"] = _timed(lambda: DefaultSavePlanner(flatten_state_dict=False).create_global_plan(
            list(plans)), rounds)
    return result


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| ranks | tensors (shapes) | layout | resilient: plan (rank 0) | DCP: global plan | resilient: gathered to a rank "
             "| DCP: gathered to its coordinator |", "|---|---|---|---|---|---|---|"]
    for r in results:
        dcp = r["dcp_plan_s"]
        ratio = f" ({r['plan_s'] / dcp:.2f}×)" if dcp else ""
        lines.append(f"| {r['ranks']} | {r['tensors']:,} ({r.get('shapes', 1)}) | {r['layout']} | {r['plan_s']:.3f} s{ratio} "
                     f"| {f'{dcp:.3f} s' if dcp else 'not run'} | {_mb(r['gathered_bytes'])} "
                     f"| {_mb(r['dcp_gathered_bytes']) if dcp else '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="64,256,1024")
    p.add_argument("--tensors", default="300,26800")
    p.add_argument("--layouts", default="replicated,sharded,hsdp")
    p.add_argument("--shapes", type=int, default=1, help="distinct tensor shapes (columns 64, 65, ... in turn)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--anchor-items", type=int, default=8_000_000,
                   help="run DCP's planning only up to this many ranks x tensors (its plans alone take "
                        "about 1.7 kB of memory an item: 12 GB at 256 x 26,800)")
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
                    results.append(run_case(ranks, tensors, layout, a.rounds, a.anchor_items, a.shapes))
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
