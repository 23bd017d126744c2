"""The writer, its encode threads and the uploader run at a lower CPU priority than the
training thread (their own nice value), so a busy step is served first."""

import os
import threading

import pytest
import torch

from resilient import Checkpointer

pytestmark = pytest.mark.timeout(60)


def _nice(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


@pytest.mark.parametrize("setting, raised_by", [(None, 19), ("3", 3), ("0", 0)])
def test_background_threads_run_niced(tmp_path, monkeypatch, setting, raised_by):
    if setting is None:
        monkeypatch.delenv("RESILIENT_BACKGROUND_NICE", raising=False)
    else:
        monkeypatch.setenv("RESILIENT_BACKGROUND_NICE", setting)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    earlier = set(threading.enumerate())  # another test's checkpointer, left open, is not this one's
    with Checkpointer(str(tmp_path / "local"), remote=f"file://{tmp_path / 'remote'}") as ckpt:
        ckpt.save(1, {"w": torch.ones(1 << 16)})
        ckpt.flush(timeout=30)  # the writer, an encode thread and the uploader have all run
        threads = [t for t in _threads("resilient-writer") + _threads("resilient-encode")
                   + _threads("resilient-uploader") if t not in earlier]
        assert {t.name.split("_")[0] for t in threads} >= {"resilient-writer", "resilient-encode",
                                                           "resilient-uploader"}
        for t in threads:
            assert _nice(t.native_id) == min(19, base + raised_by), t.name
        assert _nice(threading.get_native_id()) == base  # the training thread is untouched
