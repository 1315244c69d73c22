"""`DiffusersEditModule`: a diffusers edit transformer trained with flow matching on the package's batches.

Flow matching as those models were trained (rectified flow): `x_t = (1 - sigma) * x0 + sigma * noise`, the
transformer predicts the velocity `noise - x0`, and the loss is its mean squared error over the target's tokens
only (context tokens are conditioning). A batch with edit masks (`conditioning_tensors["edit_mask"]`) weights that
error per latent cell: 1 in the edited region, `mask_outside_weight` outside (`diffusers_inputs.weighted_mse`). A
batch without contexts (text-to-image rows) gives the transformer the target's tokens alone, as the text-to-image
pipelines do. `sigma` is drawn logit-normal (SD3's `logit_normal` weighting scheme,
mean 0, std 1) and then moved by the resolution-dependent exponential shift of the model's scheduler, the
same `mu` the pipelines use at inference; `timestep_sampling="uniform"` and `time_shift=False` switch either off.

Latents `[B, C, H, W]` are packed into 2x2 patches, `[B, HW/4, 4C]`; the noisy target's tokens come first,
then each context's, as in `QwenImageEditPlusPipeline` and `FluxKontextPipeline`. Noise and times of a step
are drawn from a generator seeded by (`noise_seed`, global step, batch index, rank), so a resumed run continues
the loss curve of an uninterrupted one exactly.

With `lora: true` the transformer is frozen and a peft LoRA adapter trains instead (`lora.py`): checkpoints then
hold the adapter alone, and validation measures the flow loss on a fixed grid of noise levels with noise fixed per
sample (`validation_loss.py`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule

from image_edit_data import ImageEditDataset
from image_edit_data.contract import EDIT_MASK
from image_edit_data.mixture_dataset import MixtureDataset
from image_edit_data.models.diffusers_check import (
    ExpectedInputs,
    check_cache,
    check_packing,
    model_directory,
    resolve_config,
)
from image_edit_data.models.diffusers_inputs import (
    ResolutionShift,
    TimestepSampling,
    pack_latents,
    packed_grids,
    packed_loss_weights,
    sample_sigmas,
    step_generator,
    weighted_mse,
)
from image_edit_data.models.lora import LoraDefaults, LoraSettings, add_lora, resolve_lora
from image_edit_data.models.validation_loss import DEFAULT_VAL_SIGMAS, check_val_sigmas, fixed_noise


class DiffusersEditModule(LightningModule):
    """A diffusers edit transformer trained with flow matching on our batches; subclasses fit one architecture.

    The transformer is built in `configure_model` (after `setup` has checked the cache against its config, and
    inside the strategy's init context, so FSDP can shard it). Precision is the Trainer's `precision`
    (`bf16-mixed`, `bf16-true`, ...): inputs are cast to the weights' dtype, the loss is computed in float32.

    Args:
        model_path: Local directory of the transformer (its `config.json` and weights), or of a whole pipeline
            with a `transformer/` subfolder. Loaded with `local_files_only=True`.
        model_config: A transformer config (the keys of its `config.json`) to build a randomly initialised model
            from, instead of `model_path`.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Optimizer steps of linear learning-rate warmup; 0 disables it.
        timestep_sampling: "logit_normal" (SD3's scheme) or "uniform" draws of `sigma`, before the shift.
        logit_mean: Mean of the normal whose sigmoid gives `sigma` before the shift.
        logit_std: Standard deviation of that normal.
        time_shift: Apply the scheduler's resolution-dependent shift to the drawn `sigma`.
        base_seq_len: Shift anchor: target tokens at which `mu = base_shift`; None takes the architecture's value.
        max_seq_len: Shift anchor: target tokens at which `mu = max_shift`; None takes the architecture's value.
        base_shift: `mu` at `base_seq_len`; None takes the architecture's value.
        max_shift: `mu` at `max_seq_len`; None takes the architecture's value.
        guidance_scale: Embedded guidance fed to guidance-distilled models (`guidance_embeds` in the config).
        gradient_checkpointing: Recompute each transformer block in the backward pass to save activation memory.
        noise_seed: Seed of every step's noise and times, combined with the step, batch index and rank; also of
            the random weights built from `model_config` and of the adapter's initial weights.
        lora: Train a LoRA adapter (peft) on the frozen transformer instead of every weight; checkpoints then hold
            only the adapter, which `image-edit-data export-lora` (or the `LoraExport` callback) writes for
            diffusers' `load_lora_weights`.
        lora_rank: The adapter's rank; None takes the architecture's default (16 for both).
        lora_alpha: The adapter's scale numerator (the update is scaled by `lora_alpha / lora_rank`); None: the rank.
        lora_target_modules: Names (or name suffixes, such as `attn.to_q`) of the linear layers to adapt; None takes
            the architecture's default (see `default_lora` of each module).
        lora_dropout: Dropout on the adapter's input during training.
        val_sigmas: Noise levels at which the validation loss is measured, each with the same noise per sample in
            every validation run; `val/loss` is their mean.
        mask_outside_weight: Loss weight of the latent cells outside the edited region in batches with edit masks
            (the region weighs 1). The default 0.1 keeps a small signal to reproduce the unedited part from the
            context; 0.0 trains on the region alone, 1.0 ignores the masks. Batches without masks are unweighted.
    """

    transformer_class: ClassVar[Any]
    default_shift: ClassVar[ResolutionShift]
    default_lora: ClassVar[LoraDefaults]

    def __init__(
        self,
        model_path: str | None = None,
        model_config: dict[str, Any] | None = None,
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        timestep_sampling: TimestepSampling = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        time_shift: bool = True,
        base_seq_len: int | None = None,
        max_seq_len: int | None = None,
        base_shift: float | None = None,
        max_shift: float | None = None,
        guidance_scale: float = 3.5,
        gradient_checkpointing: bool = False,
        noise_seed: int = 0,
        lora: bool = False,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        lora_target_modules: list[str] | None = None,
        lora_dropout: float = 0.0,
        val_sigmas: tuple[float, ...] = DEFAULT_VAL_SIGMAS,
        mask_outside_weight: float = 0.1,
    ) -> None:
        super().__init__()
        if (model_path is None) == (model_config is None):
            raise ValueError("set exactly one of model_path (a local model directory) and model_config (a dict)")
        if timestep_sampling not in ("logit_normal", "uniform"):
            raise ValueError(f"timestep_sampling: expected 'logit_normal' or 'uniform', got {timestep_sampling!r}")
        self.save_hyperparameters()
        self.model_path = model_path
        self.transformer_config = resolve_config(self.transformer_class, model_path, model_config)
        check_packing(self.transformer_class.__name__, self.transformer_config)
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.timestep_sampling: TimestepSampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        default = self.default_shift
        self.shift = (
            ResolutionShift(
                base_seq_len=default.base_seq_len if base_seq_len is None else base_seq_len,
                max_seq_len=default.max_seq_len if max_seq_len is None else max_seq_len,
                base_shift=default.base_shift if base_shift is None else base_shift,
                max_shift=default.max_shift if max_shift is None else max_shift,
            )
            if time_shift
            else None
        )
        self.guidance_scale = guidance_scale
        self.gradient_checkpointing = gradient_checkpointing
        self.noise_seed = noise_seed
        self.lora: LoraSettings | None = (
            resolve_lora(self.default_lora, lora_rank, lora_alpha, lora_target_modules, lora_dropout) if lora else None
        )
        self.val_sigmas = check_val_sigmas(val_sigmas)
        self.mask_outside_weight = checked_outside_weight(mask_outside_weight)
        self.transformer: Any = None

    def configure_model(self) -> None:
        """Load or build the transformer once (Lightning calls this on every rank, under the strategy's context)."""
        if self.transformer is not None:
            return
        cls = self.transformer_class
        # A LoRA checkpoint holds only the adapter, so random weights (model_config, the adapter's start) must be
        # drawn the same way in every run and on every rank.
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.noise_seed)
            if self.model_path is not None:
                path, subfolder = model_directory(self.model_path)
                self.transformer = cls.from_pretrained(path, subfolder=subfolder, local_files_only=True)
            else:
                self.transformer = cls.from_config(self.transformer_config)
            unreachable = self.unreachable_parameters()
            # Parameters that cannot reach the loss would stall DDP's gradient reduction and be missing from
            # FSDP2's optimizer checkpoints; freezing them changes nothing else (they never get a gradient).
            for parameter in unreachable:
                parameter.requires_grad_(False)
            if self.lora is not None:
                self.lora = add_lora(self.transformer, self.lora, unreachable)
        if self.gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()
        if self.device_mesh is not None:  # ModelParallelStrategy: shard here, as it expects
            shard_blocks(self.transformer, self.device_mesh)

    def unreachable_parameters(self) -> list[torch.nn.Parameter]:
        """Transformer parameters whose output the model discards, frozen when it is built; none by default."""
        return []

    def expected_inputs(self) -> ExpectedInputs:
        """What every cached sample must look like for this transformer."""
        return ExpectedInputs(
            model=self.transformer_class.__name__,
            latent_channels=self.transformer_config["in_channels"] // 4,
            latent_channels_source=f"in_channels {self.transformer_config['in_channels']} / 4, 2x2 packing",
            text_width=self.transformer_config["joint_attention_dim"],
        )

    def setup(self, stage: str) -> None:
        """Check the datamodule's caches against the transformer's config before any weights load or step runs."""
        datamodule = getattr(self.trainer, "datamodule", None)
        for name in ("train_dataset", "val_dataset"):
            dataset = getattr(datamodule, name, None)
            for cache in dataset.sources if isinstance(dataset, MixtureDataset) else [dataset]:  # each source
                if isinstance(cache, ImageEditDataset):
                    check_cache(cache, self.expected_inputs())

    @property
    def weight_dtype(self) -> torch.dtype:
        """The transformer's parameter dtype, which inputs are cast to."""
        return next(self.transformer.parameters()).dtype  # type: ignore[no-any-return]

    def flow_loss(self, batch: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
        """Velocity MSE on the target tokens at sampled noise levels; `generator` draws noise and `sigma`."""
        x0 = batch["image_latents"]
        sigmas = sample_sigmas(
            x0.shape[0],
            (x0.shape[-2] // 2) * (x0.shape[-1] // 2),
            generator,
            self.timestep_sampling,
            self.logit_mean,
            self.logit_std,
            self.shift,
        )
        noise = torch.randn(x0.shape, generator=generator, device=generator.device, dtype=torch.float32)
        return self.velocity_loss(batch, sigmas, noise)

    def velocity_loss(self, batch: dict[str, Any], sigmas: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Velocity MSE on the target tokens for noise levels `sigmas` `[B]` and `noise` shaped like the targets."""
        dtype = self.weight_dtype
        x0 = batch["image_latents"].to(self.device, torch.float32)
        contexts = [c.to(self.device, dtype) for c in batch["context_latents"]]
        grids = packed_grids(x0, contexts)
        noise = noise.to(self.device)
        s = sigmas.to(self.device)[:, None, None, None]
        noisy = pack_latents(((1 - s) * x0 + s * noise).to(dtype))
        hidden = torch.cat([noisy, *(pack_latents(c) for c in contexts)], dim=1)
        pred = self.predict(hidden, sigmas.to(self.device, dtype), batch, grids)
        return weighted_mse(pred[:, : noisy.shape[1]].float(), pack_latents(noise - x0), self.loss_weights(batch, x0))

    def loss_weights(self, batch: dict[str, Any], x0: torch.Tensor) -> torch.Tensor | None:
        """Packed per-element weights from the batch's edit masks (`packed_loss_weights`), or None without masks."""
        mask = batch.get("conditioning_tensors", {}).get(EDIT_MASK)
        if mask is None:
            return None
        return packed_loss_weights(mask.to(x0.device), x0.shape, self.mask_outside_weight)

    def predict(
        self, hidden: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any], grids: list[tuple[int, int]]
    ) -> torch.Tensor:
        """The transformer's output tokens `[B, tokens, 4C]` for packed target-then-context tokens `hidden`."""
        raise NotImplementedError(f"{type(self).__name__} must say how its transformer is called")

    def guidance(self, batch_size: int) -> torch.Tensor | None:
        """`guidance_scale` per sample for guidance-distilled transformers, else None."""
        if not self.transformer_config.get("guidance_embeds"):
            return None
        return torch.full((batch_size,), self.guidance_scale, device=self.device, dtype=torch.float32)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """One flow-matching step; logs `train/loss`."""
        generator = step_generator(self.device, self.noise_seed, self.global_step, batch_idx, self.global_rank)
        loss = self.flow_loss(batch, generator)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["image_latents"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Flow loss at every `val_sigmas` level, noise fixed per sample; logs `val/loss` and `val/loss_at_{sigma}`.

        The noise of a sample depends only on `noise_seed` and its index in the cache, not on the batch it lands
        in, so the curve compares across runs, resumes, batch sizes and numbers of ranks.
        """
        size = batch["image_latents"].shape[0]
        noise = fixed_noise(batch["image_latents"].shape[1:], batch["metadata"]["sample_indices"], self.noise_seed)
        losses = []
        for sigma in self.val_sigmas:
            loss = self.velocity_loss(batch, torch.full((size,), sigma), noise)
            self.log(f"val/loss_at_{sigma:g}", loss, sync_dist=True, batch_size=size)
            losses.append(loss)
        mean = torch.stack(losses).mean()
        self.log("val/loss", mean, prog_bar=True, sync_dist=True, batch_size=size)
        return mean

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Every weight, or in LoRA mode only the adapter's: checkpoints then hold megabytes, not the base model."""
        state = super().state_dict(*args, **kwargs)
        if self.lora is None:
            return state
        prefix = kwargs.get("prefix", "")
        trainable = {prefix + name for name, p in self.named_parameters() if p.requires_grad}
        for key in [k for k in state if k.startswith(prefix) and k not in trainable]:
            del state[key]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load weights; in LoRA mode exactly the adapter's, refusing a state of another adapter or a full model."""
        if self.lora is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        expected, given = set(self.state_dict()), set(state_dict)
        if expected != given:
            missing, unexpected = sorted(expected - given), sorted(given - expected)
            raise ValueError(
                f"{type(self).__name__}: the state does not match this LoRA adapter (rank {self.lora.rank}, "
                f"targets {list(self.lora.target_modules)}): {len(missing)} adapter weights missing {missing[:3]}, "
                f"{len(unexpected)} unexpected {unexpected[:3]}"
            )
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """In LoRA mode, record the adapter's settings, so it can be exported from the checkpoint alone."""
        from image_edit_data.models.lora_export import CHECKPOINT_KEY, model_name

        if self.lora is not None:
            checkpoint[CHECKPOINT_KEY] = {"model": model_name(self), "config": self.lora.metadata()}

    def configure_optimizers(self) -> Any:
        """AdamW over the transformer, with a linear warmup stepped per optimizer step when `warmup_steps > 0`."""
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.learning_rate, weight_decay=self.weight_decay)
        if self.warmup_steps <= 0:
            return optimizer
        warmup = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0 / self.warmup_steps, total_iters=self.warmup_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def checked_outside_weight(value: float) -> float:
    """`mask_outside_weight` as a float, refused unless finite and >= 0."""
    weight = float(value)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"mask_outside_weight: expected a finite number >= 0 (the region weighs 1), got {value!r}")
    return weight


def shard_blocks(transformer: Any, mesh: Any) -> None:
    """FSDP2 on the data-parallel mesh: one unit per transformer block (`_no_split_modules`), then the rest."""
    from torch.distributed.fsdp import fully_shard

    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"ModelParallelStrategy: tensor_parallel_size must be 1 for {type(transformer).__name__}, got "
            f"{mesh['tensor_parallel'].size()}; only data-parallel sharding (FSDP2) is applied"
        )
    data_parallel = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    blocks = set(transformer._no_split_modules)
    for module in transformer.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=data_parallel)
    fully_shard(transformer, mesh=data_parallel)
