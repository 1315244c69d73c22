"""Claims about caches built through diffusers pipelines (tiny, random, local Qwen-Image-Edit and FLUX.1 Kontext)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support import ROOT, SUPPORT
from support.builds import cli_env, drawing, index_files, png_bytes, torch_threads, write_lines, write_parquet
from support.pipelines import (
    CLIP_HIDDEN,
    KONTEXT,
    QWEN,
    QWEN_HIDDEN,
    QWEN_VL_PIXELS,
    T5_HIDDEN,
    build,
    edit_manifest,
    flux_kontext_pipeline,
    qwen_image_edit_pipeline,
)

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataset
from image_edit_data.payload import load_payload
from image_edit_data.preprocess.cli import cache_main

CLI_SCRIPT = SUPPORT / "pipeline_cli.py"


pytestmark = pytest.mark.usefixtures("offline")


@pytest.fixture(scope="module")
def kontext_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flux_kontext_pipeline(tmp_path_factory.mktemp("pipelines") / "flux-kontext")


def assert_loads_in_batches(cache: Path) -> list[dict[str, Any]]:
    """The cache validates, and the loader yields every sample once; returns the batches."""
    assert cache_main(["validate", str(cache), "--check-finite"]) == 0
    built = ImageEditDataloaderConfig(cache_dir=str(cache), num_workers=0, drop_last=False, shuffle=False).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    batches = list(built.dataloader)
    seen = sorted(i for batch in batches for i in batch["metadata"]["sample_indices"])
    assert seen == list(range(len(ImageEditDataset(cache))))
    return batches


def test_a_qwen_image_edit_cache_validates_and_loads_in_batches(
    tmp_path: Path, qwen_path: Path, capsys: pytest.CaptureFixture
) -> None:
    manifest = edit_manifest(tmp_path / "raw")
    build(tmp_path / "cache", manifest, QWEN, qwen_path, "--encoder.torch_dtype", "float32", "--format", "safetensors")
    batches = assert_loads_in_batches(tmp_path / "cache")
    assert all(batch["text_embeddings"].shape[-1] == QWEN_HIDDEN for batch in batches)
    assert all(batch["conditioning_tensors"] == {} for batch in batches)
    dataset = ImageEditDataset(tmp_path / "cache")
    first, second = dataset[0], dataset[1]
    assert first["target_latent"].shape == (4, 16, 32)  # 64x32 pixels, spatial factor 2
    assert [tuple(c.shape) for c in second["context_latents"]] == [(4, 32, 16), (4, 32, 32)]
    assert second["metadata"]["original_pixel_shapes"]["conditions"] == [[80, 48], [64, 64]]
    # Qwen2.5-VL looked at the condition images: two pictures give a longer prompt than one.
    assert second["metadata"]["text_token_length"] > first["metadata"]["text_token_length"]
    assert bool(first["prompt_attention_mask"].all())


def test_qwen_prompt_embeddings_depend_on_the_condition_images(tmp_path: Path, qwen_path: Path) -> None:
    from image_edit_data.preprocess.encoders.pipelines import QwenImageEditEncoder

    encoder = QwenImageEditEncoder(str(qwen_path), torch_dtype="float32")
    red, blue = drawing((48, 80), 1), drawing((48, 80), 2)
    a, b, again = encoder.encode_prompts(["make the sky red"] * 3, [(red,), (blue,), (red,)])
    assert a.embeddings.shape == b.embeddings.shape and not torch.equal(a.embeddings, b.embeddings)
    assert torch.equal(a.embeddings, again.embeddings)
    assert encoder.resize_condition(red).size == (288, 480)  # 48:80 at 384x384 pixels, sides rounded to 32


def test_the_first_qwen_image_edit_pipeline_looks_at_one_condition_at_1024_squared(tmp_path: Path) -> None:
    from image_edit_data.preprocess.encoders.pipelines import QwenImageEditEncoder

    encoder = QwenImageEditEncoder(str(qwen_image_edit_pipeline(tmp_path / "edit", plus=False)), torch_dtype="float32")
    image = drawing((48, 80), 1)
    assert encoder.resize_condition(image).size == (800, 1312)  # 48:80 at 1024x1024 pixels, sides rounded to 32
    (encoding,) = encoder.encode_prompts(["make the sky red"], [(image,)])
    assert encoding.embeddings.shape[1] == QWEN_HIDDEN and bool(encoding.mask.all())
    with pytest.raises(ValueError, match=r"edit: QwenImageEditPipeline looks at exactly one condition image, got 2"):
        encoder.encode_prompts(["make the sky red"], [(image, image)])


# The gap between a prompt encoded in a batch and alone, in float32 (values up to about 3.5 here). The pipelines' own
# batched call is QwenImagePipeline.encode_prompt on the same Qwen2.5-VL (the edit pipelines' encode_prompt gives
# every prompt of a batch the same images, so it batches no two samples): up to 4.8e-7 against single calls, as is
# ours (two float32 steps near 3.5). Padding changes the matrix shapes, and with them how the kernels round.
BATCH_TOLERANCE = 1e-6


def text_encoder_calls(encoder: Any) -> list[int]:
    """A list that grows by one for each forward call of the encoder's Qwen2.5-VL."""
    calls: list[int] = []
    encoder.pipeline.text_encoder.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("plus", [True, False])
