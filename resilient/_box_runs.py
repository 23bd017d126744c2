"""A tensor's saved boxes, written as runs: why a manifest stays small at thousands of ranks.

An FSDP job of N ranks saves each tensor as N boxes: rank r's rows ``[r*k, (r+1)*k)``, in
rank r's file, at the same offset in every file. Listed box by box (format version 1), the
manifest grows as ranks x tensors (57 MB of boxes and trees at 1,024 ranks of 300 tensors),
every node's disk holds all of it and every restoring rank parses all of it before its
first read. Version 2 writes each such sequence once, as a *run*: its first box, ``repeat``
(how many), and ``stride`` (what each next box adds: to every offset, to the rank whose file
holds it, to the offset in that file). A run is an arithmetic sequence, so it is checked at
its ends, and the boxes a restoring rank's shard meets are found by division, not by
looking at all N.

Rows (``box_rows``): how a rank's boxes travel to rank 0, one int64 row per box, so that
rank 0 orders every rank's boxes (``in_fewest_runs``) and finds the runs (``find_runs``)
with array operations.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from ._names import data_file_name, parse_data_file

__all__ = ["SavedBoxes", "box_rows", "canonical_rank", "check_run", "find_runs", "in_fewest_runs"]


def box_rows(shards: list[list[Any]], names: list[str], ndim: int) -> np.ndarray:
    """A rank's sharded boxes (``[name, offsets, sizes, file offset, nbytes]``) as rows of
    ``[tensor index in names, offsets (padded to ndim), sizes (padded), 0, file offset,
    nbytes]``: the 0 is where rank 0 writes the rank whose file holds the box, so that every
    rank's rows, stacked, are already the rows it orders, with no column inserted."""
    index = {n: i for i, n in enumerate(names)}
    rows = np.zeros((len(shards), 4 + 2 * ndim), dtype="<i8")
    for row, (name, offsets, sizes, at, nbytes) in zip(rows, shards):
        row[0], row[-2], row[-1] = index[name], at, nbytes
        row[1 : 1 + len(offsets)] = offsets
        row[1 + ndim : 1 + ndim + len(sizes)] = sizes
    return rows


#: (link[j]: rows j and j+1 may share a run, cont[j]: link j carries on the run of link j-1,
#: with the same step), for rows in the order given (``_steps``)
Steps = tuple[np.ndarray, np.ndarray]

#: rows ``_steps`` differences at a time. Why in blocks: rank 0's rows at 8,192 ranks of 300
#: tensors are 2.4 million (157 MB at TP 8); differenced whole, each pass made a temporary of
#: that size, and on this machine memory touched for the first time cost more than the
#: arithmetic (0.06-0.69 s for the same differences, by how much of it was fresh). A block's
#: temporaries stay in the cache and are reused.
STEP_BLOCK_ROWS = 1 << 15


