"""Tiered storage: local first, the object store (moto's S3 server) behind, faults injected."""

import json
import logging
import os
import shutil
import random
import re
import time
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from resilient import AnyOf, Checkpointer, KeepEvery, KeepLast, StorageError

from .launch import free_port
from .waiting import wait_until

pytestmark = pytest.mark.timeout(180)


def s3_url(server):
    return f"s3://{server['bucket']}/{uuid.uuid4().hex}"


def remote_fs(url, options):
    """(the remote tier's filesystem, its listings fresh; the root's path on it)."""
    fs = fsspec.filesystem("s3", **options) if url.startswith("s3://") else fsspec.filesystem(url.split("://")[0])
    fs.invalidate_cache()
    return fs, fs._strip_protocol(url)


def remote_steps(url, options):
    fs, base = remote_fs(url, options)
    if not fs.exists(base):
        return []
    return sorted(int(p.rsplit("-", 1)[1]) for p in fs.ls(base, detail=False)
                  if p.rsplit("/", 1)[1].startswith("step-") and fs.exists(f"{p}/manifest.json"))


def test_flush_then_restore_on_a_node_with_an_empty_disk(tmp_path, s3_server):
    url, opts = s3_url(s3_server), s3_server["options"]
    model = torch.nn.Linear(64, 32)
    with Checkpointer(tmp_path / "node-a", remote=url, storage_options=opts, keep=None) as ckpt:
        ckpt.save(1, {"model": model, "meta": {"k": 1}})
        with torch.no_grad():
            model.weight.add_(1)
        ckpt.save(2, {"model": model, "meta": {"k": 2}})
        ckpt.flush(timeout=60)
    assert remote_steps(url, opts) == [1, 2]
    shutil.rmtree(tmp_path / "node-a")
    fresh = torch.nn.Linear(64, 32)
    state = {"model": fresh, "meta": None}
    with Checkpointer(tmp_path / "node-b", remote=url, storage_options=opts) as ckpt:
        assert ckpt.latest() == 2
        assert ckpt.restore(state) == 2
    assert torch.equal(fresh.weight, model.weight) and state["meta"] == {"k": 2}
    # what the restore downloaded is now on the local tier, and is not fetched again
    assert os.path.exists(tmp_path / "node-b" / "step-0000000002" / "manifest.json")


