"""Tiny edit pipelines with a transformer, and modules that fit them, for the LoRA, export and validation tests.

The pipelines are `_pipeline_helpers`' (random weights, tokenizers made here, nothing downloaded) with a one-block
transformer saved in `transformer/` and the released scheduler configs, so `from_pretrained(path)` gives a
complete pipeline and the modules train exactly the transformer the pipeline runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from image_edit_data.models.diffusers_edit import DiffusersEditModule, FluxKontextModule, QwenImageEditModule
from support.pipelines import CLIP_HIDDEN, QWEN_HIDDEN, T5_HIDDEN, flux_kontext_pipeline, qwen_image_edit_pipeline

LATENT_CHANNELS = 4  # the tiny VAEs' latent channels; the transformers take 2x2 patches of them
# The transformers the tiny pipelines run: one block; Qwen's four heads of 16 are the narrowest that overfit one
# sample well in the closed-loop test.
QWEN_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 4 * LATENT_CHANNELS,
    "out_channels": LATENT_CHANNELS,
    "num_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": QWEN_HIDDEN,
    "axes_dims_rope": [4, 6, 6],
}
KONTEXT_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 4 * LATENT_CHANNELS,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": T5_HIDDEN,
    "pooled_projection_dim": CLIP_HIDDEN,
    "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}
# The released scheduler_config.json values (Qwen-Image-Edit-2509, FLUX.1-Kontext-dev): dynamic exponential shift.
QWEN_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
KONTEXT_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "use_dynamic_shifting": True,
}
ARCHS: dict[str, tuple[type[DiffusersEditModule], dict[str, Any], dict[str, Any]]] = {
    "qwen": (QwenImageEditModule, QWEN_TRANSFORMER, QWEN_SCHEDULER),
    "kontext": (FluxKontextModule, KONTEXT_TRANSFORMER, KONTEXT_SCHEDULER),
}


def pipeline_module(arch: str, **kwargs: Any) -> DiffusersEditModule:
    """A module whose transformer fits the tiny pipeline of `arch` (random weights unless `model_path` is given)."""
    cls, config, _ = ARCHS[arch]
    if "model_path" not in kwargs:
        kwargs["model_config"] = config
    return cls(**kwargs)


def complete_pipeline(arch: str, path: Path) -> Path:
    """Save the tiny pipeline of `arch` with a random transformer (seed 0) and the released scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, QwenImageEditPlusPipeline

    if arch == "qwen":
        qwen_image_edit_pipeline(path)
        pipeline_class: Any = QwenImageEditPlusPipeline
    else:
        flux_kontext_pipeline(path)
        pipeline_class = FluxKontextPipeline
    module = pipeline_module(arch)
    module.configure_model()
    pipeline = pipeline_class.from_pretrained(path, transformer=module.transformer, local_files_only=True)
    pipeline.register_modules(scheduler=FlowMatchEulerDiscreteScheduler(**ARCHS[arch][2]))
    pipeline.save_pretrained(path)
    return path


def load_pipeline(arch: str, path: Path) -> Any:
    """The saved pipeline of `arch`, float32 on the CPU."""
    from diffusers import FluxKontextPipeline, QwenImageEditPlusPipeline

    pipeline_class: Any = QwenImageEditPlusPipeline if arch == "qwen" else FluxKontextPipeline
    pipeline = pipeline_class.from_pretrained(path, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def randomize_adapter(module: DiffusersEditModule, seed: int = 0, scale: float = 0.5) -> None:
    """Give every adapter weight random values, so the adapter changes the output (lora_B starts at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))


def random_cache(
    root: Path, arch: str, samples: int = 4, contexts: int = 1, side: int = 4, channels: int = LATENT_CHANNELS
) -> Path:
    """Random samples in the shapes the tiny pipeline of `arch` encodes (`side`x`side` latents, prompts, pooled)."""
    from support.caches import make_payload, write_cache

    text = QWEN_HIDDEN if arch == "qwen" else T5_HIDDEN
    shape = (channels, side, side)
    payloads = []
    for i in range(samples):
        g = torch.Generator().manual_seed(i)
        conditioning = {} if arch == "qwen" else {"pooled_prompt_embeds": torch.randn(CLIP_HIDDEN, generator=g)}
        payload = make_payload(i, shape, [shape] * contexts, sequence=3 + i % 3, hidden=text, conditioning=conditioning)
        payload["target_latent"] = torch.randn(shape, generator=g)
        payload["context_latents"] = [torch.randn(shape, generator=g) for _ in range(contexts)]
        payloads.append(payload)
    return write_cache(root, payloads)
