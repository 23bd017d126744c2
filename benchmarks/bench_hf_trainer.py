"""The Hugging Face ``Trainer``'s checkpoints against ``ResilientTrainer``'s: how long each
save holds training up, and when the step is durable.

    python -m benchmarks.bench_hf_trainer --layers 12 --saves 3 --rounds 2 --out benchmarks/results-hf-trainer.json

GPT-2 built from a config (768 wide, ``--layers`` blocks: 124M parameters at 12), AdamW,
one process on the CPU, ``save_steps=2``, ``save_total_limit=1``, both trainers in the same
run, alternating by round. For each save: the time spent in the Trainer's
``_save_checkpoint`` (the training loop waits for all of it); for ``ResilientTrainer`` also
the time from that call until the step is committed (every file fsync'd, the commit
record written), from its event log. The plain Trainer's files are not fsync'd: its save
returns with them in the page cache, so its "durable" time is not known. A memcpy of the
saved tensors' bytes (model and optimizer), measured in the same run, is the floor of any
stall. ``--render`` prints the table of a results file again.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from benchmarks.common import TokenIds, committed_seconds, gpt2_saves_main, save_cells, state_bytes

METHODS = ("Trainer", "ResilientTrainer")


def _timed(base: type) -> type:
    """``base`` with each ``_save_checkpoint``'s wall time recorded in ``save_seconds``."""

    class Timed(base):  # type: ignore[misc, valid-type]
        save_seconds: list[float]

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            started = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.save_seconds.append(time.perf_counter() - started)

    return Timed


def one_run(method: str, layers: int, saves: int, root: str) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from resilient.hf import ResilientTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=64))
    out = os.path.join(root, method)
    events = os.path.join(root, f"{method}-events.jsonl")
    args = TrainingArguments(output_dir=out, max_steps=2 * saves, save_steps=2, save_total_limit=1,
                             per_device_train_batch_size=1, report_to=[], use_cpu=True, disable_tqdm=True,
                             logging_strategy="no")
    kind = _timed(Trainer if method == "Trainer" else ResilientTrainer)
    extra = {} if method == "Trainer" else {"resilient_options": {"events": events}}
    trainer = kind(model=model, args=args, train_dataset=TokenIds(4 * saves, 32), **extra)
    trainer.save_seconds = []
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    shutil.rmtree(out, ignore_errors=True)
    return {"method": method, "save_s": trainer.save_seconds, "committed_s": committed_seconds(events),
            "train_s": total, "bytes": state_bytes(model, trainer.optimizer)}


def table(results: dict[str, Any]) -> str:
    memcpy = results["memcpy_s"]
    rows = ["| trainer | saved bytes | first save's stall | later saves' stall (median, range) | committed (fsync'd) "
            f"after | run of {2 * results['saves']} steps |", "|---|---|---|---|---|---|"]
    for method in METHODS:
        runs = [r for r in results["runs"] if r["method"] == method]
        firsts, later, durable, trains = save_cells(runs, memcpy)
        rows.append(f"| {method} | {runs[0]['bytes'] / 1e9:.2f} GB | {firsts} | {later} | {durable} | {trains} |")
    return "\n".join(rows) + f"\n\nmemcpy of the saved bytes: {memcpy:.3f} s"


def main(argv: list[str] | None = None) -> None:
    gpt2_saves_main(argv, __doc__, METHODS, one_run, table,
                    lambda run: f"saves {[round(s, 3) for s in run['save_s']]} s", "bench-hf-")


if __name__ == "__main__":
    main()
