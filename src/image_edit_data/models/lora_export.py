"""A trained LoRA adapter written where diffusers' `load_lora_weights(directory)` reads it, without conversion.

The directory gets one `pytorch_lora_weights.safetensors`, written by the pipeline family's own
`save_lora_weights` (keys `transformer.<module>.lora_A.weight` / `lora_B.weight`, the adapter's `LoraConfig` in
the file's metadata), so `QwenImageEditPlusPipeline.from_pretrained(base).load_lora_weights(directory)` and
`FluxKontextPipeline.from_pretrained(base).load_lora_weights(directory)` load it as it is.

Three ways in: `export_module` (a module being trained), `LoraExport` (a callback that does it every N steps and at
the end of fit) and `export_checkpoint` / `image-edit-data export-lora` (a Lightning checkpoint, file or sharded
directory, read without unpickling anything but tensors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from image_edit_data.models.lora import WEIGHT_NAME, diffusers_lora_names

ExportDtype = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The module class -> the diffusers pipeline mixin whose `save_lora_weights` writes that architecture's adapters.
LOADERS = {"QwenImageEditModule": "QwenImageLoraLoaderMixin", "FluxKontextModule": "FluxLoraLoaderMixin"}
CHECKPOINT_KEY = "lora_adapter"  # what `DiffusersEditModule.on_save_checkpoint` records beside the weights


def save_adapter(
    weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], model: str, out_dir: str | Path, dtype: ExportDtype
) -> Path:
    """Write adapter `weights` (diffusers names, no `transformer.` prefix) and its config; returns the file.

    The file is written in a temporary directory beside `out_dir` and renamed into place, so a reader sees the
    previous adapter or the new one, never half of one.
    """
    import diffusers.loaders

    if model not in LOADERS:
        raise ValueError(f"{model}: no diffusers LoRA format is known for it (known: {sorted(LOADERS)})")
    if not weights:
        raise ValueError(f"{model}: no adapter weights to export (was the module trained with lora: true?)")
    loader = getattr(diffusers.loaders, LOADERS[model])
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        cast = {name: tensor.detach().to("cpu", DTYPES[dtype]).contiguous() for name, tensor in weights.items()}
        loader.save_lora_weights(staging, transformer_lora_layers=cast, transformer_lora_adapter_metadata=dict(config))
        os.replace(staging / WEIGHT_NAME, target / WEIGHT_NAME)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / WEIGHT_NAME


def export_module(module: Any, out_dir: str | Path, dtype: ExportDtype = "bfloat16") -> Path | None:
    """Export a LoRA-trained `DiffusersEditModule`'s adapter; under FSDP2 every rank must call it, rank 0 writes."""
    if module.lora is None:
        raise ValueError(f"{type(module).__name__}: trained without lora: true, so it has no adapter to export")
    # FSDP2 holds each weight as a DTensor shard: every rank takes part in gathering the whole tensor.
    state = {key: getattr(t, "full_tensor", lambda t=t: t)() for key, t in module.state_dict().items()}
    if getattr(module, "_trainer", None) is not None and module.global_rank != 0:
        return None
    return save_adapter(diffusers_lora_names(state), module.lora.metadata(), model_name(module), out_dir, dtype)


def model_name(module: Any) -> str:
    """The architecture of `module`: the first class in its hierarchy with a known LoRA format."""
    for cls in type(module).__mro__:
        if cls.__name__ in LOADERS:
            return cls.__name__
    return type(module).__name__


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: ExportDtype = "bfloat16") -> Path:
    """Export the adapter of a LoRA run's Lightning checkpoint: a `.ckpt` file or an FSDP2 sharded directory."""
    state, info = read_checkpoint(Path(checkpoint))
    if not isinstance(info, dict) or "config" not in info or "model" not in info:
        raise ValueError(
            f"{checkpoint}: no '{CHECKPOINT_KEY}' entry: not a checkpoint of a DiffusersEditModule trained with "
            "lora: true"
        )
    return save_adapter(diffusers_lora_names(state), info["config"], str(info["model"]), out_dir, dtype)


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The checkpoint's module state and its LoRA record, loaded weights-only (no code runs from the file)."""
    if path.is_dir():  # ModelParallelStrategy's sharded checkpoint: DCP shards plus Lightning's meta.pt
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        if not (path / "meta.pt").is_file():
            raise FileNotFoundError(f"{path}: a directory but not a sharded Lightning checkpoint (no meta.pt)")
        with tempfile.TemporaryDirectory() as scratch:
            merged = Path(scratch) / "merged.pt"
            dcp_to_torch_save(path, merged)
            shards = torch.load(merged, map_location="cpu", weights_only=True)
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
        return shards["state_dict"], meta.get(CHECKPOINT_KEY)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint["state_dict"], checkpoint.get(CHECKPOINT_KEY)


class LoraExport(pl.Callback):
    """Write the adapter for `load_lora_weights` every `every_n_train_steps` and when fit ends.

    Args:
        dirpath: Where the adapters go: `step=N/` every N steps and `last/` at the end of fit; None:
            `{trainer.default_root_dir}/lora`.
        every_n_train_steps: Export every this many optimizer steps; 0 exports only when fit ends.
        dtype: The saved weights' dtype; the pipelines cast an adapter to their own dtype when they load it.
    """

    def __init__(
        self, dirpath: str | None = None, every_n_train_steps: int = 0, dtype: ExportDtype = "bfloat16"
    ) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps: expected 0 (only at the end) or more, got {every_n_train_steps}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.dtype: ExportDtype = dtype
        self.last_step = -1

    def directory(self, trainer: pl.Trainer) -> Path:
        """The root directory of this run's adapters."""
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "lora"

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps and step % self.every_n_train_steps == 0 and step != self.last_step:
            self.last_step = step
            export_module(pl_module, self.directory(trainer) / f"step={step}", self.dtype)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        export_module(pl_module, self.directory(trainer) / "last", self.dtype)


def export_lora_main(argv: list[str]) -> int:
    """`image-edit-data export-lora CHECKPOINT OUT_DIR [--dtype D]`."""
    parser = argparse.ArgumentParser(
        prog="image-edit-data export-lora",
        description="Write a LoRA run's adapter from its Lightning checkpoint in the format diffusers' "
        "load_lora_weights reads (OUT_DIR/pytorch_lora_weights.safetensors), in bfloat16 unless --dtype says "
        "otherwise (the trained adapter is float32; --dtype float32 keeps it exact).",
    )
    parser.add_argument("checkpoint", help="a .ckpt file, or the directory of an FSDP2 sharded checkpoint")
    parser.add_argument("out_dir", help="the adapter directory to write (pass it to pipeline.load_lora_weights)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="the saved weights' dtype (default: bfloat16; float32 equals the trained module's forward exactly)",
    )
    args = parser.parse_args(argv)
    written = export_checkpoint(args.checkpoint, args.out_dir, args.dtype)
    sys.stdout.write(f"wrote {written}\n")
    return 0