def test_batched_qwen_prompts_take_one_call_and_equal_one_at_a_time_within_the_pipelines_batch_tolerance(
    tmp_path: Path, qwen_path: Path, plus: bool
) -> None:
    from image_edit_data.preprocess.encoders.pipelines import QwenImageEditEncoder

    path = qwen_path if plus else qwen_image_edit_pipeline(tmp_path / "edit", plus=False)
    encoder = QwenImageEditEncoder(str(path), torch_dtype="float32")
    prompts = ["make the sky red", "add a cat to the tree and a dog below it", "x", "remove the dog", "add a cat"]
    pictures = [drawing(size, seed) for seed, size in enumerate(((80, 48), (48, 80), (64, 64), (100, 60)))]
    two = (pictures[1], pictures[2]) if plus else (pictures[1],)
    conditions = [(pictures[0],), two, (pictures[3],), (), ()]
    with torch_threads(1):
        calls = text_encoder_calls(encoder)
        batched = encoder.encode_prompts(prompts, conditions)
        assert len(calls) == 2  # one for the prompts with images, one for those without
        alone = [encoder.encode_prompts([p], [c])[0] for p, c in zip(prompts, conditions)]
        text_to_image = encoder.text_to_image_pipeline()
        together, _ = text_to_image.encode_prompt(prompt=prompts, device="cpu")
        single = [text_to_image.encode_prompt(prompt=[p], device="cpu")[0][0] for p in prompts]
    for ours, reference in zip(batched, alone):
        assert ours.embeddings.shape == reference.embeddings.shape and torch.equal(ours.mask, reference.mask)
        torch.testing.assert_close(ours.embeddings, reference.embeddings, rtol=0, atol=BATCH_TOLERANCE)
    for row, reference in enumerate(single):
        torch.testing.assert_close(together[row, : len(reference)], reference, rtol=0, atol=BATCH_TOLERANCE)
    # Each prompt keeps its own images: the same prompt with another picture is far outside the tolerance.
    other = encoder.encode_prompts([prompts[0]], [(pictures[3],)])[0]
    assert (other.embeddings[-5:] - batched[0].embeddings[-5:]).abs().max() > 1000 * BATCH_TOLERANCE


INSTRUCTION = "make the sky red and add a cat to the tree"


@pytest.fixture(scope="module")
def first_release_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny QwenImageEditPipeline whose Qwen2.5-VL processor keeps the released pixel budget."""
    path = tmp_path_factory.mktemp("pipelines") / "qwen-image-edit"
    return qwen_image_edit_pipeline(path, plus=False, vision_pixels=QWEN_VL_PIXELS)


@pytest.fixture(scope="module")
def plus_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny QwenImageEditPlusPipeline whose Qwen2.5-VL processor keeps the released pixel budget."""
    return qwen_image_edit_pipeline(tmp_path_factory.mktemp("pipelines") / "plus", vision_pixels=QWEN_VL_PIXELS)


