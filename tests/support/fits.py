"""A real Lightning fit on a tiny cache that records, per rank, which sample ids each step trains on.

Run as a script (the tests start it in a subprocess):
    python tests/support/fits.py CACHE OUT --devices 2 --num-workers 2 --epochs 3 --kill-at-step 5 [--ckpt PATH]
Records go to OUT/rank{r}.jsonl, one line per training batch: `{"epoch", "step", "ids"}`, where `step`
is the optimizer step the batch belongs to (1-based), so a checkpoint saved at global step s covers
exactly the lines with step <= s. Checkpoints `step={s}.ckpt` go to --ckpt-dir (default OUT/ckpt)
every --ckpt-every steps. Three ways to die, all without a clean shutdown:
    --kill-at-step k            os._exit(17) right after the step-k checkpoint is on disk
    --die-while-saving-step k   the step-k save leaves half a checkpoint file at its path, then os._exit(18)
    --pause-at-step k           every rank records its step-k batch, touches OUT/paused.rank{r} and sleeps,
                                for the caller to SIGKILL the process group
In-process (`fit(FitOptions(..., in_process=True))`, one device only) the kill after a checkpoint
raises `SimulatedKill` instead, which unwinds through Lightning's exception handling like a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from image_edit_data import ImageEditDataModule, ImageEditDataset
from image_edit_data.lightning.monitor import ImageEditDataMonitor
from image_edit_data.sampling.plan import plan_epoch

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


class SimulatedKill(Exception):
    """Raised in place of `os._exit` when the harness runs inside the test process."""


class KillAfterCheckpoint(ModelCheckpoint):
    """Saves every `every_n_train_steps`; dies hard right after the save at `kill_at_step`, or halfway
    through the save at `die_while_saving_step`."""

    def __init__(
        self,
        kill_at_step: int | None,
        die_while_saving_step: int | None = None,
        in_process: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kill_at_step = kill_at_step
        self.die_while_saving_step = die_while_saving_step
        self.in_process = in_process

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.global_step == self.die_while_saving_step:
            self.die_while_saving(trainer, filepath)
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_step == self.kill_at_step:
            if self.in_process:
                raise SimulatedKill(f"killed after the step-{self.kill_at_step} checkpoint")
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


def planned(cache: Path, world: int, epoch: int) -> list[list[list[int]]]:
    """Per rank, the batches `epoch` plans at `world` ranks (batch size 2, drop_last, the default seed and order).

    Computed by the pure plan function from the cache's buckets, not by the sampler under test: the
    batches a resumed run trains on are compared with a plan that no sampler state took part in.
    """
    members = ImageEditDataset(cache).index.bucket_members()
    plan = plan_epoch(
        members,
        [2] * len(members),
        seed=42,
        epoch=epoch,
        world_size=world,
        shuffle=True,
        drop_last=True,
        order="interleaved",
    )
    return [[plan.batch(step, rank).tolist() for step in range(len(plan))] for rank in range(world)]


@dataclass
class FitOptions:
    """One harness run; the command line has a `--flag` per field."""

    cache: str
    out: str
    devices: int = 1
    num_workers: int = 0
    epochs: int = 3
    batch_size: int = 2
    accumulate: int = 1
    kill_at_step: int | None = None
    die_while_saving_step: int | None = None
    pause_at_step: int | None = None
    ckpt: str | None = None
    ckpt_dir: str | None = None  # where checkpoints go (default OUT/ckpt)
    ckpt_every: int = 1  # save a checkpoint every this many steps
    limit_train_batches: int | None = None
    max_steps: int = -1
    seed: int = 42
    elastic: bool = False  # allow resuming on another number of ranks
    in_process: bool = False  # raise SimulatedKill instead of exiting (one device only)
    storage_options: str | None = None  # JSON fsspec options when `cache` is a URL
    remote_read: str = "range"  # "range" or "shard_cache" for remote packed caches
    local_cache_dir: str | None = None  # where a remote cache keeps its index copy and shards
    sources: str | None = None  # JSON list of mixture sources; `cache` is then ignored
    on_resume_mismatch: str = "raise"  # or "restart_epoch"
    monitor: bool = False  # add the data monitor; its epoch summaries go to OUT/monitor.rank{r}.json

    def __or__(self, changes: dict[str, Any]) -> FitOptions:
        """A copy with `changes` applied."""
        return replace(self, **changes)


def fit(options: FitOptions) -> None:
    """Run the recording fit; dies as `options` asks."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    datamodule = ImageEditDataModule(
        cache_dir=None if options.sources else options.cache,
        sources=json.loads(options.sources) if options.sources else None,
        on_resume_mismatch=options.on_resume_mismatch,  # type: ignore[arg-type]
        batch_size=options.batch_size,
        num_workers=options.num_workers,
        seed=options.seed,
        elastic=options.elastic,
        storage_options=json.loads(options.storage_options) if options.storage_options else None,
        remote_read=options.remote_read,  # type: ignore[arg-type]
        local_cache_dir=options.local_cache_dir,
    )
    checkpoint = KillAfterCheckpoint(
        kill_at_step=options.kill_at_step,
        die_while_saving_step=options.die_while_saving_step,
        in_process=options.in_process,
        dirpath=options.ckpt_dir or out / "ckpt",
        filename="{step}",
        every_n_train_steps=options.ckpt_every,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=options.devices,
        strategy="ddp" if options.devices > 1 else "auto",
        max_epochs=options.epochs,
        max_steps=options.max_steps,
        accumulate_grad_batches=options.accumulate,
        limit_train_batches=options.limit_train_batches,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    monitor = ImageEditDataMonitor() if options.monitor else None
    if monitor is not None:
        trainer.callbacks.append(monitor)  # type: ignore[attr-defined]
    model = RecordingModel(str(out), pause_at_step=options.pause_at_step)
    trainer.fit(model, datamodule=datamodule, ckpt_path=options.ckpt)
    if monitor is not None:
        (out / f"monitor.rank{trainer.global_rank}.json").write_text(json.dumps(monitor.epoch_summaries))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    for field in fields(FitOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.name in ("cache", "out", "in_process"):
            continue
        if field.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=str if "str" in str(field.type) else int, default=field.default)
    fit(FitOptions(**vars(parser.parse_args(argv))))
    if torch.distributed.is_initialized():  # gloo's threads joined now, not torn down at interpreter exit (SIGABRT)
        torch.distributed.destroy_process_group()


Records = list[list[tuple[int, list[int]]]]


def run(cache: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run this harness in a fresh process (its own session, killed whole on timeout)."""
    from support.process_group import run_process_group  # the tests import this module as support.fits

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, str(cache), str(out), *args]
    return run_process_group(command, timeout=300, env=env)


def records(out: Path, devices: int) -> Records:
    """Per rank, (epoch, sample ids) of every training batch, in order."""
    result = []
    for rank in range(devices):
        lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
        result.append([(line["epoch"], line["ids"]) for line in map(json.loads, lines)])
    return result


def cli_fit_config(
    path: Path, out: Path, data: dict[str, Any], kill_at_step: int | None, monitor: bool = False
) -> Path:
    """Write a LightningCLI fit config at `path`: the recording model on one CPU device for 2 epochs, a
    checkpoint every step (and a kill after step `kill_at_step`), `data` as the DataModule's arguments."""
    import yaml  # only the LightningCLI tests need it

    checkpoint = {"kill_at_step": kill_at_step, "in_process": True, "dirpath": str(out / "ckpt"), "filename": "{step}"}
    callbacks: list[dict[str, Any]] = [
        {
            "class_path": "support.fits.KillAfterCheckpoint",
            "init_args": {**checkpoint, "every_n_train_steps": 1, "save_top_k": -1},
        }
    ]
    if monitor:
        callbacks.append({"class_path": "image_edit_data.lightning.monitor.ImageEditDataMonitor"})
    trainer = {"accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False, "enable_progress_bar": False}
    trainer |= {"enable_model_summary": False, "default_root_dir": str(out), "callbacks": callbacks}
    model = {"class_path": "support.fits.RecordingModel", "init_args": {"out": str(out)}}
    path.write_text(yaml.safe_dump({"trainer": trainer, "model": model, "data": data}))
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
