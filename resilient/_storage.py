"""A tiny storage seam on string paths: the local filesystem through ``os``, anything else
through fsspec (``s3://``, ``gs://``, ``memory://``, ``file://``).

Five operations, each taking a path relative to the storage's root URL: ``list``,
``read``, ``write``, ``delete``, ``exists`` (plus ``size``). Missing things raise
``FileNotFoundError`` naming the full path. Credentials stay inside ``storage_options``
and never appear in a message: errors name the URL, which carries none.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import socket
import weakref
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Protocol

from ._errors import StorageError

__all__ = ["Storage", "LocalStorage", "FsspecStorage", "missing_bucket", "open_storage", "is_remote",
           "refuse_a_mistyped_url", "refuse_a_root_that_is_no_directory"]

# protocol -> the extra that installs its fsspec implementation
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


class Storage(Protocol):
    url: str

    def list(self, path: str = "") -> list[str]:
        """Names directly under ``path`` (files and directories), sorted."""

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes: ...

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Create or replace the file at ``path`` from ``chunks``; durable when it returns."""

    def put_file(self, local_path: str, path: str) -> None:
        """Upload a whole local file to ``path`` the fastest way the backend knows."""

    def delete(self, path: str) -> None:
        """Remove a file or a directory tree; missing is not an error."""

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def sizes(self, path: str = "") -> dict[str, int]:
        """The files directly under ``path`` and their sizes, in one listing (an object
        store answers for a thousand files at once, where ``size`` asks once per file)."""


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


#: a protocol's name with its "://" mistyped ("s3//bucket", "s3:/bucket", "gs:bucket")
_MISTYPED_URL = re.compile(r"(?i)(%s)(//|:/?(?!/))" % "|".join(
    sorted({*_EXTRAS, "abfss", "adl", "hdfs", "http", "https", "file", "memory"}, key=len, reverse=True)))


def refuse_a_mistyped_url(url: str, name: str = "remote") -> None:
    """Why: a location that is not a URL is a local (shared) directory, so "s3//bucket/run"
    as a remote tier uploaded into ./s3/bucket/run on each node's own disk, without a word,
    and a node's loss lost what the remote tier was to keep."""
    if "://" not in url and _MISTYPED_URL.match(url):
        raise ValueError(f"{name}={url!r} looks like a mistyped URL (protocol://bucket/path); a directory that "
                         "starts so would need to be written ./" + url)


def refuse_a_root_that_is_no_directory(root: str) -> None:
    """The local tier's root must name a directory. Why: "" (an unset environment variable)
    saved into the working directory, and a URL ("s3://bucket/run", where DCP takes one)
    into ./s3:/bucket/run on the node's own disk, both without a word; the object store
    belongs in ``remote=``, behind the node's disk."""
    if not root.strip():
        raise ValueError(f"root must name a directory on the node's disk, got {root!r}")
    if "://" in root:
        raise ValueError(f"root={root!r} is a URL: root is a directory on the node's own (fast) disk, and an "
                         f"object store or shared directory goes behind it as remote=, e.g. "
                         f"Checkpointer('/nvme/run', remote={root!r})")
    refuse_a_mistyped_url(root, "root")


class LocalStorage:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
        self.url = self.root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def list(self, path: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(path)))
        except NotADirectoryError:
            raise FileNotFoundError(f"{self._p(path)} is not a directory") from None

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with open(self._p(path), "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else end - start)

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        with self.creating(path) as fd, open(fd, "wb", closefd=False) as f:
            for chunk in chunks:
                f.write(chunk)

    @contextmanager
    def creating(self, path: str, size: int = 0) -> Iterator[int]:
        """A descriptor of a new file (``size`` bytes long to start with) that replaces
        ``path`` only once the block ends without an error, fsync'd: a reader never sees it
        half-written, and a failed block leaves nothing behind."""
        full = self._p(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        _remove_abandoned(full)
        tmp = f"{full}{_TMP}{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            yield fd
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, full)

    def put_file(self, local_path: str, path: str) -> None:
        with open(local_path, "rb") as f:
            self.write(path, iter(lambda: f.read(16 << 20), b""))

    def local_path(self, path: str) -> str:
        return self._p(path)

    def delete(self, path: str) -> None:
        full = self._p(path)
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif os.path.exists(full):
            os.unlink(full)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._p(path))

    def size(self, path: str) -> int:
        return os.path.getsize(self._p(path))

    def sizes(self, path: str = "") -> dict[str, int]:
        try:
            with os.scandir(self._p(path)) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except NotADirectoryError:
            raise FileNotFoundError(f"{self._p(path)} is not a directory") from None


#: a temporary file's suffix before its writer's pid: the host's name too, because a
#: local tier may be a shared filesystem, where a pid says nothing about another host's
_TMP = f".tmp-{socket.gethostname()}-"


def _remove_abandoned(full: str) -> None:
    """Delete the temporary files of ``full`` left by this host's processes that died while
    writing it (a download killed part-way): each is as large as the file, and nothing
    else would ever remove them. A live process's file is left alone."""
    for tmp in glob.glob(f"{glob.escape(full + _TMP)}*"):
        pid = tmp[len(full + _TMP):]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


