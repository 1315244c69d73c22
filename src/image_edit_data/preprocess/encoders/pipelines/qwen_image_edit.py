"""Qwen-Image-Edit (2509/2511 `QwenImageEditPlusPipeline`, original `QwenImageEditPipeline`) through its pipeline.

Prompt embeddings come from Qwen2.5-VL looking at the sample's condition images, via the pipeline's
`encode_prompt(prompt, image=...)`, after the resize the pipeline applies to them before that call:
the aspect ratio kept at a fixed pixel area (384 x 384 for the Plus pipeline, which takes several
images; 1024 x 1024 for the original, which takes exactly one), each side rounded to a multiple of 32.
Neither pipeline truncates that sequence (its `max_sequence_length` argument is only checked, never
applied), so by default neither does the cache: the first release's one condition, given to Qwen2.5-VL
at about 1024 x 1024, is over 1,300 vision tokens, and they come before the instruction's.

A prompt without condition images (a text-to-image row) is encoded as Qwen-Image's text-to-image
pipeline (`QwenImagePipeline`) encodes it: its own system template, the text tokenizer only. That
pipeline does cut the sequence, at its `__call__`'s `max_sequence_length` (512 by default, at most
1024), so such a prompt is cut there too (or at a smaller cap you set), and each cut is reported.
Latents are the VAE's latent mode, normalised per channel as `(z - latents_mean) / latents_std`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from PIL import Image

from ..base import PromptEncoding, Truncation
from ..hf import TorchDtype
from ..pipeline import DiffusersPipelineEncoder

CONDITION_AREA = {"QwenImageEditPlusPipeline": 384 * 384, "QwenImageEditPipeline": 1024 * 1024}
CONDITION_STEP = 32
# How QwenImageEditPlusPipeline introduces each condition image before the instruction (its _get_qwen_prompt_embeds).
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
TEXT_TO_IMAGE = "QwenImagePipeline"
TEXT_TO_IMAGE_LENGTH = 512  # QwenImagePipeline.__call__'s default max_sequence_length, which it applies
TEXT_TO_IMAGE_MAX_LENGTH = 1024  # the longest max_sequence_length QwenImagePipeline.__call__ accepts


def condition_size(width: int, height: int, area: int) -> tuple[int, int]:
    """(width, height) of a condition image: its aspect ratio at `area` pixels, sides rounded to multiples of 32."""
    ratio = width / height
    scaled_width = math.sqrt(area * ratio)
    scaled_height = scaled_width / ratio
    return (
        max(CONDITION_STEP, round(scaled_width / CONDITION_STEP) * CONDITION_STEP),
        max(CONDITION_STEP, round(scaled_height / CONDITION_STEP) * CONDITION_STEP),
    )


class QwenImageEditEncoder(DiffusersPipelineEncoder):
    """Qwen-Image-Edit latents and Qwen2.5-VL prompt embeddings conditioned on the sample's condition images.

    Each prompt gives `[S, D]` embeddings (the S real tokens the pipeline gives its transformer: vision
    tokens, then the instruction, after it drops its system template) and an all-ones int64 mask `[S]`.
    A `max_sequence_length` cap keeps only the first tokens of a longer prompt and reports the cut
    (`PromptEncoding.truncations`; the build warns and records it). A batch of prompts is encoded in one
    Qwen2.5-VL call, each prompt with its own images (`encode_with_images`). No conditioning tensors are returned.
    A prompt without images goes through `QwenImagePipeline.encode_prompt` (see the module docstring).
    """

    pipeline_classes: ClassVar[tuple[str, ...]] = tuple(CONDITION_AREA)
    components: ClassVar[tuple[str, ...]] = ("vae", "text_encoder", "tokenizer", "processor")

    def __init__(
        self,
        path: str,
        torch_dtype: TorchDtype = "bfloat16",
        device: str = "cpu",
        max_sequence_length: int | None = None,
    ) -> None:
        """
        Args:
            path: Local Qwen-Image-Edit pipeline directory (e.g. a download of Qwen/Qwen-Image-Edit-2511).
            torch_dtype: Dtype the VAE and Qwen2.5-VL run in; results are returned in float32.
            device: Where the models run, e.g. `cuda` (under torchrun the build selects the local GPU).
            max_sequence_length: None (the default) keeps every token, as the pipeline does; a number cuts longer
                prompts there, with a warning and a record per cut sample (NeMo's preprocessor cuts at 512).
        """
        super().__init__(path, torch_dtype, device, max_sequence_length)
        self.condition_area = CONDITION_AREA[type(self.pipeline).__name__]
        self.single_condition = type(self.pipeline).__name__ == "QwenImageEditPipeline"
        self._text_to_image: Any = None  # QwenImagePipeline on the same text encoder, made on first use
        vae_config = self.pipeline.vae.config
        self.latents_mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(vae_config.latents_std).view(1, -1, 1, 1, 1)

    def check_environment(self, index: dict[str, Any]) -> None:
        """Without torchvision, transformers fails obscurely to load Qwen2VLProcessor (its video processor)."""
        from transformers.utils import is_torchvision_available

        if index.get("processor") == ["transformers", "Qwen2VLProcessor"] and not is_torchvision_available():
            raise ImportError(
                f"{self.path / 'processor'}: transformers needs torchvision to load Qwen2VLProcessor "
                f"(its video processor); install the torchvision build that matches your torch"
            )

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """`(mode - latents_mean) / latents_std` in the VAE dtype, like the pipeline; images go in as 1-frame clips."""
        latents = self.pipeline.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
        mean = self.latents_mean.to(latents.device, latents.dtype)
        std = self.latents_std.to(latents.device, latents.dtype)
        return ((latents - mean) / std).squeeze(2)

    def resize_condition(self, image: Image.Image) -> Image.Image:
        """The condition image at the size the pipeline gives it, resized by the pipeline's image processor."""
        width, height = condition_size(image.width, image.height, self.condition_area)
        resized: Image.Image = self.pipeline.image_processor.resize(image, height, width)
        return resized

    def encode_batch(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        """The prompts with images in one Qwen2.5-VL call, those without in one more; a cap cuts, and reports it."""
        for prompt, images in zip(prompts, conditions):
            if images and self.single_condition and len(images) != 1:
                raise ValueError(
                    f"{self.path}: QwenImageEditPipeline looks at exactly one condition image, got {len(images)} "
                    f"for prompt {prompt!r} (QwenImageEditPlusPipeline takes several)"
                )
        results: list[PromptEncoding | None] = [None] * len(prompts)
        looking = [i for i, images in enumerate(conditions) if images]
        blind = [i for i, images in enumerate(conditions) if not images]
        if looking:
            resized = [[self.resize_condition(image) for image in conditions[i]] for i in looking]
            for i, embeddings in zip(looking, self.encode_with_images([prompts[i] for i in looking], resized)):
                results[i] = self.capped(embeddings)
        if blind:
            for i, encoding in zip(blind, self.encode_text_only([prompts[i] for i in blind])):
                results[i] = encoding
        return [r for r in results if r is not None]

    def capped(self, embeddings: torch.Tensor) -> PromptEncoding:
        """One prompt's `[S, D]` embeddings with an all-ones mask, cut at `max_sequence_length` (reported) if set."""
        length = embeddings.shape[0]
        cap = self.max_sequence_length
        if cap is None or length <= cap:
            return PromptEncoding(embeddings, torch.ones(length, dtype=torch.int64))
        cut = Truncation("Qwen2.5-VL", length, cap, f"max_sequence_length {cap}")
        return PromptEncoding(embeddings[:cap], torch.ones(cap, dtype=torch.int64), truncations=(cut,))

    def encode_with_images(self, prompts: list[str], images: list[list[Image.Image]]) -> list[torch.Tensor]:
        """Each prompt's `[S, D]` embeddings (every token the pipeline keeps) with its resized condition images.

        One prompt goes through the pipeline's `encode_prompt`. Several go through one Qwen2.5-VL call built as
        `encode_prompt` builds its single-sample call, each text with its own pictures, padded to the longest
        (`encode_prompt` itself gives every prompt of a batch the same images); each prompt then keeps the
        real tokens after the template, as `encode_prompt` does, equal to one at a time within the batched
        call's rounding (docs/building-caches.md, "Batched prompts").
        """
        pipeline = self.pipeline
        if len(prompts) == 1:
            # max_sequence_length is not passed: encode_prompt ignores it, and its __call__ only checks it.
            embeddings, mask = pipeline.encode_prompt(
                prompt=prompts,
                image=images[0][0] if self.single_condition else images[0],
                device=self.device,
                num_images_per_prompt=1,
            )
            # The pipeline returns no mask when every position is a real token.
            return [embeddings[0] if mask is None else embeddings[0, : int(mask[0].sum())]]
        template = pipeline.prompt_template_encode
        if self.single_condition:  # the template holds the one picture's placeholder
            texts = [template.format(prompt) for prompt in prompts]
        else:
            texts = [
                template.format("".join(PICTURE.format(k + 1) for k in range(len(pictures))) + prompt)
                for prompt, pictures in zip(prompts, images)
            ]
        flat = [picture for pictures in images for picture in pictures]
        inputs = pipeline.processor(text=texts, images=flat, padding=True, return_tensors="pt").to(self.device)
        hidden = pipeline.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        ).hidden_states[-1]
        real = inputs["attention_mask"].bool()
        start = pipeline.prompt_template_encode_start_idx
        return [hidden[i][real[i]][start:] for i in range(len(prompts))]

    def text_to_image_pipeline(self) -> Any:
        """Qwen-Image's text-to-image pipeline sharing this pipeline's text encoder and tokenizer (nothing loaded)."""
        if self._text_to_image is None:
            import diffusers

            pipeline_class = getattr(diffusers, TEXT_TO_IMAGE, None)
            if pipeline_class is None:
                raise ValueError(
                    f"{self.path}: a prompt without condition images is encoded as {TEXT_TO_IMAGE} does, and "
                    f"diffusers {diffusers.__version__} has no {TEXT_TO_IMAGE}; upgrade it (pip install -U diffusers)"
                )
            self._text_to_image = pipeline_class(
                scheduler=None,
                vae=None,
                text_encoder=self.pipeline.text_encoder,
                tokenizer=self.pipeline.tokenizer,
                transformer=None,
            )
        return self._text_to_image

    def encode_text_only(self, prompts: list[str]) -> list[PromptEncoding]:
        """Prompts without images, in one `QwenImagePipeline.encode_prompt` call, cut where its `__call__` cuts."""
        pipeline = self.text_to_image_pipeline()
        if self.max_sequence_length is None:
            cap, cause = TEXT_TO_IMAGE_LENGTH, f"{TEXT_TO_IMAGE}'s default max_sequence_length {TEXT_TO_IMAGE_LENGTH}"
        else:
            cap = min(self.max_sequence_length, TEXT_TO_IMAGE_MAX_LENGTH)
            cause = f"max_sequence_length {cap}"
        embeddings, mask = pipeline.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, max_sequence_length=cap
        )
        results = []
        for i, prompt in enumerate(prompts):
            kept = embeddings.shape[1] if mask is None else int(mask[i].sum())
            # The template's tokens before the prompt are dropped, as encode_prompt drops them.
            template = pipeline.prompt_template_encode.format(prompt)
            tokens = len(pipeline.tokenizer(template)["input_ids"]) - pipeline.prompt_template_encode_start_idx
            cuts = (Truncation("Qwen2.5-VL", tokens, kept, cause),) if tokens > kept else ()
            results.append(PromptEncoding(embeddings[i, :kept], torch.ones(kept, dtype=torch.int64), truncations=cuts))
        return results
