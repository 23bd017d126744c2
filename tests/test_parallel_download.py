"""A step downloaded from the object store (moto's S3 server) into a local tier as concurrent
ranged reads: byte-identical to what was uploaded, every chunk checked, all or nothing."""

import os
import threading
import time
import uuid

import fsspec
import pytest
import torch

from resilient import Checkpointer, CheckpointCorruptError
from resilient import _catalog
from resilient._catalog import Catalog
from resilient._storage import FsspecStorage, LocalStorage
from resilient._transfer import copy_step

pytestmark = pytest.mark.timeout(120)

SPAN = 256 << 10  # small spans, so that a 4 MB file is many requests


@pytest.fixture
def uploaded(tmp_path, s3_server, monkeypatch):
    """(remote catalog, the uploading node's step directory, the state saved) for step 1."""
    monkeypatch.setattr(_catalog, "READ_SPAN", SPAN)
    url, opts = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}", s3_server["options"]
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(700_000, generator=g), "b": torch.randn(300, 1000, generator=g), "meta": {"k": 1}}
    with Checkpointer(tmp_path / "up", remote=url, storage_options=opts, chunk_bytes=64 << 10) as ckpt:
        ckpt.save(1, state)
        ckpt.flush(timeout=60)
    return Catalog(FsspecStorage(url, opts)), tmp_path / "up" / "step-0000000001", state


def test_a_step_downloads_in_concurrent_spans_byte_identical(tmp_path, uploaded, monkeypatch):
    remote, uploaded_dir, state = uploaded
    manifest = remote.manifest(1)
    data = [f for f in manifest["files"] if os.path.getsize(uploaded_dir / f) > SPAN]
    assert data, "the test needs a file of several spans"
    in_flight, most, lock = [0], [0], threading.Lock()
    real_read_span = Catalog.read_span

    def watched(self, *args, **kwargs):  # the real read, counted while it runs
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            time.sleep(0.02)  # a wider window than loopback's few milliseconds per request
            return real_read_span(self, *args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(Catalog, "read_span", watched)
    seen = []
    moved = copy_step(remote, LocalStorage(str(tmp_path / "node")), 1, seen.append, workers=8)
    assert most[0] > 1, "the spans were fetched one at a time"
    got = tmp_path / "node" / "step-0000000001"
    for name in manifest["files"]:
        assert (got / name).read_bytes() == (uploaded_dir / name).read_bytes(), name
    assert moved == sum(seen) == sum(r["bytes"] for r in manifest["files"].values())
    assert not [n for n in os.listdir(got) if ".tmp-" in n]
    target = {"a": torch.zeros(700_000), "b": torch.zeros(300, 1000), "meta": None}
    with Checkpointer(tmp_path / "node") as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])
    assert target["meta"] == {"k": 1}


def test_a_copy_between_object_stores_streams_every_file_with_its_chunk_table(tmp_path, uploaded, s3_server):
    """Neither side a local disk: each file is streamed chunk by chunk, then its chunk table
    (format 4: the file's last bytes, not a chunk), and the copy is byte for byte the upload."""
    remote, uploaded_dir, state = uploaded
    other = FsspecStorage(f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}", s3_server["options"])
    seen = []
    moved = copy_step(remote, other, 1, seen.append)
    manifest = remote.manifest(1)
    assert moved == sum(seen) == sum(r["bytes"] for r in manifest["files"].values())
    assert all(r["footer"][0] > 0 for r in manifest["files"].values())
    copy_step(Catalog(other), LocalStorage(str(tmp_path / "node")), 1)
    for name in manifest["files"]:
        assert (tmp_path / "node" / "step-0000000001" / name).read_bytes() == (uploaded_dir / name).read_bytes()
    target = {"a": torch.zeros(700_000), "b": torch.zeros(300, 1000), "meta": None}
    with Checkpointer(tmp_path / "node") as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])


def test_a_bad_byte_in_a_middle_span_leaves_no_file_behind(tmp_path, uploaded, s3_server):
    remote, uploaded_dir, _ = uploaded
    name = max(remote.manifest(1)["files"], key=lambda f: os.path.getsize(uploaded_dir / f))
    raw = bytearray((uploaded_dir / name).read_bytes())
    at = len(raw) // 2
    raw[at] ^= 0xFF
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_server["options"])
    fs.pipe(f"{remote.storage.url.removeprefix('s3://')}/step-0000000001/{name}", bytes(raw))
    local = tmp_path / "node"
    with pytest.raises(CheckpointCorruptError, match=name):
        copy_step(remote, LocalStorage(str(local)), 1, workers=8)
    step_dir = local / "step-0000000001"
    left = os.listdir(step_dir) if step_dir.exists() else []
    assert name not in left and not [n for n in left if ".tmp-" in n] and "manifest.json" not in left