def test_object_store_down_then_back_nothing_lost(tmp_path, s3_server):
    from .faults import TcpProxy

    # The outage is a cut link, not a stopped server: moto's server stopped still answers
    # on the connections s3fs keeps open, so the store did not always look down.
    host, port = s3_server["options"]["client_kwargs"]["endpoint_url"].split("//")[1].split(":")
    link = TcpProxy(host, int(port))
    opts = {**s3_server["options"], "client_kwargs": {"endpoint_url": f"http://{link.endpoint}"},
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    url = s3_url(s3_server)
    state = {"w": torch.zeros(1 << 16)}
    ckpt = Checkpointer(tmp_path / "local", remote=url, storage_options=opts, keep=1)
    try:
        for step in (1, 2):
            state["w"].fill_(step)
            ckpt.save(step, state)
        ckpt.flush(timeout=60)
        link.cut()  # the store vanishes
        stalls = []
        for step in (3, 4, 5):
            state["w"].fill_(step)
            t = time.perf_counter()
            ckpt.save(step, state)
            stalls.append(time.perf_counter() - t)
            ckpt.wait(timeout=30)  # local commits go on
        assert max(stalls) < 1.0
        with pytest.raises(TimeoutError, match=r"pending"):
            ckpt.flush(timeout=1)
        local = sorted(n for n in os.listdir(tmp_path / "local") if n.startswith("step-"))
        assert local == ["step-0000000002", "step-0000000003", "step-0000000004", "step-0000000005"][-len(local):]
        assert "step-0000000003" in local  # not uploaded yet, so not deleted despite keep=1
        assert remote_steps(url, s3_server["options"]) == [1, 2]
        assert ckpt._uploader.retries > 0
        link.mend()  # the store comes back
        ckpt.flush(timeout=90)
        assert remote_steps(url, s3_server["options"]) == [1, 2, 3, 4, 5]
    finally:
        ckpt.close(timeout=5)
        link.cut()
    assert sorted(n for n in os.listdir(tmp_path / "local") if n.startswith("step-")) == ["step-0000000005"]


def test_retention_on_both_tiers(tmp_path, s3_server):
    url, opts = s3_url(s3_server), s3_server["options"]
    with Checkpointer(tmp_path / "l", remote=url, storage_options=opts, keep=1,
                      keep_remote=AnyOf(KeepLast(2), KeepEvery(4))) as ckpt:
        for step in range(1, 8):
            ckpt.save(step, {"x": torch.full((8,), float(step))})
        ckpt.flush(timeout=60)
    assert remote_steps(url, opts) == [4, 6, 7]
    assert sorted(n for n in os.listdir(tmp_path / "l") if n.startswith("step-")) == ["step-0000000007"]


class FlakyFS(MemoryFileSystem):
    """An fsspec store whose every call fails while ``broken`` (refused, 503, timeouts)."""

    protocol = "flaky"
    broken = False
    calls_failed = 0
    fail_next = 0  # fail this many calls more, then answer
    fail_next_data_reads = 0  # the same, counting only reads of data files
    reads: list[str] = []  # every path read, in order
    _errors = [ConnectionRefusedError("injected: connection refused"), OSError("injected: 503 SlowDown"),
               TimeoutError("injected: read timed out")]



def _failing(name):
    """MemoryFileSystem's method ``name``, raising one of the injected errors while broken."""
    inner = getattr(MemoryFileSystem, name)

    def method(self, *a, **k):
        if name == "cat_file":
            FlakyFS.reads.append(str(a[0]))
        data_read = name == "cat_file" and str(a[0]).endswith(".data") and FlakyFS.fail_next_data_reads > 0
        if FlakyFS.broken or FlakyFS.fail_next > 0 or data_read:
            FlakyFS.fail_next = max(0, FlakyFS.fail_next - 1)
            FlakyFS.fail_next_data_reads -= int(data_read)
            FlakyFS.calls_failed += 1
            raise FlakyFS._errors[FlakyFS.calls_failed % 3]
        return inner(self, *a, **k)

    return method


for _name in ("_open", "cat_file", "ls", "info"):  # every read, write and listing goes through these
    setattr(FlakyFS, _name, _failing(_name))


def _refusing(name):
    """MemoryFileSystem's deletion ``name``, refused (as S3's AccessDenied) while
    ``refuse_deletes``, of what exists (a missing path is not found, as on S3)."""
    inner = getattr(MemoryFileSystem, name)

    def method(self, *a, **k):
        if FlakyFS.refuse_deletes and MemoryFileSystem.exists(self, a[0]):
            raise PermissionError("injected: AccessDenied (s3:DeleteObject)")
        return inner(self, *a, **k)

    return method


FlakyFS.refuse_deletes = False
for _name in ("rm", "_rm", "rmdir"):
    setattr(FlakyFS, _name, _refusing(_name))


@pytest.fixture
def flaky():
    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    FlakyFS.broken, FlakyFS.calls_failed, FlakyFS.fail_next, FlakyFS.fail_next_data_reads = False, 0, 0, 0
    FlakyFS.reads = []
    yield f"flaky://run-{uuid.uuid4().hex[:6]}"
    FlakyFS.broken, FlakyFS.fail_next, FlakyFS.fail_next_data_reads, FlakyFS.refuse_deletes = False, 0, 0, False


def test_fault_injected_store_retries_and_catches_up_in_order(tmp_path, flaky, caplog):
    FlakyFS.broken = True
    training_stream = random.getstate()  # saved with each checkpoint: the retries draw nothing from it
    with Checkpointer(tmp_path / "l", remote=flaky, keep=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
        ckpt.wait()
        time.sleep(0.5)
        # nothing could be uploaded, so nothing local was deleted
        assert sorted(n for n in os.listdir(tmp_path / "l") if n.startswith("step-")) == [
            "step-0000000001", "step-0000000002", "step-0000000003"]
        FlakyFS.broken = False
        ckpt.flush(timeout=60)
    assert FlakyFS.calls_failed > 0
    assert random.getstate() == training_stream
    assert remote_steps(flaky, {}) == [1, 2, 3]
    uploads = [r.getMessage() for r in caplog.records if "upload of step" in r.getMessage()]
    assert uploads == [] or all("step 1" in m for m in uploads)  # in order: 2 waits behind 1
    assert sorted(n for n in os.listdir(tmp_path / "l") if n.startswith("step-")) == ["step-0000000003"]


def test_a_store_that_refuses_deletes_does_not_stop_the_uploads(tmp_path, flaky, caplog):
    """Credentials that may write but not delete (a common bucket policy) made remote
    retention fail after the second step; it was retried for as long as it took, as an
    upload is, and no later step was uploaded again. Now rank 0's deletions get a few tries,
    then a warning, and run again after the next step."""
    FlakyFS.refuse_deletes = True
    with Checkpointer(tmp_path / "l", remote=flaky, keep=1, keep_remote=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
            ckpt.flush(timeout=30)
        assert remote_steps(flaky, {}) == [1, 2, 3]  # every step up; retention could delete none
        FlakyFS.refuse_deletes = False  # the policy is mended: the next step's retention catches up
        ckpt.save(4, {"x": torch.full((4,), 4.0)})
        ckpt.flush(timeout=30)
        wait_until(lambda: remote_steps(flaky, {}) == [4], what="retention catching up")
    refused = [r.getMessage() for r in caplog.records if "remote retention" in r.getMessage() and "uploads go on" in r.getMessage()]
    assert refused and "AccessDenied" in refused[0], [r.getMessage() for r in caplog.records]


def test_a_bad_marker_the_store_will_not_delete_gives_that_step_up_only(tmp_path, flaky, caplog):
    """Step 1 was found bad on the remote tier and the job saved it again; committing it
    there deletes its bad marker, which write-only credentials refuse. That was retried for
    as long as it took, and no later step was uploaded. Now the step is given up, the log
    says which marker to delete by hand, and step 2 is uploaded."""
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    remote = Catalog(open_storage(flaky))
    remote.mark_bad(1, "failed verification when restored: checksum mismatch")
    FlakyFS.refuse_deletes = True
    with Checkpointer(tmp_path / "l", remote=flaky) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
            ckpt.flush(timeout=30)
    assert remote.committed_steps() == [2] and remote.is_committed(1)  # step 1's record is there, not offered
    given_up = [r.getMessage() for r in caplog.records if "refuses to delete the bad marker" in r.getMessage()]
    assert given_up and ".bad/step-0000000001 by hand" in given_up[0] and "AccessDenied" in given_up[0], given_up


def test_remote_retention_reads_no_manifest(tmp_path, flaky):
    """Remote retention runs after every upload. It read every remote step's manifest and
    sized each of its files, so a run keeping many steps of many ranks paid for all of them
    at every upload (100,000 requests for 100 steps of 1,000 ranks). It needs the commit
    records only: each step there was checked file by file on its way up."""
    with Checkpointer(tmp_path / "l", remote=flaky, keep=1, keep_remote=AnyOf(KeepLast(1), KeepEvery(2))) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
            ckpt.flush(timeout=30)
    assert remote_steps(flaky, {}) == [2, 4, 6, 8]
    assert [p for p in FlakyFS.reads if p.endswith("manifest.json")] == []


def _local_steps(root):
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


def test_a_store_outage_queues_only_what_remote_retention_keeps(tmp_path, flaky, caplog):
    """With the store down, every save used to be queued for upload and kept on the local
    disk until it was up, whatever ``keep_remote`` said: an outage of hours filled the disk,
    and then no save fit. Now a queued step that remote retention would delete once the
    newer ones are up is not uploaded, and local retention lets it go at once. Both cases:
    the store down from the start (the uploader has not even listed it), and down while a
    step is being uploaded (that one is given up at its next try)."""
    root = tmp_path / "l"
    FlakyFS.broken = True
    with caplog.at_level(logging.INFO, logger="resilient"), \
            Checkpointer(root, remote=flaky, keep=1, keep_remote=2) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
            ckpt.wait()  # (local retention runs right after the commit, in the writer's thread)
            wait_until(lambda: _local_steps(root) == list(range(max(1, step - 1), step + 1)),  # noqa: B023
                       what=f"at most 2 steps on the local disk after step {step}")
        FlakyFS.broken = False
        ckpt.flush(timeout=60)
        assert remote_steps(flaky, {}) == [5, 6] and _local_steps(root) == [6]
        wait_until(lambda: ckpt._uploader._current is None, what="remote retention after step 6")

        FlakyFS.broken = True  # step 7's upload is retried as steps 8 to 10 come
        for step in range(7, 11):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
            ckpt.wait()
            if step == 7:  # being uploaded, not just queued (a queued one is let go at once)
                wait_until(lambda: ckpt._uploader._current == 7, what="step 7's upload begun")
        wait_until(lambda: ckpt._uploader.pending() == [9, 10] and _local_steps(root) == [9, 10], timeout=30,
                   what="steps 7 and 8 settled and deleted locally")
        FlakyFS.broken = False
        ckpt.flush(timeout=60)
    assert remote_steps(flaky, {}) == [9, 10] and _local_steps(root) == [10]
    fs, base = remote_fs(flaky, {})
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False) if "/step-" in p) == [
        "step-0000000009", "step-0000000010"]  # nothing left of 7 and 8 either
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 7 is not committed" in m and "KeepLast(n=2)" in m for m in messages), messages


def test_two_nodes_give_up_a_step_superseded_while_the_store_is_down_alike(tmp_path, flaky):
    """Each node decides from its own queue which steps remote retention lets go: with the
    store down, both retry step 1 as steps 2 and 3 come, and both give it up at their next
    try; rank 0 commits 2 and 3 once the store is back, and nothing of step 1 is left."""
    _, uploaders, _ = _saved_on_two_nodes(tmp_path, flaky, 3, keep_remote=KeepLast(2), base_delay=0.05,
                                          max_delay=0.2)
    try:
        FlakyFS.broken = True
        for u in uploaders:
            u.enqueue(1)
        wait_until(lambda: FlakyFS.calls_failed >= 4, what="both nodes retrying step 1")
        for step in (2, 3):
            for u in uploaders:
                u.enqueue(step)
        wait_until(lambda: all(u.pending() == [2, 3] for u in uploaders), timeout=30,
                   what="step 1 given up on both nodes")
        FlakyFS.broken = False
        for u in uploaders:
            u.flush(timeout=30)
    finally:
        for u in uploaders:
            u.close()
    assert remote_steps(flaky, {}) == [2, 3]
    fs, base = remote_fs(flaky, {})
    assert not fs.exists(f"{base}/step-0000000001")


def test_credentials_never_appear_in_logs_errors_or_manifests(tmp_path, caplog, capfd):
    pytest.importorskip("s3fs")
    secret = "sekrit-" + uuid.uuid4().hex
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opts = {"key": "AKIAEXAMPLE", "secret": secret, "client_kwargs": {"endpoint_url": dead},
            "config_kwargs": {"connect_timeout": 0.5, "retries": {"max_attempts": 1}}}
    with caplog.at_level(logging.DEBUG, logger="resilient"):
        ckpt = Checkpointer(tmp_path / "l", remote="s3://nowhere/run", storage_options=opts)
        ckpt.save(1, {"x": torch.ones(3)})
        ckpt.wait()
        with pytest.raises(TimeoutError) as err:
            ckpt.flush(timeout=2)
        ckpt.close(timeout=1)
    out, errout = capfd.readouterr()
    assert secret not in str(err.value) and secret not in out + errout
    assert all(secret not in r.getMessage() for r in caplog.records)
    assert any("retrying" in r.getMessage() for r in caplog.records)
    for dirpath, _, files in os.walk(tmp_path):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                assert secret.encode() not in fh.read()


def test_a_password_in_a_url_is_refused_without_being_repeated(tmp_path, capsys):
    """A URL goes into logs, errors and the root's record of its remote tier: one carrying
    a password ("sftp://bob:pw@host/run") is refused, the password shown as ***."""
    from resilient.ckpt import main as ckpt_main

    for url in ("ftp://bob:hunter2@files.example/run", "s3://AKIA:hunter2@bucket/run"):
        with pytest.raises(StorageError, match=r"://[a-zA-Z]+:\*\*\*@.*pass credentials in storage_options") as err:
            Checkpointer(tmp_path / "l", remote=url)
        assert "hunter2" not in str(err.value)
        assert ckpt_main(["ls", url]) == 1
        assert "hunter2" not in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "l" / ".remote.json")
    Checkpointer(tmp_path / "l", remote=str(tmp_path / "at@sign:dir")).close()  # a directory may hold @ and :


