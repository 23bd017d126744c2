"""Overlapped staging (``staging="overlap"``; the default on a GPU): the optimizer's tensors
are copied while training goes on and the next optimizer step waits for the copy. What is
committed is exactly the state at ``save``, never a mix with the step after it; a write
that is not an optimizer step, made before the copy was complete, fails that save naming
the tensor and leaves the previous checkpoint in place."""

import threading
import warnings

import pytest
import torch

from resilient import Checkpointer, CommitError

pytestmark = pytest.mark.timeout(120)


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim


def _step(model, optim, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 512, generator=g)
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()


def _snapshot(model, optim) -> dict:
    out = {f"p/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        out.update({f"o/{pid}/{k}": v.clone() for k, v in st.items()})
    return out


def _holds(root, step: int, expected: dict) -> None:
    model, optim = _build(seed=99)  # different weights, a fresh optimizer
    _step(model, optim, 0)  # give the optimizer state to load into
    with Checkpointer(root, state={"model": model, "optim": optim}, staging="sync") as ckpt:
        assert ckpt.restore(step=step) == step
    got = _snapshot(model, optim)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_what_commits_is_the_state_at_save_although_the_step_after_runs_at_once(root):
    model, optim = _build()
    _step(model, optim, 0)
    expected = {}
    with Checkpointer(root, state={"model": model, "optim": optim}, keep=None, staging="overlap") as ckpt:
        for i in range(1, 6):
            _step(model, optim, i)
            expected[i] = _snapshot(model, optim)
            handle = ckpt.save(i)
            _step(model, optim, 100 + i)  # the optimizer step right after: it waits for the copy, then writes
            assert handle.deferred_bytes == sum(v.numel() * v.element_size() for v in expected[i].values())
        ckpt.wait()
        assert ckpt.stats["saves_committed"] == 5 and ckpt.stats["staging_wait_s"] >= 0
    for i in (1, 3, 5):
        _holds(root, i, expected[i])


def test_a_compiled_optimizer_step_waits_for_the_copy_and_the_gate_is_not_traced(root):
    """PyTorch's recipe for a faster optimizer, ``torch.compile`` over a function that calls
    ``optimizer.step()``: the gate (a global step pre-hook) still holds each step until the
    copy is done, so what commits is the state at ``save``; and Dynamo runs the gate as it
    is instead of tracing into it (it did, and warned in the user's run of a
    ``time.perf_counter`` it cannot trace)."""
    import torch._dynamo

    torch._dynamo.reset()
    model, optim = _build()

    @torch.compile(backend="eager")  # Dynamo is what runs hooks; inductor's C++ build would add 10 s
    def optimizer_step():
        optim.step()

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        optim.zero_grad()
        model(torch.randn(16, 512, generator=g)).square().mean().backward()
        optimizer_step()

    step(0)
    expected = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(root, state={"model": model, "optim": optim}, keep=None, staging="overlap") as ckpt:
            for i in range(1, 4):
                step(i)
                expected[i] = _snapshot(model, optim)
                ckpt.save(i)
                step(100 + i)  # compiled, right after the save: it must wait for the copy
            ckpt.wait()
            assert ckpt.stats["saves_committed"] == 3
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    for i in (1, 3):
        _holds(root, i, expected[i])


def _meddle_before_the_copy_of_step_2(root, meddle, error: str) -> None:
    """Commit step 1, save step 2 with its copy held back, ``meddle`` with the model, let
    the copy run: step 2 fails with ``error``, step 1 stays the newest and intact."""
    model, optim = _build()
    _step(model, optim, 0)
    with Checkpointer(root, state={"model": model, "optim": optim}, staging="overlap") as ckpt:
        ckpt.save(1)
        ckpt.wait()
        committed = _snapshot(model, optim)
        held = threading.Event()
        ckpt._staging._copier.run(held.wait)  # the copy thread is busy: the next copy is queued behind it
        ckpt.save(2)
        meddle(model)
        held.set()
        with pytest.raises(CommitError, match=error):
            ckpt.wait()
        assert ckpt.latest() == 1
    _holds(root, 1, committed)


def test_a_write_that_is_no_optimizer_step_before_the_copy_fails_the_save(root):
    def double_in_place(model) -> None:  # not by an optimizer step, while its copy has not run
        with torch.no_grad():
            model[0].weight.mul_(2)

    _meddle_before_the_copy_of_step_2(root, double_in_place, r"'model/0\.weight'.*written in place")


def test_sync_and_auto_on_the_cpu_copy_everything_inside_save(root):
    model, optim = _build()
    _step(model, optim, 0)
    for mode in ("sync", "auto"):
        with Checkpointer(f"{root}-{mode}", state={"model": model, "optim": optim}, staging=mode) as ckpt:
            assert ckpt.save(1).deferred_bytes == 0
    with pytest.raises(ValueError, match="staging must be one of auto, sync, overlap.*'eager'"):
        Checkpointer(root, staging="eager")


def test_restore_waits_for_a_copy_still_reading_the_live_tensors(root):
    model, optim = _build()
    _step(model, optim, 0)
    with Checkpointer(root, state={"model": model, "optim": optim}, keep=None, staging="overlap") as ckpt:
        ckpt.save(1)
        ckpt.wait()
        expected = _snapshot(model, optim)
        _step(model, optim, 1)
        expected_2 = _snapshot(model, optim)
        ckpt.save(2)
        assert ckpt.restore(step=1) == 1  # overwrites the tensors that step 2's copy reads
        ckpt.wait()
        assert ckpt.latest() == 2
    _holds(root, 1, expected)
    _holds(root, 2, expected_2)


def test_a_deferred_copy_that_fails_part_way_fails_the_save_with_its_cause(root):
    """The writer writes the copied part while the copy runs: a copy that stops part-way
    must release it (no hang) and fail the save, leaving the previous checkpoint newest."""
    def free_the_last_layer(model) -> None:  # the first layer copies, this one cannot
        model[2].weight.untyped_storage().resize_(0)

    _meddle_before_the_copy_of_step_2(root, free_the_last_layer, r"deferred copy failed: UnsupportedStateError: "
                                      r"state\['model/2\.weight'\]: its storage holds 0 bytes, fewer than the 2097152 its shape")
