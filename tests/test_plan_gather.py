"""Planning a layout gathers every rank's description; a plain list the ranks share (every
rank of a data-parallel job) travels once, not once per rank."""

import pickle
import threading

import pytest
import torch

from resilient._snapshot import describe, gather_descriptions

pytestmark = pytest.mark.timeout(60)


def _gathered_by(descriptions: list[dict]) -> tuple[list[list[dict]], int]:
    """Every rank's result of ``gather_descriptions`` (ranks as threads, the collectives a
    barrier), and the bytes all its gathers moved to each rank."""
    world = len(descriptions)
    slots: list[list] = []
    moved = [0]
    barrier = threading.Barrier(world)
    lock = threading.Lock()

    def all_gather_for(rank: int):
        calls = [0]

        def all_gather(obj):
            call = calls[0]
            calls[0] += 1
            with lock:
                while len(slots) <= call:
                    slots.append([None] * world)
                slots[call][rank] = obj
            barrier.wait()
            out = list(slots[call])
            if rank == 0:
                moved[0] += len(pickle.dumps(out))
            barrier.wait()
            return out

        return all_gather

    results: list = [None] * world

    def run(rank: int) -> None:
        results[rank] = gather_descriptions(all_gather_for(rank), rank, descriptions[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, moved[0]


def test_every_rank_gets_every_description_and_a_shared_plain_list_travels_once():
    replicated = {f"layer{i}.weight": torch.full((64,), float(i)) for i in range(500)}
    world = 8
    same = [describe(replicated, set()) for _ in range(world)]
    results, moved = _gathered_by(same)
    assert all(result == same for result in results)
    one_list = len(pickle.dumps(same[0]["plain"]))
    assert moved < 2 * one_list, (moved, one_list)  # was world x one list
    # pipeline stages: each stage's list is gathered from it (two distinct lists here)
    stages = [describe({f"stage{r % 2}.{i}": torch.ones(4) * r % 2 for i in range(50)}, set()) for r in range(4)]
    results, _ = _gathered_by(stages)
    assert all(result == stages for result in results)