def test_a_process_that_saved_nothing_does_not_wait_for_a_store_that_is_down(tmp_path, caplog):
    """Nothing on the local tier and nothing saved: closing waited out the whole flush
    timeout (300 s) for the unreachable store's listing, and so did the interpreter's exit
    for a Checkpointer made only to ask latest()."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": dead},
            "config_kwargs": {"connect_timeout": 0.5, "retries": {"max_attempts": 1}}}
    ckpt = Checkpointer(tmp_path / "fresh", remote="s3://down/run", storage_options=opts)
    started = time.monotonic()
    ckpt.flush(timeout=60)
    ckpt.close()
    assert time.monotonic() - started < 10
    assert not [r for r in caplog.records if "unfinished" in r.getMessage()]


def test_missing_extra_names_the_pip_command(tmp_path):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(StorageError, match=r"pip install 'resilient\[gcs\]'"):
        Checkpointer(tmp_path / "l", remote="gs://bucket/run")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs: a real 'No space left on device' (needs root; skipped otherwise)."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_local_disk_fails_that_save_cleanly_and_training_goes_on(tiny_disk, caplog):
    from resilient import CommitError

    small, big = {"w": torch.ones(1 << 16)}, {"w": torch.ones(1 << 20)}  # 256 KiB, 4 MiB
    with Checkpointer(tiny_disk, keep=None) as ckpt:
        ckpt.save(1, small)
        ckpt.wait()
        ckpt.save(2, big)  # does not fit
        with pytest.raises(CommitError, match="No space left") as failed:
            ckpt.wait()
        # which disk, what the save needed, what is free and what holds the rest
        said = str(failed.value)
        assert f"on the local tier {tiny_disk}: this rank's file needs 4.0 MiB" in said, said
        assert re.search(r"has 2\.\d MiB free of 3\.0 MiB; the tier holds 1 committed checkpoint\(s\) \(2\d\d\.\d KiB\)",
                         said), said
        assert "room for keep + 1 of them" in said, said
        ckpt.save(3, small)  # training and saving go on
        ckpt.wait()
        assert ckpt.latest() == 3 and ckpt.stats["saves_failed"] == 1 and ckpt.stats["saves_committed"] == 2
        for step in (4, 5, 6):  # three that fail before the next wait: it names all of them
            ckpt.save(step, big)
        with pytest.raises(CommitError, match=r"step 4 was not committed \(.*No space left.*\); the saves of 2 "
                                              r"later step\(s\) failed too \(5, 6\), the newest at step 6$"):
            ckpt.wait()
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert sorted(n for n in os.listdir(tiny_disk) if n.startswith("step-")) == ["step-0000000001", "step-0000000003"]
    assert os.listdir(os.path.join(tiny_disk, ".pending")) == []  # the failed save left nothing behind
    with Checkpointer(tiny_disk, keep=None, strict=True) as ckpt:
        ckpt.save(4, big)
        with pytest.raises(CommitError):
            ckpt.save(5, small)  # strict: the failure surfaces in the training loop


def test_a_disk_filled_by_steps_waiting_for_a_store_that_is_down_says_so(tiny_disk, flaky, caplog):
    """The store is down and every save waits on the local disk to be uploaded: with
    ``keep_remote=None`` the 3 MiB disk fills, and the failed save's log says why (how many
    steps wait, for which store, the store's last error) and what bounds it. With
    ``keep_remote=2`` the same saves all fit: only the 2 newest wait."""
    FlakyFS.broken = True
    state = {"w": torch.ones(1 << 16)}  # 256 KiB a step: about 11 fit
    with Checkpointer(tiny_disk, remote=flaky, keep=1) as ckpt:
        for step in range(1, 16):
            ckpt.save(step, state)
        with pytest.raises(Exception, match="No space left"):
            ckpt.wait()
        ckpt.close(timeout=1)
    full = [r.getMessage() for r in caplog.records if "is full with" in r.getMessage()]
    assert full and "waiting to be uploaded to flaky://" in full[0] and "pass keep_remote=" in full[0], full
    assert "last error: " in full[0] and "injected" in full[0]

    for name in os.listdir(tiny_disk):
        shutil.rmtree(os.path.join(tiny_disk, name), ignore_errors=True)
    caplog.clear()
    with Checkpointer(tiny_disk, remote=flaky, keep=1, keep_remote=2) as ckpt:
        for step in range(1, 16):
            ckpt.save(step, state)
            ckpt.wait()  # each fits
        assert ckpt.stats["saves_failed"] == 0
        ckpt.close(timeout=1)
    assert not [r for r in caplog.records if "is full with" in r.getMessage()]


def test_ckpt_ls_shows_which_tiers_hold_each_step(tmp_path, s3_server, capsys):
    from resilient.ckpt import main

    url, opts = s3_url(s3_server), s3_server["options"]
    root = str(tmp_path / "l")
    with Checkpointer(root, remote=url, storage_options=opts, keep=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": torch.full((4,), float(step))})
        ckpt.flush(timeout=60)
    assert main(["ls", root, "--json", "--storage-options", json.dumps(opts)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["tiers"]) for r in rows] == [(1, ["s3"]), (2, ["s3"]), (3, ["local", "s3"])]
    with open(os.path.join(root, ".remote.json")) as f:
        assert opts["secret"] not in f.read()


def test_damaged_local_copy_is_replaced_from_the_remote_tier(tmp_path, s3_server, caplog):
    from .faults import flip_byte

    url, opts = s3_url(s3_server), s3_server["options"]
    root = tmp_path / "l"
    state = {"w": torch.arange(50_000, dtype=torch.float32)}
    with Checkpointer(root, remote=url, storage_options=opts) as ckpt:
        ckpt.save(1, state)
        ckpt.flush(timeout=60)
    flip_byte(str(root / "step-0000000001" / "rank-00000.data"), 1000)
    target = {"w": torch.zeros(50_000)}
    with Checkpointer(root, remote=url, storage_options=opts) as ckpt:
        assert ckpt.restore(target) == 1  # the same step, not an older one
    assert torch.equal(target["w"], state["w"])
    assert any("fetching it again" in r.getMessage() for r in caplog.records)


def test_a_fresh_node_whose_remote_tier_holds_only_steps_marked_bad_refuses_to_start_afresh(tmp_path):
    """A step some node proved damaged is marked bad on the remote tier, which then lists no
    committed step: a fresh node started from step 0, and its saves replaced the run's
    checkpoints. It refuses now, naming the step; once the step is pruned, it starts afresh."""
    from resilient import CheckpointCorruptError
    from resilient._catalog import Catalog
    from resilient._storage import LocalStorage
    from resilient.ckpt import main as ckpt_main

    shared = tmp_path / "shared"  # a shared directory as the remote tier
    with Checkpointer(tmp_path / "a", remote=shared) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)})
        ckpt.flush(timeout=60)
    Catalog(LocalStorage(str(shared))).mark_bad(1, "checksum mismatch (found by node a)")  # as a restore marks it
    with Checkpointer(tmp_path / "fresh", remote=shared) as ckpt:
        with pytest.raises(CheckpointCorruptError, match=r"step\(s\) 1 are committed but cannot be loaded"):
            ckpt.restore({"w": torch.zeros(1000)})
    assert ckpt_main(["prune", str(shared), "--after", "0"]) == 0
    with Checkpointer(tmp_path / "fresh", remote=shared) as ckpt:
        assert ckpt.restore({"w": torch.zeros(1000)}) == 0


def test_a_failing_upload_callback_does_not_stop_the_uploads(tmp_path, caplog):
    """The uploader's thread calls back into the Checkpointer after each step; an error there
    (once: a callback that ran before the Checkpointer had finished its __init__) killed the
    thread, and ``flush()`` then waited forever. Now the uploads go on, the error is logged
    with the step, and a thread that died anyway makes ``flush()`` fail instead of hang."""
    from resilient._catalog import Catalog
    from resilient._storage import open_storage
    from resilient._uploader import Uploader

    root, remote = str(tmp_path / "node"), "file://" + str(tmp_path / "remote")
    with Checkpointer(root, keep=None) as ckpt:  # three steps on the local tier only
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4,), float(step))}, force=True)
    calls = []

    def on_uploaded(step, seconds):
        calls.append(step)
        if step == 1:
            raise AttributeError("'Checkpointer' object has no attribute '_uploaded_bytes_seen'")

    uploader = Uploader(Catalog(open_storage(root)), open_storage(remote), rank=0, keep_remote=None,
                        on_uploaded=on_uploaded)
    try:
        for step in (1, 2, 3):
            uploader.enqueue(step)
        uploader.flush(timeout=30)
    finally:
        uploader.close()
    assert calls == [1, 2, 3]
    assert remote_steps(remote, {}) == [1, 2, 3]
    assert any("after uploading step 1" in r.getMessage() for r in caplog.records)

    # a thread that died for another reason: flush() says so instead of waiting forever
    uploader = Uploader(Catalog(open_storage(root)), open_storage(remote), rank=0, keep_remote=None,
                        on_uploaded=on_uploaded)
    uploader.close()
    uploader._closed = False  # as if the thread had ended without being closed
    uploader.enqueue(4)
    with pytest.raises(RuntimeError, match="upload thread .* died"):
        uploader.flush(timeout=10)


def test_remote_catalog_lists_only_committed_unmarked_steps(s3_server):
    """The commit records of a remote's steps are checked side by side: a step without its
    record and a step marked bad are left out, whatever order the answers come in."""
    from resilient._catalog import Catalog
    from resilient._storage import FsspecStorage

    storage = FsspecStorage(s3_url(s3_server), s3_server["options"])
    catalog = Catalog(storage)
    assert catalog.committed_steps() == []  # no root yet
    for step in range(1, 21):
        storage.write(f"step-{step:010d}/rank-00000.data", [b"x"])
        if step % 5:
            storage.write(f"step-{step:010d}/manifest.json", [b"{}"])
    catalog.mark_bad(7, "test")
    assert catalog.committed_steps() == [s for s in range(1, 21) if s % 5 and s != 7]


def _saved_remotely(root, url, steps=(1, 2)):
    with Checkpointer(root, remote=url, keep=None) as ckpt:
        for step in steps:
            ckpt.save(step, {"x": torch.full((1000,), float(step))})
        ckpt.flush(timeout=60)


def test_restore_waits_out_an_unreachable_remote_tier_then_resumes_its_newest_step(tmp_path, flaky, caplog):
    """The store refuses the first calls of a restore on an empty disk (listing, then two
    reads of the data): the restore retries and resumes the newest step, not step 0."""
    _saved_remotely(tmp_path / "a", flaky)
    FlakyFS.fail_next, FlakyFS.fail_next_data_reads = 3, 2
    target = {"x": torch.zeros(1000)}
    with Checkpointer(tmp_path / "empty", remote=flaky) as ckpt:
        assert ckpt.restore(target) == 2
    assert torch.equal(target["x"], torch.full((1000,), 2.0))
    assert FlakyFS.fail_next == 0 and FlakyFS.fail_next_data_reads == 0
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert any(m.startswith("resilient: listing flaky://") for m in retries), retries
    assert any(m.startswith("resilient: fetching step 2 from flaky://") for m in retries), retries
    assert not any("skipping checkpoint" in r.getMessage() for r in caplog.records)


def test_restore_with_the_remote_tier_down_refuses_to_start_from_scratch(tmp_path, flaky, monkeypatch, caplog):
    """Nothing on this node and a store that does not answer for RESILIENT_REMOTE_WAIT:
    restore raises, naming the store, instead of returning 0 (a run silently restarted).
    With a step on this node, it restores that one and says the store was unreachable."""
    from resilient import StorageError

    _saved_remotely(tmp_path / "a", flaky)
    monkeypatch.setenv("RESILIENT_REMOTE_WAIT", "1")
    FlakyFS.broken = True
    with Checkpointer(tmp_path / "empty", remote=flaky) as ckpt:
        with pytest.raises(StorageError, match=f"remote tier {flaky} could not be listed.*not starting from scratch"):
            ckpt.restore({"x": torch.zeros(1000)})
        FlakyFS.broken = False  # so that closing does not wait for the store
    FlakyFS.broken = True
    target = {"x": torch.zeros(1000)}
    with Checkpointer(tmp_path / "a", remote=flaky) as ckpt:  # this node holds steps 1 and 2
        assert ckpt.restore(target) == 2
        FlakyFS.broken = False
    assert torch.equal(target["x"], torch.full((1000,), 2.0))
    assert any("unreachable" in r.getMessage() and "restoring from what this node" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_step_counts_as_complete_only_with_every_file_at_its_size(tmp_path, s3_server, where):
    """One listing tells which files of a step are not there yet (what rank 0 asks the store
    until every node's files are up): a file absent and a file of another size both count."""
    from resilient._catalog import Catalog
    from resilient._storage import FsspecStorage, LocalStorage
    from resilient._transfer import missing_files

    storage = (LocalStorage(str(tmp_path / "tier")) if where == "local"
               else FsspecStorage(s3_url(s3_server), s3_server["options"]))
    catalog = Catalog(storage)
    manifest = {"step": 3, "files": {"rank-00000.data": {"bytes": 5}, "rank-00001.data": {"bytes": 3}}}
    assert missing_files(catalog, manifest) == {"rank-00000.data", "rank-00001.data"}  # no step directory
    storage.write("step-0000000003/rank-00000.data", [b"12345"])
    assert missing_files(catalog, manifest) == {"rank-00001.data"}
    storage.write("step-0000000003/rank-00001.data", [b"1234"])
    assert missing_files(catalog, manifest) == {"rank-00001.data"}  # there, at another size
    storage.write("step-0000000003/rank-00001.data", [b"123"])
    assert missing_files(catalog, manifest) == set()
    assert storage.sizes("step-0000000003") == {"rank-00000.data": 5, "rank-00001.data": 3}


def _remote_files(url, options, step):
    fs, base = remote_fs(url, options)
    sdir = f"{base}/step-{step:010d}"
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(sdir, detail=False)) if fs.exists(sdir) else []