def in_fewest_runs(rows: np.ndarray, ndim: int) -> tuple[np.ndarray, Steps | None]:
    """The order of ``rows`` (``box_rows``' columns, the rank filled in, in rank order) that
    cuts each tensor's boxes into the fewest runs: by rank, or by offsets with one dimension
    first; and, when rank order was kept, its ``_steps`` (for ``find_runs``, which would
    otherwise compute them again). An order, not the rows reordered: the rows are the
    largest array rank 0 holds, and ``find_runs`` reads them through it.

    Why not always by rank: on a 2-D mesh the ranks of one tensor-parallel group hold
    neighbouring columns (rank r = dp * TP + tp), so in rank order the step changes every TP
    ranks: 1,024 runs a tensor at 8,192 ranks of TP 8. Ordered by the column's offset first,
    then the row's, the step is the same over each data-parallel column of boxes: 8 runs.
    The other orders are tried only when rank order leaves a tensor in several runs (FSDP
    alone never does: at 4,096 ranks, trying them cost rank 0 0.25 s a save)."""
    tensor_column = rows[:, 0]
    by_rank = np.argsort(_radix_sortable(tensor_column), kind="stable")  # a rank's boxes keep their order
    if len(rows) < 2 or ndim == 0:
        return by_rank, None
    tensor = np.take(tensor_column, by_rank)
    steps = _steps(rows, ndim, by_rank)
    counts = [np.bincount(tensor, weights=_breaks(steps[1]))]
    if counts[0].max() <= 2:  # one run each (a run's first two rows count: see _breaks)
        return by_rank, steps
    rank = np.take(rows[:, 2 * ndim + 1], by_rank)
    offsets = [np.take(rows[:, 1 + d], by_rank) for d in range(ndim)]
    orders = [by_rank]
    for first in range(ndim):
        others = [offsets[d] for d in reversed(range(ndim)) if d != first]
        orders.append(by_rank[_lexsorted([rank, *others, offsets[first], tensor])])
        counts.append(np.bincount(tensor, weights=_breaks(_steps(rows, ndim, orders[-1])[1])))
    best = np.argmin(np.stack(counts), axis=0)[tensor]  # per row: its tensor's order with fewest breaks
    chosen = orders[0].copy()
    for k in range(1, len(orders)):  # every order keeps each tensor's rows in the same positions
        pick = best == k
        chosen[pick] = orders[k][pick]
    return chosen, None


def _radix_sortable(column: np.ndarray) -> np.ndarray:
    """``column`` as 16-bit integers where its values fit (tensor indices do), which numpy's
    stable sort sorts by radix: 2.4 million of them in 0.03 s against 0.07-0.08 s as int64."""
    if len(column) and 0 <= column.min() and column.max() < 1 << 16:
        return column.astype(np.uint16)
    return column


def _lexsorted(keys: list[np.ndarray]) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key primary), as one stable sort of the keys packed into
    one integer where their ranges fit in 63 bits. Why: a box's tensor, offsets and rank do,
    and at 8,192 ranks of TP 8 the packed sort took 0.02-0.06 s against lexsort's 0.14-0.18."""
    lows = [int(k.min()) for k in keys]
    spans = [int(k.max()) - low + 1 for k, low in zip(keys, lows)]
    if math.prod(spans) >= 1 << 63:
        return np.lexsort(keys)
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for key, low, span in zip(reversed(keys), reversed(lows), reversed(spans)):  # the primary first
        packed *= span
        packed += key - low
    return np.argsort(packed, kind="stable")


def _fixed(ndim: int) -> list[int]:
    """The columns of ``box_rows``' rows that stay the same along a run: tensor, sizes, nbytes."""
    return [0, *range(1 + ndim, 1 + 2 * ndim), 2 * ndim + 3]


def _moving(ndim: int) -> list[int]:
    """The columns that step along a run (offsets, rank, file offset): a run's stride."""
    return [*range(1, 1 + ndim), 2 * ndim + 1, 2 * ndim + 2]


def _steps(rows: np.ndarray, ndim: int, order: np.ndarray | None = None,
           block: int = STEP_BLOCK_ROWS) -> Steps:
    """``Steps`` of ``rows[order]`` (``rows`` if no order), ``block`` rows at a time: one
    difference of every column serves both tests, and the rows are never reordered whole."""
    n = len(rows) if order is None else len(order)
    link = np.zeros(max(n - 1, 0), dtype=bool)
    cont = np.zeros_like(link)
    fixed, moving = _fixed(ndim), _moving(ndim)
    last_step: np.ndarray | None = None  # of the link before this block's first
    for lo in range(0, n - 1, block):
        hi = min(n - 1, lo + block)  # links lo..hi-1, between rows lo..hi
        part = rows[lo:hi + 1] if order is None else np.take(rows, order[lo:hi + 1], axis=0)
        diff = part[1:] - part[:-1]
        step = diff[:, moving]
        link[lo:hi] = ~np.any(diff[:, fixed], axis=1) & (step[:, ndim] != 0) & (part[1:, -1] > 0)
        cont[lo + 1:hi] = np.all(step[1:] == step[:-1], axis=1)
        if last_step is not None:
            cont[lo] = np.array_equal(last_step, step[0])
        last_step = step[-1].copy()
    cont[1:] &= link[1:] & link[:-1]
    return link, cont


