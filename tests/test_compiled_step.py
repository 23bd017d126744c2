"""A training step compiled whole with ``torch.compile`` that calls the Checkpointer inside.

Dynamo traced into ``ckpt.save()`` and failed there with an internal error; the
Checkpointer's entry points are now graph breaks that run as plain Python with Dynamo off
(``resilient/_compiled.py``), and the step stays compiled around them. The backend here
records Dynamo's graphs and runs them as they are: what is under test is what Dynamo
traces, not what a compiler makes of it (inductor's C++ build would add 10 s a test)."""

import warnings

import pytest
import torch

from resilient import Checkpointer

pytestmark = pytest.mark.timeout(240)


def _model_and_optim():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _values(model, optim):
    params = [p.detach().clone() for p in model.parameters()]
    moments = [optim.state[p]["exp_avg"].clone() for p in model.parameters()]
    return params, moments


@pytest.mark.parametrize("staging", ["sync", "overlap"])
def test_a_step_compiled_whole_saves_inside_it_and_stays_compiled(root, staging):
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model, optim = _model_and_optim()
    saved = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(root, every=4, keep=None, state={"model": model, "optim": optim}, staging=staging) as ckpt:

            @torch.compile(backend=recording)
            def train_step(x, y, step):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optim.step()
                optim.zero_grad()
                handle = ckpt.save(step)
                return loss.detach(), handle, ckpt.preempted()

            g = torch.Generator().manual_seed(1)
            for step in range(1, 11):
                _, handle, preempted = train_step(torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g), step)
                assert preempted is False
                assert (handle is not None) == (step % 4 == 0), step
                if handle is not None:
                    saved[step] = _values(model, optim)
            ckpt.wait()
            assert ckpt.stats["saves_committed"] == 2
            assert ckpt.latest() == 8
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message) or "dynamo" in str(w.message)]
    traced = "\n".join(g.code for g in graphs)
    assert "linear" in traced and "mse_loss" in traced, traced  # the step itself was compiled
    assert "resilient" not in traced

    for step in (4, 8):
        fresh, fresh_optim = _model_and_optim()
        with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}) as ckpt:
            assert ckpt.restore(step=step) == step
        params, moments = _values(fresh, fresh_optim)
        for got, want in zip(params + moments, saved[step][0] + saved[step][1], strict=True):
            assert torch.equal(got, want), step

