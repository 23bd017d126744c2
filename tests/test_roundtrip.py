"""Single-process behaviour of the engine: every state kind, bitwise, and its edges."""

import collections
import dataclasses
import enum
import math
import os
import random

import numpy as np
import psutil
import pytest
import torch

from resilient import AnyOf, Checkpointer, KeepEvery, KeepLast, StateError


class Counter:
    """A user object with state_dict/load_state_dict (like a stateful data loader)."""

    def __init__(self) -> None:
        self.position = 0
        self.order = torch.randperm(10)

    def state_dict(self):
        return {"position": self.position, "order": self.order, "meta": {"epoch": 2, 3: "int key"}}

    def load_state_dict(self, sd):
        self.position = sd["position"]
        self.order = sd["order"]
        self.meta = sd["meta"]


def make_training_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Linear(12, 3))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(adam, max_lr=0.1, total_steps=100)
    for _ in range(3):
        adam.zero_grad()
        model(torch.randn(8, 6)).pow(2).sum().backward()
        adam.step()
        sched.step()
    return model, adam, sched


def tensors_zoo():
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(4, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(3, 3, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, 2, generator=g).double(),
        "i8": torch.randint(-100, 100, (9,), dtype=torch.int8, generator=g),
        "i64": torch.arange(12).reshape(3, 4),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
    }


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    from resilient._snapshot import byte_view

    return byte_view(t)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_torch_can_hold_round_trips_bitwise_contiguous_or_not(root):
    """Random bytes in every dtype the format names that torch lets a plain tensor hold,
    stored as they are and transposed. The sub-byte and shell dtypes (uint4, int1, bits8)
    have no copy kernel in torch: a transposed one could not be saved before."""
    from resilient._format import DTYPE_ITEMSIZE

    g = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for name, size in DTYPE_ITEMSIZE.items():
        if name.startswith(("qint", "quint")):  # quantized: refused, see test_errors.py
            continue
        raw = torch.randint(0, 256, (3, 4 * size), dtype=torch.uint8, generator=g)
        state[name] = raw.view(getattr(torch, name))
        state[f"{name}.t"] = state[name].t()
    assert {"float8_e4m3fn", "float4_e2m1fn_x2", "uint4", "int1", "bits8", "complex32"} <= set(state)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"zoo": state})
    # zeros of each dtype, made through a dtype of its size that torch can fill; laid out
    # as the saved tensor is (the transposed ones as a view of a contiguous tensor)
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
    targets = {}
    for name, t in state.items():
        shape = t.t().shape if name.endswith(".t") else t.shape
        zeros = torch.zeros(shape, dtype=by_size[t.element_size()]).view(t.dtype)
        targets[name] = zeros.t() if name.endswith(".t") else zeros
    restored = {"zoo": dict(targets)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(restored) == 1
    for name, t in state.items():
        got = restored["zoo"][name]
        assert got is targets[name], name  # filled in place, transposed ones too
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride(), name
        assert torch.equal(_bytes_of(got), _bytes_of(t)), name


def test_every_state_kind_round_trips_bitwise(root):
    model, adam, sched = make_training_state(0)
    counter = Counter()
    counter.position = 17
    zoo = tensors_zoo()
    values = {"epoch": 4, "loss": 0.125, "name": "run-42", "flags": [True, None], "nested": {"a": [1, 2.5, "x"]},
              "tup": (1, 2), "nan": float("nan"), 7: "int key"}
    state = {"model": model, "optim": adam, "sched": sched, "loader": counter, "zoo": zoo, "values": values,
             "lone": torch.arange(5.0)}
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(state) == 0
        ckpt.save(3, state)
        ckpt.wait()
        assert ckpt.latest() == 3
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(3))

    model2, adam2, sched2 = make_training_state(1)  # different weights, same shapes
    counter2 = Counter()
    lone = torch.zeros(5)
    state2 = {"model": model2, "optim": adam2, "sched": sched2, "loader": counter2, "zoo": None, "values": None,
              "lone": lone}
    random.seed(0)
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(state2) == 3

    for (k, a), (k2, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    sd, sd2 = adam.state_dict(), adam2.state_dict()
    assert sd["param_groups"] == sd2["param_groups"]
    for pid, per in sd["state"].items():
        for name, t in per.items():
            assert torch.equal(t, sd2["state"][pid][name]), (pid, name)
    assert sched.state_dict() == sched2.state_dict()
    assert counter2.position == 17 and torch.equal(counter2.order, counter.order)
    assert counter2.meta == {"epoch": 2, 3: "int key"}
    for name, t in zoo.items():
        got = state2["zoo"][name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t) or (got.numel() == 0), name
    got_values = state2["values"]
    assert math.isnan(got_values.pop("nan")) and math.isnan(values.pop("nan"))
    assert got_values == values and isinstance(got_values["tup"], tuple)
    assert state2["lone"] is lone and torch.equal(lone, torch.arange(5.0))  # in place
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])