def _breaks(cont: np.ndarray) -> np.ndarray:
    """1.0 at each row that does not carry on the step before it (``cont`` from ``_steps``):
    a run's first two rows (the second is the first with a step), a lone box's one; so twice
    the runs, about."""
    out = np.ones(len(cont) + 1)
    out[1:] = ~cont
    return out


def find_runs(rows: np.ndarray, ndim: int, steps: Steps | None = None, order: np.ndarray | None = None
              ) -> Iterator[tuple[np.ndarray, int, np.ndarray | None]]:
    """``(first row, count, stride or None for a lone box)`` for each run of ``rows[order]``
    (``rows`` if no order; ``box_rows``' columns, the rank filled in; ``steps``: their
    ``_steps`` if known), in that order; each row in exactly one run.

    Consecutive rows join a run when they are of one tensor with the same sizes and bytes,
    in different ranks, neither empty, and each step between them is the same. Greedy from
    the first row: regular layouts give one run per tensor, ragged ones more, never wrong."""
    n = len(rows) if order is None else len(order)
    if n == 0:
        return

    def row(i: int) -> np.ndarray:
        return rows[i if order is None else order[i]]

    link, cont = steps if steps is not None else _steps(rows, ndim, order)
    moving = _moving(ndim)
    breaks = np.flatnonzero(~cont)
    i = 0
    while i < n:
        if i < n - 1 and link[i]:
            after = np.searchsorted(breaks, i + 1)  # the first link from i+1 on that does not carry on
            last_link = (breaks[after] - 1) if after < len(breaks) else n - 2
            first = row(i)
            yield first, int(last_link - i + 2), row(i + 1)[moving] - first[moving]
            i = int(last_link) + 2
        else:
            yield row(i), 1, None
            i += 1


