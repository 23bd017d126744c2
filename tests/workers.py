"""Scenarios run by ``tests.launch`` in separate processes (one per rank)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient import Checkpointer
from resilient._format import step_dir_name

GLOBAL_BATCH = 16


def init() -> tuple[int, int]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or os.environ.get("FORCE_DIST"):
        dist.init_process_group("gloo", init_method="env://")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build(dropout: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(64, 8)
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.5)
    return model, optim, sched


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch at a step whatever the world size; each rank takes its rows."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)
    y = torch.randn(GLOBAL_BATCH, 8, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(a: dict) -> None:
    """DDP training with a checkpoint every ``every`` steps; optionally SIGKILL one rank."""
    rank, world = init()
    model, optim, sched = build(a.get("dropout", 0.1))
    ddp = DDP(model) if world > 1 else model
    # ``save_wrapped``: the state names the DDP wrapper, as many training scripts do
    state = {"model": ddp if a.get("save_wrapped") else model, "optim": optim, "sched": sched,
             "progress": {"seen": 0}}
    with Checkpointer(a["root"], every=a["every"], state=state, remote=a.get("remote"),
                      storage_options=a.get("storage_options")) as ckpt:
        start = ckpt.restore()
        print(f"rank {rank} restored step {start}", flush=True)
        for step in range(start, a["total"]):
            x, y = batch(step, rank, world)
            optim.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optim.step()
            sched.step()
            state["progress"]["seen"] += x.shape[0]
            ckpt.save(step + 1)
            if a.get("kill_at") == step + 1 and rank == a.get("kill_rank", 1):
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and a.get("out"):
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, a["out"])
        with open(a["out"] + ".json", "w") as f:
            json.dump({"start": start, "progress": state["progress"]}, f)


def kill_during_write(a: dict) -> None:
    """Commit step 1, start saving step 2, SIGKILL rank ``victim`` while it writes."""
    rank, world = init()
    n = a["mbytes"] * (1 << 20) // 4
    state = {"w": torch.full((n,), 1.0), "v": torch.arange(1000, dtype=torch.float64)}
    ckpt = Checkpointer(a["root"], keep=None)
    ckpt.save(1, state)
    ckpt.wait()
    state["w"].fill_(2.0)
    ckpt.save(2, state)
    if rank == a["victim"]:
        time.sleep(a.get("delay", 0.0))
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()  # the survivor cannot commit: it times out waiting for the victim


def dtensor_box_tensors(world: int, uint4: bool = True) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    full = dtensor_box_tensors_full(uint4)
    # "d": a dtype torch has no copy kernel for, sharded across its columns (each rank's
    # part a strided view), placed by hand: gloo has no collective for it either
    tensors = {
        "a": distribute_tensor(full["a"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
        "c": distribute_tensor(full["c"], mesh, [Replicate()]),
        "plain": full["plain"].clone(),
    }
    if uint4:
        d = full["d"]  # made afresh by each call: nothing to clone (uint4 has no copy either)
        tensors["d"] = DTensor.from_local(d.tensor_split(world, dim=1)[mesh.get_local_rank()], mesh, [Shard(1)],
                                          run_check=False, shape=d.shape, stride=d.stride())
    return tensors, full


def dtensor_box_tensors_full(uint4: bool = True) -> dict:
    """The full values of the tensors ``dtensor_box_tensors`` distributes (with "d", of a
    dtype no export format can hold, unless ``uint4`` is False)."""
    g = torch.Generator().manual_seed(7)
    full_a = torch.randn(10, 6, generator=g)
    full_b = torch.randn(5, 3, generator=g).to(torch.bfloat16)
    full_d = torch.randint(0, 256, (4, 6), dtype=torch.uint8, generator=g).view(torch.uint4)
    full = {"a": full_a, "b": full_b, "c": torch.arange(21, dtype=torch.int64), "plain": torch.linspace(0, 1, 33)}
    return {**full, "d": full_d} if uint4 else full


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal element for element; uint4, which torch cannot compare, as its bytes."""
    if want.dtype == torch.uint4:
        return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got, want)


