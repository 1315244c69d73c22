"""Claims about LoRA training of the diffusers edit modules: settings, what trains, checkpoints, resume, export."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open
from support import ROOT, SUPPORT
from support.diffusers_fit import Recorder
from support.fits import KillAfterCheckpoint, SimulatedKill
from support.lora import ARCHS, pipeline_module, random_cache

from image_edit_data import ImageEditDataModule
from image_edit_data.__main__ import main
from image_edit_data.models.diffusers_edit import QwenImageEditModule
from image_edit_data.models.diffusers_inputs import step_generator
from image_edit_data.models.lora import WEIGHT_NAME, LoraSettings, is_adapter_name
from image_edit_data.models.lora_export import LoraExport, export_checkpoint, export_module

HARNESS = SUPPORT / "diffusers_fit.py"

pytestmark = pytest.mark.usefixtures("one_thread")


def quiet_trainer(root: Path, max_steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A CPU trainer without logger, progress bar or sanity check."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kwargs,
    )


def first_batch(cache: Path, batch_size: int = 2) -> dict[str, Any]:
    """The first training batch of `cache`."""
    datamodule = ImageEditDataModule(cache_dir=str(cache), batch_size=batch_size, num_workers=0, pin_memory=False)
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def records(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Every training batch the Recorder wrote: optimizer step, sample ids, loss."""
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


