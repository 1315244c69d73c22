"""Raw edit examples for the build benches: a JSONL manifest of photo-sized images, made once per setting and reused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def photo_like(size: tuple[int, int], seed: int) -> Image.Image:
    """An RGB image with smooth shapes and fine grain, so JPEG and PNG decode at about a photo's cost per pixel."""
    rng = np.random.default_rng(seed)
    width, height = size
    coarse = rng.integers(0, 256, (height // 64 + 2, width // 64 + 2, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def edit_manifest(root: Path, samples: int, size: tuple[int, int], image_format: str = "jpeg") -> Path:
    """`samples` lines (a target and one context each) under `root/<W>x<H>-<format>`; images made only when missing."""
    directory = root / f"{size[0]}x{size[1]}-{image_format}"
    images = directory / "images"
    images.mkdir(parents=True, exist_ok=True)
    suffix = {"jpeg": "jpg", "png": "png", "webp": "webp"}[image_format]
    lines = []
    for i in range(samples):
        names = {}
        for role, seed in (("target", 2 * i), ("context", 2 * i + 1)):
            path = images / f"{i:06d}_{role}.{suffix}"
            if not path.exists():
                photo_like(size, seed).save(path, **({"quality": 90} if image_format == "jpeg" else {}))
            names[role] = f"images/{path.name}"
        media = [{"role": "target", "file_name": names["target"]}, {"role": "context", "file_name": names["context"]}]
        lines.append({"id": f"b{i:06d}", "prompt": f"make edit number {i}", "media": media})
    manifest = directory / f"edits-{samples}.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest
