"""The on-disk format: names, the JSON manifest, and its validation.

A checkpoint is a directory ``step-<step:010d>/`` holding one data file per writing rank
(``rank-<rank:05d>.data``, see ``_chunkio``) and ``manifest.json``. The manifest is plain
JSON, never pickle: reading it runs no code, whoever wrote the bucket. It is validated
field by field before use, so a damaged or hostile manifest is an error that names the
field, not a crash deep in the loader.

Version 4 layout (``docs/format.md`` has the prose; version 5 is 4 where a tree holds a
tensor subclass's parts, a "wrapped" node, ``_subclasses``, and 6 is 5 where such a node
lists parts saved as views of blocks, ``blocks``; versions 3, 2 and 1 are still read:
3 kept each file's chunk table in ``files``, 2 also every RNG state in ``rngs``, 1 also
listed every box on its own and each rank's tree and RNG state in ``ranks``)::

    {"format": "resilient.checkpoint", "version": 4, "step": 100, "world_size": 2,
     "created": 1764500000.0, "torch_version": "2.13.0", "codec": "none", "chunk_bytes": 16777216,
     "files":   {"rank-00000.data": {"bytes": N, "logical": L, "footer": [3, 4011829313]}},
     "tensors": {"model/w": {"dtype": "float32", "shape": [4, 4], "layout": "replicated",
                 "boxes": [{"offsets": [0, 0], "sizes": [4, 4],
                            "pieces": [["rank-00000.data", 0, 32], ["rank-00001.data", 0, 32]]}]},
                 "model/v": {"dtype": "float32", "shape": [8], "layout": "sharded",
                 "boxes": [{"offsets": [0], "sizes": [4], "pieces": [["rank-00000.data", 32, 16]],
                            "repeat": 2, "stride": [4, 1, 0]}]}},
     "trees":   [{...}],  "rngs": [],
     "ranks":   [[0, [48, 10530]], [0, [48, 10544]]]}

A box with ``repeat`` is a run (``_box_runs``); a file's chunk table is its last ``13 x
footer[0]`` bytes, whose CRC32 is ``footer[1]`` (``_chunk_table``); ``ranks[r]`` is ``[tree,
rng]``: ``tree`` an index into ``trees``, which holds each distinct tree once; ``rng`` where
rank r's generator states are in its own data file (``[logical offset, length]``, a chunk of
their own), or, for a rank without a file, an index into ``rngs``, or null. Decoded, every
version reads alike: ``ranks[r]`` is ``{"tree": ..., "rng": ...}`` (with ``"rng_at": [file,
offset, length]`` where the states are in a file), a tensor's ``boxes`` a ``SavedBoxes``, and
a file's chunks (``[offset, length, stored offset, stored length, crc32, codec]``) are
``_chunk_table.chunks_of(record, ...)``: the record's ``chunks`` before version 4, read from
the file's footer in version 4 (and then kept in ``chunks``).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ._box_runs import SavedBoxes, canonical_rank, check_run
from ._chunk_table import CODECS, FOOTER_ROW_BYTES, MAX_CHUNK_BYTES, unpack_tables
from ._errors import CheckpointCorruptError
from ._gc_pause import gc_paused
from ._names import data_file_name, parse_data_file, parse_step_dir, step_dir_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "REMOTE_RECORD",
    "BAD_DIR",
    "CHECKED_SUFFIX",
    "step_dir_name",
    "parse_step_dir",
    "data_file_name",
    "dtype_name",
    "dtype_from_name",
    "dtype_itemsize",
    "encode_manifest",
    "decode_manifest",
    "written_version",
]

FORMAT = "resilient.checkpoint"
#: what this version writes: 6 where a tensor subclass's parts are saved as views of blocks
#: (a "wrapped" node's ``blocks``: sharded low-bit optimizer state), 5 where a tree holds a
#: tensor subclass's parts otherwise (a "wrapped" node, which a reader of 4 would not know),
#: otherwise 4 (``written_version``)
VERSION = 6
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
MANIFEST = "manifest.json"
REMOTE_RECORD = ".remote.json"  # in a local root: the remote tier's URL, never credentials
BAD_DIR = ".bad"  # <root>/.bad/step-…: a committed step that failed verification (its reason)
#: on a remote tier, ``<step>/<data file>.checked-<id>`` (empty): the uploader of that file
#: checked its checksums and ``<id>`` names what it uploaded (``_transfer.checked_marker``).
#: Rank 0 commits a step only once every file has its marker: the upload runs beside the
#: check, so a file at its full size may still prove bad and be deleted again.
CHECKED_SUFFIX = ".checked-"
#: the most bytes a rank's encoded generator states (``_rng``) may take in its data file (a
#: manifest asking to read more is refused before anything is read): 11 kB on a CPU, 16 more
#: a CUDA device
MAX_RNG_BYTES = 1 << 20

#: every dtype a manifest may name, with its bytes per element. Written out rather than
#: read from torch so that validating a manifest (``resilient-ckpt ls``, ``show``, ``verify``)
#: does not import torch; ``tests/test_errors.py`` checks it against torch's own.
DTYPE_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1, "float8_e4m3fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bits16": 2,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype a manifest names (without importing torch)."""
    try:
        return DTYPE_ITEMSIZE[name]
    except KeyError:
        raise CheckpointCorruptError(f"unknown dtype {name!r} in manifest") from None