#: a URL's "user:password@" before its host: the password part
_PASSWORD_IN_URL = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@:]*):[^/@]*@", re.IGNORECASE)


def refuse_a_password_in_the_url(url: str) -> None:
    """Why: a URL is written to logs, to errors and into the local root's record of its
    remote tier (for ``resilient-ckpt``), so a password in it ("sftp://bob:pw@host/run")
    would be in all of them. Credentials go in ``storage_options`` or the environment."""
    if _PASSWORD_IN_URL.match(url):
        shown = _PASSWORD_IN_URL.sub(r"\1:***@", url, count=1)
        raise StorageError(errno.EINVAL, f"{shown}: a password in the URL would be written to logs, errors and the "
                                         "checkpoint root's record of its remote tier; pass credentials in "
                                         "storage_options (or --storage-options) or the environment instead")


class FsspecStorage:
    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        refuse_a_password_in_the_url(url)
        protocol = url.split("://", 1)[0]
        try:
            import fsspec

            self.fs = fsspec.filesystem(protocol, **dict(storage_options or {}))
        except ImportError as exc:
            extra = _EXTRAS.get(protocol)
            hint = f"pip install 'resilient[{extra}]'" if extra else f"install fsspec's {protocol!r} backend"
            raise StorageError(2, f"{url}: support for {protocol}:// is not installed ({hint})") from exc
        except ValueError as exc:  # fsspec: unknown protocol
            raise StorageError(2, f"{url}: {exc}") from None
        self.url = url.rstrip("/")
        self._base = self.fs._strip_protocol(self.url)

    def _p(self, path: str) -> str:
        return f"{self._base}/{path}" if path else self._base

    def list(self, path: str = "") -> list[str]:
        base = self._p(path)
        try:
            entries = self.fs.ls(base, detail=False, refresh=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{path}".rstrip("/")) from None
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base})

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        try:
            return self.fs.cat_file(self._p(path), start=start, end=end)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{path}") from None

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        # Object stores publish a file only once the upload completes: no temp name needed.
        with self.fs.open(self._p(path), "wb") as f:
            for chunk in chunks:
                f.write(chunk)

    def put_file(self, local_path: str, path: str) -> None:
        # the backend's own upload: for S3, concurrent multipart parts (bounded memory)
        self.fs.put_file(local_path, self._p(path))

    def delete(self, path: str) -> None:
        try:
            self.fs.rm(self._p(path), recursive=True)
        except FileNotFoundError:
            pass

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._p(path))

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._p(path)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{path}") from None

    def sizes(self, path: str = "") -> dict[str, int]:
        try:
            entries = self.fs.ls(self._p(path), detail=True, refresh=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{path}".rstrip("/")) from None
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}


#: what object stores call a bucket or container that does not exist (S3 and its clones,
#: Azure), in the errors fsspec's backends chain under their ``FileNotFoundError``
_NO_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_NO_BUCKET_WORDS = ("bucket does not exist", "container does not exist")


def _names_a_missing_bucket(exc: BaseException) -> bool:
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        response = getattr(link, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in _NO_BUCKET_CODES or any(words in str(link).lower() for words in _NO_BUCKET_WORDS):
            return True
        link = link.__cause__ or link.__context__
    return False


def the_missing_bucket(storage: Storage, exc: BaseException) -> str | None:
    """What ``exc``, a listing's ``FileNotFoundError``, means when the store said the bucket
    itself does not exist (not just the prefix under it); None otherwise."""
    if not isinstance(storage, FsspecStorage) or not _names_a_missing_bucket(exc):
        return None
    bucket = storage._base.split("/", 1)[0]
    return f"the bucket {bucket!r} does not exist"


def missing_bucket(storage: Storage) -> str | None:
    """Why ``storage`` cannot be a remote tier, when its bucket does not exist; None when it
    does, or when the store gave no answer (an unreachable store is retried where it is used).

    Why ask: a listing of a missing bucket raised ``FileNotFoundError`` as an empty prefix
    does, so a mistyped bucket looked like a new run's empty tier: a job resumed on fresh
    nodes started from step 0 without a word, and every upload was retried for ever."""
    if not isinstance(storage, FsspecStorage):
        return None
    bucket = storage._base.split("/", 1)[0]
    if bucket in _BUCKETS_FOUND.get(storage.fs, ()):
        return None
    try:
        storage.fs.ls(storage._p(""), detail=False, refresh=True)
    except FileNotFoundError as exc:
        missing = the_missing_bucket(storage, exc)
        if missing:
            return f"remote tier {storage.url}: {missing} (create it, or correct remote=)"
        # else a new prefix, in a bucket that exists
    except Exception:  # noqa: BLE001 - unreachable, throttled, refused: not this question's answer
        return None
    _BUCKETS_FOUND.setdefault(storage.fs, set()).add(bucket)
    return None


#: the buckets ``missing_bucket`` has found, by file system (its endpoint and credentials):
#: asked once a process. Why: Lightning's plugin makes a Checkpointer for each checkpoint
#: path, and the question cost a request in each save's stall (12 ms to a local S3 server)
_BUCKETS_FOUND: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    if is_remote(url):
        return FsspecStorage(url, storage_options)
    return LocalStorage(url)
