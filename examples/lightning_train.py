"""PyTorch Lightning with resilient checkpoints: one argument to ``Trainer``.

    python examples/lightning_train.py --dir runs/lit --epochs 4            # train
    python examples/lightning_train.py --dir runs/lit --epochs 8 --resume   # go on from last.ckpt
    python examples/lightning_train.py --dir runs/ddp --devices 2           # DDP: ResilientDDPStrategy

Lightning still decides when to save and what to keep (``ModelCheckpoint``); the plugin
snapshots the state and writes it in the background, commits it crash-consistently, and
loads it back without unpickling anything. Add ``--remote s3://bucket/run`` to drain every
checkpoint to an object store too. With ``--devices`` above 1 the run is DDP, and
``ResilientDDPStrategy`` takes the plugin's place: every rank saves a slice of the
(replicated) state, where the Trainer would call the plugin from rank 0 alone.
"""

from __future__ import annotations

import argparse
import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from resilient.lightning import ResilientCheckpointIO, ResilientDDPStrategy


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        optim = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)]


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where checkpoints go")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--resume", action="store_true", help="continue from DIR/last.ckpt")
    p.add_argument("--remote", default=None, help="object store URL prefix, e.g. s3://bucket/run")
    p.add_argument("--out", default=None, help="write the final weights here (torch.save)")
    p.add_argument("--devices", type=int, default=1, help="processes; above 1, DDP over gloo")
    args = p.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    model = Regressor()
    saving: dict = ({"strategy": ResilientDDPStrategy(remote=args.remote)} if args.devices > 1
                    else {"plugins": [ResilientCheckpointIO(remote=args.remote)]})
    trainer = pl.Trainer(
        max_epochs=args.epochs, accelerator="cpu", devices=args.devices, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=args.dir, save_last=True, save_top_k=2, monitor="train_loss")],
        **saving,
    )
    trainer.fit(model, data(), ckpt_path="last" if args.resume else None)
    if trainer.global_rank == 0:
        print(f"trained to epoch {trainer.current_epoch}, step {trainer.global_step}; checkpoints in "
              f"{os.path.abspath(args.dir)}: {sorted(os.listdir(args.dir))}", flush=True)
        if args.out:
            torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
