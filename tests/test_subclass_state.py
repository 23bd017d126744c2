"""Tensor subclasses in the state: torchao's low-bit optimizers (``AdamW8bit`` keeps each
moment as an ``OptimState8bit``: uint8 codes, block scales, a quantization map), and any
wrapper subclass that says how to take it apart (``resilient/_subclasses.py``). Before,
such a state was refused, and a run with a low-bit optimizer had no checkpoint at all."""

import json
import os
import subprocess
import sys

import pytest
import torch

from resilient import Checkpointer, StateError, UnsupportedStateError
from resilient._format import MANIFEST, step_dir_name
from tests.wrapped_tensors import Scaled, scaled

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parts(value: torch.Tensor) -> tuple[str, dict[str, torch.Tensor], list]:
    """A wrapper's class, inner tensors (copied) and flatten context: what it is."""
    names, context = value.__tensor_flatten__()
    return type(value).__name__, {n: getattr(value, n).clone() for n in names}, list(context)


def _same_parts(a, b) -> bool:
    return a[0] == b[0] and a[2] == b[2] and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][n], b[1][n]) for n in a[1])


def _optimizer_state(optim) -> list[dict]:
    return [{k: _parts(v) if hasattr(v, "__tensor_flatten__") and type(v) is not torch.Tensor else v.clone()
             for k, v in state.items()} for state in optim.state.values()]


def _same_state(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(_same_parts(x[k], y[k]) if isinstance(x[k], tuple) else torch.equal(x[k], y[k])
                                     for k in x)
        for x, y in zip(a, b))


def test_adamw8bit_resumed_into_a_fresh_optimizer_takes_the_same_next_step(root):
    torchao_optim = pytest.importorskip("torchao.optim")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        return model, torchao_optim.AdamW8bit(model.parameters(), lr=1e-2, block_size=128)

    def step(model, optim, i):
        g = torch.Generator().manual_seed(i)
        optim.zero_grad()
        model(torch.randn(8, 128, generator=g)).square().mean().backward()
        optim.step()

    # torchao compiles its step; the same code run eagerly spares inductor's C++ build (18 s)
    with torch.compiler.set_stance("force_eager"):
        model, optim = build()
        for i in range(3):
            step(model, optim, i)
        # the first layer's moments are quantized (>= 4096 values), the last layer's plain
        assert type(optim.state[model[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
        assert type(optim.state[model[2].weight]["exp_avg"]) is torch.Tensor
        saved = _optimizer_state(optim)
        with Checkpointer(root, state={"model": model, "optim": optim}) as ckpt:
            ckpt.save(3).result()
        with open(os.path.join(root, step_dir_name(3), MANIFEST)) as f:
            manifest = json.load(f)
        assert manifest["version"] == 5  # a reader of format 4 asks for an upgrade instead of misreading it
        assert {"optim/state/0/exp_avg/codes", "optim/state/0/exp_avg/scale",
                "optim/state/0/exp_avg/qmap"} <= manifest["tensors"].keys()

        fresh, fresh_optim = build()  # no state until its first step: the class is rebuilt (torchao allows it)
        with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}) as ckpt:
            assert ckpt.restore() == 3
        assert _same_state(saved, _optimizer_state(fresh_optim))
        step(model, optim, 3)
        step(fresh, fresh_optim, 3)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

        # in place: an optimizer one step further gets step 3's state back
        with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}) as ckpt:
            assert ckpt.restore() == 3
        assert _same_state(saved, _optimizer_state(fresh_optim))



def test_overlapped_staging_copies_a_low_bit_state_while_training_goes_on(root):
    """Overlapped staging defers the copy of what only the optimizer writes: for AdamW8bit
    those are the codes and scales inside its states (it failed on their wrapper, which has
    no storage to find); each save still holds the state at its call."""
    torchao_optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    optim = torchao_optim.AdamW8bit(model.parameters(), block_size=128)
    at_save = {}
    with torch.compiler.set_stance("force_eager"):
        with Checkpointer(root, state={"model": model, "optim": optim}, staging="overlap", keep=None) as ckpt:
            for step in range(1, 5):
                optim.zero_grad()
                model(torch.randn(8, 256)).square().mean().backward()
                optim.step()
                at_save[step] = (_optimizer_state(optim), model[0].weight.detach().clone())
                handle = ckpt.save(step)
                assert handle.deferred_bytes >= 256 * 256 * 2  # both moments' codes, at least
            ckpt.wait()
        for step in (2, 4):
            fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
            fresh_optim = torchao_optim.AdamW8bit(fresh.parameters(), block_size=128)
            with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}) as ckpt:
                assert ckpt.restore(step=step) == step
            assert _same_state(at_save[step][0], _optimizer_state(fresh_optim))
            assert torch.equal(fresh[0].weight, at_save[step][1])

