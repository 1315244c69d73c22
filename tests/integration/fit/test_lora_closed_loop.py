"""The loop closed: a cache built through the pipeline trains a LoRA that the same pipeline then edits with.

Cache, batch, packing, timesteps and export must all agree for this to work: the pipeline encodes one edit into a
cache (`cache build`), `image-edit-data fit` trains a LoRA on it with the shipped tiny config until it overfits,
the adapter is exported for diffusers, and `QwenImageEditPlusPipeline.from_pretrained(base).load_lora_weights(...)`
edits the sample's context image with its instruction: its result must be much closer to the cached target than
the base pipeline's.
"""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
from PIL import Image
from support import ROOT
from support.builds import drawing, write_lines
from support.lora import complete_pipeline, load_pipeline
from support.pipelines import QWEN

from image_edit_data import ImageEditDataset
from image_edit_data.__main__ import main
from image_edit_data.models.diffusers_inputs import pack_latents
from image_edit_data.preprocess.cli import cache_main

PROMPT = "make the sky red"
STEPS = 150  # enough for the rank-8 adapter to learn the one sample (measured: 3.5x closer than the base)

pytestmark = pytest.mark.usefixtures("one_thread")
diffusers.utils.logging.disable_progress_bar()


def one_edit_cache(root: Path, pipeline: Path) -> Path:
    """`cache build` of one 32x32 edit (context, instruction, target) through the Qwen-Image-Edit pipeline encoder."""
    (root / "images").mkdir(parents=True)
    drawing((32, 32), 1).save(root / "images" / "context.png")
    drawing((32, 32), 2).save(root / "images" / "target.png")
    media = [
        {"role": "target", "file_name": "images/target.png"},
        {"role": "context", "file_name": "images/context.png"},
        {"role": "condition", "file_name": "images/context.png"},
    ]
    manifest = write_lines(root / "edits.jsonl", [{"id": "e0", "prompt": PROMPT, "media": media}])
    args = [
        "build", str(root / "cache"), "--manifest", str(manifest), "--encoder", QWEN, "--encoder.path", str(pipeline),
        "--encoder.torch_dtype", "float32", "--max-pixels", "1024", "--spatial-alignment", "32", "--quiet",
    ]  # fmt: skip
    assert cache_main(args) == 0
    return root / "cache"


@pytest.mark.slow
def test_a_lora_trained_on_a_pipeline_built_cache_makes_the_pipeline_edit_towards_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow-tier for its length: a pipeline build, a fit long enough to learn one edit, and the pipeline's sampling."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    base = complete_pipeline("qwen", tmp_path / "base")
    cache = one_edit_cache(tmp_path / "data", base)
    monkeypatch.chdir(tmp_path)  # the config writes runs/ under the working directory
    fit = [
        "fit", "--config", str(ROOT / "configs/tiny/fit_qwen_image_edit_lora_tiny.yaml"),
        "--model.init_args.model_path", str(base), "--model.init_args.model_config", "null",
        "--data.cache_dir", str(cache), "--data.val_cache_dir", str(cache), "--trainer.max_steps", str(STEPS),
        "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=image_edit_data.models.validation_edits.ValidationEdits",
        "--trainer.callbacks.every_n_train_steps", str(STEPS), "--trainer.callbacks.num_inference_steps", "8",
    ]  # fmt: skip
    assert main(fit) == 0
    run = tmp_path / "runs" / "tiny-qwen-image-edit-lora"
    assert {p.parent.name for p in (run / "validation_edits").rglob("sample=0.png")} == {"step=0", f"step={STEPS}"}

    # The pipeline sizes the context for its VAE at 1024 x 1024 pixels; the tiny VAE downsamples by 2, not 8,
    # so at that size the edit would take 65,536 tokens. At 32 x 32 it sees the context as the cache holds it.
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)
    context = Image.open(tmp_path / "data" / "images" / "context.png").convert("RGB")
    target = pack_latents(ImageEditDataset(str(cache))[0]["target_latent"][None])
    pipeline = load_pipeline("qwen", base)

    def distance_to_target() -> float:
        edited = pipeline(
            image=[context], prompt=PROMPT, height=32, width=32, num_inference_steps=8,
            generator=torch.Generator().manual_seed(0), output_type="latent",
        ).images  # fmt: skip
        return float((edited - target).norm())

    before = distance_to_target()
    pipeline.load_lora_weights(run / "lora" / "last")
    after = distance_to_target()
    ratio = before / after
    print(f"closed loop: base {before:.2f}, LoRA {after:.2f} from the target latent: {ratio:.2f}x closer")
    assert ratio >= 2.0, f"base edit {before:.2f} from the target, with the LoRA {after:.2f}: only {ratio:.2f}x closer"