def test_a_local_file_that_fails_its_checksums_is_not_left_on_the_remote_tier(tmp_path, s3_server, capsys):
    """The upload runs beside the file's check: a file that fails it is deleted from the
    bucket again and the step is not committed there (resilient-ckpt push, which copies the
    way the uploader does)."""
    from resilient.ckpt import main

    from .faults import flip_byte

    url, opts = s3_url(s3_server), s3_server["options"]
    root = tmp_path / "l"
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.arange(300_000, dtype=torch.float32)})
    flip_byte(str(root / "step-0000000001" / "rank-00000.data"), 4096)
    code = main(["push", str(root), url, "--storage-options", json.dumps(opts)])
    err = capsys.readouterr().err
    assert code == 1 and "checksum mismatch" in err and "rank-00000.data" in err
    assert _remote_files(url, opts, 1) == [] and remote_steps(url, opts) == []


def test_an_uploaded_file_is_checked_again_before_a_later_upload_counts_it_as_there(tmp_path, s3_server, caplog):
    """As after a process that died between a failed check and deleting the upload: the
    data file is in the bucket at its size, the step uncommitted there, the local copy bad.
    The next uploader checks the local file before skipping it, deletes the remote one,
    never commits the step and gives it up at once (no retry mends a bad local copy): marked
    bad here, so that ``latest()`` does not offer it."""
    from .faults import flip_byte

    url, opts = s3_url(s3_server), s3_server["options"]
    root = tmp_path / "l"
    with Checkpointer(root, remote=url, storage_options=opts) as ckpt:
        ckpt.save(1, {"w": torch.arange(300_000, dtype=torch.float32)})
        ckpt.flush(timeout=60)
    fs, base = remote_fs(url, opts)
    # uncommitted there, and without the marker that a passed check would have left
    fs.rm([f"{base}/step-0000000001/{name}" for name in _remote_files(url, opts, 1) if name != "rank-00000.data"])
    assert _remote_files(url, opts, 1) == ["rank-00000.data"] and remote_steps(url, opts) == []
    flip_byte(str(root / "step-0000000001" / "rank-00000.data"), 4096)
    with Checkpointer(root, remote=url, storage_options=opts) as ckpt:
        ckpt.flush(timeout=30)  # returns: the step was given up, not retried
        assert ckpt.latest() is None
    assert _remote_files(url, opts, 1) == [] and remote_steps(url, opts) == []
    assert os.path.exists(root / ".bad" / "step-0000000001")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("step 1 is not uploaded" in m and "checksum mismatch" in m for m in errors), errors
    assert not any("retrying" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with Checkpointer(root, remote=url, storage_options=opts) as ckpt:  # the next start: known bad, not tried again
        ckpt.flush(timeout=30)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def _empty_nodes(tmp_path):
    """Two nodes' local tiers (``node0``, ``node1``), made empty, as their uploaders read them."""
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    for n in (0, 1):
        os.makedirs(tmp_path / f"node{n}", exist_ok=True)
    return [Catalog(open_storage(str(tmp_path / f"node{n}"))) for n in (0, 1)]


def _saved_on_two_nodes(tmp_path, remote, steps, **options):
    """Two nodes whose uploaders (made with ``options``) started first (nothing to catch up
    on: each step comes by ``enqueue``, as from its Checkpointer), then steps 1 to ``steps``
    committed on both: (their catalogs, their uploaders, node 1's data file's name). Not yet
    enqueued."""
    from .launch import run_ranks

    nodes = _empty_nodes(tmp_path)
    uploaders = [_uploader(nodes[n], remote, n, **options) for n in (0, 1)]
    try:
        for uploader in uploaders:
            uploader.flush(timeout=30)
        run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": steps})
    except BaseException:
        for uploader in uploaders:
            uploader.close()
        raise
    (name,) = [f for f in os.listdir(tmp_path / "node1" / "step-0000000001") if f.endswith(".data")]
    return nodes, uploaders, name


def _save_and_upload(tmp_path, uploaders, step):
    """Both nodes save ``step`` (a new gang's), and their uploaders, as their Checkpointers
    would, queue it and are flushed."""
    from .launch import run_ranks

    run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "first": step, "steps": step})
    for u in uploaders:
        u.enqueue(step)
    for u in uploaders:
        u.flush(timeout=60)


