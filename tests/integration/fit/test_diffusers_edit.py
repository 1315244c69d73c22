"""Claims about training diffusers' Qwen-Image and FLUX.1 Kontext transformers on our batches (tiny models, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from support import ROOT, SUPPORT
from support.caches import make_payload, write_cache
from support.diffusers_fit import main as diffusers_fit
from support.diffusers_fit import tiny_module
from support.fits import SimulatedKill
from support.process_group import run_process_group

from image_edit_data import ImageEditDataModule
from image_edit_data.__main__ import main
from image_edit_data.models.diffusers_edit import DiffusersEditModule, FluxKontextModule, QwenImageEditModule
from image_edit_data.models.diffusers_inputs import (
    ResolutionShift,
    kontext_image_ids,
    pack_latents,
    sample_sigmas,
    step_generator,
)
from image_edit_data.models.lora import is_adapter_name

HARNESS = SUPPORT / "diffusers_fit.py"
CHANNELS, TEXT, POOLED = 16, 32, 16  # what the tiny configs' transformers take
Shape = tuple[int, int, int]
ONE_CONTEXT: tuple[Shape, tuple[Shape, ...]] = ((CHANNELS, 8, 8), ((CHANNELS, 8, 6),))
TWO_CONTEXTS: tuple[Shape, tuple[Shape, ...]] = ((CHANNELS, 6, 8), ((CHANNELS, 6, 8), (CHANNELS, 4, 4)))


pytestmark = pytest.mark.usefixtures("one_thread")


def edit_cache(
    root: Path,
    buckets: Sequence[tuple[Shape, tuple[Shape, ...], int]],
    text_width: int = TEXT,
    pooled_shape: tuple[int, ...] | None = (POOLED,),
) -> Path:
    """A cache of `count` random samples per `(target, contexts, count)`, prompts 3..6 tokens long."""
    payloads = []
    for target, contexts, count in buckets:
        for _ in range(count):
            i = len(payloads)
            g = torch.Generator().manual_seed(i)
            conditioning = {"pooled_prompt_embeds": torch.randn(pooled_shape, generator=g)} if pooled_shape else {}
            payload = make_payload(
                i, target, contexts, sequence=3 + i % 4, hidden=text_width, conditioning=conditioning
            )
            payload["target_latent"] = torch.randn(target, generator=g)
            payload["context_latents"] = [torch.randn(c, generator=g) for c in contexts]
            payloads.append(payload)
    return write_cache(root, payloads)


def trainer(tmp_path: Path, max_steps: int, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer without checkpoints."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        **kwargs,
    )


def fixed_loss(model: DiffusersEditModule, batch: dict[str, Any], draws: int = 16) -> float:
    """Mean loss over `draws` fixed noise and time draws, so two models are compared on the same noise."""
    with torch.no_grad():
        losses = [model.flow_loss(batch, step_generator(torch.device("cpu"), 1234, d)).item() for d in range(draws)]
    return sum(losses) / draws


def first_batch(cache: Path, batch_size: int = 2) -> dict[str, Any]:
    """The first training batch of `cache` as the DataModule delivers it."""
    datamodule = ImageEditDataModule(cache_dir=str(cache), batch_size=batch_size, num_workers=0, pin_memory=False)
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def captured_inputs(model: DiffusersEditModule, batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the transformer is called with for `batch`."""
    seen: dict[str, Any] = {}
    hook = model.transformer.register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    try:
        model.flow_loss(batch, step_generator(torch.device("cpu"), 0))
    finally:
        hook.remove()
    return seen