def test_zstd_round_trip_and_raw_fallback(root):
    model, adam, _ = make_training_state(0)
    zeros = {"moments": torch.zeros(1 << 20)}  # compressible, like Adam state at step 0
    state = {"model": model, "optim": adam, "z": zeros}
    with Checkpointer(root, compress="zstd") as ckpt:
        ckpt.save(1, state)
    data = os.path.join(root, "step-0000000001", "rank-00000.data")
    assert os.path.getsize(data) < (1 << 20)  # 4 MiB of zeros shrank
    state2 = {"model": make_training_state(5)[0], "optim": None, "z": None}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(state2) == 1
    assert torch.equal(state2["z"]["moments"], zeros["moments"])
    for a, b in zip(model.parameters(), state2["model"].parameters()):
        assert torch.equal(a, b)


def test_policies_every_force_and_retention(root):
    state = {"x": torch.zeros(3)}
    with Checkpointer(root, every=5, keep=AnyOf(KeepLast(2), KeepEvery(10))) as ckpt:
        saved = [s for s in range(1, 31) if ckpt.save(s, state) is not None]
        assert saved == [5, 10, 15, 20, 25, 30]
        assert ckpt.save(31, state, force=True) is not None
    # retention runs right after each commit; close() waits for it
    steps = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))
    assert steps == [10, 20, 30, 31]
    with Checkpointer(root, keep=None, every_seconds=3600) as ckpt:
        assert ckpt.save(40, state) is None  # not yet an hour
        assert ckpt.latest() == 31