def adapter_file(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of an exported adapter."""
    with safe_open(str(directory / WEIGHT_NAME), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()  # noqa: SIM118


def test_lora_settings_default_per_architecture_and_bad_values_are_refused() -> None:
    qwen, kontext = pipeline_module("qwen", lora=True).lora, pipeline_module("kontext", lora=True).lora
    assert qwen is not None and kontext is not None
    assert (qwen.rank, qwen.alpha, qwen.dropout, kontext.rank, kontext.alpha) == (16, 16.0, 0.0, 16, 16.0)
    assert {"attn.to_q", "attn.add_k_proj", "img_mlp.net.2", "txt_mod.1"} <= set(qwen.target_modules)
    assert {"attn.to_q", "attn.to_add_out", "ff_context.net.2", "proj_mlp"} <= set(kontext.target_modules)
    custom = pipeline_module(
        "qwen", lora=True, lora_rank=4, lora_alpha=8, lora_target_modules=["attn.to_q"], lora_dropout=0.1
    )
    assert custom.lora == LoraSettings(4, 8.0, ("attn.to_q",), 0.1)
    assert pipeline_module("qwen").lora is None, "full fine-tuning stays the default"
    for arguments, message in [
        ({"lora_rank": 0}, r"lora_rank: expected a positive rank, got 0"),
        ({"lora_alpha": -1.0}, r"lora_alpha: expected a positive scale, got -1\.0"),
        ({"lora_dropout": 1.0}, r"lora_dropout: expected a probability in \[0, 1\), got 1\.0"),
        ({"lora_target_modules": []}, r"lora_target_modules: expected module name suffixes .*got \[\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            pipeline_module("qwen", lora=True, **arguments)


@pytest.mark.parametrize("arch", ["qwen", "kontext"])
def test_only_the_adapter_trains_in_float32_and_every_adapter_weight_gets_a_gradient(arch: str, tmp_path: Path) -> None:
    cls, config, _ = ARCHS[arch]
    module = cls(model_config={**config, "num_layers": 2}, lora=True, lora_rank=4)
    module.configure_model()
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(name) for name in trainable)
    assert {p.dtype for p in module.parameters() if p.requires_grad} == {torch.float32}
    batch = first_batch(random_cache(tmp_path / "cache", arch, samples=2))
    module.flow_loss(batch, step_generator(torch.device("cpu"), 0)).backward()
    assert [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None] == []
    adapted = {name.split(".lora_")[0] for name in trainable}
    if arch == "qwen":  # the last block's text-stream outputs never reach the loss: no adapter there
        last, first = "transformer.transformer_blocks.1.", "transformer.transformer_blocks.0."
        unreached = (f"{last}attn.add_q_proj", f"{last}attn.to_add_out", f"{last}txt_mlp")
        assert not {name for name in adapted if name.startswith(unreached)}
        assert {f"{first}attn.to_add_out", f"{first}txt_mlp.net.2", f"{last}attn.to_q", f"{last}img_mod.1"} <= adapted
    else:
        assert {
            "transformer.single_transformer_blocks.0.proj_mlp",
            "transformer.transformer_blocks.1.ff.net.2",
        } <= adapted


@pytest.mark.parametrize("arch", ["qwen", "kontext"])
def test_every_exported_adapter_weight_changes_in_training(arch: str, tmp_path: Path) -> None:
    cls, config, _ = ARCHS[arch]
    module = cls(model_config={**config, "num_layers": 2}, lora=True, lora_rank=4, learning_rate=1e-2)
    module.configure_model()
    export_module(module, tmp_path / "before", dtype="float32")
    cache = random_cache(tmp_path / "cache", arch, samples=2)
    quiet_trainer(tmp_path, 3, []).fit(module, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0))
    export_module(module, tmp_path / "after", dtype="float32")
    before, after = adapter_file(tmp_path / "before")[0], adapter_file(tmp_path / "after")[0]
    assert before.keys() == after.keys()
    # lora_B starts at zero: an adapter whose output never reaches the loss keeps it, and exports dead weight.
    assert [key for key in before if torch.equal(before[key], after[key])] == []
    if arch == "qwen":  # the last block's text queries reach only the text tokens dropped after it
        assert not [key for key in after if key.startswith("transformer.transformer_blocks.1.attn.add_q_proj")]
        assert [key for key in after if key.startswith("transformer.transformer_blocks.0.attn.add_q_proj")]


def test_a_lora_checkpoint_holds_only_the_adapter_loads_weights_only_and_exports_like_the_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = random_cache(tmp_path / "cache", "qwen")
    module = pipeline_module("qwen", lora=True, lora_rank=4, learning_rate=1e-2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    export = LoraExport(dirpath=str(tmp_path / "lora"), every_n_train_steps=1, dtype="float32")
    quiet_trainer(tmp_path, 2, [checkpoint, export]).fit(
        module, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0)
    )

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)  # no pickled objects in it
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert set(saved["state_dict"]) == trainable
    assert len(saved["optimizer_states"][0]["state"]) == len(trainable), "AdamW state for the adapter only"
    adapter = sum(t.numel() for t in saved["state_dict"].values())
    base = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    assert adapter < base / 4

    restored = QwenImageEditModule.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    for (name, a), (_, b) in zip(module.named_parameters(), restored.named_parameters()):
        assert torch.equal(a, b), f"{name}: the random base is drawn from noise_seed, the adapter comes from the file"

    other = pipeline_module("qwen", lora=True, lora_rank=4, lora_target_modules=["attn.to_q"])
    other.configure_model()
    with pytest.raises(ValueError, match=r"does not match this LoRA adapter \(rank 4, targets \['attn\.to_q'\]\)"):
        other.load_state_dict(saved["state_dict"])
    full = pipeline_module("qwen")
    full.configure_model()
    with pytest.raises(ValueError, match=r"0 adapter weights missing \[\], \d+ unexpected .*transformer\."):
        other.load_state_dict(full.state_dict() | other.state_dict())

    assert main(["export-lora", str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path / "cli"), "--dtype", "float32"]) == 0
    assert "pytorch_lora_weights.safetensors" in capsys.readouterr().out
    export_module(module, tmp_path / "module", dtype="float32")
    expected, metadata = adapter_file(tmp_path / "module")
    assert all(key.startswith("transformer.") and ".lora_" in key and ".default" not in key for key in expected)
    for directory in (tmp_path / "cli", tmp_path / "lora" / "last", tmp_path / "lora" / "step=2"):
        tensors, written = adapter_file(directory)
        assert written == metadata and tensors.keys() == expected.keys(), directory
        assert all(torch.equal(tensors[key], expected[key]) for key in expected), directory
    config = json.loads(metadata["lora_adapter_metadata"])
    assert (config["transformer.r"], config["transformer.lora_alpha"]) == (4, 4.0)
    assert config["transformer.exclude_modules"] == [
        "transformer_blocks.0.attn.add_q_proj",
        "transformer_blocks.0.attn.to_add_out",
        "transformer_blocks.0.txt_mlp.net.0.proj",
        "transformer_blocks.0.txt_mlp.net.2",
    ]
    assert adapter_file(tmp_path / "lora" / "step=1")[0].keys() == expected.keys()


def test_a_checkpoint_without_an_adapter_is_refused_for_export(tmp_path: Path) -> None:
    torch.save({"state_dict": {"transformer.proj_out.weight": torch.zeros(2, 2)}}, tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match=r"full\.ckpt: no 'lora_adapter' entry: not a checkpoint of a .* lora: true"):
        export_checkpoint(tmp_path / "full.ckpt", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt: no such checkpoint file or directory"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")
    with pytest.raises(ValueError, match=r"trained without lora: true, so it has no adapter to export"):
        export_module(pipeline_module("qwen"), tmp_path / "out")


def test_export_lora_writes_bfloat16_by_default_and_says_so_in_its_help(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["export-lora", "--help"])
    assert done.value.code == 0
    assert "in bfloat16 unless --dtype" in " ".join(capsys.readouterr().out.split())
    module = pipeline_module("qwen", lora=True, lora_rank=4)
    module.configure_model()
    export_module(module, tmp_path / "default")
    assert {t.dtype for t in adapter_file(tmp_path / "default")[0].values()} == {torch.bfloat16}


def fit_with_kill(
    cache: Path, out: Path, arch: str, strategy: Any, kill_at: int | None = None, ckpt: Path | None = None
):
    """Fit 5 steps of a rank-4 LoRA, checkpointing every step; `kill_at` raises SimulatedKill after that checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    module = pipeline_module(arch, lora=True, lora_rank=4, learning_rate=1e-2)
    checkpoint = KillAfterCheckpoint(
        kill_at_step=kill_at, in_process=True, dirpath=out / "ckpt", filename="{step}", every_n_train_steps=1,
        save_top_k=-1,
    )  # fmt: skip
    trainer = quiet_trainer(out, 5, [checkpoint, Recorder(out)], strategy=strategy, gradient_clip_val=1.0)
    trainer.fit(module, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0, seed=42), ckpt_path=ckpt)
    return module


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def restored_environment() -> Iterator[None]:
    """The process environment as it was before the test.

    An in-process ModelParallelStrategy fit leaves LOCAL_RANK, NODE_RANK and OMP_NUM_THREADS in `os.environ`; a
    later multi-process fit started from this process would inherit LOCAL_RANK, take its ranks for launched
    already, start only rank 0 and wait for rank 1 forever.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def fsdp2() -> Any:
    """FSDP2 on one rank in this process: DTensor weights, sharded checkpoint directories."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)