def dtensor_save(a: dict) -> None:
    rank, world = init()
    tensors, _ = dtensor_box_tensors(world, a.get("uint4", True))
    with Checkpointer(a["root"], keep=None) as ckpt:
        ckpt.save(a.get("step", 5), {"t": tensors})


def dtensor_load(a: dict) -> None:
    """Restore into DTensors on this world's mesh (zeroed first) and check every element."""
    rank, world = init()
    tensors, full = dtensor_box_tensors(world, uint4=not a.get("widen"))
    if a.get("widen"):  # restored into float64 DTensors of the same placements: converted, exactly
        tensors = {k: t.to(torch.float64) if t.is_floating_point() else t for k, t in tensors.items()}
        full = {k: t.to(torch.float64) if t.is_floating_point() else t for k, t in full.items()}
    with torch.no_grad():
        for t in tensors.values():
            local = t.to_local() if hasattr(t, "to_local") else t
            (local.view(torch.uint8) if local.dtype == torch.uint4 else local).zero_()
    state = {"t": dict(tensors)}
    with Checkpointer(a["root"]) as ckpt:
        step = ckpt.restore(state)
    assert step == a["expect_step"], (step, a["expect_step"])
    for name, t in tensors.items():
        assert state["t"][name] is t, f"{name} was not loaded in place"
        if name == "d":  # no collective for uint4: this rank's columns
            assert same_values(t.to_local(), full["d"].tensor_split(world, dim=1)[rank]), name
            continue
        got = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert torch.equal(got, full[name]), name
    print(f"rank {rank} dtensor ok at step {step}", flush=True)


def mismatch_on_one_rank(a: dict) -> None:
    """Save, then restore where only rank 1's state has the wrong shape: every rank must raise."""
    from resilient import StateError

    rank, world = init()
    with Checkpointer(a["root"]) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        ckpt.wait()
        try:
            ckpt.restore({"w": torch.zeros(5 if rank == 1 else 4)})
        except StateError as exc:
            print(f"rank {rank} refused: {exc}", flush=True)
            return
    raise AssertionError("restore did not refuse")


def remote_refused(a: dict) -> None:
    """A remote tier every rank must refuse: one each rank built itself (``per_rank``: the
    URL suffixed with the rank), or one whose bucket does not exist."""
    from resilient import StorageError

    rank, world = init()
    remote = f"{a['remote']}-{rank}" if a.get("per_rank") else a["remote"]
    try:
        Checkpointer(a["root"], remote=remote, storage_options=a.get("storage_options"))
    except (ValueError, StorageError) as exc:
        print(f"rank {rank} refused: {exc}", flush=True)
        return
    raise AssertionError(f"remote tier {remote} was accepted")


def rank_dependent_tensor_refused(a: dict) -> None:
    """A plain tensor that differs by rank, outside PerRank: every rank's save refuses it."""
    from resilient import UnsupportedStateError

    rank, world = init()
    with Checkpointer(a["root"], keep=None) as ckpt:
        try:
            ckpt.save(1, {"w": torch.ones(4), "extra": {"counter": torch.tensor([rank])}}, force=True)
        except UnsupportedStateError as exc:
            assert "extra/counter" in str(exc) and "PerRank" in str(exc), exc
            print(f"rank {rank} refused: {exc}", flush=True)
        else:
            raise AssertionError("a rank-dependent plain tensor was saved as shared state")
        ckpt.save(2, {"w": torch.ones(4)}, force=True)  # and the checkpointer still works
        ckpt.wait()


def _loader_state(rank: int) -> dict:
    """Per-rank state as a data loader holds it: a generator state and a position."""
    return {"generator": torch.Generator().manual_seed(100 + rank).get_state(), "position": 10 * rank,
            "epoch": 3}


def per_rank_save(a: dict) -> None:
    from resilient import PerRank

    rank, world = init()
    state = {"w": torch.arange(6.0), "loader": PerRank(_loader_state(rank))}
    with Checkpointer(a["root"], keep=None) as ckpt:
        ckpt.save(5, state, force=True)
    print(f"rank {rank} saved per-rank state", flush=True)


