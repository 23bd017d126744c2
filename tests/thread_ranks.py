"""Ranks as threads of one process, for the collective steps of planning: each rank's
``all_gather`` is a barrier over a shared slot list, as torch's object collectives behave."""

import pickle
import threading
from typing import Any, Callable

from resilient._plan import gather_descriptions


def gathered_by(descriptions: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], int]:
    """Every rank's result of ``gather_descriptions`` (ranks as threads, the collectives a
    barrier), and the bytes all its gathers moved to each rank."""
    world = len(descriptions)
    slots: list[list] = []
    moved = [0]
    barrier = threading.Barrier(world)
    lock = threading.Lock()

    def all_gather_for(rank: int) -> Callable[[object], list[Any]]:
        calls = [0]

        def all_gather(obj: object) -> list[Any]:
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

    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        results[rank] = gather_descriptions(all_gather_for(rank), rank, descriptions[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, moved[0]
