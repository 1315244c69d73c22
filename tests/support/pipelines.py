"""Tiny, randomly initialised diffusers pipelines saved to local directories: nothing is downloaded.

Tokenizers are built here with the `tokenizers` library: a byte-level BPE without merges (one token per
byte) carrying the special tokens Qwen2.5-VL's template needs, and word-level vocabularies for CLIP and T5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from image_edit_data.preprocess.cli import cache_main
from support.builds import WORDS, drawing, tiny_vae_model, write_lines

QWEN = "image_edit_data.preprocess.encoders.pipelines.QwenImageEditEncoder"
KONTEXT = "image_edit_data.preprocess.encoders.pipelines.FluxKontextEncoder"
# Raw sizes off the 32-pixel grid; with a 64x64 budget they become 64x32, 32x64, 64x64, 64x32, and 70x50
# becomes 64x64 in resize mode max_pixels but 64x32 in max_pixels_floor (NeMo's rule).
SIZES = ((80, 48), (48, 80), (64, 64), (100, 60), (70, 50))
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_HIDDEN = 32
# Qwen2.5-VL's own image processor budget (the released processor/preprocessor_config.json): a 1024 x 1024
# condition keeps its size, about 1,300 vision tokens.
QWEN_VL_PIXELS = (56 * 56, 28 * 28 * 16384)
T5_HIDDEN = 16
CLIP_HIDDEN = 24


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2 style byte-level BPE uses for bytes."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def qwen_tokenizer() -> Any:
    """A Qwen2-style byte-level tokenizer (no merges) with the chat and vision special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {char: i for i, char in enumerate(_byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(QWEN_SPECIALS)
    fast = Qwen2TokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        errors="replace",
    )
    return fast


try:
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor.

        transformers 5 builds the video processor with torchvision, and PyPI has no CPU build of torchvision
        for this torch; images go through exactly the same code as in Qwen2VLProcessor.
        """

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None) -> None:
            self.image_token = "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

except ImportError:  # the build extra is absent; the tests that need it are skipped
    pass


def qwen_text_encoder(tokenizer: Any, scale: int = 1) -> Any:
    """A 1-layer Qwen2.5-VL with a 1-block vision tower, hidden size 32; `scale` multiplies widths and depths."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in QWEN_SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": QWEN_HIDDEN * scale,
            "intermediate_size": 32 * scale,
            "num_hidden_layers": scale,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2 * scale, 3 * scale, 3 * scale],
            },
        },
        vision_config={
            "depth": scale,
            "hidden_size": 16 * scale,
            "intermediate_size": 16 * scale,
            "num_heads": 2,
            "out_hidden_size": QWEN_HIDDEN * scale,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_vae() -> Any:
    """A 2-level Qwen-Image VAE (spatial factor 2, 4 channels) with per-channel latent statistics."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(1)
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[2.0, 1.0, 0.5, 4.0],
    )


def qwen_image_edit_pipeline(
    path: Path,
    plus: bool = True,
    parts: tuple[str, ...] = ("vae", "text"),
    vision_pixels: tuple[int, int] = (56 * 56, 112 * 112),
    text_scale: int = 1,
) -> Path:
    """Save a tiny QwenImageEdit(Plus)Pipeline without its transformer; `parts` leaves out the VAE or text side.

    `vision_pixels` is the (min, max) pixel budget of Qwen2.5-VL's image processor: by default small, so the
    vision tower sees 4x4 tokens; `QWEN_VL_PIXELS` is the released model's, which sees the image as given.
    `text_scale` multiplies Qwen2.5-VL's widths and depths (benchmarks/build_prompts.py).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = qwen_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=vision_pixels[0], max_pixels=vision_pixels[1])
    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    has_text = "text" in parts
    pipeline = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=qwen_vae() if "vae" in parts else None,
        text_encoder=qwen_text_encoder(tokenizer, text_scale) if has_text else None,
        tokenizer=tokenizer if has_text else None,
        processor=processor if has_text else None,
        transformer=None,
    )
    pipeline.save_pretrained(path)
    return path


def flux_kontext_pipeline(path: Path) -> Path:
    """Save a tiny FluxKontextPipeline (AutoencoderKL, CLIP text model, T5 encoder) without its transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
    )

    clip_words = ["<|endoftext|>", "<|startoftext|>", *WORDS[1:]]
    clip = Tokenizer(models.WordLevel({w: i for i, w in enumerate(clip_words)}, unk_token="[UNK]"))
    clip.pre_tokenizer = pre_tokenizers.Whitespace()
    clip_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=clip,
        unk_token="[UNK]",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=8,
    )
    t5_words = ["<pad>", "</s>", "<unk>", *WORDS[2:]]
    t5 = Tokenizer(models.WordLevel({w: i for i, w in enumerate(t5_words)}, unk_token="<unk>"))
    t5.pre_tokenizer = pre_tokenizers.Whitespace()
    t5_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=t5, unk_token="<unk>", eos_token="</s>", pad_token="<pad>", model_max_length=512
    )
    torch.manual_seed(2)
    clip_model = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_words),
            hidden_size=CLIP_HIDDEN,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
            projection_dim=CLIP_HIDDEN,
            bos_token_id=1,
            eos_token_id=0,
            pad_token_id=0,
        )
    ).eval()
    t5_model = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_words),
            d_model=T5_HIDDEN,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
        )
    ).eval()
    vae = tiny_vae_model(scaling_factor=0.5, shift_factor=0.25)
    pipeline = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip_model,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5_model,
        tokenizer_2=t5_tokenizer,
        transformer=None,
    )
    pipeline.save_pretrained(path)
    return path


def model_index(path: Path) -> dict[str, Any]:
    """The pipeline directory's model_index.json."""
    return json.loads((path / "model_index.json").read_text())


def edit_manifest(root: Path, rows: int = 6) -> Path:
    """A manifest in the form NeMo's preprocessor takes: every line has a target, contexts and conditions."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    prompts = ["make the sky red", "add a cat to the tree", "remove the dog", "make the cat blue"]
    lines = []
    for i in range(rows):
        size = SIZES[i % len(SIZES)]
        for kind, seed in (("src", i), ("tgt", i + 50), ("ref", i + 90)):
            drawing(size if kind != "ref" else (64, 64), seed).save(images / f"{i}_{kind}.png")
        media = [
            {"role": "target", "file_name": f"images/{i}_tgt.png"},
            {"role": "context", "file_name": f"images/{i}_src.png"},
            {"role": "condition", "file_name": f"images/{i}_src.png"},
        ]
        if i % 3 == 1:  # a second context and condition image
            media += [
                {"role": "context", "file_name": f"images/{i}_ref.png"},
                {"role": "condition", "file_name": f"images/{i}_ref.png"},
            ]
        metadata = {"dataset_name": "tiny-edits", "dataset_split": "train", "n": i}
        lines.append({"id": f"e{i:02d}", "prompt": prompts[i % 4], "media": media, "metadata": metadata})
    return write_lines(root / "edits.jsonl", lines)


def build(cache: Path, manifest: Path, encoder: str, path: Path, *extra: str) -> None:
    """`image-edit-data cache build` with one pipeline encoder, in this process (from `manifest` unless `--dataset`)."""
    source = [] if "--dataset" in extra else ["--manifest", str(manifest)]
    args = ["build", str(cache), *source, "--encoder", encoder, "--encoder.path", str(path)]
    resize = ["--max-pixels", "4096", "--spatial-alignment", "32", "--upscale", "--batch-size", "2", "--quiet"]
    assert cache_main([*args, *resize, *extra]) == 0