def saves_on_own_nodes(a: dict) -> None:
    """Each rank its own node (its own local root, so each is its node's leader) and its
    own data: steps ``a["first"]`` (1) to ``a["steps"]`` committed on the local tier, and
    uploaded to ``a["remote"]`` when given."""
    from resilient import PerRank

    rank, world = init()
    with Checkpointer(os.path.join(a["root"], f"node{rank}"), keep=None, remote=a.get("remote"),
                      storage_options=a.get("storage_options")) as ckpt:
        for step in range(a.get("first", 1), a["steps"] + 1):
            ckpt.save(step, {"mine": PerRank(torch.full((100_000,), float(10 * rank + step)))}, force=True)
        if a.get("remote"):
            ckpt.flush(timeout=60)


def per_rank_restore(a: dict) -> None:
    """Same world: each rank its own. Other world: refused naming the entry, unless a rule
    (here: new rank r takes old rank r mod old world, position advanced) is given."""
    from resilient import PerRank, StateError

    rank, world = init()
    loader = PerRank({"generator": torch.Generator().get_state(), "position": -1, "epoch": 0})
    state = {"w": torch.zeros(6), "loader": loader}
    with Checkpointer(a["root"]) as ckpt:
        if world != a["saved_world"]:
            try:
                ckpt.restore(state)
            except StateError as exc:
                assert "'loader'" in str(exc) and "reshard" in str(exc), exc
                print(f"rank {rank} refused without a rule", flush=True)
            else:
                raise AssertionError("per-rank state restored at another world size without a rule")

            def broken(saved: list, new_rank: int, new_world: int) -> dict:
                return saved[0]["cursor"]  # a rule written for another loader's state

            loader.reshard = broken
            try:  # the rule's error is the state's: named, and no older step is tried
                ckpt.restore(state)
            except StateError as exc:
                assert "key 'loader': its reshard rule refused the checkpoint of step 5: KeyError" in str(exc), exc
            else:
                raise AssertionError("a reshard rule that raised restored anyway")

            def rule(saved: list, new_rank: int, new_world: int) -> dict:
                mine = dict(saved[new_rank % len(saved)])
                mine["position"] += 1000 * (new_rank // len(saved))
                return mine

            loader.reshard = rule
        assert ckpt.restore(state) == 5
    source = rank % a["saved_world"]
    want = _loader_state(source)
    got = loader.value
    assert torch.equal(got["generator"], want["generator"]), "generator state is not this rank's"
    assert got["position"] == want["position"] + 1000 * (rank // a["saved_world"]), got
    assert got["epoch"] == 3 and torch.equal(state["w"], torch.arange(6.0))
    print(f"rank {rank} per-rank ok (from saved rank {source})", flush=True)


def _draws() -> list:
    import random

    import numpy as np

    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def rng_per_rank_save(a: dict) -> None:
    """Each rank seeded differently. Step 4 saves one byte, so that only the last rank writes
    a data file (the others keep their states in the manifest); step 5 twelve floats, a file
    on every rank. After each save, writes the rank's next draws to ``out``/saved-STEP-RANK.json."""
    import random

    import numpy as np

    rank, world = init()
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    with Checkpointer(a["root"], keep=None) as ckpt:
        for step, w in ((4, torch.tensor([world], dtype=torch.uint8)), (5, torch.full((12,), float(world)))):
            ckpt.save(step, {"w": w}, force=True).result()
            with open(os.path.join(a["out"], f"saved-{step}-{rank}.json"), "w") as f:
                json.dump(_draws(), f)
    print(f"rank {rank} saved", flush=True)


def rng_per_rank_restore(a: dict) -> None:
    """Restores step ``step`` at this world size; writes the draws that follow to
    ``out``/STEP-WORLD-RANK.json."""
    import random

    import numpy as np

    rank, world = init()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    step = a["step"]
    state = {"w": torch.zeros(1, dtype=torch.uint8) if step == 4 else torch.zeros(12)}
    with Checkpointer(a["root"]) as ckpt:
        assert ckpt.restore(state, step=step) == step
    assert state["w"][0].item() == 3
    with open(os.path.join(a["out"], f"{step}-{world}-{rank}.json"), "w") as f:
        json.dump(_draws(), f)
    print(f"rank {rank} restored", flush=True)


def _stateful_loader(seed: int):
    """A shuffling loader whose sampler draws its own generator (seeded from torch's global
    one), so its saved state carries that generator: different on every rank."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(seed)
    return StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(200.0)), batch_size=4, shuffle=True)


def stateful_dataloader_per_rank(a: dict) -> None:
    """torchdata's StatefulDataLoader as users run it, one shuffled loader per rank: saved as
    a plain entry it is refused (its sampler's generator differs by rank); as a PerRank entry
    every rank resumes exactly where its own loader was."""
    from resilient import PerRank, UnsupportedStateError

    rank, world = init()
    loader = _stateful_loader(100 + rank)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    with Checkpointer(a["root"], keep=None) as ckpt:
        try:
            ckpt.save(5, {"loader": loader}, force=True)
        except UnsupportedStateError as exc:
            assert "loader/_sampler_iter_state/sampler_iter_state/generator" in str(exc), exc
        else:
            raise AssertionError("per-rank loader state saved as shared state")
        ckpt.save(5, {"loader": PerRank(loader)}, force=True)
    expected = [next(batches)[0].tolist() for _ in range(3)]
    fresh = _stateful_loader(999)  # another order altogether, until restored
    with Checkpointer(a["root"], rng=False) as ckpt:
        assert ckpt.restore({"loader": PerRank(fresh)}) == 5
    resumed = iter(fresh)
    got = [next(resumed)[0].tolist() for _ in range(3)]
    assert got == expected, (rank, got, expected)
    print(f"rank {rank} loader resumed exactly", flush=True)


def _replicated_state(step: int) -> dict:
    """DDP-like state: tensors every rank holds whole, two above the shared-read threshold."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"big": torch.randn(1024, 1024, generator=g), "odd": torch.randn(777, 1001, generator=g),
                      "small": torch.randn(10, generator=g)},
            "bf16": torch.randn(600, 1000, generator=g).to(torch.bfloat16), "meta": {"step": step}}


def _bytes_read() -> int:
    """Bytes this process has had read from storage (what the page cache served is not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _evict(root: str) -> None:
    """Drop every file under ``root`` from the page cache: the next read comes from storage."""
    for d, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def replicated_save(a: dict) -> None:
    rank, world = init()
    with Checkpointer(a["root"], keep=None, remote=a.get("remote"), storage_options=a.get("storage_options"),
                      chunk_bytes=1 << 20) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _replicated_state(step), force=True)
        ckpt.wait()
        if a.get("remote"):
            ckpt.flush(timeout=60)


def replicated_restore(a: dict) -> None:
    """Restore replicated state; report the bytes this rank read (each reads ~1/world)."""
    rank, world = init()
    expected = _replicated_state(a["expect"])
    # widen: restored into wider dtypes (converted, exactly), which are not shared
    model_dtype, bf16_dtype = (torch.float64, torch.float32) if a.get("widen") else (None, None)
    target = {"model": {k: torch.zeros_like(v, dtype=model_dtype) for k, v in expected["model"].items()},
              "bf16": torch.zeros_like(expected["bf16"], dtype=bf16_dtype), "meta": {"step": 0}}
    with Checkpointer(a["root"], remote=a.get("remote"), storage_options=a.get("storage_options")) as ckpt:
        if a.get("remote"):
            ckpt.restore(dict(target))  # fetch first: the download is not what is measured
        _evict(a["root"])
        if dist.is_initialized():
            dist.barrier()  # nobody reads before every rank has evicted
        before = _bytes_read()
        step = ckpt.restore(target)
        read = _bytes_read() - before
    assert step == a["expect"], (rank, step)
    for k, v in expected["model"].items():
        assert torch.equal(target["model"][k], v.to(target["model"][k].dtype)), (rank, k)
    assert torch.equal(target["bf16"], expected["bf16"].to(target["bf16"].dtype))
    assert target["meta"] == {"step": a["expect"]}
    print("RESULT " + json.dumps({"rank": rank, "read": read}), flush=True)


def _sized_state(step: int) -> dict:
    """Replicated state whose size changes with the step: even steps hold twice the bytes."""
    g = torch.Generator().manual_seed(step)
    rows = 512 if step % 2 else 1024
    return {"w": torch.randn(rows, 1000, generator=g), "b": torch.randn(333, generator=g), "meta": {"step": step}}


def _await_set_aside(root: str, name: str) -> None:
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(root, ".recycle", name)):
        assert time.monotonic() < deadline, f"{name} never reached .recycle"
        time.sleep(0.02)


def recycled_saves(a: dict) -> None:
    """Save steps 1-4 with ``keep=1``, each after the last one's retention; print the inode of
    this rank's data file at every step, then restore step 4 and check it exactly. Then, as
    a restarted job, save step 5 into each rank's file kept from step 3."""
    rank, world = init()
    name = f"rank-{rank:05d}.data"
    inodes = {}
    with Checkpointer(a["root"], keep=1, chunk_bytes=1 << 20) as ckpt:
        for step in (1, 2, 3, 4):
            if step > 2:  # the step before last was deleted: wait for its file to be set aside
                _await_set_aside(a["root"], name)
            ckpt.save(step, _sized_state(step), force=True)
            ckpt.wait()
            inodes[step] = os.stat(os.path.join(a["root"], step_dir_name(step), name)).st_ino
            if dist.is_initialized():
                dist.barrier()
    expected = _sized_state(4)
    target = {"w": torch.zeros_like(expected["w"]), "b": torch.zeros_like(expected["b"]), "meta": {}}
    with Checkpointer(a["root"]) as ckpt:
        assert ckpt.restore(target) == 4
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"]), "restore differs"
    assert target["meta"] == {"step": 4}
    _await_set_aside(a["root"], name)  # step 3's, after step 4
    # the job restarted on the same root: each rank's kept file is its next save's (held open
    # here, so that a new file could not get its inode number)
    with open(os.path.join(a["root"], ".recycle", name), "rb") as held:
        with Checkpointer(a["root"], keep=None, chunk_bytes=1 << 20) as ckpt:
            ckpt.save(5, _sized_state(3), force=True)
            ckpt.wait()
        inodes[5] = os.stat(os.path.join(a["root"], step_dir_name(5), name)).st_ino
        assert inodes[5] == os.fstat(held.fileno()).st_ino, "the restarted run did not overwrite its kept file"
    print("INODES " + json.dumps(inodes), flush=True)


def placements_refused(a: dict) -> None:
    """A DTensor placed Partial cannot be saved: refused at save, naming its key and its
    placement, at each save (the layouts worked out are kept between saves: the second
    refusal must name the second key); the state without it then saves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from resilient import UnsupportedStateError

    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    sharded = DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0)], run_check=False)
    refused = []
    with Checkpointer(a["root"]) as ckpt:
        for key in ("first", "second"):
            partial = DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)
            try:
                ckpt.save(1, {"w": sharded, key: partial})
            except UnsupportedStateError as exc:
                refused.append(str(exc))
        ckpt.save(2, {"w": sharded})
        ckpt.wait()
        assert ckpt.latest() == 2
    print("REFUSED " + json.dumps(refused), flush=True)


def harness_probe(a: dict) -> None:
    """What ``tests.launch`` promises a rank: its own session, its own environment, the
    interpreter state of ``python -m tests.workers``; then hang, exit or raise as asked."""
    import __main__

    print("PROBE " + json.dumps({
        "own_session": os.getsid(0) == os.getpid(), "rank": os.environ["RANK"], "marker": os.environ.get("PROBE"),
        "threads": torch.get_num_threads(), "main": __main__.__name__, "argv": sys.argv[1:],
        "cwd": os.getcwd()}), flush=True)
    if a.get("hang"):
        time.sleep(3600)
    if "exit" in a:
        sys.exit(a["exit"])
    if a.get("raise"):
        raise RuntimeError("probe raised")


def preemption_seen_by_one_rank(a: dict) -> None:
    """Rank 0 alone is signalled (SIGUSR1) before the fourth ``preempted()``; every rank gets
    the same answers, True from the signal's call or the one after it on; the next
    ``save()`` saves that step on every rank and ends the process."""
    import signal

    rank, _ = init()
    if a.get("slow_reader") and rank == 1:
        _read_outcomes_late(2.0)
    ckpt = Checkpointer(a["root"], every=10**9)
    answers = []
    for call in range(8):
        if rank == 0 and call == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        answers.append(ckpt.preempted())
    print("ANSWERS " + json.dumps(answers), flush=True)
    ckpt.save(8, {"w": torch.ones(4)})
    raise AssertionError("the preempted save did not end the process")


def _read_outcomes_late(seconds: float) -> None:
    """This rank reads every save's outcome (the ``settled`` key) ``seconds`` late, as a
    rank the machine's load holds back does: the store may be gone by then if its host
    (rank 0 here, ``MASTER_PORT``) has already exited."""
    from resilient._coord import StoreCoordinator

    collect = StoreCoordinator.collect

    def late(self, keys, timeout):  # noqa: ANN001, ANN202
        if any(key.endswith("/settled") for key in keys):
            time.sleep(seconds)
        return collect(self, keys, timeout)

    StoreCoordinator.collect = late


def closed_while_a_rank_reads_late(a: dict) -> None:
    """A run's end where rank 0 hosts the store (``MASTER_PORT``): the ``with`` block closes
    right after a save, and rank 0's process ends at once (no barrier after it, as a script
    that returns). Rank 1 reads the save's outcome 2 s late. Each rank prints whether the
    save committed and the warnings its close logged."""
    rank, _ = init()
    if rank == 1:
        _read_outcomes_late(2.0)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("resilient").addHandler(handler)
    with Checkpointer(a["root"]) as ckpt:
        handle = ckpt.save(1, {"w": torch.ones(4)})
    print(f"CLOSED committed={handle.committed} warnings={json.dumps(warnings)}", flush=True)
    os._exit(0)


def distributed_sampler_position(a: dict) -> None:
    """A StatefulDataLoader over a DistributedSampler, as a DDP loop holds one: each rank
    takes ``a["batches"]`` batches of the epoch and saves (``a["save"]``), or restores and
    takes the rest of the epoch. Each rank writes the sample ids it took to
    ``<a["out"]>/<saved|resumed>-<rank>.json``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    rank, _ = init()
    data = torch.utils.data.TensorDataset(torch.arange(96))
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
    taken: list[int] = []
    with Checkpointer(a["root"]) as ckpt:
        if a["save"]:
            batches = iter(loader)
            for _ in range(a["batches"]):
                taken += next(batches)[0].tolist()
            ckpt.save(1, {"loader": loader}, force=True)
        else:
            assert ckpt.restore({"loader": loader}) == 1
            for (ids,) in loader:
                taken += ids.tolist()
    with open(os.path.join(a["out"], f"{'saved' if a['save'] else 'resumed'}-{rank}.json"), "w") as f:
        json.dump(taken, f)


SCENARIOS = {f.__name__: f for f in (preemption_seen_by_one_rank, closed_while_a_rank_reads_late, harness_probe, train, kill_during_write, dtensor_save, dtensor_load, mismatch_on_one_rank,
                                     remote_refused,
                                     rank_dependent_tensor_refused, per_rank_save, per_rank_restore, saves_on_own_nodes,
                                     stateful_dataloader_per_rank, distributed_sampler_position,
                                     replicated_save, replicated_restore,
                                     recycled_saves, rng_per_rank_save, rng_per_rank_restore, placements_refused)}

def finish_scenario() -> None:
    """End a scenario process: barrier, tear down the group, exit without interpreter teardown.

    Skipping teardown: with DeviceMesh on 3 gloo ranks, torch 2.13 rarely aborts there
    ("terminate called without an active exception", ~1 exit in 30 under pytest), after the
    scenario has passed. The scenario's outcome is its exit status up to here.
    """
    if dist.is_initialized():
        dist.barrier()  # nobody tears down while a peer still talks to the store host
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    finish_scenario()
