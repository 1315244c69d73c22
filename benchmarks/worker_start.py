"""Time loader worker start-up per start method, as a training script sees it.

For each `multiprocessing_context`, a fresh process that has imported Lightning (as a training
script has) builds our loader with `--num-workers` workers and times:
- the first pool's start (up to the first batch; for "forkserver" this includes starting the server),
- a second pool's start in the same process (a validation loader, a resume),
- an epoch change on a running pool (the next pass's first batch),
each the median of `--rounds` fresh processes. Prints a table; `--json` keeps the numbers.

`--fit` instead times a Lightning fit (a one-parameter model, one CPU device, or `--devices 2` under
DDP) from making the DataModule to the end of its first optimizer step on rank 0 (under DDP that
step waits for every rank), with the workers' fork server started where the DataModule starts it
(`setup`, in each rank) or, as before 2026-12-06, when the DataModule is made (`made`: the script
calls `data.config.start_workers_early()` then, in each rank).

    python -m benchmarks.worker_start [--rounds 5] [--num-workers 2]
    python -m benchmarks.worker_start --fit [--rounds 5] [--num-workers 2] [--devices 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, time, json
import lightning.pytorch  # what a training script has loaded when its loaders start
from image_edit_data import ImageEditDataloaderConfig

def first_batch_seconds(loader):
    started = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - started

def main():
    cache, start, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = ImageEditDataloaderConfig(cache_dir=cache, num_workers=workers, multiprocessing_context=start)
    build = dict(dp_rank=0, dp_world_size=1, batch_size=2)
    first = config.build(**build)
    first_pool = first_batch_seconds(first.dataloader)
    epoch_change = first_batch_seconds(first.dataloader)  # the next pass on the same pool
    second = config.build(**build)
    second_pool = first_batch_seconds(second.dataloader)
    print(json.dumps({"first_pool": first_pool, "second_pool": second_pool, "epoch_change": epoch_change}))

if __name__ == "__main__":
    main()
"""

FIT_CHILD = r"""
import json, sys, time
made = time.perf_counter()
import lightning.pytorch as pl
import torch
from image_edit_data import ImageEditDataModule

cache, server, workers, devices = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


class FirstBatch(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.first = None

    def training_step(self, batch, batch_idx):
        return (self.weight * batch["image_latents"].float().mean()) ** 2

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.first is None:
            self.first = time.perf_counter()  # after the step's gradient all-reduce: every rank got here

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    data = ImageEditDataModule(cache_dir=cache, batch_size=2, num_workers=workers)
    made = time.perf_counter()
    if server == "made":
        data.config.start_workers_early()
    model = FirstBatch()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        print(json.dumps({"first_step": model.first - made}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
"""


def fit_rounds(root: Path, args: argparse.Namespace) -> None:
    """`--fit`: time to rank 0's first optimizer step with the server started in `setup` or when the module is made."""
    script = root / "fit_child.py"
    script.write_text(FIT_CHILD)
    results: dict[str, list[dict[str, float]]] = {"setup": [], "made": []}
    for _ in range(args.rounds):
        for server in results:  # taking turns, so a change in the machine's load hits both alike
            command = [
                sys.executable,
                str(script),
                str(root / "cache"),
                server,
                str(args.num_workers),
                str(args.devices),
            ]
            began = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[server].append(result | {"process": time.perf_counter() - began})
    medians = {
        server: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for server, rounds in results.items()
    }
    print(
        f"fit, {args.devices} device(s), {args.num_workers} workers, median of {args.rounds} fresh processes (seconds)"
    )
    print(f"{'fork server starts':<26}{'DataModule made -> first step':>32}{'whole process':>15}")
    for server, numbers in medians.items():
        where = "in setup (now)" if server == "setup" else "when the module is made"
        print(f"{where:<26}{numbers['first_step']:>32.3f}{numbers['process']:>15.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": results, "medians": medians}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--starts", nargs="+", default=["fork", "forkserver", "spawn"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--fit", action="store_true", help="Time a Lightning fit to its first batch instead.")
    parser.add_argument("--devices", type=int, default=1, help="With --fit: CPU devices (2 or more: DDP).")
    args = parser.parse_args()
    from image_edit_data.preprocess.demo_cache import write_demo_cache

    root = Path(tempfile.mkdtemp(prefix="worker-start-"))
    write_demo_cache(str(root / "cache"), 16, 0)
    if args.fit:
        fit_rounds(root, args)
        return
    script = root / "child.py"
    script.write_text(CHILD)
    results: dict[str, dict[str, float]] = {}
    for start in args.starts:
        rounds = []
        for _ in range(args.rounds):
            command = [sys.executable, str(script), str(root / "cache"), start, str(args.num_workers)]
            began = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
            rounds.append(json.loads(out.stdout.strip().splitlines()[-1]) | {"process": time.perf_counter() - began})
        results[start] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"worker start-up, {args.num_workers} workers, median of {args.rounds} fresh processes (seconds)")
    print(f"{'start':<12}{'first pool':>12}{'second pool':>13}{'epoch change':>14}{'whole process':>15}")
    for start, numbers in results.items():
        print(
            f"{start:<12}{numbers['first_pool']:>12.3f}{numbers['second_pool']:>13.3f}"
            f"{numbers['epoch_change']:>14.3f}{numbers['process']:>15.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