def condition_manifest(root: Path, conditions: list[tuple[int, int]], rows: int = 1, prompt: str = INSTRUCTION) -> Path:
    """`rows` edits whose condition images have the sizes `conditions` (targets and contexts are small)."""
    images = root / "images"
    images.mkdir(parents=True)
    lines = []
    for row in range(rows):
        drawing((64, 48), row).save(images / f"{row}_tgt.png")
        drawing((64, 48), row + 20).save(images / f"{row}_src.png")
        media = [
            {"role": "target", "file_name": f"images/{row}_tgt.png"},
            {"role": "context", "file_name": f"images/{row}_src.png"},
        ]
        for i, size in enumerate(conditions):
            drawing(size, row * 10 + i + 40).save(images / f"{row}_cond{i}.png")
            media.append({"role": "condition", "file_name": f"images/{row}_cond{i}.png"})
        lines.append({"id": f"e{row:02d}", "prompt": prompt, "media": media, "metadata": {}})
    return write_lines(root / "edits.jsonl", lines)


def what_the_qwen_pipeline_gives(path: Path, prompt: str, images: list[Image.Image]) -> tuple[torch.Tensor, int]:
    """`encoder_hidden_states` `[S, D]` the pipeline's `__call__` gives its transformer for one prompt (its own
    resize of the condition images: `calculate_dimensions` and the areas of its module, then `encode_prompt`),
    and how many of the S are vision tokens."""
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    class_name = json.loads((path / "model_index.json").read_text())["_class_name"]
    pipeline = getattr(diffusers, class_name).from_pretrained(path, transformer=None, local_files_only=True)
    if class_name == "QwenImageEditPipeline":
        (image,) = images
        width, height, _ = pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, image.width / image.height)
        condition: Any = pipeline.image_processor.resize(image, height, width)
    else:
        area = pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE
        condition = []
        for image in images:
            width, height = pipeline_qwenimage_edit_plus.calculate_dimensions(area, image.width / image.height)
            condition.append(pipeline.image_processor.resize(image, height, width))
    with torch.no_grad():  # as in __call__
        embeddings, mask = pipeline.encode_prompt(prompt=[prompt], image=condition, device="cpu")
    assert mask is None  # one prompt: every position is a real token
    grids = pipeline.processor.image_processor(images=condition, return_tensors="pt")["image_grid_thw"]
    return embeddings[0], int(grids.prod(dim=1).sum()) // 4  # 2x2 patches merge into one token


def test_a_first_release_cache_keeps_every_token_the_pipeline_gives_for_a_1024x768_condition(
    tmp_path: Path, first_release_path: Path
) -> None:
    manifest = condition_manifest(tmp_path / "raw", [(1024, 768)])
    build(tmp_path / "cache", manifest, QWEN, first_release_path, "--encoder.torch_dtype", "float32")
    payload = load_payload(tmp_path / "cache" / "samples" / "sample_00000000.pt", "sample 0")
    condition = Image.open(tmp_path / "raw" / "images" / "0_cond0.png")
    given, vision = what_the_qwen_pipeline_gives(first_release_path, INSTRUCTION, [condition])
    # Qwen2.5-VL sees the input at 1184x896, 42x32 merged 28-pixel patches, before the instruction: a cut at
    # 1,024 tokens would keep vision tokens only.
    assert vision == 1344 and given.shape[0] > vision + len(INSTRUCTION)
    assert payload["prompt_embeddings"].shape == given.shape
    assert torch.equal(payload["prompt_embeddings"], given)
    assert torch.equal(payload["prompt_attention_mask"], torch.ones(given.shape[0], dtype=torch.int64))
    assert payload["metadata"]["text_token_length"] == given.shape[0]
    assert "prompt_truncation" not in payload["metadata"]


