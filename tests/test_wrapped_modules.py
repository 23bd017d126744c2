"""Modules wrapped by torch.compile or DDP: checkpoints hold the module's own keys (DDP's
case, on two gloo ranks: ``test_distributed.py``).

A wrapper's ``state_dict`` prefixes every key (``_orig_mod.``, ``module.``); saved that way,
a checkpoint restored only into the same wrapping, and ``strict=False`` loaded nothing at
all while returning the step (``resilient/_wrappers.py``)."""

import json
import os

import pytest
import torch

from resilient import Checkpointer
from resilient._format import MANIFEST, step_dir_name

pytestmark = pytest.mark.timeout(240)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _trained(model):
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optim.step()
    return optim


def _saved_names(root, step):
    with open(os.path.join(root, step_dir_name(step), MANIFEST)) as f:
        return sorted(json.load(f)["tensors"])


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_compiled_models_checkpoint_restores_into_the_plain_model_and_the_other_way(root):
    model = _model(0)
    optim = _trained(model)
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, {"model": torch.compile(model, backend="eager"), "optim": optim}).result()
    assert _saved_names(root, 1)[:2] == ["model/0.bias", "model/0.weight"]  # no "_orig_mod." in them

    plain = _model(1)
    assert not _same(plain, model)
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore({"model": plain}, strict=False) == 1  # the evaluation script's case
    assert _same(plain, model)

    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(2, {"model": plain, "optim": optim}).result()
    for strict in (True, False):  # with strict=False a compiled target once matched no key
        fresh = _model(2)
        fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        with Checkpointer(root, rng=False) as ckpt:
            assert ckpt.restore({"model": torch.compile(fresh, backend="eager"), "optim": fresh_optim},
                                step=2, strict=strict) == 2
        assert _same(fresh, model)
        assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


def test_wrapped_models_in_the_programs_own_dicts_save_their_modules_keys(root):
    """A GAN's models, compiled, under one entry: saved without the wrapper's prefix, as at
    the top level, so an evaluation script restores them into plain models and a resumed
    run into compiled ones. Before, a nested wrapper kept "_orig_mod." in every name and the
    plain models were refused (the checkpoint "has entries the module lacks")."""
    gen, disc = _model(0), _model(1)
    optims = [_trained(gen), _trained(disc)]
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, {"models": {"gen": torch.compile(gen, backend="eager"), "disc": disc}, "optims": optims}).result()
    names = _saved_names(root, 1)
    assert "models/gen/0.weight" in names and not any("_orig_mod" in n for n in names), names
    for wrap in (lambda m: m, lambda m: torch.compile(m, backend="eager")):
        fresh_gen, fresh_disc = _model(2), _model(3)
        fresh_optims = [torch.optim.Adam(fresh_gen.parameters(), lr=1e-2),
                        torch.optim.Adam(fresh_disc.parameters(), lr=1e-2)]
        models = {"gen": wrap(fresh_gen), "disc": wrap(fresh_disc)}
        with Checkpointer(root, rng=False) as ckpt:
            assert ckpt.restore({"models": models, "optims": fresh_optims}) == 1
        assert _same(fresh_gen, gen) and _same(fresh_disc, disc)
        assert torch.equal(fresh_optims[0].state_dict()["state"][0]["exp_avg"],
                           optims[0].state_dict()["state"][0]["exp_avg"])


class _Holder(torch.nn.Module):
    """A module whose keys carry a wrapper's prefix: what an earlier version saved from a
    compiled (``_orig_mod``) or DDP-wrapped (``module``) model."""

    def __init__(self, attribute, inner):
        super().__init__()
        self.add_module(attribute, inner)


