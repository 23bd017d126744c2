"""The Hugging Face ``Trainer`` with resilient's checkpoints (``resilient.hf.ResilientTrainer``),
run as a user runs it: ``examples/hf_trainer.py`` under ``resilient-run`` on two gloo ranks,
SIGKILLed mid-run and resumed, against an uninterrupted run, bit for bit."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from resilient._catalog import Catalog
from resilient._storage import LocalStorage

from .launch import REPO

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(300)

EXAMPLE = "examples/hf_trainer.py"


def _launch(*args: str, check: bool = True, ranks: int = 2, env: dict[str, str] | None = None) -> str:
    # one intra-op thread: a CPU reduction's rounding depends on how it is split (test_hf_example)
    cmd = [sys.executable, "-m", "resilient.launch.run", "--standalone", "--nproc-per-node", str(ranks),
           "--max-restarts", "0", EXAMPLE, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **(env or {})})
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of the example's 12 steps on two ranks, run without a fault."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _launch("--dir", str(out / "run"), "--steps", "12", "--out", str(out / "full.pt"))
    return torch.load(out / "full.pt")


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}


def test_a_trainer_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted):
    resumed = tmp_path / "resumed"
    killed = _launch("--dir", str(resumed), "--steps", "12", "--kill-at", "10", check=False)
    assert "killed at step 10" in killed
    # step 8's save was committed in the background, or was still in flight when killed
    steps = sorted(n for n in os.listdir(resumed / "resilient") if n.startswith("step-"))
    assert steps in (["step-0000000004"], ["step-0000000004", "step-0000000008"]), steps
    newest = int(steps[-1].removeprefix("step-"))
    # the Trainer's state is the same on both ranks (not one per rank, warned about at a resize)
    assert len(Catalog(LocalStorage(str(resumed / "resilient"))).manifest(4)["trees"]) == 1
    out = _launch("--dir", str(resumed), "--steps", "12", "--out", str(tmp_path / "resumed.pt"))
    assert "trained to step 12" in out
    # the Trainer resumed through its own path, from the directory written for that step
    assert json.loads((resumed / f"checkpoint-{newest}" / "resilient.json").read_text())["step"] == newest
    state = json.loads((resumed / f"checkpoint-{newest}" / "trainer_state.json").read_text())
    assert state["global_step"] == newest
    differ = _differ(uninterrupted, torch.load(tmp_path / "resumed.pt"))
    assert not differ, f"{differ}\n{out[-3000:]}"


def test_a_preempted_trainer_saves_the_step_it_is_at_and_a_new_node_resumes_from_it(tmp_path, uninterrupted):
    """SIGTERM to rank 0 alone after step 6, with saves every 8 steps: both ranks save the
    step they agree on (rank 1 learns of the signal from rank 0 at the end of a step, one
    step later when the agreement is read without waiting: 6 or 7), it is committed, and
    the run exits with status 0, the step drained to the remote tier; run again on a new
    node (an empty output directory, the same remote), it resumes from that step (no step
    lost) and ends bit for bit where the uninterrupted run does."""
    run, remote = tmp_path / "run", str(tmp_path / "remote")  # a shared directory as the remote tier
    out = _launch("--dir", str(run), "--steps", "12", "--save-steps", "8", "--term-at", "6", "--remote", remote)
    assert "signalled at step 6" in out and "trained to step" not in out
    saved = re.findall(r"preempted: step (\d+) of", out)
    assert len(saved) == 2 and saved[0] == saved[1] and saved[0] in ("6", "7"), out[-3000:]
    assert sorted(n for n in os.listdir(run / "resilient") if n.startswith("step-")) == [f"step-{int(saved[0]):010d}"]
    assert f"step-{int(saved[0]):010d}" in os.listdir(remote)
    node = tmp_path / "new-node"
    out = _launch("--dir", str(node), "--steps", "12", "--save-steps", "8", "--remote", remote,
                  "--out", str(tmp_path / "resumed.pt"))
    assert "trained to step 12" in out
    state = json.loads((node / f"checkpoint-{saved[0]}" / "trainer_state.json").read_text())
    assert state["global_step"] == int(saved[0])
    differ = _differ(uninterrupted, torch.load(tmp_path / "resumed.pt"))
    assert not differ, f"{differ}\n{out[-3000:]}"


def test_a_run_of_two_ranks_goes_on_with_one(tmp_path):
    """Saved by 2 DDP ranks, resumed by 1 (a node lost for good): the step, the Trainer's
    state and the model come back, with nothing said about state that differs by rank."""
    run = tmp_path / "run"
    _launch("--dir", str(run), "--steps", "8")
    out = _launch("--dir", str(run), "--steps", "12", ranks=1)
    assert "trained to step 12" in out and "differs by rank" not in out, out[-3000:]
    assert json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8
    manifest = Catalog(LocalStorage(str(run / "resilient"))).manifest(12)
    assert len(manifest["files"]) == 1  # written by the one rank


def _tiny_gpt2() -> "torch.nn.Module":
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def _rows(n: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _kept(root) -> list[int]:
    return sorted(int(n.removeprefix("step-")) for n in os.listdir(root / "resilient") if n.startswith("step-"))


def test_resume_true_without_a_checkpoint_is_refused_by_name(tmp_path):
    from transformers import TrainingArguments

    from resilient.hf import ResilientTrainer

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    trainer = ResilientTrainer(model=_tiny_gpt2(), args=args, train_dataset=_rows(4))
    with pytest.raises(ValueError, match=r"no committed checkpoint in .*resilient to resume from"):
        trainer.train(resume_from_checkpoint=True)


class _Scripted:
    """``compute_metrics`` giving each evaluation the next score of a script: which step is
    the best is then known before the run."""

    def __init__(self, *scores: float) -> None:
        self.scores = list(scores)

    def __call__(self, prediction) -> dict[str, float]:  # noqa: ANN001 - the Trainer's EvalPrediction
        return {"score": self.scores.pop(0)}


class _Weights:
    """Every step's weights, as the Trainer saves them (after the step's optimizer step)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        weights = self.at = {}

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
                weights[state.global_step] = _weights_of(model)

        self.callback = Record()


