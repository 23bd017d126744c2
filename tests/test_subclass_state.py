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
from resilient.ckpt import main as ckpt_main
from tests.wrapped_tensors import Scaled, Viewable, scaled

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


def test_adamw8bit_resumed_into_a_fresh_optimizer_takes_the_same_next_step(root, capsys):
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
        assert manifest["version"] == 6  # a reader of format 4 or 5 asks for an upgrade instead of misreading it
        assert manifest["tensors"]["optim/state/0/exp_avg/scale"]["shape"] == [64, 1]  # blocks of a row of 128
        # the CLI reads format 6: every checksum, the parts listed, an export holding them as tensors
        assert ckpt_main(["verify", root]) == 0
        assert ckpt_main(["show", root]) == 0
        assert "optim/state/0/exp_avg/scale" in capsys.readouterr().out
        exported = os.path.join(os.path.dirname(root), "export.pt")
        assert ckpt_main(["export", "--format", "torch", root, exported]) == 0
        parts = torch.load(exported, weights_only=True)["optim"]["state"][0]["exp_avg"]
        assert parts["codes"].dtype == torch.uint8 and parts["scale"].shape == (64, 1)
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



def test_a_format_5_checkpoint_with_flat_scales_still_restores(root):
    """Format 5 (the release before) saved block scales flat, as the class holds them;
    format 6 saves them as views of blocks (``[64, 1]``), which sharded state needs. A
    format 5 checkpoint restores into a fresh optimizer and in place as before."""
    torchao_optim = pytest.importorskip("torchao.optim")
    with torch.compiler.set_stance("force_eager"):
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 64)
        optim = torchao_optim.AdamW8bit(model.parameters(), lr=1e-2, block_size=128)
        model(torch.randn(4, 128)).square().mean().backward()
        optim.step()
        saved = _optimizer_state(optim)
        with Checkpointer(root, state={"model": model, "optim": optim}) as ckpt:
            ckpt.save(1).result()
        path = os.path.join(root, step_dir_name(1), MANIFEST)
        with open(path) as f:
            manifest = json.load(f)
        assert manifest["version"] == 6
        for name, meta in manifest["tensors"].items():
            if name.endswith("/scale"):
                meta["shape"] = [64]
                for box in meta["boxes"]:
                    box["offsets"], box["sizes"] = [0], [64]
        text = json.dumps({**manifest, "version": 5}).replace(',"blocks":["scale"]', "").replace(
            ', "blocks": ["scale"]', "")
        assert '"blocks"' not in text
        with open(path, "w") as f:
            f.write(text)

        fresh = torch.nn.Linear(128, 64)
        fresh_optim = torchao_optim.AdamW8bit(fresh.parameters(), lr=1e-2, block_size=128)
        for _ in range(2):  # into a fresh optimizer, then in place
            with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}) as ckpt:
                assert ckpt.restore() == 1
            assert _same_state(saved, _optimizer_state(fresh_optim))
            assert fresh_optim.state[fresh.weight]["exp_avg"].scale.shape == (64,)


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
from tests.wrapped_tensors import Scaled, Viewable, scaled
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


def test_sharded_wrappers_whose_parts_cannot_be_placed_are_refused_naming_the_key():
    """A DTensor over a wrapper is saved as shards of its parts only where they can be
    placed: the class must say, by its slice along rows, which part holds blocks and which
    is a table (``Scaled`` has no slice), and blocks must lie within what is sharded (a
    shard of 64 columns cannot hold blocks of 128). Each is refused by name at the save."""
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from resilient._tree import flatten_state

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        columns = subclass_8bit.OptimState8bit.zeros((64, 64), signed=True, block_size=128)
        state = DTensor.from_local(columns, mesh, [Shard(1)], shape=torch.Size([64, 128]), stride=(128, 1),
                                   run_check=False)
        with pytest.raises(UnsupportedStateError, match=r"state\['optim/m'\]: .* part 'scale' holds one value per "
                                                        r"128 elements, and blocks of 128 do not divide"):
            flatten_state({"optim": {"m": state}})
        local = scaled(0)
        state = DTensor.from_local(Viewable(local.payload, local.scale, local.note), mesh, [Shard(0)],
                                   shape=torch.Size([8, 6]), stride=(6, 1), run_check=False)
        with pytest.raises(UnsupportedStateError, match=r"state\['optim/m'\]: it is a DTensor over a Viewable .* "
                                                        r"cannot be told apart"):
            flatten_state({"optim": {"m": state}})
    finally:
        dist.destroy_process_group()


#: torchao's low-bit optimizers and the class of their quantized states
LOW_BIT = {"AdamW8bit": "OptimState8bit", "AdamW4bit": "OptimState4bit", "AdamWFp8": "OptimStateFp8"}


@pytest.fixture(scope="module")
def fsdp2_low_bit(tmp_path_factory):
    """(optimizer, saved world) -> the arguments of its FSDP2 run, made once."""
    pytest.importorskip("torchao.optim")
    from .launch import run_ranks

    runs: dict[tuple[str, int, bool], dict] = {}

    def get(optimizer: str, world: int, hsdp: bool = False) -> dict:
        if (optimizer, world, hsdp) not in runs:
            d = tmp_path_factory.mktemp(f"{optimizer}-{world}{'-hsdp' if hsdp else ''}")
            args = {"root": str(d / "ckpt"), "reference": str(d / "reference.pt"), "optimizer": optimizer,
                    "state_class": LOW_BIT[optimizer], "hsdp": hsdp}
            results = run_ranks("save", world, args, module="tests.low_bit_workers", env={"FORCE_DIST": "1"},
                                timeout=150)
            assert all(f"saved at world {world}" in r.output for r in results)
            runs[(optimizer, world, hsdp)] = args
        return runs[(optimizer, world, hsdp)]

    return get