def dtype_from_name(name: str) -> torch.dtype:
    dtype_itemsize(name)  # refuses a name that is not a dtype before asking torch for it
    import torch

    return getattr(torch, name)


def written_version(trees: list[bytes]) -> int:
    """The format a manifest of these JSON trees is written in: 5 only where one holds a
    wrapped tensor subclass, so that a resilient reading 4 refuses it as newer (asking for
    an upgrade) rather than load the parts as a dict, 6 where such parts are views of
    blocks, which a reader of 5 would hand to the class in that shape; every other
    checkpoint is read as before. The match is exact: a quote inside a JSON string is
    escaped, and ``"blocks":`` is a key only a wrapped node has."""
    if not any(b'"t":"wrapped"' in tree for tree in trees):
        return 4
    return VERSION if any(b'"blocks":' in tree for tree in trees) else 5


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), allow_nan=True).encode()


def _fail(where: str, field: str, why: str) -> None:
    raise CheckpointCorruptError(f"{where}: field {field!r} {why}")


def _ints(value: Any, where: str, field: str | Callable[[], str], *, length: int | None = None) -> list[int]:
    """``value``, a list of non-negative integers (of ``length``), or ``CheckpointCorruptError``
    naming ``field``. ``field`` may be a function giving the name, made only for an error:
    the manifest of a state of many small tensors is checked field by field, and building
    each name only to discard it was a third of a restore's time at 26,800 tensors."""
    if (isinstance(value, list) and (length is None or len(value) == length)
            and all(type(v) is int and v >= 0 for v in value)):  # type(): a bool is no int here
        return value
    name = field if isinstance(field, str) else field()
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        _fail(where, name, "must be a list of non-negative integers")
    _fail(where, name, f"must have {length} entries, has {len(value)}")
    return value  # not reached: _fail raises


MAX_TREE_DEPTH = 512
_NODE_KINDS = ("dict", "list", "tuple", "tensor", "v", "obj", "per_rank", "wrapped")


class NewerFormatError(CheckpointCorruptError):
    """A manifest of a format newer than this version reads. Not damage: a restore refuses
    it on every rank instead of going back to an older step without a word (a job or an
    evaluation running an older resilient than the one that wrote the newest step)."""


