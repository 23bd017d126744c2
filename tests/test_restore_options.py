"""Restoring what the user asks for: a chosen step, part of a checkpoint, per-rank entries,
tied weights written once, and export to every safetensors dtype."""

import os
import tomllib

import pytest
import torch

from resilient import CheckpointCorruptError, Checkpointer, PerRank, StateError, UnsupportedStateError

from .faults import flip_byte
from .launch import REPO


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data_file(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:010d}", "rank-00000.data")


def test_restore_a_chosen_step_and_never_another(root):
    with Checkpointer(root, keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"model": _model(step), "meta": {"step": step}})
    target = {"model": _model(0), "meta": {}}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(target, step=2) == 2
        assert target["meta"] == {"step": 2}
        assert torch.equal(target["model"][0].weight, _model(2)[0].weight)
        with pytest.raises(StateError, match=r"step 7 is not a committed checkpoint.*newest: 3"):
            ckpt.restore(target, step=7)
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            ckpt.restore(target, step=-1)
    flip_byte(_data_file(root, 2), 10)
    with Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="step 2 .* does not fall back"):
            ckpt.restore(target, step=2)
        assert ckpt.restore(target) == 3  # without step=, the newest good one as always


def test_model_only_restore_for_evaluation_and_fine_tuning(root, caplog):
    trained = _model(1)
    optim = torch.optim.Adam(trained.parameters())
    trained(torch.randn(3, 4)).sum().backward()
    optim.step()
    with Checkpointer(root) as ckpt:
        ckpt.save(10, {"model": trained, "optim": optim, "meta": {"epoch": 4}})
    with Checkpointer(root) as ckpt:
        evaluation = _model(2)  # a subset of the entries: no optimizer built at all
        assert ckpt.restore({"model": evaluation}, strict=False) == 10
        assert all(torch.equal(a, b) for a, b in zip(evaluation.state_dict().values(),
                                                     trained.state_dict().values()))
        assert "which the state to restore does not name" not in caplog.text
        # strict (the default), the entries left out are named: a forgotten optimizer or
        # scheduler would go on from its initial state while the run resumes
        assert ckpt.restore({"model": evaluation}) == 10
        assert ("the checkpoint of step 10 also holds 'optim', 'meta', which the state to restore does not name: "
                "not restored") in caplog.text
        # fine-tuning: a new head the checkpoint never had, and a new entry
        tuned = _model(3)
        tuned.append(torch.nn.Linear(2, 5))
        head_before = tuned[3].weight.detach().clone()
        with pytest.raises(StateError, match=r"key 'model/3.weight' is not in the checkpoint"):
            ckpt.restore({"model": tuned})
        extra = {"model": tuned, "new": {"lr": 0.5}}
        assert ckpt.restore(extra, strict=False) == 10
        assert torch.equal(tuned[0].weight, trained[0].weight) and torch.equal(tuned[2].bias, trained[2].bias)
        assert torch.equal(tuned[3].weight, head_before) and extra["new"] == {"lr": 0.5}
        # what is loaded must still fit, as with torch's own load_state_dict(strict=False)
        resized = _model(3)
        resized[2] = torch.nn.Linear(8, 5)
        with pytest.raises(StateError, match=r"key 'model/2.weight': shape mismatch"):
            ckpt.restore({"model": resized}, strict=False)
        # a model that lost a layer: the saved extra entries are ignored, not an error
        smaller = torch.nn.Sequential(torch.nn.Linear(4, 8))
        with pytest.raises(StateError, match="entries the module lacks"):
            ckpt.restore({"model": smaller})
        assert ckpt.restore({"model": smaller}, strict=False) == 10
        assert torch.equal(smaller[0].bias, trained[0].bias)
        # a module none of whose tensors the checkpoint has (attributes renamed): said, not silent
        renamed = torch.nn.ModuleDict({"encoder": _model(4)})
        before = [t.detach().clone() for t in renamed.parameters()]
        caplog.clear()
        assert ckpt.restore({"model": renamed}, strict=False) == 10
        assert all(torch.equal(a, b) for a, b in zip(before, renamed.parameters()))
        assert "key 'model': none of its 4 tensors is among the 4 the checkpoint of step 10 holds" in caplog.text
        assert "'model/encoder.0.bias', the checkpoint 'model/0.bias'" in caplog.text