def _uploader(catalog, remote, node, **options):
    """A node's uploader as its Checkpointer makes it (node 0: rank 0's, which commits)."""
    from resilient._storage import open_storage
    from resilient._uploader import Uploader

    options.setdefault("keep_remote", None)
    return Uploader(catalog, open_storage(remote), rank=node, on_uploaded=lambda step, seconds: None, **options)


def test_rank_0_does_not_wait_forever_for_a_step_another_node_gave_up(tmp_path, caplog):
    """Two nodes' leaders upload the same three steps; node 1's local copy of step 2 fails its
    checksums, so node 1 gives step 2 up. Rank 0, which commits each step once every node's
    files are up, used to wait for node 1's files of step 2 forever, and step 3 behind it
    never reached the remote tier. Now node 1 says so on the remote tier (step 2's bad
    marker, naming that save), rank 0 gives step 2 up too and commits step 3."""
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    from .faults import flip_byte

    remote = "file://" + str(tmp_path / "remote")
    # a marker an earlier save of step 3 left (failed verification once committed): not this save's
    Catalog(open_storage(remote)).mark_bad(3, "failed verification when restored: checksum mismatch")
    nodes, uploaders, bad_file = _saved_on_two_nodes(tmp_path, remote, 3)
    try:
        assert nodes[0].manifest(2)["created"] == nodes[1].manifest(2)["created"]  # one commit record
        flip_byte(str(tmp_path / "node1" / "step-0000000002" / bad_file), 4096)
        for uploader in uploaders:
            for step in (1, 2, 3):
                uploader.enqueue(step)
        for uploader in uploaders:
            uploader.flush(timeout=60)  # before: rank 0's timed out waiting for step 2
    finally:
        for uploader in uploaders:
            uploader.close()
    assert remote_steps(remote, {}) == [1, 3]
    assert not os.path.exists(tmp_path / "remote" / "step-0000000002")  # node 0's upload of it removed
    assert nodes[1].bad_reason(2) is not None and nodes[0].bad_reason(2) is None  # node 0's copy is good
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 2 is not uploaded" in m and bad_file in m for m in messages), messages
    assert any("step 2 is not committed" in m and "another node" in m for m in messages), messages