def test_the_shipped_qwen_config_keeps_every_token_the_plus_pipeline_gives_for_three_large_conditions(
    tmp_path: Path, plus_path: Path
) -> None:
    manifest = condition_manifest(tmp_path / "raw", [(1024, 768), (768, 1024), (1024, 1024)])
    config = ROOT / "configs" / "cache" / "qwen_image_edit.yaml"
    encoder = ["--encoder.init_args.path", str(plus_path), "--encoder.init_args.device", "cpu"]
    exact = ["--encoder.init_args.torch_dtype", "float32", "--store-dtype", "float32"]  # so equal means equal
    small = ["--max-pixels", "4096", "--quiet"]
    args = ["build", "--config", str(config), str(tmp_path / "cache"), "--manifest", str(manifest)]
    assert cache_main([*args, *encoder, *exact, *small]) == 0
    payload = load_payload(tmp_path / "cache" / "samples" / "sample_00000000.pt", "sample 0")
    conditions = [Image.open(tmp_path / "raw" / "images" / f"0_cond{i}.png") for i in range(3)]
    given, vision = what_the_qwen_pipeline_gives(plus_path, INSTRUCTION, conditions)
    # At 384x384 pixels the conditions are 176, 176 and 196 vision tokens: together past NeMo's 512.
    assert vision == 548 and given.shape[0] > vision + len(INSTRUCTION)
    assert payload["prompt_embeddings"].shape == given.shape
    assert torch.equal(payload["prompt_embeddings"], given)
    assert payload["metadata"]["text_token_length"] == given.shape[0]
    assert "prompt_truncation" not in payload["metadata"]