@pytest.mark.parametrize("optimizer,saved_world,world,sharded", [
    ("AdamW8bit", 2, 2, True), ("AdamW8bit", 2, 3, True), ("AdamW8bit", 2, 1, True), ("AdamW8bit", 2, 1, False),
    ("AdamW8bit", 3, 2, True), ("AdamW4bit", 2, 3, True), ("AdamW4bit", 2, 1, False), ("AdamWFp8", 2, 3, True),
    ("AdamWFp8", 2, 1, False)])
def test_fsdp2_with_a_low_bit_optimizer_resumes_at_any_world_size_and_without_fsdp(fsdp2_low_bit, optimizer,
                                                                                  saved_world, world, sharded):
    """FSDP2 with torchao's low-bit optimizers: each quantized state is a DTensor over the
    class's state. Before, the save was refused ("a DTensor over a OptimState8bit"), so
    such a run had no checkpoint (DCP saves it). Now its parts are shards like the
    parameter's: restored into a fresh optimizer at 1, 2 or 3 ranks, or without FSDP, the
    state is the saved one and the next step is a twin's, the twin given that state by
    torchao's own slicing. 4-bit holds its shard's shape in its flatten context, which must
    become the new shard's."""
    from .launch import run_ranks

    args = {**fsdp2_low_bit(optimizer, saved_world), "sharded": sharded}
    env = {"FORCE_DIST": "1"} if sharded else {}
    for result in run_ranks("resume", world, args, module="tests.low_bit_workers", env=env, timeout=150):
        assert f"resumed at world {world}" in result.output, result.output[-2000:]


@pytest.mark.parametrize("world,resume_hsdp", [(4, True), (2, False)])
def test_hsdp_with_adamw8bit_resumes_as_hsdp_and_as_fsdp2(fsdp2_low_bit, world, resume_hsdp):
    """HSDP (2 replicas of 2 shards on 4 ranks) with AdamW8bit: each shard's codes and
    scales are written once, whatever replicates them, and come back at the same layout
    and on 2 FSDP2 ranks, with the twin's next step."""
    from .launch import run_ranks

    args = {**fsdp2_low_bit("AdamW8bit", 4, hsdp=True), "sharded": True, "resume_hsdp": resume_hsdp}
    for result in run_ranks("resume", world, args, module="tests.low_bit_workers", env={"FORCE_DIST": "1"},
                            timeout=150):
        assert f"resumed at world {world}" in result.output, result.output[-2000:]


def test_fsdp2_with_tensor_parallel_and_adamw8bit_resumes_on_fewer_ranks(tmp_path):
    """FSDP2 + TP (2 x 2 ranks; ``up`` placed (_StridedShard(0), Shard(0)), ``down``
    (Shard(0), Shard(1)): blocks lie within each row of a shard of columns) with
    AdamW8bit: restored at 2 x 2 and at 1 x 2 ranks, every parameter and moment, whole
    and dequantized by torch's own ``full_tensor``, is the saved one."""
    pytest.importorskip("torchao.optim")
    from .launch import run_ranks

    args = {"root": str(tmp_path / "ckpt"), "reference": str(tmp_path / "reference.pt")}
    results = run_ranks("tp_save", 4, args, module="tests.low_bit_workers", env={"FORCE_DIST": "1"}, timeout=150)
    assert all("saved at world 4" in r.output for r in results)
    for world in (4, 2):
        for result in run_ranks("tp_resume", world, args, module="tests.low_bit_workers", env={"FORCE_DIST": "1"},
                                timeout=150):
            assert f"resumed at world {world}" in result.output, result.output[-2000:]


def test_fsdp2_low_bit_state_with_overlapped_staging_restores_in_place(tmp_path):
    pytest.importorskip("torchao.optim")
    from .launch import run_ranks

    args = {"root": str(tmp_path / "ckpt"), "reference": str(tmp_path / "reference.pt"), "staging": "overlap",
            "optimizer": "AdamW8bit", "state_class": "OptimState8bit"}
    results = run_ranks("save", 2, args, module="tests.low_bit_workers", env={"FORCE_DIST": "1"}, timeout=150)
    assert all("saved at world 2" in r.output for r in results)


def test_a_state_quantized_on_some_ranks_only_is_refused_before_anything_is_written(tmp_path):
    """torchao quantizes a shard only with >= 4096 values: 7 rows of 2048 on 3 ranks leave
    the last rank's shard (1 row) in full precision. Saved as it was, the checkpoint was
    committed and then refused by every restore (its codes cover 6 of 7 rows)."""
    pytest.importorskip("torchao.optim")
    from .launch import run_ranks

    results = run_ranks("refused_where_shards_differ", 3, {"root": str(tmp_path / "ckpt")},
                        module="tests.low_bit_workers", env={"FORCE_DIST": "1"}, timeout=150)
    assert all("refused" in r.output for r in results)