def test_what_nodes_uploaded_of_a_step_given_up_is_removed_once_a_later_step_commits(tmp_path, caplog):
    """A new gang finds steps 1 and 2 on its nodes' disks, written by an earlier gang, and
    none of them on the remote tier. Rank 0's uploader starts first, uploads its files of
    them, finds node 1's missing and gives both steps up (node 1 might be gone). Node 1 then
    uploads its own files of them too. Once step 3, saved by this gang, is committed, every
    node is past steps 1 and 2 (each uploads in order): what is left of them in the bucket
    is deleted instead of staying there for good."""

    from .launch import run_ranks

    run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": 2})
    remote = "file://" + str(tmp_path / "remote")
    nodes = _empty_nodes(tmp_path)
    uploaders = [_uploader(nodes[0], remote, 0)]
    try:
        uploaders[0].flush(timeout=30)
        assert remote_steps(remote, {}) == [] and sorted(os.listdir(tmp_path / "remote")) == [
            "step-0000000001", "step-0000000002"]  # node 0's files, uncommitted
        uploaders.append(_uploader(nodes[1], remote, 1))
        uploaders[1].flush(timeout=30)
        data = [n for n in os.listdir(tmp_path / "remote" / "step-0000000001") if n.endswith(".data")]
        assert len(data) == 2  # both nodes' files now
        _save_and_upload(tmp_path, uploaders, 3)
    finally:
        for u in uploaders:
            u.close()
    assert remote_steps(remote, {}) == [3]
    assert sorted(n for n in os.listdir(tmp_path / "remote") if n.startswith("step-")) == ["step-0000000003"]
    removed = [r.getMessage() for r in caplog.records if "given up" in r.getMessage() and "removed" in r.getMessage()]
    assert len(removed) == 2, removed