def test_a_checkpoint_saved_with_the_wrappers_prefix_restores_into_the_same_wrapping(root):
    model = _model(0)
    with Checkpointer(root, rng=False) as ckpt:
        ckpt.save(1, {"model": _Holder("_orig_mod", model)}).result()
    assert _saved_names(root, 1)[0] == "model/_orig_mod.0.bias"
    fresh = _model(1)
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore({"model": torch.compile(fresh, backend="eager")}) == 1
    assert _same(fresh, model)
    # and a module whose own child is named like a wrapper's attribute is still itself
    holder = _Holder("_orig_mod", _model(3))
    with Checkpointer(root, rng=False) as ckpt:
        assert ckpt.restore({"model": holder}) == 1
    assert _same(holder, _Holder("_orig_mod", model))


def _lazy_model():
    return torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.LazyLinear(4),
                               torch.nn.LazyBatchNorm1d())


def test_a_lazy_module_restores_before_its_first_forward_and_refuses_to_save_before_it(root):
    """``nn.LazyLinear`` and kin have no shape before their first forward. A restore into
    one used to raise torch's "uninitialized parameter" error for every checkpoint and end
    blaming them all ("no loadable checkpoint"); ``load_state_dict`` gives them the saved
    shapes, and so does the restore now. Saving one is refused by key."""
    from resilient import StateError, UnsupportedStateError

    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"state\['model/0.weight'\]: .*uninitialized parameter of "
                                                        r"a lazy module.*run a forward pass first"):
            ckpt.save(1, {"model": _lazy_model()})
    torch.manual_seed(0)
    trained = _lazy_model()
    x = torch.randn(6, 8)
    trained(x)
    _trained(trained)
    trained.eval()
    with Checkpointer(root) as ckpt:
        ckpt.save(3, {"model": trained})
    # a refused restore materializes nothing (the other entry is missing: checked first)
    fresh = _lazy_model()
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match="key 'optim' is not in the checkpoint"):
            ckpt.restore({"model": fresh, "optim": {}})
    assert fresh[0].has_uninitialized_params()
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"model": fresh}) == 3
    assert [tuple(p.shape) for p in fresh.parameters()] == [tuple(p.shape) for p in trained.parameters()]
    fresh.eval()
    assert torch.equal(fresh(x), trained(x))  # running stats included
    assert type(fresh[0]) is torch.nn.Linear  # the first forward finished it as torch's own load does
    optim = torch.optim.Adam(fresh.parameters())  # built after the restore, as torch advises for lazy modules
    fresh.train()
    fresh(x).sum().backward()
    optim.step()


def _blocks_compiled(seed):
    """torchtitan's recipe: each block compiled on its own inside the plain model."""
    model = _model(seed)
    model[0] = torch.compile(model[0], backend="eager")  # Dynamo's own wrapper: no compiler is run here
    model[2] = torch.compile(model[2], backend="eager")
    return model


def test_blocks_compiled_one_by_one_save_plain_keys_and_restore_either_way(root):
    """Their keys held ``_orig_mod.`` in the middle (``0._orig_mod.weight``), and such a
    checkpoint restored only into a model compiled the same way."""
    saved = _blocks_compiled(1)
    optim = _trained(saved)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": saved, "optim": optim}).result()
    assert _saved_names(root, 1)[:4] == ["model/0.bias", "model/0.weight", "model/2.bias", "model/2.weight"]
    for into in (_model(2), _blocks_compiled(2)):
        fresh_optim = torch.optim.Adam(into.parameters(), lr=1e-2)
        with Checkpointer(root) as ckpt:
            assert ckpt.restore({"model": into, "optim": fresh_optim}) == 1
        assert _same(saved, into)
        assert torch.equal(fresh_optim.state[into[0].weight]["exp_avg"], optim.state[saved[0].weight]["exp_avg"])


def test_a_checkpoint_with_the_blocks_orig_mod_keys_still_restores_into_the_same_model(root):
    """As an earlier version saved such a model: the keys as its state_dict gives them."""
    saved = _blocks_compiled(1)
    _trained(saved)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": dict(saved.state_dict())}).result()
    assert "model/0._orig_mod.weight" in _saved_names(root, 1)
    into = _blocks_compiled(2)
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"model": into}) == 1
    assert _same(saved, into)