def test_a_step_saved_again_is_skipped_unless_forced(root, caplog, monkeypatch):
    """A loop that calls save once per micro-batch saved each due step once per micro-batch,
    each a stall and a full write: the step saved last is skipped, the first call's state
    kept, and force=True saves it again, which is the retry of a save that failed."""
    state = {"x": torch.zeros(3)}
    with Checkpointer(root, every=10, keep=None) as ckpt:
        saved = []
        for step in range(1, 21):
            for micro in range(4):
                state["x"] += 1
                if ckpt.save(step, state) is not None:
                    saved.append((step, micro))
        assert saved == [(10, 0), (20, 0)]
        assert ckpt.save(20, state, force=True) is not None
        ckpt.wait()
        assert ckpt.stats["saves_committed"] == 3
    assert caplog.text.count("save(step=10) skipped: this step was saved already") == 1
    back = {"x": torch.zeros(3)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(back, step=10) == 10 and back["x"].tolist() == [37.0] * 3  # the first call's
        assert ckpt.restore(back) == 20 and torch.equal(back["x"], state["x"])  # the forced save's

    # a save that raised is no save: its retry is not skipped
    with Checkpointer(root, keep=None) as ckpt:
        with pytest.raises(TypeError):
            ckpt.save(30, {"x": torch.ones(3), "bad": object()})
        assert ckpt.save(30, state) is not None
    # one that failed in the background is the step saved last: said, and retried with force
    monkeypatch.setenv("RESILIENT_FAULT", "raise:rank=0,step=40,phase=write")
    with Checkpointer(root, keep=None) as ckpt:
        with pytest.raises(Exception, match="injected"):
            ckpt.save(40, state).result()
        assert ckpt.save(40, state) is None
        assert "save(step=40) skipped: it is the step saved last, and that save failed" in caplog.text
        ckpt.save(40, state, force=True).result()
        assert ckpt.latest() == 40


class _Giving:
    """An object whose state_dict() gives what it was made with (and loads nothing)."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        pass


def test_random_generators_in_the_state_resume_the_data_order(root):
    """A DataLoader shuffling with a generator of the program's own, and generators of
    Python and numpy: each was refused as needing pickle, so a resumed run shuffled
    differently. Restored into the program's own objects, the resumed epochs draw what the
    uninterrupted run drew."""
    from resilient import UnsupportedStateError

    def generators(seed):
        return {"loader": torch.Generator().manual_seed(seed), "py": random.Random(seed),
                "np": np.random.default_rng(seed), "legacy": np.random.RandomState(seed)}

    def epoch(gens):
        loader = torch.utils.data.DataLoader(range(20), batch_size=5, shuffle=True, generator=gens["loader"])
        return ([b.tolist() for b in loader], gens["py"].random(), gens["np"].integers(1 << 30),
                gens["legacy"].randint(1 << 30))

    straight = generators(0)
    uninterrupted = [epoch(straight) for _ in range(3)]
    first = generators(0)
    assert epoch(first) == uninterrupted[0]
    with Checkpointer(root) as ckpt:
        ckpt.save(1, dict(first))
    resumed = generators(99)  # a new process: other seeds, other objects
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(resumed) == 1
    assert [epoch(resumed) for _ in range(2)] == uninterrupted[1:]
    # in the program's own dict too (restored into its object); inside a state_dict() it is
    # refused, saying where it goes
    nested = torch.Generator().manual_seed(5)
    with Checkpointer(root) as ckpt:
        ckpt.save(2, {"data": {"g": nested, "epoch": 1}})
    expected = torch.rand(3, generator=nested)
    other = torch.Generator().manual_seed(6)
    back = {"data": {"g": other, "epoch": 0}}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(back) == 2
    assert back["data"]["g"] is other and torch.equal(torch.rand(3, generator=other), expected)

    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"state\['sampler/g'\]: .* a random generator is saved in "
                                                         r"the state itself or its own dicts and lists"):
            ckpt.save(3, {"sampler": _Giving({"g": torch.Generator()})})


def test_steps_past_ten_digits_are_listed_restored_and_kept_in_order(root):
    """A count of tokens as the step (10^12 and more) made directories of 13 digits, which
    were written and committed but never listed: restore returned an older step, and
    retention never deleted them."""
    from resilient._names import parse_step_dir

    state = {"x": torch.zeros(3)}
    with Checkpointer(root, keep=2) as ckpt:
        for step in (9_999_999_999, 10**12, 2 * 10**12, 10**13):
            state["x"].fill_(step % 1000 + 1)
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.latest() == 10**13
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-10000000000000", "step-2000000000000"]
    back = {"x": torch.zeros(3)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(back) == 10**13 and back["x"].tolist() == [1.0] * 3
    assert parse_step_dir("step-00000000001") is None  # one step, one name: no zero-padded twin


def test_a_step_lower_than_the_last_save_is_said_once_per_jump(root, caplog):
    """The batch index of an epoch passed as the step restarts at every epoch: each save
    then overwrites the previous epoch's checkpoint of that number and retention deletes the
    new ones first, without a word. Said at each jump back, and not after a restore (a
    rollback, which the first save's check covers) nor when steps grow."""
    state = {"x": torch.zeros(3)}
    with Checkpointer(root, every=25, keep=2) as ckpt:
        for epoch in range(3):
            for batch in range(1, 101):
                ckpt.save(batch, state)
        jumps = [r.getMessage() for r in caplog.records if "a run's steps must grow" in r.getMessage()]
        assert len(jumps) == 2 and jumps[0].startswith("resilient: save(step=25) after this Checkpointer saved "
                                                       "step 100"), jumps
        assert "pass the global step, not the batch index within an epoch" in jumps[0]
        caplog.clear()
        ckpt.restore(state, step=75)  # a rollback: the first save's check speaks instead
        ckpt.save(80, state, force=True)
        ckpt.wait()
    assert "a run's steps must grow" not in caplog.text and "holds newer checkpoints (steps 100)" in caplog.text


def test_host_memory_does_not_grow_across_saves(root):
    state = {"big": torch.randn(16 << 20 // 4)}  # 16 MiB
    proc = psutil.Process()
    with Checkpointer(root, keep=1) as ckpt:
        for step in range(3):
            ckpt.save(step, state)
        ckpt.wait()
        before = proc.memory_info().rss
        for step in range(3, 13):
            state["big"].add_(1)
            ckpt.save(step, state)
        ckpt.wait()
        grown = proc.memory_info().rss - before
    assert grown < 12 << 20, f"RSS grew by {grown >> 20} MiB over 10 saves of 16 MiB"


def test_a_loop_that_never_waits_holds_no_memory_per_save(root, caplog):
    """Every save's handle was kept until the next wait(), ~2 kB each: a loop that never
    waits (saving often, for days) grew by 2 GB a million saves."""
    import logging
    import tracemalloc

    caplog.set_level(logging.WARNING, logger="resilient")  # the test's log capture keeps every record
    state = {"w": torch.ones(4)}
    with Checkpointer(root, keep=1) as ckpt:
        for step in range(100):
            ckpt.save(step, state)
        tracemalloc.start()
        try:
            ckpt.save(100, state).result()
            before = tracemalloc.get_traced_memory()[0]
            for step in range(101, 601):
                ckpt.save(step, state)
            ckpt.save(601, state).result()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert grown < 200_000, f"{grown} bytes held after 500 more saves"


def test_save_returns_before_commit_and_commits_by_itself(root):
    state = {"big": torch.randn(64 << 20 // 4)}
    with Checkpointer(root) as ckpt:
        handle = ckpt.save(1, state)
        assert handle.staged_at is not None
        state["big"].zero_()  # mutating after save must not change what is written
        handle.result(timeout=60)
        assert handle.committed
    target = {"big": torch.empty(64 << 20 // 4)}
    with Checkpointer(root) as ckpt:
        ckpt.restore(target)
    assert target["big"].abs().sum() > 0


def test_abandoned_pending_saves_are_cleaned_before_the_next_job_writes(root):
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"x": torch.ones(2)})
    junk = os.path.join(root, ".pending", "deadbeef-00000007")
    os.makedirs(junk)
    open(os.path.join(junk, "rank-00000.data"), "wb").write(b"partial")
    with Checkpointer(root) as ckpt:
        assert ckpt.latest() == 1  # reading touches nothing (another job may be writing)
        assert os.path.exists(junk)
        ckpt.save(2, {"x": torch.ones(2)})  # writing claims the root, then cleans it
        assert not os.path.exists(junk)


def test_a_keys_name_does_not_depend_on_the_keys_named_before_it():
    """Key texts are kept from save to save (``_tree._child``): a str enum equals its value
    but is named otherwise, and must be named the same whichever came first."""
    import enum

    from resilient._tree import flatten_state

    class Part(str, enum.Enum):
        HEAD = "head"

    one, two = torch.ones(1), torch.zeros(1)
    first = sorted(flatten_state({"x": {Part.HEAD: one}, "y": {"head": two}}).tensors)
    second = sorted(flatten_state({"y": {"head": two}, "x": {Part.HEAD: one}}).tensors)
    assert first == second == ["x/Part.HEAD", "y/head"]


class _Sampler:
    """A sampler whose state_dict holds numpy's values, as torch.save users keep them."""

    def __init__(self, n):
        self.perm, self.position, self.best = np.arange(n), np.int64(0), np.float32(0.0)

    def state_dict(self):
        return {"perm": self.perm, "position": self.position, "best": self.best}

    def load_state_dict(self, sd):
        self.perm, self.position, self.best = sd["perm"], sd["position"], sd["best"]


def test_numpy_arrays_and_numbers_come_back_as_numpy(root):
    """numpy's arrays of numbers and its scalars are saved (as tensors and JSON numbers) and
    come back as numpy: into the program's array where it fits, a new one where not (another
    shape, read-only), and as arrays inside an object's state_dict, where nothing holds a
    target. Before, every one was refused at save."""
    rng = np.random.default_rng(0)
    sampler = _Sampler(7)
    sampler.perm, sampler.position, sampler.best = rng.permutation(7), np.int64(5), np.float32(0.25)
    frozen = np.arange(3, dtype=np.int16)
    frozen.flags.writeable = False
    saved = {"sampler": sampler, "stats": {"hist": rng.random((2, 3)), "count": np.int64(3), "flag": np.bool_(True),
                                           "grown": np.arange(4.0), "frozen": frozen, "odd": np.arange(10)[::-3],
                                           "mean": np.float64(0.5)}}
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, saved).result()
    hist = np.zeros((2, 3))
    live_frozen = np.zeros(3, dtype=np.int16)
    live_frozen.flags.writeable = False
    state = {"sampler": _Sampler(7), "stats": {"hist": hist, "count": np.int64(0), "flag": np.bool_(False),
                                               "grown": np.zeros(2), "frozen": live_frozen,
                                               "odd": np.zeros(4, dtype=np.int64), "mean": np.float64(0)}}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(state) == 1
    got, want = state["stats"], saved["stats"]
    assert got["hist"] is hist and np.array_equal(hist, want["hist"])  # filled in place
    for name in ("grown", "frozen", "odd"):  # another shape, read-only: the saved array
        assert type(got[name]) is np.ndarray and np.array_equal(got[name], want[name]), name
        assert got[name].dtype == want[name].dtype
    for name in ("count", "flag", "mean"):
        assert type(got[name]) is type(want[name]) and got[name] == want[name], name
    restored = state["sampler"]
    assert type(restored.perm) is np.ndarray and np.array_equal(restored.perm, sampler.perm)
    assert restored.position == 5 and restored.best == np.float32(0.25)
    # read for an export: the tensors they were saved as (what its file formats hold)
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    catalog = Catalog(open_storage(root))
    tree, _ = catalog.read_state(catalog.manifest(1), 1)
    assert torch.equal(tree["stats"]["hist"], torch.from_numpy(want["hist"])) and tree["stats"]["count"] == 3


def test_sets_and_bytes_come_back_as_sets_and_bytes(root):
    """A set of numbers and strings (a sampler's seen indices) and bytes (a tokenizer's
    blob) are saved without pickle and come back as they were, with or without a target,
    inside a state_dict too; a set the program holds takes the saved items in place. Before,
    both were refused at save."""
    seen, blob = {3, 1, 7}, bytearray(b"\x00\xffab")

    class Holder:
        def state_dict(self):
            return {"tags": frozenset({"b", "a"}), "raw": b"\x01\x02", "empty": b""}

        def load_state_dict(self, sd):
            self.loaded = sd

    saved = {"data": {"seen": seen, "mixed": {None, 2.5, "x", True}, "blob": blob}, "holder": Holder()}
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, saved).result()
    live_seen, live_blob, holder = {99}, bytearray(b"zz"), Holder()
    state = {"data": {"seen": live_seen, "mixed": set(), "blob": live_blob}, "holder": holder}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(state) == 1
    assert state["data"]["seen"] is live_seen and live_seen == {1, 3, 7}
    assert state["data"]["mixed"] == {None, 2.5, "x", True}
    assert state["data"]["blob"] is live_blob and live_blob == blob
    assert holder.loaded == {"tags": frozenset({"a", "b"}), "raw": b"\x01\x02", "empty": b""}
    assert type(holder.loaded["tags"]) is frozenset and type(holder.loaded["raw"]) is bytes
    # read for an export (whose file formats hold tensors, lists and JSON): as stored
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    catalog = Catalog(open_storage(root))
    tree, _ = catalog.read_state(catalog.manifest(1), 1)
    assert tree["data"]["seen"] == [1, 3, 7] and torch.equal(tree["data"]["blob"], torch.tensor(list(blob)).byte())
    # saved in one order whatever the set's (ranks' trees alike in content are one tree)
    from resilient._tree import flatten_state

    node = flatten_state({"s": {"b", 2, "a", 1}}).tree["items"][0][1]
    assert [item["v"] for item in node["items"]] == [1, 2, "a", "b"] and node["set"] == "set"


class _Split(enum.Enum):
    TRAIN = "train"
    TEST = "test"


def test_a_configs_paths_dates_dtypes_and_devices_come_back_as_they_were(root):
    """Values a config holds (an output directory, a start time, a dtype, a device) are saved
    as text and made again by their parser, never by the checkpoint's code; an export keeps
    the text. Before, each was refused at save."""
    import datetime
    import pathlib
    import uuid

    config = {"out": pathlib.Path("/data/run-7"), "started": datetime.datetime(2026, 12, 6, 21, 30, 5, 123),
              "day": datetime.date(2026, 12, 6), "budget": datetime.timedelta(hours=1, seconds=0.5),
              "dtype": torch.bfloat16, "device": torch.device("cpu"), "z": complex(1.5, -2.0),
              "id": uuid.UUID("12345678-1234-5678-1234-567812345678")}
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, {"config": config, "split": _Split.TRAIN, "w": torch.ones(2)}).result()
    state = {"config": {}, "split": _Split.TEST, "w": torch.zeros(2)}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(state) == 1
    assert state["split"] is _Split.TRAIN  # by name, into the program's own enum
    assert state["config"] == config and all(type(state["config"][k]) is type(v) or k == "out"
                                              for k, v in config.items())
    assert isinstance(state["config"]["out"], pathlib.PurePath)
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    catalog = Catalog(open_storage(root))
    tree, _ = catalog.read_state(catalog.manifest(1), 1)
    assert tree["config"]["dtype"] == "bfloat16" and tree["config"]["out"] == "/data/run-7"
    assert tree["split"] == "TRAIN"  # no target, no class: the member's name


@dataclasses.dataclass
class _Config:
    lr: float = 0.1
    out: str = "/tmp"
    schedule: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    seed: int = 0
    mask: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(2))


def test_dataclasses_come_back_into_the_programs_instances(root):
    """A config kept as a dataclass is saved as its fields (no pickle, no class named) and
    restored into the program's instance, a frozen one replaced by a copy with the saved
    fields (its tensors filled in place); without a target it reads as a dict. Before, a
    dataclass was refused at save."""
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, {"config": _Config(0.5, "/data", {"warmup": 10}), "frozen": _Frozen(7, torch.ones(2))}).result()
    config, frozen = _Config(), _Frozen()
    mask = frozen.mask
    state = {"config": config, "frozen": frozen}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(state) == 1
    assert state["config"] is config and config == _Config(0.5, "/data", {"warmup": 10})
    assert type(state["frozen"]) is _Frozen and state["frozen"].seed == 7
    assert state["frozen"].mask is mask and torch.equal(mask, torch.ones(2))
    from resilient._catalog import Catalog
    from resilient._storage import open_storage

    catalog = Catalog(open_storage(root))
    tree, _ = catalog.read_state(catalog.manifest(1), 1)
    assert tree["config"] == {"lr": 0.5, "out": "/data", "schedule": {"warmup": 10}}


Progress = collections.namedtuple("Progress", "epoch step")


def test_tuples_come_back_as_the_programs_kind_and_a_tuple_of_models_loads_them(root):
    """A namedtuple comes back as one (``progress.epoch`` works), a ``torch.Size`` as one, and
    a tuple of models (and of their optimizers) is loaded into the program's models. Before,
    each came back a plain tuple: of plain values, and of state dicts in place of the models."""
    torch.manual_seed(0)
    pair = (torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    optims = (torch.optim.Adam(pair[0].parameters()), torch.optim.Adam(pair[1].parameters()))
    pair[1](pair[0](torch.randn(2, 3))).sum().backward()
    for optim in optims:
        optim.step()
    saved = {"pair": pair, "optims": optims, "progress": Progress(3, 70), "shape": torch.Size([4, 5]),
             "plain": (1, "a")}
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, saved).result()
    live = (torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    live_optims = (torch.optim.Adam(live[0].parameters()), torch.optim.Adam(live[1].parameters()))
    state = {"pair": live, "optims": live_optims, "progress": Progress(0, 0), "shape": torch.Size([1]),
             "plain": ()}
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore(state) == 1
    assert state["progress"] == Progress(3, 70) and state["progress"].epoch == 3
    assert type(state["shape"]) is torch.Size and state["shape"] == torch.Size([4, 5])
    assert state["plain"] == (1, "a")
    assert state["pair"][0] is live[0] and state["optims"][1] is live_optims[1]
    for got, want in zip(live, pair):
        assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    assert str(live_optims[1].state_dict()) == str(optims[1].state_dict())
    # a module in the tuple lacking saved entries is named, as in a dict
    smaller = {**state, "pair": (torch.nn.Linear(3, 3), torch.nn.Linear(3, 1, bias=False))}
    with Checkpointer(root, rng=False) as ckpt:
        with pytest.raises(StateError, match=r"key 'pair/1': the checkpoint of step 1 has entries the module lacks"):
            ckpt.restore(smaller)


def test_objects_in_the_programs_own_dicts_and_lists_save_and_restore_in_place(root):
    """A GAN's models under one entry, their optimizers in a list: each is saved through
    its state_dict() and restored through its load_state_dict(), the program's own objects
    kept. Before, saving refused them, with a remedy ("an object with state_dict()") that
    they already were; and a restore target holding one replaced it with a plain dict."""
    from resilient import UnsupportedStateError

    def gan(seed):
        torch.manual_seed(seed)
        g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        return {"gen": g, "disc": d}, [torch.optim.Adam(g.parameters()), torch.optim.SGD(d.parameters(), lr=0.1,
                                                                                      momentum=0.9)]

    models, optims = gan(0)
    for step in range(2):
        for optim in optims:
            optim.zero_grad()
        models["disc"](models["gen"](torch.randn(3, 4))).sum().backward()
        for optim in optims:
            optim.step()
    with Checkpointer(root) as ckpt:
        ckpt.save(2, {"models": models, "optims": optims, "progress": {"epoch": 1}})
    live_models, live_optims = gan(1)
    weight = live_models["gen"].weight
    state = {"models": live_models, "optims": live_optims, "progress": {}}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(state) == 2
    assert state["models"] is live_models and state["models"]["gen"] is not None
    assert state["optims"][0] is live_optims[0] and live_models["gen"].weight is weight  # in place
    for name in ("gen", "disc"):
        for got, want in zip(live_models[name].state_dict().values(), models[name].state_dict().values()):
            assert torch.equal(got, want)
    assert str(live_optims[0].state_dict()) == str(optims[0].state_dict())
    assert str(live_optims[1].state_dict()) == str(optims[1].state_dict())
    # one that does not fit is named by its entry
    wrong = {"models": {"gen": torch.nn.Linear(4, 4), "disc": torch.nn.Linear(4, 2)}, "optims": gan(2)[1],
             "progress": {}}
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=r"key 'models/disc/weight': shape mismatch"):
            ckpt.restore(wrong)
    # a module that lacks some of its saved entries is named before anything is read
    smaller = {"models": {"gen": torch.nn.Linear(4, 4), "disc": torch.nn.Linear(4, 1, bias=False)},
               "optims": gan(3)[1], "progress": {}}
    before = smaller["models"]["gen"].weight.detach().clone()
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=r"key 'models/disc': the checkpoint of step 2 has entries the module "
                                             r"lacks: \['models/disc/bias'\]"):
            ckpt.restore(smaller)
        assert torch.equal(smaller["models"]["gen"].weight, before)
        assert ckpt.restore(smaller, strict=False) == 2  # the rest, on purpose
    assert torch.equal(smaller["models"]["disc"].weight, models["disc"].weight)
    # inside another object's state_dict(), nothing would call its load_state_dict
    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"state\['holder/inner'\]: .*an object inside a state_dict\(\) "
                                                        r"is not saved through its own; return obj.state_dict\(\)"):
            ckpt.save(3, {"holder": _Giving({"inner": torch.nn.Linear(2, 2)})})


