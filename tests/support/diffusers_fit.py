"""A real Lightning fit of a tiny diffusers edit transformer that records every step's samples and loss, per rank.

Run as a script (the tests start it in a subprocess):
    python tests/support/diffusers_fit.py CACHE OUT --arch qwen --max-steps 8 [--devices 2] [--kill-at-step 4]
        [--ckpt PATH] [--lora] [--then CACHE OUT2 ...]
`--then` starts another fit's arguments: the fits run one after another in the same processes (each rank runs
them all; the ranks Lightning launches for the first fit stay for the others), so a test that compares several
multi-rank fits pays for one launch; a kill ends the process, so only the last fit may ask for one.
The model is the tiny config's (`configs/tiny/`). OUT/rank{r}.jsonl gets one line per training batch,
`{"step", "ids", "contexts", "loss"}`; OUT/rank{r}.initial.json and OUT/rank{r}.params.json hold every parameter's sum
when training starts and when fit ends, to compare ranks. Checkpoints `step={s}.ckpt` go to OUT/ckpt every
step; `--kill-at-step k` exits hard right after the step-k checkpoint is on disk (see fits.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.strategies import ModelParallelStrategy

from image_edit_data import ImageEditDataModule
from image_edit_data.models.diffusers_edit import DiffusersEditModule, FluxKontextModule, QwenImageEditModule

if __package__ in (None, ""):  # run as a script, as the tests do: make the `support` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ROOT
from support.fits import KillAfterCheckpoint

TINY = ROOT / "configs" / "tiny"
ARCHS: dict[str, tuple[type[DiffusersEditModule], str]] = {
    "qwen": (QwenImageEditModule, "fit_qwen_image_edit_tiny.yaml"),
    "flux": (FluxKontextModule, "fit_flux_kontext_tiny.yaml"),
}


def tiny_module(arch: str, **overrides: Any) -> DiffusersEditModule:
    """The module of the tiny config of `arch`, with `overrides` on its init args."""
    cls, config = ARCHS[arch]
    init_args = yaml.safe_load((TINY / config).read_text())["model"]["init_args"]
    return cls(**(init_args | overrides))


class Recorder(pl.Callback):
    """Appends each training batch's optimizer step, sample ids and loss to this rank's record file."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        line = {
            "step": trainer.global_step,
            "ids": batch["metadata"]["sample_indices"],
            "contexts": len(batch["context_latents"]),
            "loss": outputs["loss"].item(),
        }
        with (self.out / f"rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write_params(trainer, pl_module, "initial")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write_params(trainer, pl_module, "params")

    def write_params(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> None:
        """Write every parameter's sum to OUT/rank{r}.{name}.json."""
        # FSDP2 parameters are DTensor shards: gather each (every rank takes part) to sum the whole tensor.
        full = {key: getattr(p, "full_tensor", p.detach)().detach() for key, p in pl_module.named_parameters()}
        sums = {key: tensor.double().sum().item() for key, tensor in full.items()}
        (self.out / f"rank{trainer.global_rank}.{name}.json").write_text(json.dumps(sums))


def strategy(name: str, devices: int) -> str | ModelParallelStrategy:
    """The Trainer strategy: DDP, or FSDP2 over all ranks (ModelParallelStrategy with data parallelism only)."""
    if devices == 1:
        return "auto"
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return "ddp"


def main(argv: list[str], in_process: bool = False) -> None:
    """Run the fits `argv` describes, in order; `in_process` (one device): the kill raises SimulatedKill instead of
    exiting, and the caller's torch thread count is restored after."""
    runs = [parse(part) for part in split_runs(argv)]
    if any(run.kill_at_step is not None for run in runs[:-1]):
        raise SystemExit("only the last fit may be killed: the kill ends the process")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float results in every run, and no oversubscription on small machines
    try:
        for run in runs:
            fit(run, in_process)
    finally:
        if torch.distributed.is_initialized():  # gloo's threads joined now, not torn down at interpreter exit (SIGABRT)
            torch.distributed.destroy_process_group()
        if in_process:
            torch.set_num_threads(threads)


def split_runs(argv: list[str]) -> list[list[str]]:
    """The arguments of each fit: `argv` cut at every `--then`."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp", help="with --devices > 1")
    parser.add_argument("--no-checkpoints", action="store_true")
    parser.add_argument("--lora", action="store_true", help="train a rank-4 LoRA instead of every weight")
    return parser.parse_args(argv)


def fit(args: argparse.Namespace, in_process: bool) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model = tiny_module(args.arch, **({"lora": True, "lora_rank": 4, "learning_rate": 1e-2} if args.lora else {}))
    datamodule = ImageEditDataModule(cache_dir=args.cache, batch_size=args.batch_size, num_workers=0, seed=42)
    checkpoint = KillAfterCheckpoint(
        kill_at_step=args.kill_at_step,
        in_process=in_process,
        dirpath=out / "ckpt",
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy(args.strategy, args.devices),
        max_steps=args.max_steps,
        gradient_clip_val=1.0,  # clipping by the global norm, across shards under FSDP2
        callbacks=[Recorder(out)] if args.no_checkpoints else [checkpoint, Recorder(out)],
        enable_checkpointing=not args.no_checkpoints,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.ckpt)  # a later fit reuses the process group


if __name__ == "__main__":
    main(sys.argv[1:])
