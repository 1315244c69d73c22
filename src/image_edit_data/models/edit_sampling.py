"""Edit a cached sample with the model being trained, denoising exactly as the diffusers pipeline does.

The same steps as `QwenImageEditPlusPipeline.__call__` and `FluxKontextPipeline.__call__` with precomputed inputs
and no negative prompt (so no true CFG): noise from `randn_tensor` with the caller's generator, the scheduler's
sigmas `linspace(1, 1/n, n)` shifted by `mu` from its config and the target's token count, the transformer given
`t / 1000`, the context tokens appended after the noisy target's and its outputs cut to the target's tokens, the
scheduler's Euler step. The prompt embeddings and context latents come from the cache instead of the encoders,
so for the same inputs and seed the final latents equal the pipeline's (`output_type="latent"`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from image_edit_data.models.diffusers_inputs import pack_latents, packed_grids


def pipeline_mu(scheduler_config: Mapping[str, Any], image_tokens: int) -> float:
    """The pipelines' `calculate_shift`: `mu` linear in the target's token count, with their defaults and order."""
    base_seq_len = scheduler_config.get("base_image_seq_len", 256)
    max_seq_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    # The same operations in the same order as the pipelines, so the sigmas match them bit for bit.
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return float(image_tokens * slope + intercept)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`[B, (H/2) * (W/2), 4C]` -> `[B, C, H, W]`: the inverse of `pack_latents`."""
    batch, _, channels = tokens.shape
    patches = tokens.reshape(batch, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(batch, channels // 4, height, width)


def prompt_batch(sample: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """One cached sample's prompt as a batch of one for `DiffusersEditModule.predict`.

    The mask is None when every token is real, as the pipelines pass it (Qwen's `encode_prompt` drops an
    all-ones mask).
    """
    mask = sample["prompt_attention_mask"]
    conditioning = {name: tensor[None].to(device) for name, tensor in sample["conditioning_tensors"].items()}
    return {
        "text_embeddings": sample["prompt_embeddings"][None].to(device),
        "text_attention_mask": None if bool(mask.bool().all()) else mask[None].to(device),
        "conditioning_tensors": conditioning,
    }


@torch.no_grad()
def generate_edit(
    module: Any, sample: Mapping[str, Any], scheduler: Any, generator: torch.Generator, num_inference_steps: int
) -> torch.Tensor:
    """The edited target's latents `[1, tokens, 4C]` (packed, as the pipelines return them) for one cached sample.

    The target latent's shape sets the output size; its values are not used. `module` is a
    `DiffusersEditModule` with its transformer built; its weight dtype is the pipeline's `prompt_embeds.dtype`.
    """
    from diffusers.utils.torch_utils import randn_tensor

    device, dtype = module.device, module.weight_dtype
    channels, height, width = (int(n) for n in sample["target_latent"].shape)
    contexts = [c[None].to(device, dtype) for c in sample["context_latents"]]
    grids = packed_grids(sample["target_latent"][None], contexts)
    noise = randn_tensor((1, channels, height, width), generator=generator, device=device, dtype=dtype)
    latents = pack_latents(noise)
    context_tokens = [pack_latents(c) for c in contexts]
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    mu = pipeline_mu(scheduler.config, latents.shape[1])
    scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    scheduler.set_begin_index(0)
    batch = prompt_batch(sample, device)
    for t in scheduler.timesteps:
        hidden = torch.cat([latents, *context_tokens], dim=1)
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        velocity = module.predict(hidden, timestep / 1000, batch, grids)[:, : latents.shape[1]]
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    return latents


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents `[1, C, H, W]` -> an image `[3, H * f, W * f]` in [0, 1], undoing the cache's normalisation.

    Qwen-Image's VAE (per-channel `latents_mean`/`latents_std`, a frame axis) and FLUX.1's (`scaling_factor`,
    `shift_factor`), as each pipeline decodes.
    """
    config = vae.config
    z = latents.to(vae.device, vae.dtype)
    if getattr(config, "latents_mean", None) is not None:
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        image = vae.decode(z[:, :, None] / inverse_std + mean, return_dict=False)[0][:, :, 0]
    else:
        image = vae.decode(z / config.scaling_factor + (config.shift_factor or 0.0), return_dict=False)[0]
    return (image[0].float() / 2 + 0.5).clamp(0, 1).cpu()
