"""A step copied from one local directory to another (the uploader to a remote tier that is
a mounted directory, ``resilient-ckpt push`` to one): one pass, each chunk written at its
offset once its CRC has passed; the copy is byte-identical, and a bad byte leaves no file."""

import os

import pytest
import torch

from resilient import Checkpointer, CheckpointCorruptError
from resilient._catalog import Catalog
from resilient._storage import LocalStorage
from resilient._transfer import copy_step

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def saved(tmp_path):
    """(the local tier's catalog, its step directory) for step 1, in chunks of 64 KiB."""
    g = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(300_000, generator=g), "b": torch.randn(70, 90, generator=g), "meta": {"k": 1}}
    with Checkpointer(str(tmp_path / "node"), chunk_bytes=64 << 10) as ckpt:
        ckpt.save(1, state).result()
    return Catalog(LocalStorage(str(tmp_path / "node"))), tmp_path / "node" / "step-0000000001"


def test_a_step_copied_between_directories_is_byte_identical(tmp_path, saved):
    src, step_dir = saved
    seen: list[int] = []
    moved = copy_step(src, LocalStorage(str(tmp_path / "mounted")), 1, seen.append)
    got = tmp_path / "mounted" / "step-0000000001"
    names = src.manifest(1)["files"]
    assert moved == sum(os.path.getsize(step_dir / n) for n in names) == sum(seen)
    for name in names:
        assert (got / name).read_bytes() == (step_dir / name).read_bytes(), name
    assert Catalog(LocalStorage(str(tmp_path / "mounted"))).committed_steps() == [1]


def test_a_bad_byte_in_a_middle_chunk_leaves_no_file_behind(tmp_path, saved):
    src, step_dir = saved
    name = max(src.manifest(1)["files"], key=lambda f: os.path.getsize(step_dir / f))
    with open(step_dir / name, "r+b") as f:
        f.seek(os.path.getsize(step_dir / name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match=name):
        copy_step(src, LocalStorage(str(tmp_path / "mounted")), 1)
    assert not (tmp_path / "mounted" / "step-0000000001").exists()  # one file: nothing at all
