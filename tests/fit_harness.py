"""A real Lightning fit on a tiny cache that records, per rank, which sample ids each step trains on.

Run as a script (the tests start it in a subprocess):
    python fit_harness.py CACHE OUT --devices 2 --num-workers 2 --epochs 3 --kill-at-step 5 [--ckpt PATH]
With --kill-at-step k the run hard-exits (os._exit, no clean shutdown) right after the step-k
checkpoint is on disk. Records go to OUT/rank{r}.jsonl, one line per training batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from image_edit_data.datamodule import ImageEditDataModule


class RecordingModel(pl.LightningModule):
    """One parameter; every training step appends its sample ids to this rank's record file."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.out = Path(out)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        line = {"epoch": self.current_epoch, "ids": batch["metadata"]["sample_indices"]}
        with (self.out / f"rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        return (self.weight * batch["image_latents"].float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class KillAfterCheckpoint(ModelCheckpoint):
    """Saves every `every_n_train_steps`; dies hard right after the save at `kill_at_step`."""

    def __init__(self, kill_at_step: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_at_step = kill_at_step

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_step == self.kill_at_step:
            trainer.strategy.barrier("killed")
            os._exit(17)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--limit-train-batches", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    datamodule = ImageEditDataModule(
        cache_dir=args.cache, batch_size=args.batch_size, num_workers=args.num_workers, seed=args.seed
    )
    checkpoint = KillAfterCheckpoint(
        kill_at_step=args.kill_at_step,
        dirpath=out / "ckpt",
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        limit_train_batches=args.limit_train_batches,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    trainer.fit(RecordingModel(str(out)), datamodule=datamodule, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main(sys.argv[1:])
