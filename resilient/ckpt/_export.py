"""Export one checkpoint as a single world-size-free file: torch.save, safetensors or DCP.

Memory stays bounded whatever the checkpoint's size: each tensor is assembled shard by
shard into a memory-mapped scratch file next to the output (page cache, reclaimable), and
the writers stream from those maps. The output is written under a temporary name and
renamed into place, so a failed export leaves nothing that looks finished.

torch is imported where a tensor is made, not at the top: ``resilient-ckpt``'s other commands
import this module for its names and need no torch.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import shutil
import struct
import tempfile
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Callable

from .._catalog import Catalog
from .._format import dtype_from_name, dtype_itemsize, dtype_name
from .._saved_trees import whole_tree

if TYPE_CHECKING:
    import torch

__all__ = ["export", "FORMATS"]

FORMATS = ("torch", "safetensors", "dcp")

_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
}


class ExportError(ValueError):
    """The checkpoint cannot be expressed in the requested format (names the tensor)."""


@functools.cache
def _holds(fmt: str, dtype: str) -> bool:
    """Whether ``fmt`` can store a tensor of ``dtype``: asked of the writer itself, on an
    empty tensor (torch.save and DCP lack the sub-byte and shell dtypes, and which they
    lack changes with torch's version), so that the export stops before reading anything
    rather than after assembling gigabytes, with torch's KeyError naming no tensor."""
    if fmt == "safetensors":
        return dtype in _SAFETENSORS_DTYPES
    import torch
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    empty = {"x": torch.empty(0, dtype=dtype_from_name(dtype), device="cpu")}
    try:
        if fmt == "torch":
            torch.save(empty, io.BytesIO())
        else:
            with tempfile.TemporaryDirectory() as probe:
                _write_dcp(empty, probe)
    except (Exception, CheckpointException):
        return False
    return True


def _refuse_what_the_format_cannot_hold(manifest: dict[str, Any], names: list[str], fmt: str) -> None:
    for name in names:
        dtype = manifest["tensors"][name]["dtype"]
        if not _holds(fmt, dtype):
            others = [f for f in FORMATS if f != fmt and _holds(f, dtype)]
            hint = f"export with --format {' or '.join(others)}" if others else "no export format can hold it"
            raise ExportError(f"tensor {name!r}: --format {fmt} cannot hold dtype {dtype}; {hint}")


def _scratch_tensor(scratch: str, index: int, meta: dict[str, Any]) -> torch.Tensor:
    import torch

    dtype = dtype_from_name(meta["dtype"])
    numel = math.prod(meta["shape"])
    if numel == 0:
        return torch.empty(meta["shape"], dtype=dtype, device="cpu")
    path = os.path.join(scratch, f"{index}.bin")
    with open(path, "wb") as f:
        f.truncate(numel * dtype_itemsize(meta["dtype"]))
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(meta["shape"])


def _dotted(obj: Any, prefix: str, out: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
    """Flatten to dotted names (the Hugging Face convention), tensors and plain values apart."""
    import torch

    if isinstance(obj, torch.Tensor):
        if prefix in out:
            raise ExportError(f"two tensors flatten to the name {prefix!r}")
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _dotted(v, f"{prefix}.{k}" if prefix else str(k), out, values)
    elif isinstance(obj, (list, tuple)):
        if any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
            for i, v in enumerate(obj):
                _dotted(v, f"{prefix}.{i}" if prefix else str(i), out, values)
        else:
            values[prefix] = list(obj)
    else:
        values[prefix] = obj


def _write_safetensors(obj: Any, path: str, step: int) -> None:
    import torch

    flat: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    _dotted(obj, "", flat, values)
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "resilient.step": str(step), "resilient.values": json.dumps(values)}
    }
    offset = 0
    for name, t in flat.items():
        code = _SAFETENSORS_DTYPES.get(dtype_name(t.dtype))
        if code is None:
            raise ExportError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in flat.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _write_dcp(obj: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = obj if isinstance(obj, dict) else {"value": obj}
    with warnings.catch_warnings():  # one process is what no_dist says: not worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def export(catalog: Catalog, step: int, fmt: str, out: str, *, key: str | None = None,
           progress: Callable[[int], None] = lambda n: None) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = os.path.abspath(out)
    if os.path.exists(out):
        raise ExportError(f"{out} already exists; remove it or choose another OUT")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    scratch = os.path.join(parent, f".{os.path.basename(out)}.scratch-{token}")
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{token}")
    os.makedirs(scratch)
    try:
        manifest = catalog.manifest(step)
        whole = whole_tree(manifest)  # every rank's names (pipeline stages')
        entries = dict(whole["items"])
        if key is not None and key not in entries:
            raise ExportError(f"--key {key!r} is not in step {step} (it holds: {', '.join(map(str, entries))})")
        from .._tree import tensor_names

        tree = entries[key] if key is not None else whole
        _refuse_what_the_format_cannot_hold(manifest, tensor_names(tree), fmt)
        count = iter(range(1 << 62))
        obj, _ = catalog.read_state(manifest, step, key, progress=progress,
                                    allocate=lambda meta: _scratch_tensor(scratch, next(count), meta))
        if fmt == "torch":
            import torch

            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        elif fmt == "safetensors":
            _write_safetensors(obj, tmp, step)
        else:
            _write_dcp(obj, tmp)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.unlink(tmp)
