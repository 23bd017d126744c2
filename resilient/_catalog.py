"""A read-only view of the checkpoints under a root, on any storage.

What the CLI and the tiers need to know without loading anything into a model: which
steps exist and in what state, what a manifest holds, whether the bytes still match their
checksums, and a tensor's full value assembled from its saved boxes (resharding to world
size one). Reading never unpickles or executes anything.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ._chunk_table import chunks_of, footer_bytes, pack_footer
from ._chunkio import decode_chunk
from ._errors import CheckpointCorruptError
from ._format import BAD_DIR, MANIFEST, decode_manifest, dtype_from_name, parse_step_dir, step_dir_name
from ._layout import Box
from ._storage import LocalStorage, Storage, the_missing_bucket
from ._saved_trees import whole_tree

if TYPE_CHECKING:
    import torch

__all__ = ["Entry", "Catalog", "spans"]

COMMITTED, PARTIAL, CORRUPT = "committed", "partial", "corrupt"
#: the most bytes of a bad marker's reason written or read: a marker in a bucket others can
#: write to is read at most this far (rank 0 reads one every 0.2 s while it waits)
BAD_REASON_BYTES = 4096
READ_SPAN = 64 << 20  # bytes fetched per request when streaming a file


def spans(chunks: Sequence[list[int]], limit: int | None = None) -> list[list[list[int]]]:
    """Consecutive chunks grouped into requests of at most ``limit`` (default ``READ_SPAN``)
    stored bytes (a larger chunk alone)."""
    limit = READ_SPAN if limit is None else limit
    out: list[list[list[int]]] = []
    i = 0
    while i < len(chunks):
        j, start = i, chunks[i][2]
        while j < len(chunks) and chunks[j][2] + chunks[j][3] - start <= max(limit, chunks[i][3]):
            j += 1
        out.append(list(chunks[i:j]))
        i = j
    return out


@dataclass
class Entry:
    """One step directory: its state and, when readable, what its manifest says."""

    step: int
    state: str
    problem: str | None = None
    manifest: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(f["bytes"] for f in self.manifest["files"].values()) if self.manifest else 0


class Catalog:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # -- listing ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every step directory, committed or not, ascending."""
        try:
            names = self.storage.list("")
        except FileNotFoundError as exc:
            why = the_missing_bucket(self.storage, exc) or "no such checkpoint root"
            raise FileNotFoundError(f"{self.storage.url}: {why}") from None
        return sorted(s for s in (parse_step_dir(n) for n in names) if s is not None)

    def is_committed(self, step: int) -> bool:
        """Whether ``step``'s commit record is there (files and checksums not checked)."""
        return self.storage.exists(f"{step_dir_name(step)}/{MANIFEST}")

    def committed_steps(self) -> list[int]:
        """Steps with a commit record and not marked bad, ascending; none when the root does
        not exist yet."""
        try:
            steps = self.steps()
        except FileNotFoundError:
            return []
        bad = self.bad_steps()
        candidates = [s for s in steps if s not in bad]
        return [s for s, ok in zip(candidates, self._each(self.is_committed, candidates)) if ok]

    def _each(self, check: Callable[[int], bool], steps: list[int]) -> list[bool]:
        """``check`` of every step; on an object store as concurrent requests. Why: one
        request per step, one at a time, made listing a run that keeps hundreds of steps
        cost hundreds of round trips at every ``latest()`` and restore."""
        if len(steps) < 2 or isinstance(self.storage, LocalStorage):
            return [check(s) for s in steps]
        with ThreadPoolExecutor(max_workers=min(16, len(steps)), thread_name_prefix="resilient-list") as pool:
            return list(pool.map(check, steps))

    def bad_steps(self) -> dict[int, str]:
        """Committed steps that failed verification when restored (step -> reason): they
        are not offered again and do not count towards retention. One listing."""
        try:
            names = self.storage.list(BAD_DIR)
        except FileNotFoundError:
            return {}
        bad = {}
        for name in names:
            step = parse_step_dir(name.rsplit("/", 1)[-1])
            if step is not None:
                bad[step] = name
        return bad

    def bad_reason(self, step: int) -> str | None:
        """The reason ``step`` was marked bad, None if it is not (one request, where
        ``bad_steps`` lists them all)."""
        try:
            return self.storage.read(f"{BAD_DIR}/{step_dir_name(step)}", 0, BAD_REASON_BYTES).decode(errors="replace")
        except FileNotFoundError:
            return None

    def mark_bad(self, step: int, reason: str) -> None:
        self.storage.write(f"{BAD_DIR}/{step_dir_name(step)}", [reason.encode()[:BAD_REASON_BYTES]])

    def clear_bad(self, step: int) -> None:
        """A step committed again (a new copy) is no longer the one that failed."""
        self.storage.delete(f"{BAD_DIR}/{step_dir_name(step)}")

    def entry(self, step: int, *, deep: bool = False, progress: Callable[[int], None] | None = None) -> Entry:
        """The state of ``step``: files and sizes checked; with ``deep``, every checksum too."""
        sdir = step_dir_name(step)
        if not self.is_committed(step):
            return Entry(step, PARTIAL, "no commit record (manifest.json)")
        reason = self.bad_reason(step)
        if reason is not None:
            return Entry(step, CORRUPT, f"failed verification when restored: {reason}")
        try:
            manifest = self.manifest(step)
            for fname, record in manifest["files"].items():
                size = self.storage.size(f"{sdir}/{fname}")
                if size != record["bytes"]:
                    return Entry(step, CORRUPT, f"{sdir}/{fname}: {size} bytes, manifest says {record['bytes']}",
                                 manifest)
            if deep:
                for fname in manifest["files"]:
                    self.verify_file(manifest, step, fname, progress)
        except FileNotFoundError as exc:
            return Entry(step, CORRUPT, f"missing file: {exc}")
        except CheckpointCorruptError as exc:
            return Entry(step, CORRUPT, str(exc))
        return Entry(step, COMMITTED, None, manifest)

    def entries(self, *, deep: bool = False) -> list[Entry]:
        return [self.entry(s, deep=deep) for s in self.steps()]

    def newest_consistent(self) -> int | None:
        """Newest step whose commit record is there and whose files have the recorded sizes."""
        for step in reversed(self.steps()):
            if self.entry(step).state == COMMITTED:
                return step
        return None

    # -- reading ------------------------------------------------------------------------------
    def manifest(self, step: int) -> dict[str, Any]:
        return self.manifest_and_record(step)[0]

    def manifest_and_record(self, step: int) -> tuple[dict[str, Any], bytes]:
        """The manifest, and the commit record's bytes it was decoded from (a copy commits
        with exactly the record it copied by, without fetching it twice)."""
        path = f"{step_dir_name(step)}/{MANIFEST}"
        raw = self.storage.read(path)
        return decode_manifest(raw, f"{self.storage.url}/{path}"), raw

    def table(self, manifest: dict[str, Any], step: int, fname: str) -> Sequence[list[int]]:
        """A data file's chunks, as the manifest lists them or, in format 4, as the file's
        footer does (read from this storage once, checked against the manifest)."""
        path = f"{step_dir_name(step)}/{fname}"
        return chunks_of(manifest["files"][fname], lambda start, end: bytes(self.storage.read(path, start, end)),
                         f"{self.storage.url}/{path}")

    def footer(self, manifest: dict[str, Any], step: int, fname: str) -> tuple[int, bytes]:
        """(where a format 4 file's chunk table starts, its bytes), checked; (size, b"")
        before format 4. What a copy writes after the chunks."""
        record = manifest["files"][fname]
        size = footer_bytes(record)
        if not size:
            return record["bytes"], b""
        # the table as read and checked, packed again: the same bytes the file ends with
        return record["bytes"] - size, pack_footer(list(self.table(manifest, step, fname)))

    def chunks(
        self, step: int, fname: str, chunks: Sequence[list[int]], *, decode: bool = True, span: int | None = None
    ) -> Iterator[tuple[list[int], memoryview]]:
        """Yield (chunk, its logical bytes, or its stored bytes without ``decode``) for
        consecutive chunks, fetched in spans of ``span`` bytes (``spans``), each checked
        against its CRC."""
        for group in spans(chunks, span):
            yield from self.read_span(step, fname, group, decode=decode)

    def read_span(
        self, step: int, fname: str, span: list[list[int]], *, decode: bool = True
    ) -> list[tuple[list[int], memoryview]]:
        """The chunks of one span (consecutive in the file) in one request, each checked
        against its CRC, as ``chunks`` yields them."""
        path = f"{step_dir_name(step)}/{fname}"
        where = f"{self.storage.url}/{path}"
        start = span[0][2]
        data = memoryview(self.storage.read(path, start, span[-1][2] + span[-1][3]))
        return [(chunk, decode_chunk(chunk, data[chunk[2] - start : chunk[2] - start + chunk[3]], where,
                                     decode=decode)) for chunk in span]

    def verify_file(self, manifest: dict, step: int, fname: str, progress: Callable[[int], None] | None = None) -> None:
        """Read every chunk of a data file and check its CRC (and, in format 4, its chunk
        table against the manifest's CRC of it); CheckpointCorruptError if not."""
        for chunk, _ in self.chunks(step, fname, self.table(manifest, step, fname), decode=False):
            if progress:
                progress(chunk[3])
        if progress:
            progress(footer_bytes(manifest["files"][fname]))

    def read_bytes(self, manifest: dict, step: int, fname: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with logical bytes ``[offset, offset+len(dest))`` of a data file."""
        end = offset + len(dest)
        chunks = [c for c in self.table(manifest, step, fname) if c[0] < end and c[0] + c[1] > offset]
        for chunk, data in self.chunks(step, fname, chunks):
            lo, hi = max(offset, chunk[0]), min(end, chunk[0] + chunk[1])
            dest[lo - offset : hi - offset] = data[lo - chunk[0] : hi - chunk[0]]

    def read_tensor(self, manifest: dict, step: int, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (every saved box placed), into ``out`` if given."""
        import torch  # here: listing and verifying checkpoints (``resilient-ckpt``) need no torch

        from ._snapshot import bitwise

        meta = manifest["tensors"][name]
        dtype = dtype_from_name(meta["dtype"])
        full = out if out is not None else torch.empty(meta["shape"], dtype=dtype, device="cpu")
        covered = 0
        for saved in meta["boxes"]:
            box = Box(tuple(saved["offsets"]), tuple(saved["sizes"]))
            whole = list(box.sizes) == list(meta["shape"]) and full.is_contiguous()
            # a box covering the tensor is read straight into it: no copy of the tensor in RAM
            part = full if whole else torch.empty(box.sizes, dtype=dtype, device="cpu")
            view = memoryview(part.reshape(-1).view(torch.uint8).numpy()) if part.numel() else memoryview(b"")
            pos = 0
            for fname, offset, nbytes in saved["pieces"]:
                self.read_bytes(manifest, step, fname, offset, view[pos : pos + nbytes])
                pos += nbytes
            if pos != len(view):
                raise CheckpointCorruptError(f"tensor {name!r}: pieces hold {pos} of {len(view)} bytes")
            if not whole:
                bitwise(full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]).copy_(bitwise(part))
            covered += box.numel
        if covered != math.prod(meta["shape"]):
            raise CheckpointCorruptError(f"tensor {name!r}: saved boxes cover {covered} of {math.prod(meta['shape'])} elements")
        return full

    def read_state(
        self,
        manifest: dict[str, Any],
        step: int,
        key: str | None = None,
        allocate: Callable[[dict[str, Any]], torch.Tensor] | None = None,
        progress: Callable[[int], None] = lambda n: None,
        kinds: bool = False,
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """(the saved structure, entry ``key`` or all of them, with full tensors; name ->
        tensor). Reading needs no target state: this is how a checkpoint is exported or
        handed to code that expects a ``torch.load``-style dict (numpy's arrays, bytes and
        sets come back as the tensors and lists they are stored as, what an export's formats
        hold, unless ``kinds``).
        ``allocate(meta)`` gives the
        memory a tensor is read into (export maps files, to bound memory)."""
        from ._tree import build_value  # here: ``_tree`` imports torch, which the CLI's listings never need

        entries = dict(whole_tree(manifest)["items"])  # every rank's names (pipeline stages')
        tensors: dict[str, torch.Tensor] = {}

        def tensor(name: str) -> torch.Tensor:
            if name not in tensors:
                meta = manifest["tensors"][name]
                tied = meta.get("same_as")
                if isinstance(tied, str) and "same_as" not in manifest["tensors"].get(tied, {"same_as": 0}):
                    tensors[name] = tensor(tied)  # one tensor under both names, as it was saved
                    return tensors[name]
                out = allocate(meta) if allocate is not None else None
                tensors[name] = self.read_tensor(manifest, step, name, out=out)
                progress(tensors[name].numel() * tensors[name].element_size())
            return tensors[name]

        if key is not None:
            return build_value(entries[key], tensor, kinds=kinds), tensors
        return {k: build_value(node, tensor, kinds=kinds) for k, node in entries.items()}, tensors

    # -- deleting -----------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """Uncommit first (the manifest), then remove the rest: a crash midway leaves a
        partial step, never a committed one with files missing."""
        sdir = step_dir_name(step)
        self.storage.delete(f"{sdir}/{MANIFEST}")
        self.clear_bad(step)
        self.storage.delete(sdir)
