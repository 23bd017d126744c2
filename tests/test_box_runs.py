"""Runs of saved boxes (format 2): the manifest rank 0 assembles from every rank's boxes
lists, once decoded, exactly the boxes the ranks wrote, whatever the layout, and a
restoring rank's first-dimension lookup finds exactly the ones its target meets."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient._box_runs import _lexsorted, _steps, in_fewest_runs
from resilient._chunk_table import with_footer
from resilient._commit import assemble_manifest, encode_report
from resilient._format import data_file_name, decode_manifest
from resilient._layout import Box, intersect

pytestmark = pytest.mark.timeout(120)


def _cuts(draw, dim: int, parts: int, even: bool) -> list[tuple[int, int]]:
    """(offset, size) of ``parts`` non-empty slices of a dimension: even ones as torch.chunk
    cuts them (the last smaller), else at random points."""
    parts = min(parts, dim)
    if even:
        size = -(-dim // parts)
        return [(o, min(size, dim - o)) for o in range(0, dim, size)]
    points = sorted(draw(st.sets(st.integers(1, dim - 1), min_size=parts - 1, max_size=parts - 1))) if dim > 1 else []
    edges = [0, *points, dim]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


@st.composite
def layouts(draw):
    """(world, tensors' shapes, every rank's boxes as [name, offsets, sizes]) for a random
    sharding: a grid over the first one or two dimensions, its cells given to ranks in order,
    shuffled, or at random (several to a rank, or none)."""
    world = draw(st.integers(1, 6))
    shapes, held = {}, {r: [] for r in range(world)}
    for t in range(draw(st.integers(1, 3))):
        name = f"t{t}"
        shape = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
        shapes[name] = shape
        even = draw(st.booleans())
        grid = [_cuts(draw, shape[0], draw(st.integers(1, world + 1)), even)]
        if len(shape) > 1 and draw(st.booleans()):
            grid.append(_cuts(draw, shape[1], draw(st.integers(1, 3)), even))
        cells = [[c] for c in grid[0]] if len(grid) == 1 else [[a, b] for a in grid[0] for b in grid[1]]
        mode = draw(st.sampled_from(["in order", "shuffled", "random"]))
        order = list(range(len(cells)))
        if mode == "shuffled":
            order = draw(st.permutations(order))
        for j, cell in enumerate(cells):
            rank = draw(st.integers(0, world - 1)) if mode == "random" else order[j] % world
            offsets = [o for o, _ in cell] + [0] * (len(shape) - len(cell))
            sizes = [s for _, s in cell] + shape[len(cell):]
            held[rank].append([name, offsets, sizes])
    return world, shapes, held


def _reports(world, shapes, held):
    """What each rank reports having written its boxes one after another into its file."""
    meta = {n: {"dtype": "float32", "shape": s, "layout": "sharded"} for n, s in shapes.items()}
    tree = {"t": "dict", "items": [[n, {"t": "tensor", "name": n}] for n in shapes]}
    reports, written = [], {}
    for rank in range(world):
        at, shards = 0, []
        for name, offsets, sizes in held[rank]:
            nbytes = math.prod(sizes) * 4
            shards.append([name, offsets, sizes, at, nbytes])
            written.setdefault(name, []).append((offsets, sizes, [data_file_name(rank), at, nbytes]))
            at += nbytes
        chunks = [[0, at, 0, at, 0, 0]] if at else []
        reports.append({"rank": rank, "file": data_file_name(rank), "record": with_footer(chunks, at)[1],
                        "signature": "s", "meta": meta, "replicated": [], "shards": shards, "tree": tree,
                        "rng": None, "chunk_bytes": 1 << 24})
    return reports, written


def _key(offsets, sizes, piece):
    return json.dumps([list(offsets), list(sizes), list(piece)])


@settings(max_examples=300, deadline=None)
@given(layouts(), st.data())
def test_the_manifest_lists_exactly_the_boxes_written(layout, data):
    world, shapes, held = layout
    reports, written = _reports(world, shapes, held)
    raw = assemble_manifest(3, [encode_report(r) for r in reports], "none")
    manifest = decode_manifest(raw, "test")
    for name, shape in shapes.items():
        boxes = manifest["tensors"][name]["boxes"]
        got = sorted(_key(b["offsets"], b["sizes"], b["pieces"][0]) for b in boxes)
        assert got == sorted(_key(*w) for w in written[name])
        assert len(boxes) == len(written[name]) and [boxes[i] for i in range(len(boxes))] == list(boxes)
        lo = data.draw(st.integers(0, shape[0] - 1))
        hi = data.draw(st.integers(lo + 1, shape[0]))
        target = Box((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]))
        met = boxes.meeting_first_dim(lo, hi)
        assert sorted(_key(b["offsets"], b["sizes"], b["pieces"][0]) for b in met) == sorted(
            _key(b["offsets"], b["sizes"], b["pieces"][0]) for b in boxes
            if intersect(Box(tuple(b["offsets"]), tuple(b["sizes"])), target) is not None)


def test_an_fsdp_state_is_one_run_a_tensor_and_every_rank_shares_one_tree():
    """What keeps the manifest from growing as ranks x tensors: 64 ranks, each holding rows
    [4r, 4r+4) of three tensors, list each tensor once, and their one tree once."""
    world = 64
    shapes = {f"t{i}": [4 * world, 8] for i in range(3)}
    held = {r: [[n, [4 * r, 0], [4, 8]] for n in shapes] for r in range(world)}
    reports, _ = _reports(world, shapes, held)
    raw = assemble_manifest(3, [encode_report(r) for r in reports], "none")
    doc = json.loads(raw)
    for i, name in enumerate(shapes):  # each rank's file: its rows of t0, of t1, of t2
        assert doc["tensors"][name]["boxes"] == [{"offsets": [0, 0], "sizes": [4, 8],
                                                  "pieces": [["rank-00000.data", 128 * i, 128]],
                                                  "repeat": world, "stride": [4, 0, 1, 0]}]
    assert len(doc["trees"]) == 1 and doc["ranks"] == [[0, None]] * world
    boxes = decode_manifest(raw, "test")["tensors"]["t2"]["boxes"]
    assert len(boxes) == world
    assert boxes[37] == {"offsets": [148, 0], "sizes": [4, 8], "pieces": [["rank-00037.data", 256, 128]]}
    assert boxes.meeting_first_dim(150, 157) == [boxes[37], boxes[38], boxes[39]]


def test_distinct_rng_states_are_kept_per_rank_and_alike_ones_once():
    world = 4
    shapes = {"t": [world, 2]}
    held = {r: [["t", [r, 0], [1, 2]]] for r in range(world)}
    reports, _ = _reports(world, shapes, held)
    for r in reports:
        r["rng"] = {"torch": "same" if r["rank"] < 2 else f"own-{r['rank']}"}
    raw = assemble_manifest(3, [encode_report(r) for r in reports], "none")
    assert json.loads(raw)["ranks"] == [[0, 0], [0, 0], [0, 1], [0, 2]]
    manifest = decode_manifest(raw, "test")
    assert [r["rng"] for r in manifest["ranks"]] == [{"torch": "same"}] * 2 + [{"torch": "own-2"}, {"torch": "own-3"}]


@pytest.mark.parametrize("tp_dim", [0, 1])
def test_a_2d_mesh_is_one_run_per_tensor_parallel_rank(tp_dim):
    """FSDP over tensor parallel: rank r = dp * TP + tp. Row-wise TP (tp_dim 1): rank r holds
    rows of its dp index and columns of its tp index; column-wise (tp_dim 0, FSDP's strided
    shard): TP cuts the rows into TP blocks and FSDP each block into DP. In rank order the
    step changes every TP ranks (DP runs a tensor); ordered by offsets, TP runs."""
    dp, tp, rows, cols = 16, 4, 2, 3
    world = dp * tp
    shapes = {"w": [rows * world, cols] if tp_dim == 0 else [rows * dp, cols * tp]}
    held = {}
    for r in range(world):
        i, j = divmod(r, tp)
        if tp_dim == 0:
            held[r] = [["w", [rows * (j * dp + i), 0], [rows, cols]]]
        else:
            held[r] = [["w", [rows * i, cols * j], [rows, cols]]]
    reports, written = _reports(world, shapes, held)
    raw = assemble_manifest(3, [encode_report(r) for r in reports], "none")
    entries = json.loads(raw)["tensors"]["w"]["boxes"]
    assert len(entries) == tp and all(e["repeat"] == dp for e in entries)
    boxes = decode_manifest(raw, "test")["tensors"]["w"]["boxes"]
    assert sorted(_key(b["offsets"], b["sizes"], b["pieces"][0]) for b in boxes) == sorted(
        _key(*w) for w in written["w"])


def _columns(ndim):
    """A box row's columns that a run keeps (tensor, sizes, nbytes) and those it steps
    (offsets, rank, file offset), as ``box_rows`` lays them out."""
    return [0, *range(1 + ndim, 1 + 2 * ndim), 2 * ndim + 3], [*range(1, 1 + ndim), 2 * ndim + 1, 2 * ndim + 2]


def _steps_by_definition(rows, ndim):
    """``_steps``' two arrays, row by row in Python: link j when rows j and j+1 are of one
    tensor with the same sizes and bytes, in different ranks, the second not empty; cont j
    when links j-1 and j both hold with the same step."""
    fixed, moving = _columns(ndim)
    link = [all(a[c] == b[c] for c in fixed) and a[2 * ndim + 1] != b[2 * ndim + 1] and b[-1] > 0
            for a, b in zip(rows, rows[1:])]
    step = [[b[c] - a[c] for c in moving] for a, b in zip(rows, rows[1:])]
    cont = [j > 0 and link[j] and link[j - 1] and step[j] == step[j - 1] for j in range(len(link))]
    return link, cont


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_steps_in_blocks_through_an_order_are_those_of_the_rows_reordered(data):
    """Rank 0 differences its rows (millions at thousands of ranks) in blocks and through an
    order, never reordered whole: every block boundary and order gives the steps the rows,
    reordered, have by definition."""
    ndim = data.draw(st.integers(1, 2))
    fixed, moving = _columns(ndim)
    small = st.integers(0, 2)
    rows = []
    for _ in range(data.draw(st.integers(0, 6))):  # arithmetic sequences, as real layouts make
        row = [0] * (2 * ndim + 4)
        for c in fixed + moving:
            row[c] = data.draw(small)
        step = {c: data.draw(st.integers(-1, 2)) for c in moving}
        for _ in range(data.draw(st.integers(1, 8))):
            rows.append(list(row))
            row = [v + step.get(c, 0) for c, v in enumerate(row)]
    rows = np.array(rows, dtype="<i8").reshape(len(rows), 2 * ndim + 4)
    n = len(rows)
    shuffled = data.draw(st.booleans())
    order = np.array(data.draw(st.permutations(range(n))) if shuffled else range(n), dtype=np.int64)
    want = _steps_by_definition(rows[order].tolist(), ndim)
    block = data.draw(st.integers(1, 9))
    for got in (_steps(rows, ndim, order, block=block), _steps(rows[order], ndim, block=block)):
        assert [a.tolist() for a in got] == [list(w) for w in want]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_keys_packed_into_one_sort_order_as_lexsort_does(data):
    """Rank 0 sorts boxes by several keys as one packed integer where the keys' ranges fit,
    and by ``np.lexsort`` where they do not: the same order either way, ties included."""
    n = data.draw(st.integers(1, 30))
    wide = data.draw(st.booleans())  # ranges whose product passes 63 bits: lexsort itself
    values = st.integers(-(1 << 40), 1 << 40) if wide else st.integers(-3, 5)
    keys = [np.array(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=np.int64)
            for _ in range(data.draw(st.integers(1, 4)))]
    assert _lexsorted(keys).tolist() == np.lexsort(keys).tolist()


def test_tensor_indices_past_16_bits_order_boxes_as_small_ones_do():
    """Rank 0 sorts tensor indices as 16-bit integers where they fit: indices that do not
    (a state of more than 65,535 tensors) give the same order, sorted as they are."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 4, size=(200, 8), dtype=np.int64)
    wide = rows.copy()
    wide[:, 0] += (1 << 16) - 2  # indices on both sides of 2**16
    assert in_fewest_runs(rows, 2)[0].tolist() == in_fewest_runs(wide, 2)[0].tolist()
