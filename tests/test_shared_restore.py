"""Replicated state is read from storage once, split over the ranks, and shared through the
page cache or by broadcast: every rank gets every byte exactly, each rank has about 1/world
of them read from storage, and a bad chunk in one rank's part makes every rank fall back
together."""

import glob
import json
import os

import pytest

from .faults import flip_byte
from .launch import run_ranks

pytestmark = pytest.mark.timeout(180)

# the shared tensors of tests.workers._replicated_state (the 10-element one is read by all)
SHARED_BYTES = 1024 * 1024 * 4 + 777 * 1001 * 4 + 600 * 1000 * 2


def _readahead_bytes(path: str) -> int:
    """How far the kernel reads ahead on its own on the device holding ``path`` (the
    largest of all block devices' when that one is not found: an overlay or a partition)."""
    dev = os.stat(path).st_dev
    here = glob.glob(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/read_ahead_kb")
    values = [int(open(f).read()) for f in here or glob.glob("/sys/block/*/queue/read_ahead_kb")]
    return max(values or [128]) * 1024


def _reads(results) -> list[int]:
    out = []
    for r in results:
        line = next(line for line in r.output.splitlines() if line.startswith("RESULT "))
        out.append(json.loads(line[len("RESULT "):])["read"])
    return out


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shared") / "ckpt")
    run_ranks("replicated_save", 2, {"root": root})
    return root


MODES = ["page-cache", "broadcast"]


@pytest.mark.parametrize("world,mode", [(1, "auto"), (2, "page-cache"), (3, "page-cache"), (2, "broadcast"),
                                        (3, "broadcast")])
def test_each_byte_is_read_once_whatever_the_rank_count(saved_by_two, world, mode):
    reads = _reads(run_ranks("replicated_restore", world, {"root": saved_by_two, "expect": 2},
                             env={"RESILIENT_RESTORE_SHARING": mode}))
    # every rank has every tensor exactly (asserted in the worker); storage served each byte
    # about once in total (read-ahead aside). A broadcast splits the reads evenly, up to what
    # the kernel reads ahead past a rank's part on its own (this machine's disk: 8 MB, which
    # can take a neighbour's whole part; then that neighbour finds it cached and reads
    # nothing); through the page cache a rank that is ahead reads on into a slower rank's
    # part itself
    assert SHARED_BYTES * 0.9 <= sum(reads) < SHARED_BYTES * 1.1 + (1 << 20), reads
    if mode == "broadcast":
        assert max(reads) < SHARED_BYTES / world * 1.35 + (1 << 20) + _readahead_bytes(saved_by_two), reads


@pytest.mark.parametrize("mode", MODES)
def test_a_bad_chunk_in_one_ranks_part_makes_every_rank_fall_back(tmp_path, mode):
    root = str(tmp_path / "ckpt")
    run_ranks("replicated_save", 2, {"root": root})
    flip_byte(os.path.join(root, "step-0000000002", "rank-00001.data"), 100_000)
    # both ranks load step 1, none hangs
    run_ranks("replicated_restore", 2, {"root": root, "expect": 1}, env={"RESILIENT_RESTORE_SHARING": mode})


def test_shared_reads_from_a_node_with_only_the_remote_tier(tmp_path, s3_server):
    remote = {"remote": f"s3://{s3_server['bucket']}/shared-{os.getpid()}", "storage_options": s3_server["options"]}
    run_ranks("replicated_save", 2, {"root": str(tmp_path / "first"), **remote})
    reads = _reads(run_ranks("replicated_restore", 3, {"root": str(tmp_path / "empty"), "expect": 2, **remote}))
    assert SHARED_BYTES * 0.9 <= sum(reads) < SHARED_BYTES * 1.1 + (1 << 20), reads
