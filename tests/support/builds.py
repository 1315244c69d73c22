"""Raw inputs and tiny local models for cache-build tests: nothing is downloaded, everything is random or drawn."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

from image_edit_data.preprocess.encoders.demo import DemoImageEncoder
from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.resize import ResizePolicy
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource
from support import TESTS

# Sizes deliberately not aligned: the build resizes them (max_pixels policy) to multiples of 16.
RAW_SIZES: tuple[tuple[int, int], ...] = ((40, 24), (24, 40), (32, 32))
WORDS = ["[PAD]", "[UNK]", "make", "the", "sky", "red", "blue", "add", "a", "cat", "dog", "remove", "tree", "to"]


def drawing(size: tuple[int, int], seed: int) -> Image.Image:
    """A small RGB image that differs by seed."""
    image = Image.new("RGB", size, ((seed * 37) % 256, (seed * 91) % 256, (seed * 53) % 256))
    draw = ImageDraw.Draw(image)
    draw.rectangle((seed % 7, seed % 5, size[0] // 2, size[1] // 2), fill=(255 - seed % 256, 40, 90))
    return image


def prompt_for(i: int) -> str:
    return ["make the sky red", "add a cat", "remove the tree", "make the dog blue"][i % 4] + f" {i}"


def write_manifest(root: Path, rows: int = 20, name: str = "edits.jsonl") -> Path:
    """`rows` manifest lines with PNG images; every fifth sample has two contexts, every fourth a condition."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        size = RAW_SIZES[i % len(RAW_SIZES)]
        media = [{"role": "context", "file_name": f"images/{i}_src.png"}]
        drawing(size, i).save(images / f"{i}_src.png")
        drawing(size, i + 100).save(images / f"{i}_tgt.png")
        if i % 5 == 0:
            drawing((32, 32), i + 200).save(images / f"{i}_ref.png")
            media.append({"role": "context", "file_name": f"images/{i}_ref.png"})
        if i % 4 == 0:
            media.append({"role": "condition", "file_name": f"images/{i}_src.png"})
        media.insert(i % 2, {"role": "target", "file_name": f"images/{i}_tgt.png"})
        lines.append({"id": f"s{i:03d}", "prompt": prompt_for(i), "media": media, "metadata": {"n": i}})
    return write_lines(root / name, lines)


def write_lines(path: Path, lines: Sequence[Any]) -> Path:
    """A JSONL file; strings are written verbatim, anything else as JSON."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def png_bytes(image: Image.Image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def parquet_rows(rows: int = 20) -> dict[str, list[Any]]:
    """MagicBrush-style columns: images as `{"bytes", "path"}` structs."""
    return {
        "img_id": [f"m{i:03d}" for i in range(rows)],
        "source_img": [{"bytes": png_bytes(drawing(RAW_SIZES[i % 3], i)), "path": None} for i in range(rows)],
        "target_img": [{"bytes": png_bytes(drawing(RAW_SIZES[i % 3], i + 100)), "path": None} for i in range(rows)],
        "instruction": [prompt_for(i) for i in range(rows)],
        "turn_index": list(range(rows)),
    }


def write_parquet(path: Path, columns: Mapping[str, list[Any]], image_columns: Sequence[str] = ()) -> Path:
    """A parquet file written by `datasets` (types inferred), with `image_columns` typed as `Image`."""
    import datasets

    dataset = datasets.Dataset.from_dict(dict(columns))
    for name in image_columns:
        dataset = dataset.cast_column(name, datasets.Image())
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.to_parquet(str(path))
    return path


def tiny_vae_model(**config: Any) -> Any:
    """A random 2-level AutoencoderKL (spatial factor 2), drawn from torch's current random state."""
    from diffusers import AutoencoderKL

    args: dict[str, Any] = dict(
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=32,
    )
    return AutoencoderKL(**(args | config))


def tiny_vae(path: Path, **config: Any) -> Path:
    """`tiny_vae_model` with seed 0, saved with save_pretrained."""
    torch.manual_seed(0)
    tiny_vae_model(**config).save_pretrained(path)
    return path