def test_a_program_whose_default_device_is_not_the_cpu_saves_and_restores(root):
    """``torch.set_default_device`` ("cuda" in some GPU code, "meta" for a model's
    initialisation left on): the restore made its host buffers there, read nothing into
    them, took the checkpoint for a truncated one and marked it bad, so no later restore
    would take it. Host memory is now asked for on the CPU by name."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optim.step()
    try:
        torch.set_default_device("meta")
        for staging in ("sync", "overlap"):
            with Checkpointer(root, staging=staging, keep=None) as ckpt:
                ckpt.save(1 if staging == "sync" else 2, {"model": model, "optim": optim,
                                                          "extra": {"b": b"xy", "n": np.arange(3)}}).result()
        fresh = torch.nn.Linear(64, 64, device="cpu")
        fresh_optim = torch.optim.Adam(fresh.parameters())
        state = {"model": fresh, "optim": fresh_optim, "extra": {}}
        for step in (1, 2):
            with Checkpointer(root) as ckpt:
                assert ckpt.restore(state, step=step) == step
            assert torch.equal(fresh.weight, model.weight)
            assert torch.equal(fresh_optim.state[fresh.weight]["exp_avg"], optim.state[model.weight]["exp_avg"])
            assert state["extra"]["b"] == b"xy" and state["extra"]["n"].tolist() == [0, 1, 2]
    finally:
        torch.set_default_device(None)
    assert not os.path.exists(os.path.join(root, ".bad"))
