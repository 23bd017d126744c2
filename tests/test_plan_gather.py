"""Planning a layout gathers every rank's description; a plain list the ranks share (every
rank of a data-parallel job) travels once, not once per rank."""

import pickle

import pytest
import torch

from resilient._plan import describe

from .thread_ranks import gathered_by

pytestmark = pytest.mark.timeout(60)


def test_every_rank_gets_every_description_and_a_shared_plain_list_travels_once():
    replicated = {f"layer{i}.weight": torch.full((64,), float(i)) for i in range(500)}
    world = 8
    same = [describe(replicated, set()) for _ in range(world)]
    results, moved = gathered_by(same)
    assert all(result == same for result in results)
    one_list = len(pickle.dumps(same[0]["plain"]))
    assert moved < 2 * one_list, (moved, one_list)  # was world x one list
    # pipeline stages: each stage's list is gathered from it (two distinct lists here)
    stages = [describe({f"stage{r % 2}.{i}": torch.ones(4) * r % 2 for i in range(50)}, set()) for r in range(4)]
    results, _ = gathered_by(stages)
    assert all(result == stages for result in results)
