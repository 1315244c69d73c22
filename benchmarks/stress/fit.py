"""One stress fit: a one-parameter model trained for many short epochs on a tiny cache, with loader workers.

Each rank writes its last finished epoch to `progress-rank<R>` (atomically) after every epoch, so the
stress command can tell a run that is slow from one that stopped. `--thread-churn` keeps Python
threads starting and exiting in the training process the whole time, which is what makes a fork of
that process hang in CPython's after-fork handler; a loader that forks the training process at
each epoch change then hangs within a few epochs.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from image_edit_data._atomic import write_bytes_atomic
from image_edit_data.lightning.datamodule import ImageEditDataModule


class OneParameter(pl.LightningModule):
    """The smallest model that trains: data loading is the whole cost."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return (self.weight - batch["image_latents"].mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Progress(pl.Callback):
    """Write `<epoch> <monotonic seconds>` for this rank after every training epoch."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        line = f"{trainer.current_epoch} {time.monotonic():.3f}\n".encode()
        write_bytes_atomic(self.directory / f"progress-rank{trainer.global_rank}", line)


def churn_threads(stop: threading.Event) -> None:
    """Start and end short-lived threads back to back until `stop` is set."""
    while not stop.is_set():
        worker = threading.Thread(target=time.sleep, args=(0.0005,))
        worker.start()
        worker.join()


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run the fit (Lightning starts the other ranks by running this module again)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stress.fit")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--multiprocessing-context", default="forkserver")
    parser.add_argument("--thread-churn", action="store_true")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stress command asks for stacks before a kill
    torch.set_num_threads(1)
    stop = threading.Event()
    if args.thread_churn:
        threading.Thread(target=churn_threads, args=(stop,), daemon=True, name="thread-churn").start()
    data = ImageEditDataModule(
        cache_dir=args.cache,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        multiprocessing_context=args.multiprocessing_context,
        worker_timeout=60.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Progress(Path(args.out))],
    )
    started = time.monotonic()
    trainer.fit(OneParameter(), datamodule=data)
    stop.set()
    done = f"{trainer.current_epoch} {time.monotonic() - started:.3f}\n".encode()
    write_bytes_atomic(Path(args.out) / f"done-rank{trainer.global_rank}", done)
    if torch.distributed.is_initialized():  # gloo's threads joined now, not torn down at interpreter exit (SIGABRT)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
