"""Property tests: the resharding arithmetic, the on-disk format, the regroup seating."""

import json
import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient import Checkpointer, UnsupportedStateError
from resilient._errors import CheckpointCorruptError
from resilient._format import decode_manifest
from resilient._layout import Box, chunk_bounds, contiguous_range, even_split, intersect, replicated_slices, shard_box
from resilient._regroup import Member, partners
from resilient._box_runs import SavedBoxes
from resilient._restore import _along_first_dim

sizes_st = st.lists(st.integers(0, 5000), min_size=1, max_size=12)


@given(sizes_st, st.integers(1, 9))
def test_replicated_slices_write_every_byte_exactly_once_and_evenly(sizes, world):
    named = [(f"t{i}", n) for i, n in enumerate(sizes)]
    seen = {name: np.zeros(n, dtype=np.int64) for name, n in named}
    per_rank = []
    for rank in range(world):
        slices = replicated_slices(named, rank, world)
        per_rank.append(sum(s.length for s in slices))
        for s in slices:
            assert s.length > 0
            seen[s.name][s.start : s.start + s.length] += 1
    assert all((v == 1).all() for v in seen.values())
    assert max(per_rank) - min(per_rank) <= 1


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_even_split_partitions(total, parts):
    ranges = even_split(total, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@given(st.integers(0, 50), st.integers(1, 9))
def test_chunk_bounds_match_torch_chunk(size, parts):
    pieces = torch.arange(size).chunk(parts) if size else ()
    for index in range(parts):
        start, length = chunk_bounds(size, parts, index)
        if index < len(pieces):
            assert (start, length) == (int(pieces[index][0]) if length else start, len(pieces[index]))
        else:
            assert length == 0


shape_st = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@st.composite
def box_in(draw, shape):
    offsets, sizes = [], []
    for dim in shape:
        lo = draw(st.integers(0, dim - 1))
        offsets.append(lo)
        sizes.append(draw(st.integers(1, dim - lo)))
    return Box(tuple(offsets), tuple(sizes))


@given(st.data(), shape_st)
def test_contiguous_range_agrees_with_brute_force(data, shape):
    box = data.draw(box_in(shape))
    index = np.arange(math.prod(shape)).reshape(shape)
    picked = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].reshape(-1)
    is_run = bool((np.diff(picked) == 1).all())
    got = contiguous_range(box, shape)
    if is_run:
        assert got == (int(picked[0]), picked.size)
    else:
        assert got is None


@given(st.data(), shape_st)
def test_restore_skips_only_saved_boxes_that_cannot_meet_its_target(data, shape):
    target = data.draw(box_in(shape))
    saved = data.draw(st.lists(box_in(shape), max_size=8))
    boxes = [{"offsets": list(b.offsets), "sizes": list(b.sizes), "pieces": []} for b in saved]
    kept = _along_first_dim(SavedBoxes(boxes), target)
    assert all(k in boxes for k in kept)
    assert [b for b in boxes if intersect(Box(tuple(b["offsets"]), tuple(b["sizes"])), target)] == \
        [b for b in kept if intersect(Box(tuple(b["offsets"]), tuple(b["sizes"])), target)]


@given(st.data(), shape_st)
def test_intersect_agrees_with_masks(data, shape):
    a, b = data.draw(box_in(shape)), data.draw(box_in(shape))

    def mask(box):
        m = np.zeros(shape, dtype=bool)
        m[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] = True
        return m

    both = mask(a) & mask(b)
    inter = intersect(a, b)
    assert (inter is None) == (not both.any())
    if inter is not None:
        assert (mask(inter) == both).all()


@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=3),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.data(),
)
def test_shard_boxes_tile_the_tensor(shape, mesh, data):
    shard_dims = [data.draw(st.one_of(st.none(), st.integers(0, len(shape) - 1))) for _ in mesh]
    count = np.zeros(shape, dtype=np.int64)
    replicas = math.prod(m for m, d in zip(mesh, shard_dims) if d is None)
    for coord in np.ndindex(*mesh):
        box = shard_box(shape, mesh, coord, shard_dims)
        if box.numel:
            count[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] += 1
    assert (count == replicas).all()


dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.bool]
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=8),
                        st.floats(allow_nan=False))


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    dtype = draw(st.sampled_from(dtypes))
    t = torch.randint(0, 2 if dtype == torch.bool else 100, shape).to(dtype)
    return t


values = st.recursive(
    st.one_of(json_scalar, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.text(min_size=1, max_size=6), st.integers(0, 99)), children, max_size=3),
    ),
    max_leaves=10,
)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text(min_size=1, max_size=8), values, min_size=1, max_size=4), st.sampled_from([None, "zstd"]))
def test_any_state_round_trips(tmp_path_factory, state, compress):
    from hypothesis import assume

    names = [str(k) for k in state]
    assume(len(set(names)) == len(names))
    root = str(tmp_path_factory.mktemp("prop"))
    with Checkpointer(root, compress=compress, rng=False) as ckpt:
        try:
            ckpt.save(1, state)
        except UnsupportedStateError as exc:  # keys 1 and "1" in one dict are refused
            assume("are both named" not in str(exc))
            raise
    loaded = {k: None for k in state}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(loaded) == 1
    for k in state:
        assert _same(state[k], loaded[k]), k


@settings(max_examples=200, deadline=None)
@given(st.recursive(json_scalar, lambda c: st.one_of(st.lists(c, max_size=3),
                                                      st.dictionaries(st.text(max_size=5), c, max_size=3)),
                    max_leaves=12))
def test_decode_manifest_rejects_garbage_with_one_error_type(junk):
    valid = {"format": "resilient.checkpoint", "version": 1, "step": 1, "world_size": 1, "files": {},
             "tensors": {}, "ranks": [{"tree": {"t": "dict", "items": []}, "rng": None}]}
    for doc in (junk, {**valid, "tensors": junk}, {**valid, "files": junk}, {**valid, "ranks": junk}):
        try:
            decode_manifest(json.dumps(doc).encode(), "m.json")
        except CheckpointCorruptError:
            pass


members_st = st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=40)


@given(members_st)
def test_every_partner_is_the_next_peer_copy_server_on_another_node(layout):
    """Seating thousands of members looks only at the ones serving peer copies; it must pick
    what the definition says: the first member after, circularly, on another node, with an
    address (none when no other node serves)."""
    members = [Member(f"m{i}", f"node{n}", i, f"10.0.0.{i}:1" if serves else "") for i, (n, serves) in enumerate(layout)]
    for rank, partner in enumerate(partners(members)):
        after = members[rank + 1:] + members[:rank]
        expected = next((m.address for m in after if m.node != members[rank].node and m.address), "")
        assert partner == expected