def test_rank_0_waits_for_a_surviving_nodes_upload_of_a_step_an_earlier_gang_left(tmp_path, caplog):
    """A new gang finds steps 1 and 2 on both nodes' disks, not on the remote tier (the
    earlier gang stopped before they were up). Rank 0 used to give such a step up as soon
    as another node's files were missing, though that node is alive and about to upload
    them: the step's remote copy was lost for nothing. Now the gang's nodes say which files
    they hold when the Checkpointer is made (``files_held``), and rank 0 waits for those;
    only a file no node holds gives the step up at once."""
    from resilient._uploader import Holdings, files_held

    from .launch import run_ranks

    run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": 2})
    remote = "file://" + str(tmp_path / "remote")
    nodes = _empty_nodes(tmp_path)
    held = Holdings.gathered([files_held(nodes[0]), files_held(nodes[1])])
    assert held.files == {1: {"rank-00000.data", "rank-00001.data"}, 2: {"rank-00000.data", "rank-00001.data"}}
    assert held.committer == {1: 0, 2: 0}
    uploaders = [_uploader(nodes[0], remote, 0, holdings=held)]
    try:
        with pytest.raises(TimeoutError, match=r"steps \[1, 2\] still pending"):
            uploaders[0].flush(timeout=3)  # node 1's uploader is slow to start
        assert remote_steps(remote, {}) == []
        uploaders.append(_uploader(nodes[1], remote, 1, holdings=held))
        for u in uploaders:
            u.flush(timeout=30)
    finally:
        for u in uploaders:
            u.close()
    assert remote_steps(remote, {}) == [1, 2]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records

    # a gang without node 1 (its disk went with it): nobody holds its files, given up at once
    other = "file://" + str(tmp_path / "other")
    alone = _uploader(nodes[0], other, 0, holdings=Holdings.gathered([files_held(nodes[0])]))
    try:
        alone.flush(timeout=30)
    finally:
        alone.close()
    assert remote_steps(other, {}) == []
    lost = [r.getMessage() for r in caplog.records if "no node of this gang holds rank-00001.data" in r.getMessage()]
    assert len(lost) == 2, [r.getMessage() for r in caplog.records]


def test_a_step_an_earlier_gang_left_is_committed_by_a_node_holding_it_when_a_spare_is_rank_0(tmp_path, caplog):
    """Node 0 uploaded its files of steps 1 and 2, then was lost before node 1 had; a spare
    with an empty disk took its ranks, rank 0 among them. Only rank 0 committed, and the
    spare holds neither step nor its commit record: node 1 uploaded its files of them, and
    they stayed uncommitted for good. Now the lowest rank holding such a step commits it.
    And where that node gives a step up instead (node 0's files never reached the store),
    rank 0 removes what was uploaded of it once a later step is committed, as for its own."""
    from resilient._uploader import Holdings, files_held

    from .launch import run_ranks

    run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": 2})
    remote, other = "file://" + str(tmp_path / "remote"), "file://" + str(tmp_path / "other")
    nodes = _empty_nodes(tmp_path)
    before_loss = _uploader(nodes[0], remote, 0)  # the earlier gang's rank 0: node 1's files not up yet
    try:
        before_loss.flush(timeout=30)
    finally:
        before_loss.close()
    assert remote_steps(remote, {}) == []
    os.rename(tmp_path / "node0", tmp_path / "lost0")  # node 0 is gone; the spare, at the same path, is empty
    spare, node1 = _empty_nodes(tmp_path)
    holdings = Holdings.gathered([files_held(spare), files_held(node1)])
    assert holdings.committer == {1: 1, 2: 1}
    for url in (remote, other):
        uploaders = [_uploader(spare, url, 0, holdings=holdings), _uploader(node1, url, 1, holdings=holdings)]
        try:
            for u in uploaders:
                u.flush(timeout=30)
            if url == other:  # node 1 gave steps 1 and 2 up (node 0's files are nowhere); then step 3
                _save_and_upload(tmp_path, uploaders, 3)
        finally:
            for u in uploaders:
                u.close()
    assert remote_steps(remote, {}) == [1, 2]
    assert remote_steps(other, {}) == [3]
    assert sorted(n for n in os.listdir(tmp_path / "other") if n.startswith("step-")) == ["step-0000000003"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no node of this gang holds rank-00000.data" in m for m in messages) == 2, messages


def test_a_restarted_gang_completes_the_uploads_its_predecessor_left(tmp_path):
    """End to end: a gang of two nodes saves steps 1 and 2 with no remote tier reachable
    (here: none given); the next gang, the same two nodes with a remote tier, saves step 3.
    Every step reaches the remote tier: each node's Checkpointer tells rank 0 which files of
    steps 1 and 2 it holds, and rank 0 waits for them instead of racing the other node's
    uploader (before, which steps were committed depended on which uploader ran first)."""
    from .launch import run_ranks

    run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": 2})
    remote = "file://" + str(tmp_path / "remote")
    results = run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "first": 3, "steps": 3, "remote": remote})
    assert remote_steps(remote, {}) == [1, 2, 3], [r.output for r in results]
    assert not any("not committed" in r.output for r in results), [r.output for r in results]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_bit_flipped_on_one_nodes_disk_costs_the_remote_tier_that_step_only(tmp_path, where, request):
    """End to end, as a run with ``RESILIENT_FAULT=corrupt:...`` shows it: two nodes, each
    its own disk, one remote tier; one bit of node 1's file of step 2 flips once written.
    Every step commits locally; node 1's upload check catches the bit and gives step 2 up,
    rank 0 commits every other step, and both ranks' ``flush()`` return."""
    from .launch import run_ranks

    if where == "s3":
        server = request.getfixturevalue("s3_server")
        remote, options = s3_url(server), server["options"]
    else:
        remote, options = "file://" + str(tmp_path / "remote"), {}
    results = run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": 4, "remote": remote,
                                                  "storage_options": options},
                        env={"RESILIENT_FAULT": "corrupt:rank=1,step=2,phase=write"})
    assert "injected fault: corrupt on rank 1 at step 2" in results[1].output
    assert "step 2 is not uploaded" in results[1].output and "checksum mismatch" in results[1].output
    fs, base = remote_fs(remote, options)
    assert remote_steps(remote, options) == [1, 3, 4], (fs.find(base), results[0].output, results[1].output)
    assert os.path.exists(tmp_path / "node1" / ".bad" / "step-0000000002")
    assert _remote_files(remote, options, 2) == []  # node 0's upload of it removed


def test_rank_0_commits_a_step_only_once_every_file_has_passed_its_check(tmp_path):
    """A node uploads a file while its checksums are checked from its disk: the file is in
    the bucket at its full size before the check has passed, and is deleted again if it
    fails. Rank 0 used to commit as soon as every file was there at its size, so it could
    commit a file about to be deleted (seen once in ten runs of the test above on S3). Now
    it waits for each file's marker, which its node writes once the check has passed."""
    remote = "file://" + str(tmp_path / "remote")
    _, uploaders, name = _saved_on_two_nodes(tmp_path, remote, 1)
    try:
        # node 1's upload of it is complete; its check, beside it, is still running
        os.makedirs(tmp_path / "remote" / "step-0000000001")
        shutil.copy(tmp_path / "node1" / "step-0000000001" / name, tmp_path / "remote" / "step-0000000001" / name)
        uploaders[0].enqueue(1)
        with pytest.raises(TimeoutError):
            uploaders[0].flush(timeout=3)
        assert remote_steps(remote, {}) == []
        uploaders[1].enqueue(1)  # node 1's uploader: the file is there at its size, checked now, marked
        for u in uploaders:
            u.flush(timeout=30)
    finally:
        for u in uploaders:
            u.close()
    assert remote_steps(remote, {}) == [1]
    assert [n for n in os.listdir(tmp_path / "remote" / "step-0000000001") if n.startswith(f"{name}.checked-")]


