"""The on-disk format: names, the JSON manifest, and its validation.

A checkpoint is a directory ``step-<step:010d>/`` holding one data file per writing rank
(``rank-<rank:05d>.data``, see ``_chunkio``) and ``manifest.json``. The manifest is plain
JSON, never pickle: reading it runs no code, whoever wrote the bucket. It is validated
field by field before use, so a damaged or hostile manifest is an error that names the
field, not a crash deep in the loader.

Version 1 layout (``docs/format.md`` has the prose)::

    {"format": "resilient.checkpoint", "version": 1, "step": 100, "world_size": 2,
     "created": 1764500000.0, "torch_version": "2.13.0", "codec": "none",
     "files":   {"rank-00000.data": {"bytes": N, "chunks": [[off, len, soff, slen, crc32, codec]]}},
     "tensors": {"model/w": {"dtype": "float32", "shape": [4, 4], "layout": "replicated",
                 "boxes": [{"offsets": [0, 0], "sizes": [4, 4],
                            "pieces": [["rank-00000.data", 0, 32], ["rank-00001.data", 0, 32]]}]}},
     "ranks":   [{"tree": {...}, "rng": {...}}, ...]}
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from ._errors import CheckpointCorruptError

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "REMOTE_RECORD",
    "BAD_DIR",
    "step_dir_name",
    "parse_step_dir",
    "data_file_name",
    "dtype_name",
    "dtype_from_name",
    "encode_manifest",
    "decode_manifest",
]

FORMAT = "resilient.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
REMOTE_RECORD = ".remote.json"  # in a local root: the remote tier's URL, never credentials
BAD_DIR = ".bad"  # <root>/.bad/step-…: a committed step that failed verification (its reason)
_STEP_RE = re.compile(r"^step-(\d{10})$")
_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointCorruptError(f"unknown dtype {name!r} in manifest") from None


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), allow_nan=True).encode()


def _fail(where: str, field: str, why: str) -> None:
    raise CheckpointCorruptError(f"{where}: field {field!r} {why}")


def _ints(value: Any, where: str, field: str, *, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        _fail(where, field, "must be a list of non-negative integers")
    if length is not None and len(value) != length:
        _fail(where, field, f"must have {length} entries, has {len(value)}")
    return value


def decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a manifest; ``where`` names it in errors."""
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where}: not a resilient checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{where}: format version {manifest.get('version')!r} is not supported "
            f"(this resilient reads version {VERSION})"
        )
    for field, kind in (("step", int), ("world_size", int), ("files", dict), ("tensors", dict), ("ranks", list)):
        if not isinstance(manifest.get(field), kind):
            _fail(where, field, f"must be of type {kind.__name__}")
    if len(manifest["ranks"]) != manifest["world_size"]:
        _fail(where, "ranks", "must have one entry per rank")
    for fname, record in manifest["files"].items():
        if "/" in fname or fname.startswith(".") or not isinstance(record, dict):
            _fail(where, f"files[{fname!r}]", "is not a plain file name with a record")
        chunks = record.get("chunks")
        if not isinstance(chunks, list):
            _fail(where, f"files[{fname!r}].chunks", "must be a list")
        for chunk in chunks:
            _ints(chunk, where, f"files[{fname!r}].chunks[]", length=6)
    for name, meta in manifest["tensors"].items():
        tw = f"tensors[{name!r}]"
        if not isinstance(meta, dict):
            _fail(where, tw, "must be an object")
        dtype_from_name(meta.get("dtype"))
        shape = _ints(meta.get("shape"), where, f"{tw}.shape")
        if meta.get("layout") not in ("replicated", "sharded"):
            _fail(where, f"{tw}.layout", "must be 'replicated' or 'sharded'")
        boxes = meta.get("boxes")
        if not isinstance(boxes, list):
            _fail(where, f"{tw}.boxes", "must be a list")
        for box in boxes:
            if not isinstance(box, dict) or not isinstance(box.get("pieces"), list):
                _fail(where, f"{tw}.boxes[]", "must be an object with pieces")
            offsets = _ints(box.get("offsets"), where, f"{tw}.boxes[].offsets", length=len(shape))
            sizes = _ints(box.get("sizes"), where, f"{tw}.boxes[].sizes", length=len(shape))
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                _fail(where, f"{tw}.boxes[]", "lies outside the tensor's shape")
            for piece in box["pieces"]:
                if (
                    not isinstance(piece, list)
                    or len(piece) != 3
                    or piece[0] not in manifest["files"]
                ):
                    _fail(where, f"{tw}.boxes[].pieces[]", "must be [known file, offset, nbytes]")
                _ints(piece[1:], where, f"{tw}.boxes[].pieces[]")
    return manifest