def test_a_qwen_prompt_cap_that_cuts_warns_for_each_sample_records_the_cut_and_nemo_still_reads_the_cache(
    tmp_path: Path, plus_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from nemo_automodel.components.datasets.diffusion.image_edit_dataset import ImageEditDataset as NemoDataset

    from image_edit_data.preprocess.encoders.base import PromptTruncationWarning

    manifest = condition_manifest(tmp_path / "raw", [(1024, 768), (768, 1024), (1024, 1024)], rows=2)
    cache = tmp_path / "cache"
    with pytest.warns(PromptTruncationWarning) as caught:
        build(
            cache, manifest, QWEN, plus_path, "--encoder.torch_dtype", "float32", "--encoder.max_sequence_length", "512"
        )
    conditions = [Image.open(tmp_path / "raw" / "images" / f"1_cond{i}.png") for i in range(3)]
    given, _ = what_the_qwen_pipeline_gives(plus_path, INSTRUCTION, conditions)
    tokens = given.shape[0]
    messages = [str(w.message) for w in caught if w.category is PromptTruncationWarning]
    assert messages == [
        f"{manifest} line {row + 1} (id 'e0{row}'): prompt cut: Qwen2.5-VL kept 512 of {tokens} tokens "
        f"(max_sequence_length 512); the dropped tokens are the end of the prompt. Recorded in the payload's "
        f"metadata.prompt_truncation (prompt {row + 1} cut by this rank)"
        for row in range(2)
    ]
    assert "2 of the 2 prompts were cut by a length limit" in capsys.readouterr().out
    payload = load_payload(cache / "samples" / "sample_00000001.pt", "sample 1")
    assert torch.equal(payload["prompt_embeddings"], given[:512])  # the pipeline's first 512 tokens
    assert payload["metadata"]["text_token_length"] == 512
    record = {"encoder": "Qwen2.5-VL", "tokens": tokens, "kept": 512, "cause": "max_sequence_length 512"}
    assert payload["metadata"]["prompt_truncation"] == [record]
    assert ImageEditDataset(cache)[1]["metadata"]["prompt_truncation"] == [record]
    nemo = NemoDataset(str(cache))[1]
    assert torch.equal(nemo["prompt_embeddings"], payload["prompt_embeddings"])


def test_a_kontext_cache_is_cut_where_the_pipeline_cuts_and_says_so(tmp_path: Path, kontext_path: Path) -> None:
    from diffusers import FluxKontextPipeline

    from image_edit_data.preprocess.encoders.base import PromptTruncationWarning

    prompt = "make the sky red and add a cat to the tree to the dog"  # 14 words; "and" is unknown to both vocabularies
    manifest = condition_manifest(tmp_path / "raw", [], prompt=prompt)
    with pytest.warns(
        PromptTruncationWarning,
        match=r"line 1 \(id 'e00'\): prompt cut: T5 kept 8 of 14 tokens "
        r"\(the pipeline's max_sequence_length 8\); CLIP kept 8 of 14 tokens \(CLIP's tokenizer limit 8\)",
    ):
        build(
            tmp_path / "cache",
            manifest,
            KONTEXT,
            kontext_path,
            "--encoder.torch_dtype",
            "float32",
            "--encoder.max_sequence_length",
            "8",
        )
    pipeline = FluxKontextPipeline.from_pretrained(kontext_path, transformer=None, local_files_only=True)
    with torch.no_grad():  # as in __call__ (with autograd on, T5 differs in the last float32 bit)
        embeddings, pooled, _ = pipeline.encode_prompt([prompt], None, device="cpu", max_sequence_length=8)
    payload = load_payload(tmp_path / "cache" / "samples" / "sample_00000000.pt", "sample 0")
    assert torch.equal(payload["prompt_embeddings"], embeddings[0])
    assert torch.equal(payload["conditioning_tensors"]["pooled_prompt_embeds"], pooled[0])
    assert payload["metadata"]["prompt_truncation"] == [
        {"encoder": "T5", "tokens": 14, "kept": 8, "cause": "the pipeline's max_sequence_length 8"},
        {"encoder": "CLIP", "tokens": 14, "kept": 8, "cause": "CLIP's tokenizer limit 8"},
    ]


def test_a_kontext_prompt_length_the_pipeline_refuses_is_refused_before_loading(tmp_path: Path) -> None:
    from image_edit_data.preprocess.encoders.pipelines import FluxKontextEncoder

    with pytest.raises(ValueError, match=r"max_sequence_length: FluxKontextPipeline takes 1 to 512 T5 tokens, got 513"):
        FluxKontextEncoder(str(tmp_path / "not-loaded"), max_sequence_length=513)


def test_a_kontext_cache_stores_the_pooled_clip_embedding_as_conditioning(tmp_path: Path, kontext_path: Path) -> None:
    manifest = edit_manifest(tmp_path / "raw")
    build(tmp_path / "cache", manifest, KONTEXT, kontext_path, "--encoder.max_sequence_length", "12")
    batches = assert_loads_in_batches(tmp_path / "cache")
    for batch in batches:
        pooled = batch["conditioning_tensors"]["pooled_prompt_embeds"]
        assert pooled.shape == (batch["image_latents"].shape[0], CLIP_HIDDEN)
        assert batch["text_embeddings"].shape[1:] == (12, T5_HIDDEN)
        assert batch["metadata"]["text_token_counts"] == [12] * pooled.shape[0]
    payload = load_payload(tmp_path / "cache" / "samples" / "sample_00000000.pt", "sample 0")
    assert payload["metadata"]["conditioning_shapes"] == {"pooled_prompt_embeds": [CLIP_HIDDEN]}
    assert payload["conditioning_tensors"]["pooled_prompt_embeds"].dtype == torch.float32


def test_kontext_latents_use_the_pipelines_shift_and_scaling_factor(kontext_path: Path) -> None:
    from diffusers import AutoencoderKL

    from image_edit_data.preprocess.encoders.pipelines import FluxKontextEncoder
    from image_edit_data.preprocess.run.resize import to_pixels

    encoder = FluxKontextEncoder(str(kontext_path), torch_dtype="float32")
    images = to_pixels([drawing((32, 16), 3)])
    raw = AutoencoderKL.from_pretrained(kontext_path / "vae").encode(images).latent_dist.mode()
    assert encoder.spatial_factor == 2
    torch.testing.assert_close(encoder.encode(images), (raw - 0.25) * 0.5, rtol=0, atol=0)


def test_a_pipeline_directory_without_a_vae_is_refused_naming_the_component(tmp_path: Path) -> None:
    from image_edit_data.preprocess.encoders.pipelines import QwenImageEditEncoder

    path = qwen_image_edit_pipeline(tmp_path / "no-vae", parts=("text",))
    with pytest.raises(
        ValueError, match=r"no-vae/model_index.json: vae: QwenImageEditEncoder needs the pipeline's vae"
    ):
        QwenImageEditEncoder(str(path))


def test_a_pipeline_directory_without_a_text_encoder_is_refused_naming_the_component(
    tmp_path: Path, kontext_path: Path
) -> None:
    from image_edit_data.preprocess.encoders.pipelines import FluxKontextEncoder

    path = tmp_path / "kontext"
    shutil.copytree(kontext_path, path)
    shutil.rmtree(path / "text_encoder_2")
    with pytest.raises(
        FileNotFoundError, match=r"kontext/text_encoder_2: the pipeline's text_encoder_2 folder is missing"
    ):
        FluxKontextEncoder(str(path))
    with pytest.raises(FileNotFoundError, match=r"nowhere: pipeline directory does not exist"):
        FluxKontextEncoder(str(tmp_path / "nowhere"))


def test_an_unsupported_pipeline_class_is_refused_naming_the_file_and_the_right_encoder(
    tmp_path: Path, qwen_path: Path
) -> None:
    from image_edit_data.preprocess.encoders.pipelines import FluxKontextEncoder

    with pytest.raises(
        ValueError,
        match=r"model_index.json: _class_name: FluxKontextEncoder encodes FluxKontextPipeline, "
        r"got QwenImageEditPlusPipeline; use "
        r"image_edit_data.preprocess.encoders.pipelines.qwen_image_edit.QwenImageEditEncoder",
    ):
        FluxKontextEncoder(str(qwen_path))
    path = tmp_path / "sdxl"
    shutil.copytree(qwen_path, path)
    index = json.loads((path / "model_index.json").read_text()) | {"_class_name": "StableDiffusionXLPipeline"}
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"StableDiffusionXLPipeline is not supported; pipeline encoders exist for "
        r"FluxKontextPipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline",
    ):
        FluxKontextEncoder(str(path))