@pytest.mark.parametrize(
    ("arch", "strategy"),
    [("qwen", "auto"), ("kontext", "auto"), pytest.param("qwen", "fsdp2", marks=pytest.mark.slow)],
)
def test_a_killed_lora_run_resumes_with_the_same_batches_and_bit_identical_losses(
    arch: str, strategy: str, tmp_path: Path, restored_environment: None
) -> None:
    """In this process; the FSDP2 case is slow-tier (a one-rank process group and sharded checkpoints)."""
    cache = random_cache(tmp_path / "cache", arch, samples=6)  # 3 batches an epoch: the run crosses an epoch end
    make = fsdp2 if strategy == "fsdp2" else lambda: "auto"
    if strategy == "fsdp2":
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    try:
        fit_with_kill(cache, tmp_path / "whole", arch, make())
        with pytest.raises(SimulatedKill):
            fit_with_kill(cache, tmp_path / "run", arch, make(), kill_at=2)
        assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]
        ckpt = tmp_path / "run" / "ckpt" / "step=2.ckpt"
        assert ckpt.is_dir() == (strategy == "fsdp2"), "FSDP2 checkpoints are sharded directories"
        resumed = fit_with_kill(cache, tmp_path / "run", arch, make(), ckpt=ckpt)
        if strategy == "fsdp2":  # the sharded checkpoint exports like the module it came from
            export_checkpoint(tmp_path / "run" / "ckpt" / "step=5.ckpt", tmp_path / "from-ckpt", "float32")
            export_module(resumed, tmp_path / "from-module", "float32")
            from_ckpt, from_module = adapter_file(tmp_path / "from-ckpt")[0], adapter_file(tmp_path / "from-module")[0]
            assert all(torch.equal(from_ckpt[key], from_module[key]) for key in from_module)
    finally:
        if strategy == "fsdp2" and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    expected = records(tmp_path / "whole")
    assert records(tmp_path / "run") == expected, "same batches and bit-identical losses as the uninterrupted run"
    assert len({r["loss"] for r in expected}) == 5


@pytest.mark.parametrize("arch", ["qwen", "kontext"])
def test_the_shipped_tiny_lora_configs_fit_resume_and_export_through_the_cli(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = {"qwen": "qwen-image-edit", "kontext": "flux-kontext"}[arch]
    config = ROOT / "configs" / "tiny" / f"fit_{name.replace('-', '_')}_lora_tiny.yaml"
    monkeypatch.chdir(tmp_path)  # the config writes runs/ under the working directory
    cache = random_cache(tmp_path / "cache", arch, samples=4)
    args = ["fit", "--config", str(config), "--data.cache_dir", str(cache), "--trainer.max_steps", "3"]
    assert main(args) == 0
    run = tmp_path / "runs" / f"tiny-{name}-lora"
    assert main([*args[:-1], "5", "--ckpt_path", "last"]) == 0
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 5, "resumed after step 3 and ran to the new max_steps"
    assert saved["state_dict"] and all(is_adapter_name(key) for key in saved["state_dict"]), "the adapter only"
    weights, _ = adapter_file(run / "lora" / "last")
    assert weights and all("lora" in key for key in weights), "exported for load_lora_weights when fit ends"