def tiny_text_model(path: Path) -> Path:
    """A random 1-layer BERT with a word-level tokenizer built here, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(path)
    return path


def hf_specs(vae: Path, text: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Encoder specs of the tiny local models."""
    image = {
        "class_path": "image_edit_data.preprocess.encoders.hf.DiffusersVAEEncoder",
        "init_args": {"path": str(vae)},
    }
    text_spec = {
        "class_path": "image_edit_data.preprocess.encoders.hf.TransformersTextEncoder",
        "init_args": {"path": str(text), "max_sequence_length": 16},
    }
    return image, text_spec


DEMO_SPECS = (
    {"class_path": "image_edit_data.preprocess.encoders.demo.DemoImageEncoder", "init_args": {"latent_channels": 4}},
    {"class_path": "image_edit_data.preprocess.encoders.demo.DemoTextEncoder", "init_args": {"dim": 8}},
)


class SlowDemoImageEncoder(DemoImageEncoder):
    """The demo image encoder, sleeping `delay` seconds per call so a test can kill a build mid-way."""

    awake = False  # `reference_cache` sets it: the same spec (delay included) in the cache's metadata, no waiting

    def __init__(self, latent_channels: int = 4, delay: float = 0.0) -> None:
        super().__init__(latent_channels)
        self.delay = delay

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        if not self.awake:
            time.sleep(self.delay)
        return super().encode(images)


class InterruptedImageEncoder(DemoImageEncoder):
    """The demo image encoder, raising in its `fail_at`-th call (when set): a build stopped mid-way, same settings."""

    fail_at: int | None = None  # a test sets it on the class, so the encoder spec (the build settings) stays the same

    def __init__(self, latent_channels: int = 4) -> None:
        super().__init__(latent_channels)
        self.calls = 0

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"stopped in encode call {self.calls}")
        return super().encode(images)


def cli_command(*args: str) -> list[str]:
    """`image-edit-data cache ...` run through `cache_main` in a fresh interpreter."""
    code = "import sys; from image_edit_data.preprocess.cli import cache_main; sys.exit(cache_main(sys.argv[1:]))"
    return [sys.executable, "-c", code, *args]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for CLI subprocesses: offline, this test directory importable, one torch thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    # Float results are bit-identical across processes only at the same thread count (reductions split by
    # thread): tests compare these builds bit for bit with in-process ones run under `torch_threads(1)`.
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the body with `count` torch threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the cache CLI to completion and capture its output."""
    return subprocess.run(cli_command(*args), env=cli_env(), capture_output=True, text=True, timeout=timeout)


def index_files(root: Path) -> dict[str, bytes]:
    """metadata.json and every shard, by name."""
    return {p.name: p.read_bytes() for p in sorted(root.glob("metadata*.json"))}


# The cache CLI's build in tests: the demo encoders (the image one slowed when asked), small images.
SLOW_ENCODER = "support.builds.SlowDemoImageEncoder"
RESIZE_ARGS = ["--max-pixels", "1024", "--spatial-alignment", "16", "--upscale"]
CLI_RESIZE = ResizePolicy("max_pixels", max_pixels=1024, spatial_alignment=16, upscale=True)


def build_args(manifest: Path, out: Path, *extra: str, delay: str = "0") -> list[str]:
    """`cache build` options for a manifest with the (optionally slowed) demo encoders."""
    return [
        "build",
        str(out),
        "--manifest",
        str(manifest),
        "--image-encoder",
        SLOW_ENCODER,
        "--image-encoder.delay",
        delay,
        "--text-encoder",
        DEMO_SPECS[1]["class_path"],
        "--text-encoder.dim",
        "8",
        "--batch-size",
        "2",
        "--quiet",
        *RESIZE_ARGS,
        *extra,
    ]


def reference_cache(manifest: Path, out: Path, delay: float = 0.0, batch_size: int = 2) -> Path:
    """The same build as `build_args`, uninterrupted and in this process, on one thread as `cli_env` runs the CLI.

    Its encoder spec names `delay` as the build it stands for did (the metadata records it), but does not sleep.
    """
    image = {"class_path": SLOW_ENCODER, "init_args": {"latent_channels": 4, "delay": delay}}
    text = {"class_path": DEMO_SPECS[1]["class_path"], "init_args": {"dim": 8, "max_length": 32}}
    SlowDemoImageEncoder.awake = True
    try:
        with torch_threads(1):
            build_cache(
                out, JsonlManifestSource(manifest), image, text, BuildOptions(resize=CLI_RESIZE, batch_size=batch_size)
            )
    finally:
        SlowDemoImageEncoder.awake = False
    return out