def test_a_missing_condition_image_is_a_bad_sample_naming_the_file(
    tmp_path: Path, qwen_path: Path, capsys: pytest.CaptureFixture
) -> None:
    manifest = edit_manifest(tmp_path / "raw", rows=2)
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    lines[1]["media"][2]["file_name"] = "images/gone.png"
    broken = write_lines(manifest.parent / "broken.jsonl", lines)
    args = [
        "build",
        str(tmp_path / "c"),
        "--manifest",
        str(broken),
        "--encoder",
        QWEN,
        "--encoder.path",
        str(qwen_path),
    ]
    assert cache_main([*args, "--quiet", "--max-pixels", "4096"]) == 1
    assert "broken.jsonl line 2: media[2].file_name: 'images/gone.png' does not exist" in capsys.readouterr().out
    from image_edit_data.preprocess.sources.base import BadSampleError
    from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

    with pytest.raises(BadSampleError, match=r"line 2: media\[2\].file_name: 'images/gone.png' does not exist"):
        JsonlManifestSource(broken).read(1)


def test_encoder_options_are_either_one_pipeline_or_an_image_and_a_text_encoder(
    tmp_path: Path, qwen_path: Path, capsys: pytest.CaptureFixture
) -> None:
    manifest = edit_manifest(tmp_path / "raw", rows=1)
    base = ["build", str(tmp_path / "c"), "--manifest", str(manifest), "--quiet"]
    assert cache_main(base) == 1
    assert "encoder: give --encoder (a pipeline encoder), or both --image-encoder and --text-encoder" in (
        capsys.readouterr().out
    )
    both = ["--encoder", QWEN, "--encoder.path", str(qwen_path), "--image-encoder", QWEN, "--image-encoder.path", "x"]
    assert cache_main([*base, *both]) == 1
    assert "encoder: give either --encoder or --image-encoder with --text-encoder, not both" in capsys.readouterr().out