class SavedBoxes(Sequence[dict[str, Any]]):
    """One tensor's saved boxes as the manifest lists them (boxes and runs), read as the
    plain boxes (``{"offsets", "sizes", "pieces"}``) they stand for. Entries are validated
    (``_format``) before this is built."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.entries = entries
        # a list, not numpy's cumsum: most tensors have one entry, and numpy's call cost
        # ~10 µs each, a tenth of a restore's time at 26,800 small tensors
        self._starts = list(itertools.accumulate((e.get("repeat", 1) for e in entries), initial=0))

    def __len__(self) -> int:
        return self._starts[-1]

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self._starts, i) - 1
        return _nth(self.entries[k], i - self._starts[k])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SavedBoxes({self.entries!r})"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for entry in self.entries:
            for i in range(entry.get("repeat", 1)):
                yield _nth(entry, i)

    def meeting_first_dim(self, lo: int, hi: int) -> list[dict[str, Any]]:
        """The boxes whose first-dimension range meets ``[lo, hi)``: the only ones that can
        intersect a target there. A run's are found by division (at 1,024 ranks x 300
        tensors, a rank's planning no longer looks at 300,000 boxes)."""
        met = []
        for entry in self.entries:
            n, first, size = entry.get("repeat", 1), entry["offsets"][0], entry["sizes"][0]
            step = entry["stride"][0] if n > 1 else 0
            if step > 0:  # box i: first + i*step < hi and lo < first + i*step + size
                start, stop = max(0, (lo - first - size) // step + 1), min(n, (hi - first - 1) // step + 1)
                met += [_nth(entry, i) for i in range(start, stop)]
            elif step < 0:
                met += [b for b in (_nth(entry, i) for i in range(n))
                        if b["offsets"][0] < hi and lo < b["offsets"][0] + size]
            elif first < hi and lo < first + size:
                met += [_nth(entry, i) for i in range(n)]
        return met


def _nth(entry: dict[str, Any], i: int) -> dict[str, Any]:
    """Box ``i`` of a manifest entry (a box is its own box 0)."""
    if i == 0:
        return {"offsets": entry["offsets"], "sizes": entry["sizes"], "pieces": entry["pieces"]}
    stride, (fname, at, nbytes) = entry["stride"], entry["pieces"][0]
    ndim = len(entry["offsets"])
    rank = canonical_rank(fname) + i * stride[ndim]  # type: ignore[operator]
    return {"offsets": [o + i * d for o, d in zip(entry["offsets"], stride)], "sizes": entry["sizes"],
            "pieces": [[data_file_name(rank), at + i * stride[ndim + 1], nbytes]]}


def canonical_rank(fname: str) -> int | None:
    """The rank whose data file is named exactly ``fname``, else None: a run names its
    boxes' files by rank, so only the names ``data_file_name`` gives can be part of one."""
    rank = parse_data_file(fname)
    return rank if rank is not None and data_file_name(rank) == fname else None


def check_run(entry: dict[str, Any], shape: list[int], itemsize: int, ranks: np.ndarray, logical: np.ndarray,
              fail: Any) -> int:
    """Validate a run entry (``repeat`` >= 2) against the tensor's shape and the files
    (``ranks``, sorted, and each one's ``logical`` size); return the elements it covers.
    ``fail(field, why)`` raises. Checked at its ends (offsets and file offsets are linear in
    the box's index) and, for the files, every box at once: each names a rank whose file
    exists and holds its bytes."""
    n, stride, pieces = entry.get("repeat"), entry.get("stride"), entry.get("pieces")
    ndim = len(shape)
    if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= len(ranks):
        fail("repeat", f"must be an integer from 2 to the number of files ({len(ranks)})")
    if (not isinstance(stride, list) or len(stride) != ndim + 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in stride) or stride[ndim] == 0):
        fail("stride", f"must be {ndim + 2} integers (offsets, rank, file offset), the rank's not 0")
    if not isinstance(pieces, list) or len(pieces) != 1 or not isinstance(pieces[0], list) or len(pieces[0]) != 3:
        fail("pieces", "of a run must be one [rank's file, offset, nbytes]")
    fname, at, nbytes = pieces[0]
    sizes, offsets = entry["sizes"], entry["offsets"]
    if not isinstance(fname, str) or canonical_rank(fname) is None:
        fail("pieces", f"of a run must name a rank's data file, not {str(fname)[:60]!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (at, nbytes)):
        fail("pieces", "must hold a non-negative offset and nbytes")
    numel = math.prod(sizes)
    if numel == 0 or nbytes != numel * itemsize:
        fail("pieces", f"hold {nbytes} bytes a box, a box of a run needs {numel * itemsize} (and not 0)")
    last = [o + (n - 1) * d for o, d in zip(offsets, stride)]
    if any(o < 0 or o + s > dim for o, s, dim in zip(last, sizes, shape)):
        fail("stride", f"takes box {n - 1} outside the tensor's shape (offsets {last[:4]})")
    first_rank = canonical_rank(fname)
    ends = (first_rank, first_rank + (n - 1) * stride[ndim], at, at + (n - 1) * stride[ndim + 1])
    if not all(0 <= v < 1 << 62 for v in ends):  # linear between its ends: no box leaves the range
        fail("stride", "takes a box's rank or file offset out of range")
    box_ranks = first_rank + np.arange(n, dtype=np.int64) * stride[ndim]
    box_at = at + np.arange(n, dtype=np.int64) * stride[ndim + 1]
    where = np.minimum(np.searchsorted(ranks, box_ranks), len(ranks) - 1)
    if not np.array_equal(ranks[where], box_ranks):
        missing = int(box_ranks[np.flatnonzero(ranks[where] != box_ranks)[0]])
        fail("stride", f"names rank {missing}, which has no data file")
    if box_at.min() < 0 or np.any(logical[where] < box_at + nbytes):
        fail("stride", "takes a box's bytes outside its rank's file (before its start or past its end)")
    return n * numel