def test_a_wrapper_in_the_programs_dict_is_restored_in_place_with_its_saved_parts(root):
    held = scaled(1)
    with Checkpointer(root, state={"extra": {"w": held, "n": 3}}) as ckpt:
        ckpt.save(1).result()
    other = scaled(2, note="other")
    state = {"extra": {"w": other, "n": 0}}
    with Checkpointer(root, state=state) as ckpt:
        assert ckpt.restore() == 1
    back = state["extra"]["w"]
    assert isinstance(back, Scaled) and _same_parts(_parts(back), _parts(held))
    assert back.payload is other.payload  # read into the program's own inner tensors
    assert state["extra"]["n"] == 3


def test_a_flatten_context_that_is_not_plain_values_is_refused_naming_the_key(root):
    with Checkpointer(root, state={"extra": {"w": scaled(1, note=object())}}) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"state\['extra/w'\]: a tests.wrapped_tensors.Scaled's "
                                                        r"flatten context .* is not plain values"):
            ckpt.save(1)


def test_a_class_the_program_neither_holds_nor_allows_is_not_rebuilt(root):
    """A new process restoring into a state without the wrapper: the checkpoint names the
    class, and that alone must not make it run that class's code."""
    with Checkpointer(root, state={"extra": {"w": scaled(1)}}) as ckpt:
        ckpt.save(1).result()
    program = f"""
import torch
from resilient import Checkpointer, StateError
from tests.wrapped_tensors import Scaled, scaled
try:
    with Checkpointer({str(root)!r}, state={{"extra": {{}}}}) as ckpt:
        ckpt.restore()
    print("rebuilt without being allowed")
except StateError as exc:
    print("refused:", exc)
with torch.serialization.safe_globals([Scaled]):
    state = {{"extra": {{}}}}
    with Checkpointer({str(root)!r}, state=state) as ckpt:
        assert ckpt.restore() == 1
    w, want = state["extra"]["w"], scaled(1)
    assert type(w) is Scaled and torch.equal(w.payload, want.payload) and torch.equal(w.scale, want.scale)
    assert w.note == "per-row"
    print("allowed: rebuilt")
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: key 'extra/w': the checkpoint holds a tests.wrapped_tensors.Scaled" in out.stdout, out.stdout
    assert "torch.serialization.add_safe_globals([Scaled])" in out.stdout, out.stdout
    assert "allowed: rebuilt" in out.stdout, out.stdout


def test_a_checkpoint_naming_another_class_gets_a_refusal_not_that_class(root):
    """A manifest is anyone's to write: one that names ``subprocess.Popen`` for a wrapper's
    class is refused by name, and nothing of that class runs."""
    with Checkpointer(root, state={"extra": {"w": scaled(1)}}) as ckpt:
        ckpt.save(1).result()
    path = os.path.join(root, step_dir_name(1), MANIFEST)
    with open(path) as f:
        raw = f.read()
    assert raw.count('"class":"tests.wrapped_tensors.Scaled"') == 1
    with open(path, "w") as f:
        f.write(raw.replace('"class":"tests.wrapped_tensors.Scaled"', '"class":"subprocess.Popen"'))
    with Checkpointer(root, state={"extra": {}}) as ckpt:
        with pytest.raises(StateError, match=r"key 'extra/w': the checkpoint holds a subprocess.Popen"):
            ckpt.restore()


def test_under_fsdp2_a_dtensor_over_a_low_bit_state_is_refused_naming_the_key():
    """FSDP2 with AdamW8bit: each state is a DTensor over the subclass, whose parts are
    quantization blocks of the rank's shard, not shards of one tensor: refused by name
    rather than saved as something that would not restore at another world size."""
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from resilient._tree import flatten_state

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        local = subclass_8bit.OptimState8bit.zeros((64, 128), signed=True, block_size=128)
        state = DTensor.from_local(local, init_device_mesh("cpu", (2,)), [Shard(0)], run_check=False)
        with pytest.raises(UnsupportedStateError, match=r"state\['optim/m'\]: it is a DTensor over a OptimState8bit"):
            flatten_state({"optim": {"m": state}})
    finally:
        dist.destroy_process_group()