def test_a_step_saved_again_after_a_fallback_replaces_what_its_earlier_save_uploaded(tmp_path, s3_server):
    """Step 1 is committed remotely, then found bad there; the job falls back and saves step
    1 again, different values in files of the same names and sizes. The upload used to keep
    the earlier save's file (there at its size) under the new commit record, so the remote
    copy failed its checksums. The checked marker names the file's checksums: the new file
    is uploaded, and the remote step reads back as the new save."""
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    url, opts = s3_url(s3_server), s3_server["options"]
    with Checkpointer(tmp_path / "first", remote=url, storage_options=opts) as ckpt:
        ckpt.save(1, {"w": torch.ones(100_000)}, force=True)
        ckpt.flush(timeout=60)
    remote = Catalog(open_storage(url, opts))
    remote.mark_bad(1, "failed verification when restored: checksum mismatch")
    with Checkpointer(tmp_path / "again", remote=url, storage_options=opts) as ckpt:
        ckpt.save(1, {"w": torch.full((100_000,), 2.0)}, force=True)
        ckpt.flush(timeout=60)
    assert remote_steps(url, opts) == [1]
    _, tensors = remote.read_state(remote.manifest(1), 1)
    assert torch.equal(tensors["w"], torch.full((100_000,), 2.0))


def test_a_step_committed_while_the_uploader_lists_the_remote_tier_is_this_gangs(tmp_path, flaky):
    """Rank 0's uploader lists the remote tier when it starts, and a step committed by then
    was taken for one an earlier gang left: rank 0 then did not wait for the other nodes'
    files and gave the step up (seen once in the bit-flip test above on S3). Only the steps
    on the local tier when the uploader is made are an earlier gang's."""

    from .launch import run_ranks

    FlakyFS.broken = True  # the remote tier does not answer yet: the first listing is retried
    nodes = _empty_nodes(tmp_path)
    rank0 = _uploader(nodes[0], flaky, 0, base_delay=0.05, max_delay=0.1)
    node1 = None
    try:
        run_ranks("saves_on_own_nodes", 2, {"root": str(tmp_path), "steps": 1})  # committed locally
        FlakyFS.broken = False
        rank0.flush(timeout=30)  # caught up: nothing of its own to do
        rank0.enqueue(1)  # as its Checkpointer does after the commit
        with pytest.raises(TimeoutError):
            rank0.flush(timeout=2)  # waits for node 1's files
        node1 = _uploader(nodes[1], flaky, 1)
        node1.enqueue(1)
        for u in (node1, rank0):
            u.flush(timeout=30)
    finally:
        for u in (rank0, node1):
            if u is not None:
                u.close()
    assert remote_steps(flaky, {}) == [1]


def test_a_local_root_holding_another_remotes_checkpoints_is_refused(tmp_path):
    """A node reused with the same local path: the new run (its own remote prefix) restored
    the previous run's newest step as its own and uploaded that run's checkpoints into its
    prefix, without a word. Now it is refused, naming both remotes and the remedies."""
    from resilient import StorageError
    from resilient.ckpt import main

    local, bucket = str(tmp_path / "nvme"), tmp_path / "bucket"
    first, second = f"file://{bucket}/run-42", f"file://{bucket}/run-43"
    with Checkpointer(local, remote=first) as ckpt:
        for step in (100, 200):
            ckpt.save(step, {"w": torch.full((4,), float(step))}, force=True)
        ckpt.flush(30)
    with pytest.raises(StorageError, match=rf"the local root {local} .*holds checkpoints saved for the remote tier "
                                           rf"{first}, not for this run's {second}: they are another run's.*"
                                           rf"prune {local} --after -1.*remove {local}/.remote.json"):
        Checkpointer(local, remote=second)
    assert not (bucket / "run-43").exists() or not os.listdir(bucket / "run-43")  # nothing uploaded there
    state = {"w": torch.zeros(4)}
    with Checkpointer(local, remote=first + "/") as ckpt:  # the same remote, however spelt: its own
        assert ckpt.restore(state) == 200
    # the remote moved (copied to run-43): removing the record says the steps are this run's
    os.remove(os.path.join(local, ".remote.json"))
    with Checkpointer(local, remote=second) as ckpt:
        assert ckpt.restore(state) == 200
        ckpt.flush(30)
    assert {"step-0000000100", "step-0000000200"} <= set(os.listdir(bucket / "run-43"))
    # another run's steps removed: a third run starts afresh on the same node
    assert main(["prune", local, "--after", "-1"]) == 0
    with Checkpointer(local, remote=f"file://{bucket}/run-44") as ckpt:
        assert ckpt.restore({"w": torch.zeros(4)}) == 0


def test_a_bucket_found_is_not_asked_for_again_and_a_missing_one_still_refused(tmp_path, s3_server, monkeypatch):
    """Each Checkpointer asked the store whether its bucket exists: Lightning's plugin makes
    one per checkpoint path, and that request sat in every save's stall. A bucket found is
    asked for once a process (by endpoint and credentials); a missing one is asked for each
    time, and still refused, naming it."""
    import weakref

    from resilient import _storage

    monkeypatch.setattr(_storage, "_BUCKETS_FOUND", weakref.WeakKeyDictionary())  # as in a new process
    fs = fsspec.filesystem("s3", **s3_server["options"])  # fsspec's instance, the one each Checkpointer gets
    asked: list[str] = []
    listing = fs.ls

    def counted(path, *args, **kwargs):
        asked.append(path)
        return listing(path, *args, **kwargs)

    monkeypatch.setattr(fs, "ls", counted)
    prefix = f"s3://{s3_server['bucket']}/asked-{uuid.uuid4().hex[:8]}"
    for n in range(3):
        with Checkpointer(str(tmp_path / f"local-{n}"), remote=f"{prefix}/{n}",
                          storage_options=s3_server["options"]) as ckpt:
            ckpt.save(1, {"w": torch.ones(4)})
    # each Checkpointer lists its tier's root as it saves; the first also asked for the bucket there
    roots = [sum(path == f"{prefix.removeprefix('s3://')}/{n}" for path in asked) for n in range(3)]
    assert roots[0] == roots[1] + 1 == roots[2] + 1, (roots, asked)
    for _ in range(2):
        with pytest.raises(StorageError, match="the bucket 'no-such-bucket-here' does not exist"):
            Checkpointer(str(tmp_path / "local-missing"), remote="s3://no-such-bucket-here/run",
                         storage_options=s3_server["options"])
