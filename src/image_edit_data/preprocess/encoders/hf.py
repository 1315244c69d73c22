"""Encoders backed by real models from local directories: a diffusers VAE and a transformers text model.

diffusers and transformers (the `build` extra) are imported inside the constructors, so the base
package works without them. Models are opened with `local_files_only=True`: nothing is downloaded.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from PIL import Image

from .base import PromptEncoding, PromptTruncationWarning, Truncation

TorchDtype = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _float_list(config: Any, name: str) -> list[float] | None:
    value = config.get(name) if hasattr(config, "get") else getattr(config, name, None)
    return None if value is None else [float(v) for v in value]


class DiffusersVAEEncoder:
    """A diffusers VAE (`AutoencoderKL` family, or Qwen-Image's `AutoencoderKLQwenImage`).

    Latents are normalised the way diffusion pipelines expect them. With per-channel `latents_mean`
    and `latents_std` in the VAE config (Qwen-Image, SDXL-style): `(z - mean) / std * scaling_factor`
    (`scaling_factor` taken as 1 when absent); otherwise `(z - shift_factor) * scaling_factor` with
    `shift_factor` 0 when absent or null (SD 1.x/2.x: scaling only; SD3/Flux: shift and scale).
    Qwen-Image/Wan VAEs work on video tensors; images are passed as one-frame clips.
    """

    def __init__(
        self,
        path: str,
        subfolder: str | None = None,
        sampling: Literal["mode", "sample"] = "mode",
        seed: int = 0,
        torch_dtype: TorchDtype = "float32",
        device: str = "cpu",
        spatial_factor: int | None = None,
    ) -> None:
        """
        Args:
            path: Local directory of the VAE (or of a pipeline, with `subfolder="vae"`).
            subfolder: Subdirectory of `path` holding the VAE's config.json and weights.
            sampling: `mode` (deterministic) takes the latent distribution's mean; `sample` draws from it,
                seeded once per process, so its draws depend on batching and are not reproduced on resume.
            seed: Seed of the `sample` draws.
            torch_dtype: Dtype the VAE runs in; latents are normalised and returned in float32.
            device: Where the VAE runs, e.g. `cuda` (under torchrun the build selects the local GPU).
            spatial_factor: Pixels per latent cell; read from the VAE config when not given.
        """
        from diffusers import AutoModel

        self.device = torch.device(device)
        self.dtype = DTYPES[torch_dtype]
        self.sampling = sampling
        self.vae = AutoModel.from_pretrained(path, subfolder=subfolder, torch_dtype=self.dtype, local_files_only=True)
        self.vae.to(self.device).eval().requires_grad_(False)
        config = self.vae.config
        # Video VAEs (Qwen-Image, Wan) declare a temporal downsampling list and take [B, C, T, H, W].
        self.video = config.get("temperal_downsample") is not None
        if spatial_factor is None:
            if self.video:
                spatial_factor = 2 ** len(config["temperal_downsample"])
            else:
                spatial_factor = 2 ** (len(config["block_out_channels"]) - 1)
        self.spatial_factor = spatial_factor
        mean, std = _float_list(config, "latents_mean"), _float_list(config, "latents_std")
        scaling = float(config.get("scaling_factor") or 1.0)
        if mean is not None and std is not None:
            self.offset = torch.tensor(mean).view(1, -1, 1, 1)
            self.scale = scaling / torch.tensor(std).view(1, -1, 1, 1)
        else:
            self.offset = torch.tensor(float(config.get("shift_factor") or 0.0))
            self.scale = torch.tensor(scaling)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images `[B, 3, H, W]` in `[-1, 1]` -> normalised float32 latents `[B, C, H / f, W / f]` on the CPU."""
        pixels = images.to(self.device, self.dtype)
        if self.video:
            pixels = pixels.unsqueeze(2)
        distribution = self.vae.encode(pixels).latent_dist
        latents = distribution.mode() if self.sampling == "mode" else distribution.sample(generator=self.generator)
        if self.video:
            latents = latents.squeeze(2)
        return (latents.float().cpu() - self.offset) * self.scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents `[B, C, h, w]` -> float32 images `[B, 3, h * f, w * f]` in `[-1, 1]`."""
        raw = latents.float().cpu() / self.scale + self.offset
        raw = raw.to(self.device, self.dtype)
        if self.video:
            raw = raw.unsqueeze(2)
        images = self.vae.decode(raw).sample
        if self.video:
            images = images.squeeze(2)
        return images.float().clamp(-1.0, 1.0).cpu()


class TransformersTextEncoder:
    """A transformers model's hidden states for each prompt, keeping only the real tokens by default.

    Each prompt gives `[S_i, D]` embeddings with an all-ones mask `[S_i]`, S_i = its token count
    (at most `max_sequence_length`); collate pads a batch later. With `pad_to_max_length` every
    prompt is padded to `max_sequence_length` instead, with zeros in the embeddings and the mask.
    A longer prompt is cut and the cut reported: `encode_prompts` (what a build calls) returns it
    in `PromptEncoding.truncations`, and `encode` warns with a `PromptTruncationWarning`.
    """

    def __init__(
        self,
        path: str,
        subfolder: str | None = None,
        tokenizer_subfolder: str | None = None,
        model_class: str = "AutoModel",
        max_sequence_length: int = 512,
        pad_to_max_length: bool = False,
        hidden_state_index: int = -1,
        torch_dtype: TorchDtype = "float32",
        device: str = "cpu",
    ) -> None:
        """
        Args:
            path: Local directory with the tokenizer and model (or a pipeline, with subfolders).
            subfolder: Subdirectory of `path` holding the model.
            tokenizer_subfolder: Subdirectory of `path` holding the tokenizer (defaults to `subfolder`).
            model_class: transformers class that loads the model, e.g. `T5EncoderModel` or `CLIPTextModel`.
            max_sequence_length: Tokens kept per prompt, special tokens included; longer prompts are cut there,
                and each cut is reported (a build warns and records it per sample).
            pad_to_max_length: Store every prompt at `max_sequence_length` tokens, padded with a zero mask.
            hidden_state_index: Which hidden state to keep; -1 is the last hidden state.
            torch_dtype: Dtype the model runs in; embeddings are returned in float32.
            device: Where the model runs.
        """
        import transformers
        from packaging.version import Version

        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length: expected at least 1, got {max_sequence_length}")
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.pad_to_max_length = pad_to_max_length
        self.hidden_state_index = hidden_state_index
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(
            path, subfolder=tokenizer_subfolder or subfolder or "", local_files_only=True
        )
        if self.tokenizer.pad_token is None:  # decoder-only tokenizers (GPT-2, Qwen) may have none
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        loader = getattr(transformers, model_class)
        kwargs = {dtype_key: DTYPES[torch_dtype], "subfolder": subfolder or "", "local_files_only": True}
        self.model = loader.from_pretrained(path, **kwargs)
        self.model.to(self.device).eval().requires_grad_(False)
        self.name = type(self.model).__name__  # names the encoder in truncation records

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per prompt, float32 embeddings `[S, D]` and an int64 mask `[S]`; warns for each prompt it cuts."""
        results = self.encode_prompts(prompts, [() for _ in prompts])
        for prompt, result in zip(prompts, results):
            for cut in result.truncations:
                warnings.warn(PromptTruncationWarning(f"prompt {prompt[:80]!r}: {cut.describe()}"), stacklevel=2)
        return [(result.embeddings, result.mask) for result in results]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        """Per prompt, a `PromptEncoding` with the cut, if any (condition images are not used)."""
        lengths = [len(ids) for ids in self.tokenizer(prompts, truncation=False)["input_ids"]]
        tokens = self.tokenizer(
            prompts,
            padding="max_length" if self.pad_to_max_length else True,
            truncation=True,
            max_length=self.max_sequence_length,
            return_tensors="pt",
        )
        ids = tokens["input_ids"].to(self.device)
        mask = tokens["attention_mask"].to(self.device)
        wants_states = self.hidden_state_index != -1
        output = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=wants_states)
        states = output.hidden_states[self.hidden_state_index] if wants_states else output.last_hidden_state
        states, mask = states.float().cpu(), mask.cpu().to(torch.int64)
        results = []
        for row, length in enumerate(lengths):
            cap = self.max_sequence_length
            cuts = (Truncation(self.name, length, cap, f"max_sequence_length {cap}"),) if length > cap else ()
            if self.pad_to_max_length:
                results.append(PromptEncoding(states[row] * mask[row, :, None], mask[row], truncations=cuts))
            else:
                real = mask[row].bool()
                kept = torch.ones(int(real.sum()), dtype=torch.int64)
                results.append(PromptEncoding(states[row][real].contiguous(), kept, truncations=cuts))
        return results
