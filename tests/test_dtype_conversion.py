"""A checkpoint restores into a state of other floating-point dtypes (an fp32 checkpoint
into a bf16 model, to fine-tune or evaluate), converted as ``load_state_dict`` converts,
and said in a warning; a dtype change of another kind (floats into integers) is refused by
key. Before, every dtype change was refused, which DCP and ``load_state_dict`` allow."""

import pytest
import torch

from resilient import Checkpointer, StateError

from .launch import run_ranks

pytestmark = pytest.mark.timeout(180)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture
def saved_fp32(root):
    model = _model()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    with Checkpointer(root) as ckpt:
        ckpt.save(7, {"model": model, "optim": optim, "ema": {"w": model[0].weight.detach().clone()}})
    return root, model


def test_an_fp32_checkpoint_restores_into_a_bf16_model_and_its_optimizer(saved_fp32, caplog):
    root, saved = saved_fp32
    model = _model().to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optim = torch.optim.AdamW(model.parameters())
    ema = {"w": torch.zeros(16, 8, dtype=torch.float16)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore({"model": model, "optim": optim, "ema": ema}) == 7
    for (name, got), want in zip(model.state_dict().items(), saved.state_dict().values()):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name
    assert ema["w"].dtype == torch.float16 and torch.equal(ema["w"], saved[0].weight.detach().half())
    # the optimizer converts its moments to its parameters' dtype itself; it steps on
    exp_avg = optim.state[model[0].weight]["exp_avg"]
    assert exp_avg.dtype == torch.bfloat16
    model(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    optim.step()
    said = [r.getMessage() for r in caplog.records if "restored into the state's dtypes" in r.getMessage()]
    assert len(said) == 1, said
    assert "float32 -> bfloat16" in said[0] and "float32 -> float16" in said[0] and "step 7" in said[0]


def test_a_bf16_checkpoint_restores_into_fp32_exactly_and_float8_rounds(root):
    values = torch.randn(64, 32).to(torch.bfloat16)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": values, "scale": torch.randn(5)})
    wide = {"w": torch.zeros(64, 32, dtype=torch.float64), "scale": torch.zeros(5, dtype=torch.float8_e4m3fn)}
    with Checkpointer(root) as ckpt:
        assert ckpt.restore(wide) == 1
    assert torch.equal(wide["w"], values.double())
    saved_scale = Checkpointer(root)
    plain = {"w": torch.zeros(64, 32, dtype=torch.bfloat16), "scale": torch.zeros(5)}
    saved_scale.restore(plain)
    saved_scale.close()
    assert torch.equal(wide["scale"].float(), plain["scale"].to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("wanted,why", [(torch.int32, "int32"), (torch.bool, "bool"),
                                        (torch.complex64, "complex64"),
                                        (torch.float4_e2m1fn_x2, "float4_e2m1fn_x2")])
def test_a_change_of_kind_is_refused_by_key_and_changes_nothing(root, wanted, why):
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.randn(4, 4), "b": torch.arange(3.0)})
    b = torch.full((3,), 9.0, dtype=torch.float64)
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=rf"key 'w': dtype mismatch: the state expects {why}.*float32"):
            ckpt.restore({"b": b, "w": torch.zeros(4, 4, dtype=wanted)})
    assert torch.equal(b, torch.full((3,), 9.0, dtype=torch.float64))  # checked before anything was read


def test_integers_are_not_converted(root):
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"ids": torch.arange(6, dtype=torch.int32)})
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=r"key 'ids'.*int64.*int32"):
            ckpt.restore({"ids": torch.zeros(6, dtype=torch.int64)})


@pytest.mark.parametrize("world,mode", [(2, "page-cache"), (3, "broadcast")])
def test_replicated_state_converts_on_every_rank_beside_shared_reads(tmp_path, world, mode):
    root = str(tmp_path / "ckpt")
    run_ranks("replicated_save", 2, {"root": root})
    run_ranks("replicated_restore", world, {"root": root, "expect": 2, "widen": True},
              env={"RESILIENT_RESTORE_SHARING": mode})  # every rank asserts every element


def test_dtensors_convert_when_resharded(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks("dtensor_save", 2, {"root": root, "uint4": False}, env={"FORCE_DIST": "1"})
    results = run_ranks("dtensor_load", 3, {"root": root, "expect_step": 5, "widen": True}, env={"FORCE_DIST": "1"})
    assert all("dtensor ok at step 5" in r.output for r in results)