def test_a_long_fetch_logs_its_progress(tmp_path, uploaded, s3_server, monkeypatch, caplog):
    """A node restoring from the object store says how far it has come while it downloads
    (every 10 s; here at every span), then how long the whole fetch took."""
    from resilient._transfer import ProgressLog

    monkeypatch.setattr(ProgressLog, "EVERY_S", 0.0)
    remote, _, state = uploaded
    target = {"a": torch.zeros(700_000), "b": torch.zeros(300, 1000), "meta": None}
    caplog.set_level("INFO", logger="resilient")
    with Checkpointer(tmp_path / "empty", remote=remote.storage.url, storage_options=s3_server["options"]) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["a"], state["a"])
    lines = [r.getMessage() for r in caplog.records]
    progress = [m for m in lines if m.startswith("resilient: fetching step 1 from s3://") and "GB so far" in m]
    assert len(progress) > 3, lines
    assert any(m.startswith("resilient: fetched step 1 from s3://") for m in lines)


def test_a_download_killed_part_way_leaves_nothing_after_the_next_one(tmp_path, uploaded, s3_server):
    """A process SIGKILLed while it downloads leaves its temporary file (as large as the data
    file); the next download of that file, by a live process, removes it. Another live
    process's temporary file is left alone."""
    import signal
    import subprocess
    import sys

    remote, uploaded_dir, _ = uploaded
    node = tmp_path / "node"
    script = (
        "import sys, time\n"
        "from resilient._catalog import Catalog\n"
        "from resilient._storage import FsspecStorage, LocalStorage\n"
        "from resilient._transfer import copy_step\n"
        "real = Catalog.read_span\n"
        "def slow(self, *a, **k):\n"
        "    out = real(self, *a, **k)\n"
        "    print('span', flush=True)\n"
        "    time.sleep(60)  # killed here, its temporary file part-written\n"
        "    return out\n"
        "Catalog.read_span = slow\n"
        f"copy_step(Catalog(FsspecStorage({remote.storage.url!r}, {s3_server['options']!r})), "
        f"LocalStorage({str(node)!r}), 1, workers=1)\n"
    )
    from .launch import REPO

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert proc.stdout.readline().strip() == "span"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    step_dir = node / "step-0000000001"
    left = [n for n in os.listdir(step_dir) if ".tmp-" in n]
    assert left and all(n.endswith(f"-{proc.pid}") for n in left)
    data = left[0].split(".tmp-")[0]
    live = step_dir / f"{left[0].rsplit('-', 1)[0]}-1"  # pid 1 is alive: not ours to remove
    live.write_bytes(b"x")
    copy_step(remote, LocalStorage(str(node)), 1, skip_present=True, workers=8)
    assert sorted(os.listdir(step_dir)) == sorted([*remote.manifest(1)["files"], "manifest.json", live.name])
    assert (step_dir / data).read_bytes() == (uploaded_dir / data).read_bytes()


def test_a_step_left_without_its_commit_record_is_removed_at_the_first_save(tmp_path, uploaded, caplog):
    """A fetch stopped after its data files, before the commit record: that directory is
    never committed and nothing else deletes it. The job's first save, which claims the
    root, removes it; a committed step stays."""
    remote, _, state = uploaded
    node = tmp_path / "node"
    copy_step(remote, LocalStorage(str(node)), 1, commit=False, workers=8)  # the files, no record
    assert (node / "step-0000000001").is_dir() and not (node / "step-0000000001" / "manifest.json").exists()
    caplog.set_level("INFO", logger="resilient")
    with Checkpointer(node) as ckpt:
        assert ckpt.latest() is None
        ckpt.save(2, state)
        ckpt.wait()
    assert sorted(n for n in os.listdir(node) if n.startswith("step-")) == ["step-0000000002"]
    assert any("a download stopped part-way" in r.getMessage() and "step-0000000001" in r.getMessage()
               for r in caplog.records)
