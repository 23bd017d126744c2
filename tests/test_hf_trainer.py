"""The Hugging Face ``Trainer`` with resilient's checkpoints (``resilient.hf.ResilientTrainer``),
run as a user runs it: ``examples/hf_trainer.py`` under ``resilient-run`` on two gloo ranks,
SIGKILLed mid-run and resumed, against an uninterrupted run, bit for bit."""

import json
import os
import subprocess
import sys

import pytest
import torch

from .launch import REPO

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(300)

EXAMPLE = "examples/hf_trainer.py"


def _launch(*args: str, check: bool = True) -> str:
    # one intra-op thread: a CPU reduction's rounding depends on how it is split (test_hf_example)
    cmd = [sys.executable, "-m", "resilient.launch.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", EXAMPLE, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_a_trainer_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _launch("--dir", str(full), "--steps", "12", "--out", str(tmp_path / "full.pt"))
    killed = _launch("--dir", str(resumed), "--steps", "12", "--kill-at", "10", check=False)
    assert "killed at step 10" in killed
    # step 8's save was committed in the background, or was still in flight when killed
    steps = sorted(n for n in os.listdir(resumed / "resilient") if n.startswith("step-"))
    assert steps in (["step-0000000004"], ["step-0000000004", "step-0000000008"]), steps
    newest = int(steps[-1].removeprefix("step-"))
    out = _launch("--dir", str(resumed), "--steps", "12", "--out", str(tmp_path / "resumed.pt"))
    assert "trained to step 12" in out
    # the Trainer resumed through its own path, from the directory written for that step
    assert json.loads((resumed / f"checkpoint-{newest}" / "resilient.json").read_text())["step"] == newest
    state = json.loads((resumed / f"checkpoint-{newest}" / "trainer_state.json").read_text())
    assert state["global_step"] == newest
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    differ = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert a.keys() == b.keys() and not differ, f"{differ}\n{out[-3000:]}"


def test_a_run_the_plain_trainer_checkpointed_resumes_from_its_own_checkpoint(tmp_path):
    """Switching a run midway: the plain Trainer saved checkpoint-4 and was killed; the
    ResilientTrainer's "auto" resumes from it (resilient has no step yet), through the
    Trainer's own loading, and ends where the uninterrupted run does."""
    full, switched = tmp_path / "full", tmp_path / "switched"
    _launch("--dir", str(full), "--steps", "8", "--out", str(tmp_path / "full.pt"))
    _launch("--dir", str(switched), "--steps", "8", "--plain", "--kill-at", "6", check=False)
    assert os.path.isfile(switched / "checkpoint-4" / "trainer_state.json")
    out = _launch("--dir", str(switched), "--steps", "8", "--out", str(tmp_path / "switched.pt"))
    assert "trained to step 8" in out and os.path.isdir(switched / "resilient" / "step-0000000008")
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "switched.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), out[-3000:]


def test_resume_true_without_a_checkpoint_and_load_best_model_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from resilient.hf import ResilientTrainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    data = [{"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    trainer = ResilientTrainer(model=model, args=args, train_dataset=data)
    with pytest.raises(ValueError, match=r"no committed checkpoint in .*resilient to resume from"):
        trainer.train(resume_from_checkpoint=True)
    best = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True,
                             load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps")
    with pytest.raises(ValueError, match="load_best_model_at_end is not supported"):
        ResilientTrainer(model=model, args=best, train_dataset=data, eval_dataset=data)


def test_save_total_limit_is_the_number_of_steps_kept(tmp_path):
    """The Trainer's ``save_total_limit`` bounds resilient's checkpoints as it bounds its own
    directories; every save of the run is committed when ``train`` returns."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from resilient.hf import ResilientTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, save_steps=4, save_total_limit=2,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True)
    ResilientTrainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint="auto")
    kept = sorted(n for n in os.listdir(tmp_path / "resilient") if n.startswith("step-"))
    assert kept == ["step-0000000008", "step-0000000012"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")]  # none written when saving
