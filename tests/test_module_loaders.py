"""Modules that load their state through code of their own, as ``load_state_dict`` lets
them: quantization-aware training (``torch.ao.quantization.prepare_qat``), whose
``FakeQuantize`` modules hold a scale of one value until their first forward and one per
output channel after. A restore into a freshly prepared model refused that checkpoint
("shape mismatch") where torch's ``load_state_dict`` takes it."""

import warnings

import pytest
import torch

from resilient import Checkpointer, StateError

pytestmark = pytest.mark.timeout(120)


def _qat_model():
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model = torch.nn.Sequential(tq.QuantStub(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2),
                                tq.DeQuantStub())
    model.qconfig = tq.get_default_qat_qconfig("x86")  # per-channel weights: the scale grows to one per channel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's own deprecation notes
        tq.prepare_qat(model.train(), inplace=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, optim, seed: int) -> None:
    optim.zero_grad()
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    optim.step()


def test_a_qat_model_resumes_in_a_freshly_prepared_model_and_takes_the_same_next_step(root):
    model, optim = _qat_model()
    for seed in range(3):
        _step(model, optim, seed)
    fresh, fresh_optim = _qat_model()
    grown = [k for k, v in model.state_dict().items() if v.shape != fresh.state_dict()[k].shape]
    assert "1.weight_fake_quant.scale" in grown  # what the restore meets: [16] saved, [1] live
    with Checkpointer(root, state={"model": model, "optim": optim}) as ckpt:
        ckpt.save(3).result()
    with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}) as ckpt:
        assert ckpt.restore() == 3
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    _step(model, optim, 3)
    _step(fresh, fresh_optim, 3)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_plain_modules_parameter_of_another_shape_is_still_refused_by_name(root):
    with Checkpointer(root, state={"model": torch.nn.Linear(4, 3)}) as ckpt:
        ckpt.save(1).result()
    with Checkpointer(root, state={"model": torch.nn.Linear(4, 5)}) as ckpt:
        with pytest.raises(StateError, match=r"key 'model/weight': shape mismatch: the state expects \[5, 4\]"):
            ckpt.restore()
