"""FLUX.1 Kontext (`FluxKontextPipeline`) through its pipeline: T5 sequence embeddings and the pooled CLIP vector.

The pooled CLIP embedding is stored as the conditioning tensor `pooled_prompt_embeds` `[D_clip]`: the
name under which the pipeline's `encode_prompt` returns it and its `__call__` accepts it, so code written
against the pipeline reads it from the batch's `conditioning_tensors["pooled_prompt_embeds"]` as
`[B, D_clip]`, which is what the transformer's `pooled_projections` takes.
Latents are the VAE's latent mode as `(z - shift_factor) * scaling_factor`, as the pipeline does.

The pipeline itself cuts long prompts: T5 at `max_sequence_length` tokens (at most 512, which its
`__call__` enforces) and CLIP at its tokenizer's limit (77 tokens). The cache holds what the pipeline
gives its transformer, so it is cut the same way, and each cut is reported in `PromptEncoding.truncations`
(the build warns and records it per sample).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from PIL import Image

from ..base import PromptEncoding, Truncation
from ..hf import TorchDtype
from ..pipeline import DiffusersPipelineEncoder

POOLED_NAME = "pooled_prompt_embeds"
MAX_T5_TOKENS = 512  # FluxKontextPipeline.__call__ refuses a longer max_sequence_length


class FluxKontextEncoder(DiffusersPipelineEncoder):
    """FLUX.1 Kontext latents, T5 prompt embeddings and the pooled CLIP embedding.

    T5 pads every prompt to `max_sequence_length` tokens and the Kontext transformer attends to all of
    them (it takes no text mask), so the stored mask is all ones `[max_sequence_length]` and each
    sample's text token count is `max_sequence_length`. Condition images are not used: Kontext sees its
    input image only through the VAE context latents.
    """

    pipeline_classes: ClassVar[tuple[str, ...]] = ("FluxKontextPipeline",)
    components: ClassVar[tuple[str, ...]] = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def __init__(
        self,
        path: str,
        torch_dtype: TorchDtype = "bfloat16",
        device: str = "cpu",
        max_sequence_length: int = 512,
    ) -> None:
        """
        Args:
            path: Local FLUX.1 Kontext pipeline directory (e.g. a download of black-forest-labs/FLUX.1-Kontext-dev).
            torch_dtype: Dtype the VAE, CLIP and T5 run in; results are returned in float32.
            device: Where the models run, e.g. `cuda` (under torchrun the build selects the local GPU).
            max_sequence_length: T5 tokens per prompt, padding included: 1 to 512 (the pipeline's default and
                its maximum). The pipeline cuts longer prompts there; so does the cache, reporting each cut.
        """
        if not 1 <= max_sequence_length <= MAX_T5_TOKENS:
            raise ValueError(
                f"max_sequence_length: FluxKontextPipeline takes 1 to {MAX_T5_TOKENS} T5 tokens, "
                f"got {max_sequence_length}"
            )
        super().__init__(path, torch_dtype, device, max_sequence_length)
        self.t5_tokens = max_sequence_length
        vae_config = self.pipeline.vae.config
        self.shift = float(vae_config.shift_factor or 0.0)
        self.scale = float(vae_config.scaling_factor)

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """`(mode - shift_factor) * scaling_factor`, in the VAE dtype like the pipeline."""
        latents = self.pipeline.vae.encode(pixels).latent_dist.mode()
        return (latents - self.shift) * self.scale

    def encode_batch(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        """The batch through `encode_prompt` (CLIP and T5 both see each prompt), with the cuts it makes."""
        embeddings, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.t5_tokens,
        )
        mask = torch.ones(embeddings.shape[1], dtype=torch.int64)
        cuts = self.truncations(prompts)
        return [PromptEncoding(embeddings[i], mask, {POOLED_NAME: pooled[i]}, cuts[i]) for i in range(len(prompts))]

    def truncations(self, prompts: list[str]) -> list[tuple[Truncation, ...]]:
        """Per prompt, the tokens T5 and CLIP lose to the limits `encode_prompt` tokenizes them with."""
        limits = (
            ("T5", self.pipeline.tokenizer_2, self.t5_tokens, "the pipeline's max_sequence_length"),
            ("CLIP", self.pipeline.tokenizer, self.pipeline.tokenizer_max_length, "CLIP's tokenizer limit"),
        )
        cuts: list[list[Truncation]] = [[] for _ in prompts]
        for name, tokenizer, limit, cause in limits:
            # Special tokens included, as the pipeline counts them when it compares against the limit.
            for i, ids in enumerate(tokenizer(prompts, truncation=False)["input_ids"]):
                if len(ids) > limit:
                    cuts[i].append(Truncation(name, len(ids), limit, f"{cause} {limit}"))
        return [tuple(c) for c in cuts]
