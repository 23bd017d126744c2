"""Copying committed checkpoints between storages, verified, commit record last.

Used by ``resilient-ckpt pull/push``. The copy streams each data file chunk-span by
chunk-span, checking every chunk's CRC on the way, so a bad source byte stops the copy
instead of spreading; the destination's manifest is written only after every data file is
complete, so a reader of the destination never sees a half-copied step as committed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Callable, Iterable, Iterator, Sequence

from ._background import drain
from ._catalog import READ_SPAN, Catalog, spans
from ._chunk_table import footer_bytes
from ._chunkio import pwrite_all
from ._format import CHECKED_SUFFIX, MANIFEST, step_dir_name
from ._local import LocalTier
from ._storage import LocalStorage, Storage

__all__ = ["copy_step", "commit_step", "missing_files", "ProgressLog"]

log = logging.getLogger("resilient")

#: stored bytes read at a time from a local source: a local read needs no large requests, and
#: the piece of a copy a yielding thread has in hand, done at its share of a busy core (some
#: 1.5%), is waited for by whoever takes the copy over (``_background.Handover``)
LOCAL_SPAN = 8 << 20


def copy_step(
    src: Catalog,
    dst: Storage,
    step: int,
    progress: Callable[[int], None] | None = None,
    *,
    skip_present: bool = False,
    only_present: bool = False,
    commit: bool = True,
    mark_checked: bool = False,
    workers: int = 4,
    run_pieces: Callable[[Iterator[object]], None] = drain,
) -> int:
    """Copy committed ``step`` from ``src`` to ``dst``; return the bytes copied.

    ``skip_present``: files the destination already holds at their recorded size are not
    copied again (a resumed upload, a partly filled local tier). ``only_present``: copy
    just the files the source holds (a node-local tier holds its own ranks' files).
    ``commit``: write the manifest last; without it the step stays uncommitted there.
    ``mark_checked``: give each file its ``checked_marker`` once its checksums have passed,
    for the rank that commits the step from the nodes' uploads (``missing_files``); a file
    already there is then kept only with its marker, and uploaded again otherwise.
    ``run_pieces``: how the work read from a local source is run, piece by piece (its
    checksums, a copy to a local directory): in the calling thread, or, for the uploader,
    by a thread that yields to training until someone waits (``_background.in_pieces``).
    """
    manifest, commit_record = src.manifest_and_record(step)
    sdir = step_dir_name(step)
    if not skip_present and commit and dst.exists(f"{sdir}/{MANIFEST}"):
        # The destination holds this step already: its copy stays until the new one is
        # complete and verified. On a local disk the new copy is built aside and swapped in;
        # an object store has no rename, so there the whole source is verified before the
        # old copy is uncommitted (the source keeps a good copy throughout).
        if isinstance(dst, LocalStorage):
            return _replace_local(src, dst, step, progress, workers)
        for fname in manifest["files"]:
            src.verify_file(manifest, step, fname)
    if not skip_present:
        dst.delete(f"{sdir}/{MANIFEST}")  # re-copying a step: uncommit the old copy first
    lock = threading.Lock()
    report = None if progress is None else functools.partial(_locked, lock, progress)
    # what each side holds, one listing each (not two requests per file)
    present = _sizes(dst, sdir) if skip_present else {}
    available = _sizes(src.storage, sdir) if only_present else {}
    local_src = isinstance(src.storage, LocalStorage)
    span = LOCAL_SPAN if local_src else None  # (None: READ_SPAN)

    def one(fname: str, record: dict) -> int:
        path = f"{sdir}/{fname}"
        if only_present and fname not in available:
            return 0

        def stream() -> Iterator[memoryview]:
            for _, stored in src.chunks(step, fname, src.table(manifest, step, fname), decode=False, span=span):
                if report:
                    report(len(stored))
                yield stored
            footer = src.footer(manifest, step, fname)[1]
            if report and footer:
                report(len(footer))
            yield memoryview(footer)

        marks = mark_checked and isinstance(src.storage, LocalStorage)
        marker = checked_marker(fname, record)
        if marks and skip_present and marker in present:
            return 0  # this very file, uploaded and checked before
        if not marks and skip_present and present.get(fname) == record["bytes"]:
            if isinstance(src.storage, LocalStorage):
                # it may be an upload whose checksums failed beside it, the process dying
                # before it deleted it: what is committed there was read here and checked
                _checked_or_removed(lambda: run_pieces(stream()), dst, path)
            return 0
        if local_src and isinstance(dst, LocalStorage):
            run_pieces(_copying(src, dst, step, fname, manifest, report))  # each byte read once
        elif local_src:
            # the backend uploads the file its own way (S3: concurrent multipart) while its
            # checksums are checked from the local disk beside it (``_put_checked``)
            _put_checked(stream, dst, src.storage.local_path(path), path, run_pieces)
        elif isinstance(dst, LocalStorage) and _back_to_back(src.table(manifest, step, fname), record):
            _download(src, dst, step, fname, manifest, span_workers, report)
        else:
            dst.write(path, stream())
        size = dst.size(path)
        if size != record["bytes"]:
            raise OSError(f"{dst.url}/{path}: wrote {size} bytes, expected {record['bytes']}")
        if marks:  # after the check and the size: what the committing rank waits for
            dst.write(f"{sdir}/{marker}", [b""])
        return size

    files = list(manifest["files"].items())
    # about ``workers`` requests in flight: the files of more than one span share them
    # (a file's stored bytes tell whether it takes several spans: its table may not be read yet)
    span_workers = max(1, workers // max(1, min(workers, sum(r["bytes"] - footer_bytes(r) > READ_SPAN
                                                             for _, r in files))))
    made_here = isinstance(dst, LocalStorage) and not dst.exists(sdir)
    try:
        if workers > 1 and len(files) > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(files))) as pool:  # (every file done on leaving)
                total = sum(pool.map(lambda item: one(*item), files))
        else:
            total = sum(one(*item) for item in files)
    except BaseException:
        if made_here:  # a bad source leaves not even the step's directory behind, where no file was copied
            with suppress(OSError):
                os.rmdir(dst.local_path(sdir))
        raise
    if commit:
        commit_step(src, dst, step, commit_record)
    return total


class ProgressLog:
    """Logs how far a long copy has come, every ``EVERY_S`` seconds: a node restoring
    hundreds of GB from an object store is otherwise silent for minutes. A copy shorter
    than that logs nothing here (its caller logs its end). Calls come under one lock."""

    EVERY_S = 10.0

    def __init__(self, what: str) -> None:
        self.what, self.done = what, 0
        self.start = time.monotonic()
        self._next = self.start + self.EVERY_S

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.EVERY_S
            log.info("resilient: %s: %.2f GB so far, %.2f GB/s", self.what, self.done / 1e9,
                     self.done / 1e9 / max(now - self.start, 1e-9))


def _locked(lock: threading.Lock, progress: Callable[[int], None], n: int) -> None:
    with lock:
        progress(n)


def _back_to_back(chunks: Sequence[list[int]], record: dict) -> bool:
    """Whether a data file is its chunks, stored one after the other from byte 0 (what the
    writer makes), then its footer, if any: then each span can be written at its own offset."""
    end = 0
    for chunk in chunks:
        if chunk[2] != end:
            return False
        end += chunk[3]
    return end == record["bytes"] - footer_bytes(record)


def _download(src: Catalog, dst: LocalStorage, step: int, fname: str, manifest: dict, workers: int,
              progress: Callable[[int], None] | None) -> None:
    """One data file from a remote tier into local storage as up to ``workers`` concurrent
    ranged reads, each span's chunks checked against their CRCs before they are written at
    their offset; the file appears complete and fsync'd, or not at all.

    Why not one stream: a node with an empty disk restores only as fast as it downloads.
    With one request at a time, a restore of 0.5 GB from one file (S3 protocol on loopback)
    reached 61% of the throughput of 8 plain concurrent ranged GETs of the same bytes; with
    this, 93%."""
    with _creating(src, dst, step, fname, manifest, progress) as fd:

        def fetch(span: list[list[int]]) -> None:
            drain(_written(fd, src.read_span(step, fname, span, decode=False), progress))

        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resilient-download")
        try:
            for future in [pool.submit(fetch, span) for span in spans(src.table(manifest, step, fname))]:
                future.result()
        finally:  # a failed span: nothing more is fetched, and no thread writes after the file is gone
            pool.shutdown(wait=True, cancel_futures=True)


def _copying(src: Catalog, dst: LocalStorage, step: int, fname: str, manifest: dict,
             progress: Callable[[int], None] | None) -> Iterator[None]:
    """A data file from a local directory into another, each chunk written at its offset once
    its CRC has passed, one chunk a step (for ``copy_step``'s ``run_pieces``); the file
    appears complete and fsync'd, or not at all. Why not check, then copy: that read every
    byte twice (the second time from the page cache, if it still held the file), and held
    two passes' work for a yielding thread to be taken over from."""
    with _creating(src, dst, step, fname, manifest, progress) as fd:
        yield from _written(fd, src.chunks(step, fname, src.table(manifest, step, fname), decode=False,
                                           span=LOCAL_SPAN), progress)


@contextmanager
def _creating(src: Catalog, dst: LocalStorage, step: int, fname: str, manifest: dict,
              progress: Callable[[int], None] | None) -> Iterator[int]:
    """A new data file of ``step`` in ``dst`` (``LocalStorage.creating``), its footer written."""
    with dst.creating(f"{step_dir_name(step)}/{fname}", manifest["files"][fname]["bytes"]) as fd:
        at, footer = src.footer(manifest, step, fname)
        pwrite_all(fd, memoryview(footer), at)
        if progress and footer:
            progress(len(footer))
        yield fd


def _written(fd: int, chunks: Iterable[tuple[list[int], memoryview]],
             progress: Callable[[int], None] | None) -> Iterator[None]:
    """Checked chunks written at their offsets, one a step."""
    for chunk, stored in chunks:
        pwrite_all(fd, stored, chunk[2])
        if progress:
            progress(len(stored))
        yield


def _replace_local(src: Catalog, dst: LocalStorage, step: int, progress: Callable[[int], None] | None,
                   workers: int) -> int:
    tier = LocalTier(dst.root)
    aside = LocalStorage(os.path.join(tier.pending_dir(f"copy-{uuid.uuid4().hex[:8]}", 0)))
    try:
        total = copy_step(src, aside, step, progress, workers=workers)  # verified as it streams
        tier.install(aside.local_path(step_dir_name(step)), step)
    finally:
        shutil.rmtree(aside.root, ignore_errors=True)
        tier.close()  # the replaced copy is gone before the command returns
    return total


def _put_checked(checking: Callable[[], Iterator[object]], dst: Storage, local_path: str, path: str,
                 run_pieces: Callable[[Iterator[object]], None] = drain) -> None:
    """Upload ``local_path`` to ``path`` while ``checking()`` (its checksums, read from the
    local disk, in pieces run by ``run_pieces``) runs beside it; a file that fails its check
    is deleted from ``dst`` again.

    Why beside and not first: checking 0.5 GB takes 0.4-0.6 s of one core here, which an
    upload waited for; against an object store as fast as the disk that halves the upload's
    throughput. Nothing unchecked can be committed: the commit record is written after every
    file's ``copy_step`` returns (by rank 0, for the nodes' uploads, once each file has its
    ``checked_marker``), and a file left behind by a process that died before
    deleting it is checked again before a later copy counts it as present. (A copy to a
    local directory writes only checked chunks: ``_copying``.)"""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient-check") as pool:
        checked = pool.submit(lambda: run_pieces(checking()))
        try:
            dst.put_file(local_path, path)
        except BaseException:
            if checked.exception() is not None:
                _delete_quietly(dst, path)
            raise
        _checked_or_removed(checked.result, dst, path)


def _checked_or_removed(check: Callable[[], object], dst: Storage, path: str) -> None:
    """``check()``; when it raises, ``path`` is deleted from ``dst`` before the error goes on."""
    try:
        check()
    except BaseException:
        _delete_quietly(dst, path)
        raise


def _delete_quietly(dst: Storage, path: str) -> None:
    try:
        dst.delete(path)
    except Exception:  # noqa: BLE001 - the check's error is the one to report
        log.warning("resilient: could not delete %s/%s after its checksums failed", dst.url, path, exc_info=True)


def commit_step(src: Catalog, dst: Storage, step: int, record: bytes | None = None) -> None:
    """Write ``step``'s commit record (its manifest; ``record`` when the copy read it
    already) on ``dst``: the last write of a copy."""
    path = f"{step_dir_name(step)}/{MANIFEST}"
    dst.write(path, [record if record is not None else src.storage.read(path)])
    Catalog(dst).clear_bad(step)


def checked_marker(fname: str, record: dict) -> str:
    """The name of the empty object that says ``fname``, as ``record`` (its manifest entry:
    size and checksums) describes it, was uploaded and checked.

    Why the record's digest is in the name: a step number can be saved again after a
    fallback, with files of the same names and sizes. A marker or file left by the earlier
    save then does not pass for the new one, and a listing alone tells them apart."""
    digest = zlib.crc32(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return f"{fname}{CHECKED_SUFFIX}{digest:08x}"


def missing_files(catalog: Catalog, manifest: dict, *, checked: bool = False) -> set[str]:
    """The data files of ``manifest`` not on ``catalog``'s storage at their size (one
    listing: rank 0 asks this of the object store until every node's files are up).

    With ``checked``, a file without its ``checked_marker`` counts as missing too. Without
    it, rank 0 could commit a file whose check, beside its upload, was still running and
    then failed (a committed step with a file deleted from under it), or a file of the same
    name and size an earlier save of that step number left."""
    sizes = _sizes(catalog.storage, step_dir_name(manifest["step"]))
    return {f for f, r in manifest["files"].items()
            if sizes.get(f) != r["bytes"] or (checked and checked_marker(f, r) not in sizes)}


def _sizes(storage: Storage, path: str) -> dict[str, int]:
    """``storage.sizes(path)``; empty where ``path`` does not exist."""
    try:
        return storage.sizes(path)
    except FileNotFoundError:
        return {}