def _weights_of(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _best_model_trainer(tmp_path, steps: int, weights: _Weights, *scores: float):
    from transformers import TrainingArguments

    from resilient.hf import ResilientTrainer

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, save_steps=4, eval_strategy="steps",
                             eval_steps=4, save_total_limit=1, load_best_model_at_end=True,
                             metric_for_best_model="score", greater_is_better=False,
                             per_device_train_batch_size=4, per_device_eval_batch_size=8, report_to=[],
                             use_cpu=True, disable_tqdm=True)
    return ResilientTrainer(model=_tiny_gpt2(), args=args, train_dataset=_rows(), eval_dataset=_rows(8),
                            compute_metrics=_Scripted(*scores), callbacks=[weights.callback])


def test_load_best_model_at_end_loads_the_best_step_kept_beside_the_newest(tmp_path):
    """``load_best_model_at_end``: the best step (8: scores 3, 1, 2 at steps 4, 8, 12) is kept
    by retention besides ``save_total_limit=1``'s newest step, loaded at the end of ``train``,
    and still known after a resume (the Trainer forgets a best step whose ``checkpoint-N``
    directory is missing)."""
    first = _Weights()
    trainer = _best_model_trainer(tmp_path, 12, first, 3.0, 1.0, 2.0)
    trainer.train(resume_from_checkpoint="auto")
    assert _kept(tmp_path) == [8, 12]
    assert trainer.state.best_model_checkpoint == os.path.join(str(tmp_path), "checkpoint-8")
    model = _weights_of(trainer.model)
    assert _same(model, first.at[8]) and not _same(model, first.at[12])

    later = _Weights()  # the run goes on to step 16, whose score (4) is no better
    trainer = _best_model_trainer(tmp_path, 16, later, 4.0)
    trainer.train(resume_from_checkpoint="auto")
    assert min(later.at) == 13 and trainer.state.best_metric == 1.0
    # 12, the step resumed from, is kept while the Checkpointer counts it as the step restored
    # from: until the best model's restore at the end, which may come before the last retention
    assert _kept(tmp_path) in ([8, 16], [8, 12, 16])
    model = _weights_of(trainer.model)
    assert _same(model, first.at[8]) and not _same(model, later.at[16])


def test_save_only_model_saves_the_model_alone_and_is_not_resumed_from(tmp_path):
    """``save_only_model``: the steps hold the model and the Trainer's state only (without
    Adam's two moments, under half the bytes), and resuming from one is refused, naming the
    step, instead of going on with a new optimizer and schedule."""
    from transformers import TrainingArguments

    from resilient.hf import ResilientTrainer

    def args(only_model: bool, out: str, steps: int) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path / out), max_steps=steps, save_steps=4,
                                 save_only_model=only_model, per_device_train_batch_size=4, report_to=[],
                                 use_cpu=True, disable_tqdm=True)

    for only_model, out in ((False, "full"), (True, "only")):
        ResilientTrainer(model=_tiny_gpt2(), args=args(only_model, out, 4),
                         train_dataset=_rows()).train(resume_from_checkpoint="auto")
    full, only = (Catalog(LocalStorage(str(tmp_path / out / "resilient"))) for out in ("full", "only"))
    assert any(n.startswith("optimizer/") for n in full.manifest(4)["tensors"])
    assert all(n.startswith("model/") for n in only.manifest(4)["tensors"])
    assert only.entry(4).nbytes < full.entry(4).nbytes / 2
    trainer = ResilientTrainer(model=_tiny_gpt2(), args=args(True, "only", 8), train_dataset=_rows())
    with pytest.raises(ValueError, match=r"step 4 in .*only.resilient was saved with save_only_model=True"):
        trainer.train(resume_from_checkpoint="auto")


