"""A real Lightning fit on a tiny cache that records, per rank, which sample ids each step trains on.

Run as a script (the tests start it in a subprocess):
    python fit_harness.py CACHE OUT --devices 2 --num-workers 2 --epochs 3 --kill-at-step 5 [--ckpt PATH]
Records go to OUT/rank{r}.jsonl, one line per training batch: `{"epoch", "step", "ids"}`, where `step`
is the optimizer step the batch belongs to (1-based), so a checkpoint saved at global step s covers
exactly the lines with step <= s. Checkpoints `step={s}.ckpt` go to --ckpt-dir (default OUT/ckpt)
every --ckpt-every steps. Three ways to die, all without a clean shutdown:
    --kill-at-step k            os._exit(17) right after the step-k checkpoint is on disk
    --die-while-saving-step k   the step-k save leaves half a checkpoint file at its path, then os._exit(18)
    --pause-at-step k           every rank records its step-k batch, touches OUT/paused.rank{r} and sleeps,
                                for the caller to SIGKILL the process group
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from image_edit_data.lightning.datamodule import ImageEditDataModule

KILLED_AFTER_CHECKPOINT = 17
DIED_WHILE_SAVING = 18


class RecordingModel(pl.LightningModule):
    """One parameter; every training step appends its sample ids to this rank's record file."""

    def __init__(self, out: str, pause_at_step: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.out = Path(out)
        self.pause_at_step = pause_at_step

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        step = self.global_step + 1  # the optimizer step this batch contributes to
        line = {"epoch": self.current_epoch, "step": step, "ids": batch["metadata"]["sample_indices"]}
        with (self.out / f"rank{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        if step == self.pause_at_step:
            (self.out / f"paused.rank{self.global_rank}").touch()
            time.sleep(3600)
        return (self.weight * batch["image_latents"].float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class KillAfterCheckpoint(ModelCheckpoint):
    """Saves every `every_n_train_steps`; dies hard right after the save at `kill_at_step`, or halfway
    through the save at `die_while_saving_step`."""

    def __init__(self, kill_at_step: int | None, die_while_saving_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_at_step = kill_at_step
        self.die_while_saving_step = die_while_saving_step

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.global_step == self.die_while_saving_step:
            self.die_while_saving(trainer, filepath)
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_step == self.kill_at_step:
            trainer.strategy.barrier("killed")
            os._exit(KILLED_AFTER_CHECKPOINT)

    def die_while_saving(self, trainer: pl.Trainer, filepath: str) -> None:
        """Leave the first half of a real checkpoint at `filepath`, as a save killed mid-write would, and exit.

        Lightning itself writes to a temp file and moves it into place, but that move is a copy when
        the temp directory is on another filesystem; a reader must skip half-written files either way.
        """
        whole = f"{filepath}.whole"
        trainer.save_checkpoint(whole, self.save_weights_only)  # collective: every rank takes part
        if trainer.is_global_zero:
            data = Path(whole).read_bytes()
            Path(whole).unlink()
            with open(filepath, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
        trainer.strategy.barrier("dying while saving")
        os._exit(DIED_WHILE_SAVING)


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
    parser.add_argument("--die-while-saving-step", type=int, default=None)
    parser.add_argument("--pause-at-step", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--ckpt-dir", default=None, help="where checkpoints go (default OUT/ckpt)")
    parser.add_argument("--ckpt-every", type=int, default=1, help="save a checkpoint every this many steps")
    parser.add_argument("--limit-train-batches", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--elastic", action="store_true", help="allow resuming on another number of ranks")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    datamodule = ImageEditDataModule(
        cache_dir=args.cache,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        seed=args.seed,
        elastic=args.elastic,
    )
    checkpoint = KillAfterCheckpoint(
        kill_at_step=args.kill_at_step,
        die_while_saving_step=args.die_while_saving_step,
        dirpath=args.ckpt_dir or out / "ckpt",
        filename="{step}",
        every_n_train_steps=args.ckpt_every,
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
    model = RecordingModel(str(out), pause_at_step=args.pause_at_step)
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main(sys.argv[1:])
