"""Raw image-edit data for cache builds: edit, text-to-image and masked manifest rows, and a demo-encoder build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.resize import ResizePolicy
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

from .builds import DEMO_SPECS, drawing, write_lines

KEEP = ResizePolicy("none", spatial_alignment=16)


PROMPTS = ["a red circle on grey", "make the sky red", "a blue square", "add a cat", "a green triangle"]


def mixed_manifest(root: Path, rows: int = 5) -> Path:
    """Even lines are text-to-image rows (a target only), odd lines edits with one context; all images 32x32."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        drawing((32, 32), i).save(root / "images" / f"{i}_tgt.png")
        media = [{"role": "target", "file_name": f"images/{i}_tgt.png"}]
        if i % 2:
            drawing((32, 32), i + 50).save(root / "images" / f"{i}_src.png")
            media.append({"role": "context", "file_name": f"images/{i}_src.png"})
        lines.append({"id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)], "media": media})
    return write_lines(root / "rows.jsonl", lines)


def band(size: tuple[int, int], left: int, right: int) -> Image.Image:
    """A black mask, white (edited) over columns [left, right)."""
    mask = Image.new("L", size, 0)
    mask.paste(255, (left, 0, right, size[1]))
    return mask


def masked_manifest(root: Path, masked: tuple[int, ...] = (0, 1), rows: int = 4) -> Path:
    """`rows` one-context edits of 32x32 images; rows in `masked` carry a mask white over the left 8 columns."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    band((32, 32), 0, 8).save(root / "images" / "mask.png")
    lines = []
    for i in range(rows):
        drawing((32, 32), i).save(root / "images" / f"{i}_tgt.png")
        drawing((32, 32), i + 50).save(root / "images" / f"{i}_src.png")
        media = [
            {"role": "context", "file_name": f"images/{i}_src.png"},
            {"role": "target", "file_name": f"images/{i}_tgt.png"},
        ]
        if i in masked:
            media.append({"role": "mask", "file_name": "images/mask.png"})
        lines.append({"id": f"m{i}", "prompt": f"make the sky red {i}", "media": media})
    return write_lines(root / "rows.jsonl", lines)


def build(manifest: Path, out: Path, **options: Any) -> Any:
    """Build `manifest` into cache `out` with the demo encoders, image sizes kept; the build report."""
    source = JsonlManifestSource(manifest)
    return build_cache(out, source, *DEMO_SPECS, BuildOptions(resize=KEEP, num_workers=1, **options))


def text_to_image_manifest(root: Path, rows: int = 4) -> Path:
    """`rows` text-to-image rows (a 32x32 target, no context)."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        drawing((32, 32), i + 100).save(root / "images" / f"{i}_tgt.png")
        media = [{"role": "target", "file_name": f"images/{i}_tgt.png"}]
        lines.append({"id": f"t{i}", "prompt": PROMPTS[i % len(PROMPTS)], "media": media})
    return write_lines(root / "rows.jsonl", lines)