def test_save_total_limit_is_the_number_of_steps_kept(tmp_path):
    """The Trainer's ``save_total_limit`` bounds resilient's checkpoints as it bounds its own
    directories; every save of the run is committed when ``train`` returns."""
    from transformers import TrainingArguments

    from resilient.hf import ResilientTrainer

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, save_steps=4, save_total_limit=2,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True)
    ResilientTrainer(model=_tiny_gpt2(), args=args, train_dataset=_rows()).train(resume_from_checkpoint="auto")
    assert _kept(tmp_path) == [8, 12]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")]  # none written when saving


def test_a_peft_adapter_is_saved_alone_and_resumes_to_the_uninterrupted_result(tmp_path):
    """A LoRA fine-tune: each step holds the adapter's parameters (and their optimizer state),
    not the frozen base, as the Trainer's own checkpoints do; a run stopped after step 6 and
    resumed from step 4 into a new base and adapter ends bit for bit where the uninterrupted
    run does (dropout on: the generators come back too)."""
    peft = pytest.importorskip("peft")
    from transformers import TrainerCallback, TrainingArguments

    from resilient.hf import ResilientTrainer

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            control.should_training_stop = state.global_step == 6

    def run(out: str, *callbacks: TrainerCallback) -> dict[str, torch.Tensor]:
        model = peft.get_peft_model(_tiny_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                                  fan_in_fan_out=True))
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=8, save_steps=4,
                                 per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], use_cpu=True,
                                 disable_tqdm=True)
        trainer = ResilientTrainer(model=model, args=args, train_dataset=_rows(), callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint="auto")
        return _weights_of(trainer.model)

    full = run("full")
    assert run("stopped", StopAt())["base_model.model.lm_head.weight"].equal(full["base_model.model.lm_head.weight"])
    assert _kept(tmp_path / "stopped") == [4]
    saved = Catalog(LocalStorage(str(tmp_path / "stopped" / "resilient"))).manifest(4)["tensors"]
    model_keys = sorted(n for n in saved if n.startswith("model/"))
    assert model_keys and all(".lora_" in n for n in model_keys), model_keys
    resumed = run("stopped")
    differ = [k for k in full if not torch.equal(full[k], resumed[k])]
    trained = [k for k in full if ".lora_B" in k and full[k].abs().sum() > 0]  # (lora_B starts at zero)
    assert trained and not differ, differ


def test_a_low_bit_optimizer_chosen_by_name_resumes_to_the_uninterrupted_result(tmp_path):
    """``optim="adamw_torch_8bit"``: torchao's AdamW8bit, whose moments are tensor subclasses
    (``tests/test_subclass_state.py``). Its first save was refused before, so such a run had no
    checkpoint; now a crash at step 10 resumes (from step 8, or 4 if 8's save was in flight)
    to the uninterrupted weights."""
    pytest.importorskip("torchao")
    eager = {"TORCHDYNAMO_DISABLE": "1"}  # torchao compiles its step: the same code run eagerly, 18 s less
    common = ("--steps", "12", "--optim", "adamw_torch_8bit")
    _launch("--dir", str(tmp_path / "full"), *common, "--out", str(tmp_path / "full.pt"), ranks=1, env=eager)
    killed = _launch("--dir", str(tmp_path / "run"), *common, "--kill-at", "10", check=False, ranks=1, env=eager)
    assert "killed at step 10" in killed
    # step 8's save was committed in the background, or was still in flight when killed
    newest = max(int(n.removeprefix("step-")) for n in os.listdir(tmp_path / "run" / "resilient") if n.startswith("step-"))
    assert newest in (4, 8)
    out = _launch("--dir", str(tmp_path / "run"), *common, "--out", str(tmp_path / "resumed.pt"), ranks=1, env=eager)
    assert json.loads((tmp_path / "run" / f"checkpoint-{newest}" / "resilient.json").read_text())["step"] == newest
    assert "trained to step 12" in out
    differ = _differ(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt"))
    assert not differ, f"{differ}\n{out[-3000:]}"
