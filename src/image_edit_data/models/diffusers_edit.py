"""Train diffusers' Qwen-Image(-Edit) and FLUX.1 Kontext transformers on the package's batches.

How a batch becomes each model's inputs is here; the flow-matching loss, timestep sampling, cache checks and
Lightning hooks they share are in `DiffusersEditModule` (`diffusers_module.py`).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel
from lightning.pytorch.utilities import rank_zero_warn

from image_edit_data.models.diffusers_check import ExpectedInputs
from image_edit_data.models.diffusers_inputs import ResolutionShift, kontext_image_ids, qwen_img_shapes
from image_edit_data.models.diffusers_module import DiffusersEditModule
from image_edit_data.models.lora import LoraDefaults

__all__ = ["POOLED", "DiffusersEditModule", "FluxKontextModule", "QwenImageEditModule"]

POOLED = "pooled_prompt_embeds"  # conditioning tensor holding Flux's pooled CLIP embedding, `[pooled_projection_dim]`


class QwenImageEditModule(DiffusersEditModule):
    """`QwenImageTransformer2DModel` (Qwen-Image-Edit, -2509 and later) on a cache of Qwen2.5-VL prompt embeddings.

    Inputs: packed tokens, `img_shapes` `(1, H/2, W/2)` per image from the batch's compound signature, the prompt
    embeddings with their mask (`encoder_hidden_states(_mask)`, plus `txt_seq_lens` on diffusers versions that
    take it). Conditioning tensors such as `image_grid_thw` are not used by the transformer.
    """

    transformer_class = QwenImageTransformer2DModel
    # The released Qwen-Image scheduler_config.json (its shift_terminal only stretches inference schedules).
    default_shift = ResolutionShift(base_seq_len=256, max_seq_len=8192, base_shift=0.5, max_shift=0.9)
    # Every linear layer of every block, as ai-toolkit's and musubi-tuner's Qwen-Image(-Edit) LoRAs (rank 16).
    default_lora = LoraDefaults(
        rank=16,
        target_modules=(
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
            "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
            "img_mod.1", "txt_mod.1",
        ),
        source="ai-toolkit and musubi-tuner: every linear layer of the transformer blocks, rank 16",
    )  # fmt: skip

    def unreachable_parameters(self) -> list[torch.nn.Parameter]:
        """The last block's text-stream layers: the transformer drops the text tokens after that block.

        Its text queries (`add_q_proj`, `norm_added_q`) reach only those tokens' attention outputs, so they get a
        zero gradient and never train; the text keys and values reach the image tokens and stay trainable.
        """
        last = self.transformer.transformer_blocks[-1]
        queries = [last.attn.add_q_proj, *([last.attn.norm_added_q] if last.attn.norm_added_q is not None else [])]
        layers = [*queries, last.attn.to_add_out, last.txt_mlp]
        return [parameter for layer in layers for parameter in layer.parameters()]

    def predict(
        self, hidden: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any], grids: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Call the Qwen-Image transformer on one batch."""
        text = batch["text_embeddings"].to(self.device, hidden.dtype)
        # None when every prompt token is real: the pipeline then passes no mask either.
        mask = batch["text_attention_mask"]
        mask = None if mask is None else mask.to(self.device)
        inputs: dict[str, Any] = {
            "hidden_states": hidden,
            "encoder_hidden_states": text,
            "encoder_hidden_states_mask": mask,
            "timestep": sigmas,
            "img_shapes": qwen_img_shapes(grids, hidden.shape[0]),
            "guidance": self.guidance(hidden.shape[0]),
            "return_dict": False,
        }
        if takes_txt_seq_lens(self.transformer):
            inputs["txt_seq_lens"] = [text.shape[1]] * text.shape[0] if mask is None else mask.sum(dim=1).tolist()
        return self.transformer(**inputs)[0]  # type: ignore[no-any-return]

    def configure_model(self) -> None:
        """Build the transformer, and warn once if this diffusers version ignores the prompt mask."""
        super().configure_model()
        if takes_txt_seq_lens(self.transformer):
            rank_zero_warn(
                "this diffusers version's QwenImageTransformer2DModel still takes txt_seq_lens and ignores "
                "encoder_hidden_states_mask (diffusers issue #12294, fixed by PR #12702): padded prompt tokens "
                "take part in attention. Upgrade diffusers to mask them."
            )


class FluxKontextModule(DiffusersEditModule):
    """`FluxTransformer2DModel` as FLUX.1 Kontext: T5 prompt embeddings, pooled CLIP, position ids per image.

    The cache carries the pooled CLIP embedding as the conditioning tensor `pooled_prompt_embeds`
    (`[pooled_projection_dim]` per sample). `txt_ids` are zeros; `img_ids` are `(image, row, col)` with image 0
    the noisy target and `k + 1` context k, as Kontext marks its context image with 1.

    Args:
        mask_text_padding: Pass the prompt mask as an attention mask. FLUX.1 was trained attending to T5's
            padding embeddings, so leave it off for caches that store the full padded T5 sequence; turn it on
            for caches that store only the real tokens (which the batch then pads with zeros).
        **kwargs: The arguments of `DiffusersEditModule`.
    """

    transformer_class = FluxTransformer2DModel
    # FLUX.1's scheduler_config.json.
    default_shift = ResolutionShift(base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15)
    # diffusers' FLUX.1 Kontext LoRA example's layers (attention of both block kinds, feed-forwards, proj_mlp) at
    # ai-toolkit's Kontext rank 16.
    default_lora = LoraDefaults(
        rank=16,
        target_modules=(
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
        ),
        source="diffusers' train_dreambooth_lora_flux_kontext.py layers, ai-toolkit's Kontext rank 16",
    )  # fmt: skip

    def __init__(self, mask_text_padding: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mask_text_padding = mask_text_padding

    def expected_inputs(self) -> ExpectedInputs:
        """Latents and T5 width as for every model, plus the pooled CLIP embedding."""
        width = self.transformer_config["pooled_projection_dim"]
        return replace(
            super().expected_inputs(),
            conditioning={POOLED: (width,)},
            conditioning_source={POOLED: f"pooled_projection_dim {width}"},
        )

    def predict(
        self, hidden: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any], grids: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Call the Flux transformer on one batch."""
        text = batch["text_embeddings"].to(self.device, hidden.dtype)
        pooled = batch["conditioning_tensors"][POOLED].to(self.device, hidden.dtype)
        attention: dict[str, Any] | None = None
        if self.mask_text_padding:
            # Text tokens come first in Flux's joint attention; every image token is a valid key.
            keep_text = batch["text_attention_mask"].to(self.device).bool()
            keep = torch.cat([keep_text, keep_text.new_ones(hidden.shape[0], hidden.shape[1])], dim=1)
            attention = {"attention_mask": keep[:, None, None, :]}
        out = self.transformer(
            hidden_states=hidden,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=sigmas,
            img_ids=kontext_image_ids(grids, self.device),
            txt_ids=torch.zeros(text.shape[1], 3, device=self.device),
            guidance=self.guidance(hidden.shape[0]),
            joint_attention_kwargs=attention,
            return_dict=False,
        )
        return out[0]  # type: ignore[no-any-return]


def takes_txt_seq_lens(transformer: Any) -> bool:
    """Whether the forward takes `txt_seq_lens` (diffusers before PR #12702 read the text length from it)."""
    return "txt_seq_lens" in inspect.signature(transformer.forward).parameters