def test_an_optimizer_that_does_not_fit_the_checkpoint_is_named_and_no_older_step_is_tried(root, caplog):
    """Its load_state_dict refuses a checkpoint that passed every check: the state does not
    fit, and no older step would (each was tried before, and the checkpoints were blamed)."""
    model = _model(1)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        ckpt.save(2, {"model": model, "optim": optim})
    grouped = _model(2)
    groups = torch.optim.AdamW([{"params": grouped[0].parameters()}, {"params": grouped[2].parameters(), "lr": 0.1}])
    caplog.clear()
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=r"key 'optim': AdamW.load_state_dict refused the checkpoint of step 2: "
                                             r"ValueError: loaded state dict has a different number of parameter groups"):
            ckpt.restore({"model": grouped, "optim": groups})
        assert "skipping checkpoint" not in caplog.text
        fitting = torch.optim.AdamW(grouped.parameters())
        assert ckpt.restore({"model": grouped, "optim": fitting}) == 2  # nothing was marked bad
    assert torch.equal(fitting.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


def test_a_rollback_into_a_live_optimizer_whose_state_has_grown_resumes_bitwise(root):
    """restore(step=N) in the same process (a rollback after a loss spike): LBFGS's history
    lists were longer than when saved, and its live tensors the checkpoint lacks were taken
    for missing keys ("key 'o/state/0/al/3' is not in the checkpoint"). An optimizer's
    load_state_dict replaces its whole state, so they are no missing key."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.LBFGS(model.parameters(), history_size=5, max_iter=3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step():
        def loss():
            optim.zero_grad()
            value = ((model(x) - y) ** 2).mean()
            value.backward()
            return value
        optim.step(loss)

    state = {"model": model, "optim": optim}
    with Checkpointer(root, keep=None) as ckpt:
        for n in range(1, 3):
            step()
            ckpt.save(n, state)
        for n in range(3, 6):
            step()
        ckpt.restore(state, step=2)  # the history holds more entries now than at step 2
        for n in range(3, 6):
            step()
        after_rollback = model.weight.detach().clone()
    torch.manual_seed(0)
    twin = torch.nn.Linear(4, 1)
    twin_optim = torch.optim.LBFGS(twin.parameters(), history_size=5, max_iter=3)
    with Checkpointer(root) as ckpt:
        ckpt.restore({"model": twin, "optim": twin_optim}, step=2)  # a fresh process's optimizer
    model, optim = twin, twin_optim  # what step() trains from here
    for n in range(3, 6):
        step()
    assert torch.equal(after_rollback, twin.weight)


def test_plain_values_are_restored_into_the_programs_own_dicts_and_lists(root):
    """A program holds references into its state (``progress = state["progress"]``): they see
    the restored values, as after DCP's load. The entry was replaced by new containers, and
    those references kept their old values without a word."""
    saved = {"seen": 100, "history": [1, 2, {"lr": 0.5}], "nested": {"epoch": 3}}
    one = {"k": 1}
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"progress": saved, "twice": {"a": one, "b": one}, "loader": PerRank({"pos": 7})})
    progress = {"seen": 0, "history": [9], "nested": {"epoch": 0, "gone": True}, "extra": 1}
    history, nested = progress["history"], progress["nested"]
    alias = {"k": 0}
    loader = {"pos": 0}
    state = {"progress": progress, "twice": {"a": alias, "b": alias}, "loader": PerRank(loader)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(state) == 1
    assert state["progress"] is progress and progress == saved  # the program's dict, the saved values
    assert progress["history"] is history and history == [1, 2, {"lr": 0.5}]
    assert progress["nested"] is nested and nested == {"epoch": 3}
    assert loader == {"pos": 7} and state["loader"].value is loader
    # one dict under two keys is filled once; the second place gets a dict of its own
    assert state["twice"] == {"a": {"k": 1}, "b": {"k": 1}} and state["twice"]["a"] is alias


def test_per_rank_entry_in_one_process(root):
    state = {"w": torch.ones(2), "loader": PerRank({"gen": torch.Generator().manual_seed(5).get_state(), "pos": 7})}
    with Checkpointer(root) as ckpt:
        ckpt.save(1, state)
    back = PerRank({"gen": torch.Generator().get_state(), "pos": 0})
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"w": torch.zeros(2), "loader": back}) == 1
    assert back.value["pos"] == 7 and torch.equal(back.value["gen"], state["loader"].value["gen"])
    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match="PerRank must wrap a top-level entry"):
            ckpt.save(2, {"outer": {"inner": PerRank({"x": 1})}})
    with pytest.raises(TypeError):
        PerRank(PerRank(1))


class TiedLM(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as GPT-2 and Llama do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)
        self.head = torch.nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_are_written_once_and_stay_tied(root):
    model = TiedLM()
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model})
    assert os.path.getsize(_data_file(root, 1)) < 1.2 * 1000 * 64 * 4  # one copy, not two
    fresh = TiedLM()
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    untied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(1000, 64), "head": torch.nn.Linear(64, 1000, bias=False)})
    with Checkpointer(root) as ckpt:  # the same checkpoint into an untied model: both names load
        assert ckpt.restore({"model": untied}) == 1
    assert torch.equal(untied["head"].weight, model.embed.weight)


def test_safetensors_export_of_every_dtype_it_has_a_code_for(tmp_path, capsys):
    from safetensors.torch import load_file

    from resilient.ckpt import main

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=g)
    tensors = {
        "u16": torch.arange(0, 60000, 7000).to(torch.uint16),
        "u32": torch.tensor([0, 1, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([0, 2**63 + 5], dtype=torch.uint64),
        "c64": torch.complex(torch.randn(5, generator=g), torch.randn(5, generator=g)),
        "e4m3fnuz": bits.view(torch.float8_e4m3fnuz),
        "e5m2fnuz": bits.view(torch.float8_e5m2fnuz),
    }
    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"t": tensors})
    out = str(tmp_path / "all.safetensors")
    assert main(["export", root, out, "--format", "safetensors"]) == 0
    loaded = load_file(out)
    for name, t in tensors.items():
        got = loaded[f"t.{name}"]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


def test_every_storage_protocol_names_an_extra_that_exists():
    from resilient._storage import _EXTRAS

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for protocol, extra in _EXTRAS.items():
        assert extra in extras, f"{protocol}:// points to the extra {extra!r}, which pyproject.toml lacks"