@gc_paused()
def decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a manifest; ``where`` names it in errors.

    Every field is checked against the format and against the others, so that whatever a
    damaged or hostile manifest says, using it cannot raise anything but
    ``CheckpointCorruptError`` nor make anyone allocate more than the data files hold: chunk
    tables cover each file exactly, tensor pieces lie inside their file's logical bytes and
    add up to the tensor's size, trees are shallow and name only tensors that exist.
    (Files' real sizes are compared with ``bytes`` where they are opened.)
    """
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where}: not a resilient checkpoint manifest")
    version = manifest.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise NewerFormatError(
            f"{where}: written by a newer resilient (checkpoint format {version}; this one reads formats "
            f"{', '.join(map(str, READ_VERSIONS))}): upgrade resilient to read it, or restore an older step with "
            "restore(step=...)"
        )
    if version not in READ_VERSIONS:
        raise CheckpointCorruptError(
            f"{where}: format version {manifest.get('version')!r} is not supported "
            f"(this resilient reads versions {', '.join(map(str, READ_VERSIONS))})"
        )
    for field, kind in (("step", int), ("world_size", int), ("files", dict), ("tensors", dict), ("ranks", list)):
        if not isinstance(manifest.get(field), kind) or isinstance(manifest.get(field), bool):
            _fail(where, field, f"must be of type {kind.__name__}")
    if manifest["step"] < 0 or manifest["world_size"] < 1:
        _fail(where, "step", "and world_size must be >= 0 and >= 1")
    if len(manifest["ranks"]) != manifest["world_size"]:
        _fail(where, "ranks", "must have one entry per rank")
    if manifest["version"] == 1:
        files = _Files({fname: _check_file(fname, record, where) for fname, record in manifest["files"].items()})
    elif manifest["version"] >= 4:
        chunk_bytes = manifest.get("chunk_bytes")
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            _fail(where, "chunk_bytes", f"must be an integer from 1 to {MAX_CHUNK_BYTES}")
        files = _Files({fname: _check_footer_record(fname, record, where) for fname, record in manifest["files"].items()})
    else:
        for fname, record in manifest["files"].items():
            _check_file_record(fname, record, where)
        files = _Files(unpack_tables(manifest["files"], lambda field, why: _fail(where, field, why)))
    for name, meta in manifest["tensors"].items():
        _check_tensor(name, meta, files, where)
    if manifest["version"] == 1:
        for rank, record in enumerate(manifest["ranks"]):
            if not isinstance(record, dict):
                _fail(where, f"ranks[{rank}]", "must be an object with a tree")
            _check_tree_root(record.get("tree"), manifest["tensors"], where, f"ranks[{rank}].tree")
            _check_rng(record.get("rng"), where, f"ranks[{rank}].rng")
    else:
        manifest["ranks"] = _shared_rank_states(manifest, files.logical_sizes, where)
    return manifest


def _shared_rank_states(manifest: dict[str, Any], logical_sizes: dict[str, int], where: str) -> list[dict[str, Any]]:
    """Version 2 to 4's ``ranks`` (``[tree, rng]``), each distinct tree and RNG state
    checked once, as version 1's ``{"tree", "rng"}`` objects (sharing them); a rank whose
    states are in its data file (since version 3: ``rng`` is ``[offset, length]``) has
    ``"rng_at": [file, offset, length]`` instead, checked to lie inside that file."""
    trees, rngs = manifest.get("trees"), manifest.get("rngs")
    if not isinstance(trees, list) or not isinstance(rngs, list):
        _fail(where, "trees", "and rngs must be lists")
    for i, tree in enumerate(trees):
        _check_tree_root(tree, manifest["tensors"], where, f"trees[{i}]")
    for i, rng in enumerate(rngs):
        _check_rng(rng, where, f"rngs[{i}]")
    in_files = manifest["version"] >= 3
    ranks = []
    for rank, pair in enumerate(manifest["ranks"]):
        if (not isinstance(pair, list) or len(pair) != 2 or not _is_index(pair[0], trees)
                or not (pair[1] is None or _is_index(pair[1], rngs) or (in_files and isinstance(pair[1], list)))):
            _fail(where, f"ranks[{rank}]", "must be [index into trees, index into rngs, [offset, length] or null]"
                  if in_files else "must be [index into trees, index into rngs or null]")
        entry = {"tree": trees[pair[0]], "rng": None}
        if isinstance(pair[1], list):
            entry["rng_at"] = _rng_in_file(pair[1], rank, logical_sizes, where)
        elif pair[1] is not None:
            entry["rng"] = rngs[pair[1]]
        ranks.append(entry)
    return ranks


def _rng_in_file(at: list[Any], rank: int, logical_sizes: dict[str, int], where: str) -> list[Any]:
    """``[file, offset, length]`` of rank ``rank``'s generator states: in its own file, inside
    the file's logical bytes, at most ``MAX_RNG_BYTES`` (what a restoring rank will read)."""
    field = f"ranks[{rank}][1]"
    offset, length = _ints(at, where, field, length=2)
    fname = data_file_name(rank)
    if fname not in logical_sizes:
        _fail(where, field, f"places the generator states in {fname}, which the checkpoint lacks")
    if not 0 < length <= MAX_RNG_BYTES or offset + length > logical_sizes[fname]:
        _fail(where, field, f"must be 1 to {MAX_RNG_BYTES} bytes inside {fname}'s {logical_sizes[fname]}")
    return [fname, offset, length]


def _is_index(value: Any, into: list[Any]) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(into)


def _check_tree_root(tree: Any, tensors: dict[str, Any], where: str, field: str) -> None:
    if not isinstance(tree, dict) or tree.get("t") != "dict":
        _fail(where, field, "must be a dict node")
    _check_tree(tree, tensors, where, field)


def _check_rng(rng: Any, where: str, field: str) -> None:
    if rng is not None and not isinstance(rng, dict):
        _fail(where, field, "must be an object or null")


class _Files:
    """The files' logical sizes, by name and, for runs of boxes, by rank (sorted arrays)."""

    def __init__(self, logical_sizes: dict[str, int]) -> None:
        self.logical_sizes = logical_sizes
        by_rank = sorted((r, size) for name, size in logical_sizes.items() if (r := canonical_rank(name)) is not None)
        self.ranks = np.array([r for r, _ in by_rank], dtype=np.int64)
        self.logical = np.array([size for _, size in by_rank], dtype=np.int64)


def _check_file_record(fname: str, record: Any, where: str) -> int:
    """A file's name and record, whatever the version; return its stored size."""
    fw = f"files[{fname!r}]"
    if not isinstance(fname, str) or "/" in fname or fname.startswith(".") or not isinstance(record, dict):
        _fail(where, fw, "is not a plain file name with a record")
    size = record.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        _fail(where, f"{fw}.bytes", "must be a non-negative integer")
    return size


def _check_footer_record(fname: str, record: Any, where: str) -> int:
    """A format 4 file record (its chunk table in the file's last ``13 x count`` bytes,
    ``footer: [count, crc32 of them]``, checked against them where the file is read:
    ``_chunk_table.chunks_of``); return its logical size."""
    fw = f"files[{fname!r}]"
    size = _check_file_record(fname, record, where)
    logical = record.get("logical")
    if not isinstance(logical, int) or isinstance(logical, bool) or logical < 0:
        _fail(where, f"{fw}.logical", "must be a non-negative integer")
    count, crc = _ints(record.get("footer"), where, f"{fw}.footer", length=2)
    if crc > 0xFFFFFFFF or count * FOOTER_ROW_BYTES > size or logical > count * MAX_CHUNK_BYTES:
        _fail(where, f"{fw}.footer", f"must be [chunks, crc32] of a table that fits in the file's {size} bytes "
              f"and can hold its {logical} logical bytes")
    return logical


def _check_file(fname: str, record: Any, where: str) -> int:
    """Validate one version 1 file record (its chunks as lists); return the file's logical
    size (what its chunks decode to)."""
    fw = f"files[{fname!r}]"
    size = _check_file_record(fname, record, where)
    chunks = record.get("chunks")
    if not isinstance(chunks, list):
        _fail(where, f"{fw}.chunks", "must be a list")
    logical = stored = 0
    for i, chunk in enumerate(chunks):
        off, length, soff, slen, crc, codec = _ints(chunk, where, f"{fw}.chunks[{i}]", length=6)
        if off != logical or soff != stored:
            _fail(where, f"{fw}.chunks[{i}]", f"must start where the previous chunk ended ({logical}, {stored})")
        if codec not in CODECS or crc > 0xFFFFFFFF or length > MAX_CHUNK_BYTES:
            _fail(where, f"{fw}.chunks[{i}]", "has an unknown codec, a bad CRC or a length over 1 GiB")
        if codec == 0 and slen != length:
            _fail(where, f"{fw}.chunks[{i}]", "is raw but its stored and logical lengths differ")
        logical, stored = logical + length, stored + slen
    if stored != size:
        _fail(where, f"{fw}.chunks", f"cover {stored} of the file's {size} bytes")
    return logical


def _check_tensor(name: str, meta: Any, files: _Files, where: str) -> None:
    def tw(suffix: str = "") -> str:  # the field's name, made only for an error
        return f"tensors[{name!r}]{suffix}"

    if not isinstance(meta, dict):
        _fail(where, tw(), "must be an object")
    if not isinstance(meta.get("dtype"), str):
        _fail(where, tw(".dtype"), "must be a string")
    itemsize = dtype_itemsize(meta["dtype"])
    shape = _ints(meta.get("shape"), where, lambda: tw(".shape"))
    if meta.get("layout") not in ("replicated", "sharded"):
        _fail(where, tw(".layout"), "must be 'replicated' or 'sharded'")
    same_as = meta.get("same_as")
    if same_as is not None and not isinstance(same_as, str):
        _fail(where, tw(".same_as"), "must be a tensor name")
    boxes = meta.get("boxes")
    if not isinstance(boxes, list):
        _fail(where, tw(".boxes"), "must be a list")
    numel = math.prod(shape)
    covered = 0
    logical_sizes = files.logical_sizes
    ndim = len(shape)
    for i, box in enumerate(boxes):
        if not isinstance(box, dict) or not isinstance(box.get("pieces"), list):
            _fail(where, tw(f".boxes[{i}]"), "must be an object with pieces")
        offsets = _ints(box.get("offsets"), where, lambda: tw(f".boxes[{i}].offsets"), length=ndim)
        sizes = _ints(box.get("sizes"), where, lambda: tw(f".boxes[{i}].sizes"), length=ndim)
        if any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
            _fail(where, tw(f".boxes[{i}]"), "lies outside the tensor's shape")
        if "repeat" in box:
            covered += check_run(box, shape, itemsize, files.ranks, files.logical,
                                 lambda field, why, i=i: _fail(where, tw(f".boxes[{i}].{field}"), why))
            continue
        held = 0
        for piece in box["pieces"]:
            if not isinstance(piece, list) or len(piece) != 3 or piece[0] not in logical_sizes:
                _fail(where, tw(f".boxes[{i}].pieces[]"), "must be [known file, offset, nbytes]")
            offset, nbytes = _ints(piece[1:], where, lambda: tw(f".boxes[{i}].pieces[]"))
            if offset + nbytes > logical_sizes[piece[0]]:
                _fail(where, tw(f".boxes[{i}].pieces[]"), f"reads past the end of {piece[0]}")
            held += nbytes
        if held != math.prod(sizes) * itemsize:
            _fail(where, tw(f".boxes[{i}]"), f"pieces hold {held} bytes, the box needs {math.prod(sizes) * itemsize}")
        covered += math.prod(sizes)
    if covered != numel:
        _fail(where, tw(".boxes"), f"cover {covered} of the tensor's {numel} elements")
    meta["boxes"] = SavedBoxes(boxes)


def _check_tree(root: dict[str, Any], tensors: dict[str, Any], where: str, field: str) -> None:
    """Every node well formed, at most MAX_TREE_DEPTH deep, tensors named in the manifest."""
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            _fail(where, field, f"nests deeper than {MAX_TREE_DEPTH} levels")
        kind = node.get("t") if isinstance(node, dict) else None
        if kind not in _NODE_KINDS:
            _fail(where, field, f"has a node of unknown type {kind!r}")
        if kind == "tensor":
            if not isinstance(node.get("name"), str) or node["name"] not in tensors:
                _fail(where, field, f"names a tensor the manifest lacks: {str(node.get('name'))[:100]!r}")
        elif kind == "v":
            if "v" not in node or not isinstance(node["v"], (type(None), bool, int, float, str)):
                _fail(where, field, "has a value that is not a JSON scalar")
        elif kind in ("obj", "per_rank"):
            stack.append((node.get("sd"), depth + 1))
        elif kind == "wrapped":  # a tensor subclass's parts (``_subclasses``), its items as a dict's
            if not (isinstance(node.get("class"), str) and isinstance(node.get("name"), str)):
                _fail(where, field, "has a wrapped tensor without its class and name")
            _ints(node.get("shape"), where, field)
            _ints(node.get("stride"), where, field)
            blocks = node.get("blocks", [])
            items = node.get("items")
            named = ({item[0] for item in items if isinstance(item, list) and item and isinstance(item[0], str)}
                     if isinstance(items, list) else set())
            if not (isinstance(blocks, list) and all(isinstance(b, str) and b in named for b in blocks)):
                _fail(where, field, "has a wrapped tensor whose blocks are not names of its parts")
            stack.append((node.get("ctx"), depth + 1))
            stack.append(({"t": "dict", "items": node.get("items")}, depth + 1))
        else:
            items = node.get("items")
            if not isinstance(items, list):
                _fail(where, field, f"has a {kind} node without items")
            for item in items:
                if kind != "dict":
                    stack.append((item, depth + 1))
                    continue
                if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], (str, int))
                        or isinstance(item[0], bool)):
                    _fail(where, field, "has a dict item that is not [str or int key, node]")
                stack.append((item[1], depth + 1))