def harness(cache: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run support/diffusers_fit.py in a fresh process."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(HARNESS), str(cache), str(out), *args]
    return run_process_group(command, timeout=300, env=env)


def records(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Every training batch a rank recorded: optimizer step, sample ids, loss."""
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


# The batch -> model input functions, checked against the layout diffusers' pipelines use.


def test_packing_puts_each_2x2_patch_in_one_token_channels_outermost() -> None:
    latents = torch.randn(2, 3, 4, 6)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 2 * 3, 3 * 4)
    for row in range(2):
        for col in range(3):
            patch = latents[:, :, 2 * row : 2 * row + 2, 2 * col : 2 * col + 2]  # [B, C, 2, 2]
            assert torch.equal(tokens[:, row * 3 + col], patch.reshape(2, 12))


def test_kontext_ids_mark_the_target_0_and_each_context_by_its_position() -> None:
    ids = kontext_image_ids([(2, 3), (1, 2), (2, 2)], torch.device("cpu"))
    assert ids.shape == (6 + 2 + 4, 3)
    assert ids[:, 0].tolist() == [0] * 6 + [1] * 2 + [2] * 4
    assert ids[:6, 1:].tolist() == [[r, c] for r in range(2) for c in range(3)]
    assert ids[8:, 1:].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_sigmas_are_logit_normal_and_shifted_towards_noise_for_larger_targets() -> None:
    g = step_generator(torch.device("cpu"), 0)
    plain = sample_sigmas(20_000, 256, g)
    assert abs(plain.median().item() - 0.5) < 0.02
    assert abs(torch.logit(plain).std().item() - 1.0) < 0.03, "logit(sigma) is a unit normal"
    shift = ResolutionShift(base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15)
    small = sample_sigmas(20_000, 256, step_generator(torch.device("cpu"), 0), shift=shift)
    large = sample_sigmas(20_000, 4096, step_generator(torch.device("cpu"), 0), shift=shift)
    assert 0.5 < small.median().item() < large.median().item() < 1.0
    torch.testing.assert_close(torch.logit(large) - torch.logit(plain), torch.full_like(plain, 1.15), atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def two_context_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return edit_cache(tmp_path_factory.mktemp("two"), [(*TWO_CONTEXTS, 4)])


def test_qwen_gets_img_shapes_from_the_signature_and_the_prompt_mask(two_context_cache: Path) -> None:
    model = tiny_module("qwen")
    model.configure_model()
    batch = first_batch(two_context_cache)
    inputs = captured_inputs(model, batch)
    assert inputs["img_shapes"] == [[(1, 3, 4), (1, 3, 4), (1, 2, 2)]] * 2
    assert inputs["hidden_states"].shape == (2, 12 + 12 + 4, 4 * CHANNELS)
    assert torch.equal(inputs["encoder_hidden_states_mask"], batch["text_attention_mask"])
    assert inputs["guidance"] is None
    assert torch.equal(pack_latents(batch["context_latents"][1]), inputs["hidden_states"][:, 24:])


class ForwardWithTxtSeqLens(torch.nn.Module):
    """A Qwen transformer called as diffusers before PR #12702 called it: its forward also takes `txt_seq_lens`."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.txt_seq_lens: list[int] | None = None

    def forward(self, txt_seq_lens: list[int], **inputs: Any) -> Any:
        self.txt_seq_lens = txt_seq_lens
        return self.transformer(**inputs)


def test_older_qwen_transformers_get_txt_seq_lens_and_a_warning_that_they_ignore_the_mask(
    two_context_cache: Path,
) -> None:
    model = tiny_module("qwen")
    model.configure_model()
    older = ForwardWithTxtSeqLens(model.transformer)
    model.transformer = older
    with pytest.warns(UserWarning, match=r"ignores encoder_hidden_states_mask .*padded prompt tokens"):
        model.configure_model()
    batch = first_batch(two_context_cache)
    model.flow_loss(batch, step_generator(torch.device("cpu"), 0))
    assert older.txt_seq_lens == batch["text_attention_mask"].sum(dim=1).tolist()
    assert len(set(older.txt_seq_lens)) == 2, "the two prompts differ in length, so the lengths are per sample"


def test_flux_gets_pooled_embeddings_kontext_ids_and_guidance(two_context_cache: Path) -> None:
    model = tiny_module("flux")
    model.configure_model()
    batch = first_batch(two_context_cache)
    inputs = captured_inputs(model, batch)
    assert torch.equal(inputs["pooled_projections"], batch["conditioning_tensors"]["pooled_prompt_embeds"])
    assert inputs["img_ids"][:, 0].tolist() == [0] * 12 + [1] * 12 + [2] * 4
    assert torch.equal(inputs["txt_ids"], torch.zeros(batch["text_embeddings"].shape[1], 3))
    assert inputs["guidance"].tolist() == [2.5, 2.5]
    assert inputs["joint_attention_kwargs"] is None, "FLUX.1 attends to its padding unless asked not to"


@pytest.mark.parametrize("arch", ["qwen", "flux"])
def test_padded_prompt_tokens_do_not_change_the_loss(arch: str, two_context_cache: Path) -> None:
    model = tiny_module(arch, **({"mask_text_padding": True} if arch == "flux" else {}))
    model.configure_model()
    batch = first_batch(two_context_cache)
    padded = dict(batch)
    # Garbage rather than zeros in the padding, so only the mask can be what hides it.
    padded["text_embeddings"] = torch.cat([batch["text_embeddings"], 50 * torch.randn(2, 3, TEXT)], dim=1)
    padded["text_attention_mask"] = torch.cat([batch["text_attention_mask"], torch.zeros(2, 3, dtype=torch.long)], 1)
    generator = step_generator(torch.device("cpu"), 5)
    with torch.no_grad():
        reference = model.flow_loss(batch, generator).item()
        assert model.flow_loss(padded, step_generator(torch.device("cpu"), 5)).item() == pytest.approx(reference, 1e-5)
        changed = dict(batch, text_embeddings=batch["text_embeddings"] + 1.0)
        assert model.flow_loss(changed, step_generator(torch.device("cpu"), 5)).item() != pytest.approx(reference)


def test_the_loss_ignores_the_predictions_for_context_tokens(two_context_cache: Path) -> None:
    model = tiny_module("qwen")
    model.configure_model()
    batch = first_batch(two_context_cache)
    reference = model.flow_loss(batch, step_generator(torch.device("cpu"), 3))

    def garbage_on_contexts(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        target_tokens = 12
        out = output[0].clone()
        out[:, target_tokens:] = 1e6
        return (out,)

    hook = model.transformer.register_forward_hook(garbage_on_contexts, with_kwargs=True)
    try:
        assert model.flow_loss(batch, step_generator(torch.device("cpu"), 3)).item() == reference.item()
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ["qwen", "flux"])
def test_every_trainable_parameter_gets_a_gradient_so_ddp_needs_no_unused_parameter_search(
    arch: str, two_context_cache: Path
) -> None:
    base = tiny_module(arch)
    model = tiny_module(arch, model_config={**base.transformer_config, "num_layers": 2})
    model.configure_model()
    model.flow_loss(first_batch(two_context_cache), step_generator(torch.device("cpu"), 0)).backward()
    assert [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if arch == "flux":
        assert frozen == []
    else:  # Qwen drops the text tokens after its last block, so that block's text stream is frozen
        last = "transformer.transformer_blocks.1."
        assert {name.removeprefix(last).split(".")[0] for name in frozen} == {"attn", "txt_mlp"}
        text_stream = ("attn.to_add_out.", "attn.add_q_proj.", "attn.norm_added_q.", "txt_mlp.")
        assert all(name.startswith(tuple(last + layer for layer in text_stream)) for name in frozen)
        assert f"{last}attn.add_q_proj.weight" in frozen and f"{last}attn.add_k_proj.weight" not in frozen


# Fit runs.


@pytest.mark.parametrize("arch", ["qwen", "flux"])
def test_fit_on_a_repeated_batch_learns_its_samples(arch: str, tmp_path: Path) -> None:
    small = ((CHANNELS, 4, 4), ((CHANNELS, 4, 4),))
    cache = edit_cache(tmp_path / "cache", [(*small, 2)])  # batch size 2: every step sees the same batch
    model = tiny_module(arch, learning_rate=1e-2)
    model.configure_model()
    batch = first_batch(cache)
    before = fixed_loss(model, batch)
    trainer(tmp_path, max_steps=60).fit(model, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0))
    after = fixed_loss(model, batch)
    # With unit-Gaussian latents, the best prediction that does not know the sample scores about 1.71 at these
    # shifted logit-normal times; going clearly below it means the transformer learned these samples.
    assert after < min(1.55, 0.7 * before), f"{arch}: loss on the repeated batch went from {before:.3f} to {after:.3f}"


@pytest.mark.parametrize(
    ("config", "dynamic"),
    [("fit_qwen_image_edit_tiny.yaml", False), ("fit_flux_kontext_tiny.yaml", True)],
)
def test_the_tiny_config_fits_one_and_two_context_batches_and_resumes_through_the_cli(
    config: str, dynamic: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the config writes runs/ under the working directory
    # Dynamic batch size over these buckets: 2, 8 and 4 quantized cells per sample -> 4, 1 and 2 per batch.
    cache = edit_cache(
        tmp_path / "cache",
        [
            ((CHANNELS, 4, 4), ((CHANNELS, 4, 4),), 4),
            ((CHANNELS, 8, 8), ((CHANNELS, 8, 8),), 2),
            ((CHANNELS, 4, 4), ((CHANNELS, 4, 4), (CHANNELS, 4, 4)), 4),
        ],
    )
    args = ["fit", "--config", str(ROOT / "configs/tiny" / config), "--data.cache_dir", str(cache)]
    args += ["--trainer.callbacks+=support.diffusers_fit.Recorder", "--trainer.callbacks.out", str(tmp_path)]
    if dynamic:
        args += ["--data.dynamic_batch_size", "true", "--data.batch_size", "4", "--data.quantization", "32"]
        args += ["--data.base_resolution", "[32, 32]"]
    assert main(args) == 0
    trained = {(r["contexts"], len(r["ids"])) for r in records(tmp_path)}
    assert trained == ({(1, 4), (1, 1), (2, 2)} if dynamic else {(1, 2), (2, 2)})

    assert main([*args, "--ckpt_path", "last", "--trainer.max_steps", "8"]) == 0
    assert [r["step"] for r in records(tmp_path)] == list(range(1, 9)), "resumed after step 6"
    last = tmp_path / yaml.safe_load((ROOT / "configs/tiny" / config).read_text())["trainer"]["default_root_dir"]
    last = last / "checkpoints" / "last.ckpt"
    module_class = QwenImageEditModule if "qwen" in config else FluxKontextModule
    restored = module_class.load_from_checkpoint(last)
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 8
    for name, tensor in restored.state_dict().items():
        assert torch.equal(tensor, saved["state_dict"][name]), name


# Bad input: refused at setup, before the weights load or a step runs.

EIGHT_CHANNELS = ((8, 8, 8), ((8, 8, 8),))
CONTEXT_CHANNELS = ((CHANNELS, 8, 8), ((8, 8, 8),))
ODD = ((CHANNELS, 8, 8), ((CHANNELS, 5, 8),))


@pytest.mark.parametrize(
    ("arch", "buckets", "cache_args", "message"),
    [
        pytest.param(
            "qwen", EIGHT_CHANNELS, {},
            r"compound_bucket_signature\.target has 8 latent channels, but QwenImageTransformer2DModel expects 16 "
            r"\(in_channels 64 / 4, 2x2 packing\)",
            id="latent-channels",
        ),
        pytest.param(
            "flux", CONTEXT_CHANNELS, {},
            r"compound_bucket_signature\.contexts\[0\] has 8 latent channels, but FluxTransformer2DModel expects 16",
            id="context-channels",
        ),
        pytest.param(
            "qwen", ODD, {}, r"compound_bucket_signature\.contexts\[0\] is 5x8, but .* height and width must be even",
            id="odd-latent-side",
        ),
        pytest.param(
            "qwen", ONE_CONTEXT, {"text_width": 48},
            r"sample_00000000\.pt: prompt_embeddings width is 48, but QwenImageTransformer2DModel expects 32 "
            r"\(joint_attention_dim\)",
            id="text-width",
        ),
        pytest.param(
            "flux", ONE_CONTEXT, {"text_width": 48},
            r"prompt_embeddings width is 48, but FluxTransformer2DModel expects 32 \(joint_attention_dim\)",
            id="t5-width",
        ),
        pytest.param(
            "flux", ONE_CONTEXT, {"pooled_shape": None},
            r"conditioning_tensors has no 'pooled_prompt_embeds' \(it has \[\]\), but FluxTransformer2DModel needs it "
            r"with shape \[16\] \(pooled_projection_dim 16\)",
            id="pooled-missing",
        ),
        pytest.param(
            "flux", ONE_CONTEXT, {"pooled_shape": (1, 16)},
            r"conditioning_tensors\.pooled_prompt_embeds has shape \[1, 16\], but FluxTransformer2DModel "
            r"expects \[16\] \(pooled_projection_dim 16\)",
            id="pooled-shape",
        ),
    ],
)  # fmt: skip
def test_a_cache_that_does_not_fit_the_model_is_refused_at_setup_before_any_step(
    arch: str,
    buckets: tuple[Shape, tuple[Shape, ...]],
    cache_args: dict[str, Any],
    message: str,
    tmp_path: Path,
) -> None:
    cache = edit_cache(tmp_path / "cache", [(*buckets, 2)], **cache_args)
    model = tiny_module(arch)
    fit = trainer(tmp_path, max_steps=2)
    with pytest.raises(ValueError, match=message):
        fit.fit(model, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0))
    assert fit.global_step == 0
    assert model.transformer is None, "the check runs before the weights are even built"


def test_a_validation_cache_that_does_not_fit_is_refused_too(tmp_path: Path) -> None:
    train = edit_cache(tmp_path / "train", [(*ONE_CONTEXT, 2)])
    val = edit_cache(tmp_path / "val", [(*ONE_CONTEXT, 2)], text_width=40)
    datamodule = ImageEditDataModule(str(train), 2, val_cache_dir=str(val), num_workers=0)
    with pytest.raises(ValueError, match=r"val/samples/sample_00000000\.pt: prompt_embeddings width is 40"):
        trainer(tmp_path, max_steps=2).fit(tiny_module("qwen"), datamodule=datamodule)


def test_every_source_of_a_mixture_is_checked_against_the_model_at_setup(tmp_path: Path) -> None:
    good = edit_cache(tmp_path / "good", [(*ONE_CONTEXT, 2)])
    odd = edit_cache(tmp_path / "odd", [(*ODD, 2)])  # shares batches with `good`, but does not fit the model
    sources = [{"cache_dir": str(good), "weight": 3}, {"cache_dir": str(odd)}]
    datamodule = ImageEditDataModule(sources=sources, batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match=r"odd: bucket .*contexts\[0\] is 5x8, but .* height and width must be even"):
        trainer(tmp_path, max_steps=2).fit(tiny_module("qwen"), datamodule=datamodule)


def test_a_config_that_does_not_take_packed_latents_is_refused() -> None:
    with pytest.raises(ValueError, match=r"in_channels a multiple of 4.*got in_channels=16, output width 64"):
        tiny_module("qwen", model_config={"in_channels": 16, "out_channels": 16, "num_layers": 1})
    with pytest.raises(ValueError, match="set exactly one of model_path .* and model_config"):
        QwenImageEditModule()


# Loading, precision, gradient checkpointing, sharding.


def test_a_model_directory_is_loaded_locally_with_its_config(tmp_path: Path) -> None:
    built = tiny_module("flux")
    built.configure_model()
    built.transformer.save_pretrained(tmp_path / "pipeline" / "transformer")
    loaded = FluxKontextModule(model_path=str(tmp_path / "pipeline"))  # a pipeline root: its transformer/ is used
    assert loaded.expected_inputs() == built.expected_inputs()
    loaded.configure_model()
    for (name, a), (_, b) in zip(built.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match=r"no config\.json here or in .*transformer"):
        FluxKontextModule(model_path=str(tmp_path))


def test_gradient_checkpointing_recomputes_blocks_and_gives_the_same_gradients(two_context_cache: Path) -> None:
    batch = first_batch(two_context_cache)
    grads, calls = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = tiny_module("flux", gradient_checkpointing=checkpointing)
        model.configure_model()
        block_calls: list[None] = []
        model.transformer.transformer_blocks[0].register_forward_pre_hook(
            lambda *_, seen=block_calls: seen.append(None)
        )
        model.flow_loss(batch, step_generator(torch.device("cpu"), 9)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        calls.append(len(block_calls))
    assert calls == [1, 2], "with checkpointing the block runs again in the backward pass"
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fit_runs_in_bf16(precision: str, tmp_path: Path) -> None:
    cache = edit_cache(tmp_path / "cache", [(*ONE_CONTEXT, 2), (*TWO_CONTEXTS, 2)])
    model = tiny_module("qwen")
    fit = trainer(tmp_path, max_steps=2, precision=precision)
    fit.fit(model, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0))
    assert fit.global_step == 2
    assert torch.isfinite(fit.callback_metrics["train/loss"])
    assert model.weight_dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)


@pytest.mark.parametrize("config", ["fit_qwen_image_edit.yaml", "fit_flux_kontext.yaml", "mixture.yaml"])
def test_the_shipped_configs_shard_with_fsdp2_over_every_gpu(config: str) -> None:
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    trainer_settings = yaml.safe_load((ROOT / "configs" / config).read_text())["trainer"]
    strategy = parser.instantiate(parser.parse_object({"strategy": trainer_settings["strategy"]})).strategy
    assert isinstance(strategy, ModelParallelStrategy)
    # The module shards blocks over the data-parallel mesh only, so tensor parallelism must stay off.
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (trainer_settings["devices"], 1)


# Real processes: a hard-killed run that resumes, and 2-process DDP on gloo.


@pytest.fixture(scope="module")
def mixed_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two buckets, one and two contexts: 3 batches of 2 per epoch on one rank."""
    return edit_cache(tmp_path_factory.mktemp("mixed"), [(*ONE_CONTEXT, 4), (*TWO_CONTEXTS, 2)])


@pytest.mark.slow
def test_a_killed_and_resumed_run_continues_the_data_stream_and_the_loss_curve_exactly(
    mixed_cache: Path, tmp_path: Path
) -> None:
    """In this process, one torch thread as the harness pins it, so the losses can be compared bit for bit; the kill
    after the step-4 checkpoint is the harness's in-process one (this model's real kills: the FSDP2 test below)."""
    diffusers_fit([str(mixed_cache), str(tmp_path / "whole"), "--max-steps", "8"], in_process=True)
    with pytest.raises(SimulatedKill):
        diffusers_fit([str(mixed_cache), str(tmp_path / "run"), "--max-steps", "8", "--kill-at-step", "4"], True)
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4], "killed mid-epoch 2, after step 4"
    checkpoint = tmp_path / "run" / "ckpt" / "step=4.ckpt"
    diffusers_fit([str(mixed_cache), str(tmp_path / "run"), "--max-steps", "8", "--ckpt", str(checkpoint)], True)
    expected = records(tmp_path / "whole")
    assert len(expected) == 8
    assert records(tmp_path / "run") == expected, "same batches and bit-identical losses as the uninterrupted run"
    assert len({r["loss"] for r in expected}) == 8, "the losses differ per step, so equal curves mean something"


@pytest.mark.slow
def test_two_process_ddp_and_fsdp2_train_alike_whole_and_lora_and_a_killed_fsdp2_run_resumes(
    mixed_cache: Path, tmp_path: Path
) -> None:
    """Real processes: two ranks need them, and the FSDP2 run's kill is a real exit, whose sharded checkpoint the next
    launch must load. One launch runs the DDP fit, the LoRA fits under DDP and FSDP2 and the FSDP2 fit killed at
    step 2, one after another in the same two ranks (`--then`); a second launch resumes the FSDP2 fit."""
    common = ["--arch", "qwen", "--devices", "2", "--max-steps", "4"]
    fsdp2 = tmp_path / "fsdp2"
    first = [*common, "--strategy", "ddp", "--no-checkpoints"]
    then = [
        (tmp_path / "lora-ddp", [*common, "--strategy", "ddp", "--no-checkpoints", "--lora"]),
        (tmp_path / "lora-fsdp2", [*common, "--strategy", "fsdp2", "--no-checkpoints", "--lora"]),
        (fsdp2, [*common, "--strategy", "fsdp2", "--kill-at-step", "2"]),
    ]
    later = [arg for out, args in then for arg in ("--then", str(mixed_cache), str(out), *args)]
    killed = harness(mixed_cache, tmp_path / "ddp", *first, *later)
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = harness(mixed_cache, fsdp2, *common, "--strategy", "fsdp2", "--ckpt", str(fsdp2 / "ckpt" / "step=2.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def sums(run: str, name: str, rank: int) -> dict[str, float]:
        return json.loads((tmp_path / run / f"rank{rank}.{name}.json").read_text())  # type: ignore[no-any-return]

    for whole, sharded, lora in (("ddp", "fsdp2", False), ("lora-ddp", "lora-fsdp2", True)):
        ranks = [records(tmp_path / whole, rank) for rank in (0, 1)]
        assert [[r["step"] for r in rank] for rank in ranks] == [[1, 2, 3, 4]] * 2, whole
        for first, second in zip(*ranks):
            assert not set(first["ids"]) & set(second["ids"]), f"{whole}: one step's batches share no sample"
            assert first["loss"] != second["loss"]
        for rank, expected in enumerate(ranks):
            got = records(tmp_path / sharded, rank)
            assert [(r["step"], r["ids"]) for r in got] == [(r["step"], r["ids"]) for r in expected], sharded
            assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5), sharded

        final, initial = sums(whole, "params", 0), sums(whole, "initial", 0)
        assert sums(whole, "params", 1) == final, f"{whole}: DDP keeps the replicas identical"
        changed = {name for name in final if final[name] != initial[name]}
        if lora:
            assert changed and all(is_adapter_name(name) for name in changed), "only the adapter trains"
        else:
            assert len(changed) > len(final) // 2, "and they trained"
        for rank in (0, 1):
            ends = sums(sharded, "params", rank)
            assert ends == pytest.approx(final, rel=1e-4, abs=1e-5), f"{sharded} ends where {whole} does"
