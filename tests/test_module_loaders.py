"""Modules that load their state through code of their own, as ``load_state_dict`` lets
them: quantization-aware training (``torch.ao.quantization.prepare_qat``), whose
``FakeQuantize`` modules hold a scale of one value until their first forward and one per
output channel after, and torchmetrics' metrics, whose list states (every prediction so
far, for an AUROC) grow with each update. A restore into a fresh model or metric refused
those checkpoints ("shape mismatch", "entries the module lacks") where torch's
``load_state_dict`` takes them."""

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


def _metrics(torchmetrics):
    metrics = {"auroc": torchmetrics.classification.BinaryAUROC(),  # list states: preds, target
               "mean": torchmetrics.MeanMetric()}
    for metric in metrics.values():
        metric.persistent(True)  # checkpointed, as a resumed evaluation needs
    return metrics


def _update(metrics, generator, times: int) -> None:
    for _ in range(times):
        metrics["auroc"].update(torch.rand(5, generator=generator), torch.randint(0, 2, (5,), generator=generator))
        metrics["mean"].update(torch.rand(5, generator=generator))


def test_torchmetrics_list_states_restore_into_a_fresh_metric_and_a_fuller_one(root):
    torchmetrics = pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(0)
    saved = _metrics(torchmetrics)
    _update(saved, g, 3)
    with Checkpointer(root, state={"metrics": saved}) as ckpt:
        ckpt.save(1).result()
    fresh, fuller = _metrics(torchmetrics), _metrics(torchmetrics)
    _update(fuller, g, 5)  # holds more predictions than were saved: the checkpoint's replace them
    for metrics in (fresh, fuller):
        with Checkpointer(root, state={"metrics": metrics}) as ckpt:
            assert ckpt.restore() == 1
        assert len(metrics["auroc"].preds) == 3
        for name in ("auroc", "mean"):
            assert torch.equal(metrics[name].compute(), saved[name].compute()), name