@pytest.mark.parametrize("config", ["qwen_image_edit.yaml", "flux_kontext.yaml"])
def test_a_shipped_cache_config_builds_a_cache_with_only_the_model_path_device_and_budget_changed(
    tmp_path: Path, config: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue("qwen_path" if config.startswith("qwen") else "kontext_path")
    manifest = edit_manifest(tmp_path / "raw", rows=3)
    config_file = ROOT / "configs" / "cache" / config
    overrides = ["--encoder.init_args.path", str(path), "--encoder.init_args.device", "cpu"]
    small = ["--resize", "max_pixels", "--max-pixels", "4096", "--spatial-alignment", "32", "--quiet"]
    args = ["build", "--config", str(config_file), str(tmp_path / "c"), "--manifest", str(manifest)]
    assert cache_main([*args, *overrides, *small]) == 0
    assert_loads_in_batches(tmp_path / "c")
    sample = ImageEditDataset(tmp_path / "c")[0]
    assert sample["target_latent"].dtype == sample["prompt_embeddings"].dtype == torch.bfloat16
    settings = json.loads((tmp_path / "c" / "metadata.json").read_text())["preprocessing_config"]
    assert settings["image_encoder"]["init_args"]["torch_dtype"] == "bfloat16"


def pipeline_args(cache: Path, manifest: Path, path: Path, *extra: str) -> list[str]:
    """`cache build` options for a float32 Qwen build one image per VAE call, so any two runs are bit-identical."""
    encoder = ["--encoder", QWEN, "--encoder.path", str(path), "--encoder.torch_dtype", "float32"]
    options = ["--max-pixels", "4096", "--upscale", "--batch-size", "1", "--quiet", *extra]
    return ["build", str(cache), "--manifest", str(manifest), *encoder, *options]


def assert_same_payloads(a: Path, b: Path) -> None:
    assert index_files(a) == index_files(b)
    names = sorted(p.name for p in (a / "samples").iterdir())
    assert names == sorted(p.name for p in (b / "samples").iterdir())
    for name in names:
        first, second = load_payload(a / "samples" / name, name), load_payload(b / "samples" / name, name)
        for key in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
            assert torch.equal(first[key], second[key]), (name, key)
        assert all(torch.equal(x, y) for x, y in zip(first["context_latents"], second["context_latents"]))
        assert first["metadata"] == second["metadata"]


def journal_lines(cache: Path) -> int:
    journal = cache / "progress" / "rank-00000.jsonl"
    return journal.read_bytes().count(b"\n") if journal.exists() else 0


@pytest.mark.slow
def test_a_killed_pipeline_build_rerun_equals_an_uninterrupted_one(
    tmp_path: Path, qwen_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real process, killed mid-build: the journal and the payloads must survive a death no handler sees. The rerun
    runs in this process (one torch thread, as `cli_env` runs the CLI): what it must find is what the kill left."""
    manifest = edit_manifest(tmp_path / "raw", rows=12)
    cache = tmp_path / "killed"
    command = [sys.executable, str(CLI_SCRIPT), *pipeline_args(cache, manifest, qwen_path)]
    process = subprocess.Popen(command, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while journal_lines(cache) < 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = journal_lines(cache)
    assert 4 <= done < 12, "the build should have been killed between windows"
    with torch_threads(1):  # as cli_env runs the CLI, so the floats may be compared bit for bit
        assert cache_main(pipeline_args(cache, manifest, qwen_path)) == 0
        assert f"wrote {12 - done} payloads ({done} of 12 already done)" in capsys.readouterr().out
        assert cache_main(pipeline_args(tmp_path / "reference", manifest, qwen_path)) == 0
    assert_same_payloads(cache, tmp_path / "reference")


@pytest.mark.slow
def test_torchrun_with_two_ranks_builds_the_same_pipeline_cache_as_one_process(tmp_path: Path, qwen_path: Path) -> None:
    """Real processes: torchrun's two ranks, as users launch a build."""
    manifest = edit_manifest(tmp_path / "raw", rows=8)
    cache = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # An hour between looks: rank 0 merges when the ranks meet at the end, not when a clock says so.
    args = pipeline_args(cache, manifest, qwen_path, "--poll-interval", "3600")
    command = [*torchrun, str(CLI_SCRIPT), *args]
    done = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1/2: wrote 4 payloads" in done.stdout and "8 samples in 1 index shard(s)" in done.stdout
    assert sorted(p.name for p in (cache / "progress").glob("rank-*.jsonl")) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    with torch_threads(1):  # as cli_env (and torchrun) run the ranks, so the floats may be compared bit for bit
        assert cache_main(pipeline_args(tmp_path / "one", manifest, qwen_path)) == 0
    assert_same_payloads(cache, tmp_path / "one")


def test_data_set_condition_columns_reach_qwen_and_without_them_the_contexts_do(
    tmp_path: Path, qwen_path: Path
) -> None:
    rows = {
        "source_img": [{"bytes": png_bytes(drawing((48, 80), i)), "path": None} for i in range(2)],
        "target_img": [{"bytes": png_bytes(drawing((48, 80), i + 10)), "path": None} for i in range(2)],
        "other_img": [{"bytes": png_bytes(drawing((80, 48), i + 20)), "path": None} for i in range(2)],
        "instruction": ["make the sky red", "add a cat"],
    }
    parquet = write_parquet(tmp_path / "pq" / "train.parquet", rows)
    base = ["--dataset", str(parquet), "--hf-cache-dir", str(tmp_path / "hf"), "--encoder.torch_dtype", "float32"]
    build(tmp_path / "contexts", Path("unused"), QWEN, qwen_path, *base)
    build(tmp_path / "same", Path("unused"), QWEN, qwen_path, *base, "--condition-columns", "[source_img]")
    build(tmp_path / "other", Path("unused"), QWEN, qwen_path, *base, "--condition-columns", "[other_img]")
    contexts, same, other = (ImageEditDataset(tmp_path / name)[1] for name in ("contexts", "same", "other"))
    assert torch.equal(contexts["prompt_embeddings"], same["prompt_embeddings"])
    assert not torch.equal(contexts["prompt_embeddings"], other["prompt_embeddings"])
    assert torch.equal(contexts["target_latent"], other["target_latent"])  # conditions are not VAE-encoded
    assert other["metadata"]["original_pixel_shapes"]["conditions"] == [[48, 80]]
    manifest = json.loads((tmp_path / "other" / "metadata.json").read_text())
    assert manifest["source"]["condition_columns"] == ["other_img"]
    assert "condition_columns" not in json.loads((tmp_path / "contexts" / "metadata.json").read_text())["source"]


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here")
def test_a_qwen_pipeline_needing_torchvision_is_refused_with_the_fix(
    tmp_path: Path, qwen_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "qwen"
    shutil.copytree(qwen_path, path)
    index = json.loads((path / "model_index.json").read_text()) | {"processor": ["transformers", "Qwen2VLProcessor"]}
    (path / "model_index.json").write_text(json.dumps(index))
    manifest = edit_manifest(tmp_path / "raw", rows=1)
    args = ["build", str(tmp_path / "c"), "--manifest", str(manifest), "--encoder", QWEN, "--encoder.path", str(path)]
    assert cache_main([*args, "--quiet"]) == 1
    assert "qwen/processor: transformers needs torchvision to load Qwen2VLProcessor" in capsys.readouterr().out
