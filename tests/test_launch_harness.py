"""The harness that starts the tests' ranks (``tests.launch``) keeps what a separate
``python -m tests.workers`` process would give: each rank in a session of its own, with the
environment it was given, one intra-op thread, its exit status and its output as they were;
a rank that hangs is SIGKILLed at the deadline. Ranks are forked from a server that has
imported torch, so these are checked, not assumed."""

import json
import os

import pytest

from .launch import REPO, run_ranks

pytestmark = pytest.mark.timeout(120)


def probes(results):
    return [json.loads(r.output.split("PROBE ", 1)[1].splitlines()[0]) for r in results]


def test_each_rank_is_its_own_process_with_its_own_environment():
    results = run_ranks("harness_probe", 2, {"x": 1}, env={"PROBE": "given"})
    assert [r.returncode for r in results] == [0, 0]
    for rank, probe in enumerate(probes(results)):
        assert probe == {"own_session": True, "rank": str(rank), "marker": "given", "threads": 1,
                         "main": "__main__", "argv": ["harness_probe", json.dumps({"x": 1})], "cwd": REPO}
    assert "PROBE" not in os.environ  # the test's own environment is untouched


def test_exit_status_and_exceptions_come_back_as_from_a_process():
    assert run_ranks("harness_probe", 1, {"exit": 3}, expect_ok=False)[0].returncode == 3
    raised = run_ranks("harness_probe", 1, {"raise": True}, expect_ok=False)[0]
    assert raised.returncode == 1
    assert "Traceback" in raised.output and "RuntimeError: probe raised" in raised.output


def test_a_hung_rank_is_killed_at_the_deadline():
    hung = run_ranks("harness_probe", 1, {"hang": True}, timeout=5, expect_ok=False)[0]
    assert hung.returncode == -9
    assert "PROBE " in hung.output and "[killed by the test harness after 5 s]" in hung.output
