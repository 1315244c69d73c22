"""Data sets in the trainers' own layouts (musubi-tuner, ai-toolkit, DiffSynth-Studio), drawn here, and the
manifest that says the same thing, for the claims that both build the same cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from image_edit_data import ImageEditDataset
from image_edit_data.preprocess.cli import cache_main
from support.builds import DEMO_SPECS, drawing, write_lines
from support.caches import same_samples

RESIZE_ARGS = ["--max-pixels", "1024", "--spatial-alignment", "16", "--upscale"]
SIZES = ((40, 24), (24, 40), (32, 32))


def image(path: Path, seed: int, size: tuple[int, int] | None = None) -> Path:
    """A small drawn image at `path` (format from its extension), differing by seed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    drawing(size or SIZES[seed % len(SIZES)], seed).save(path)
    return path


def text(path: Path, content: str) -> Path:
    """A caption file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")
    return path


def build(out: Path, *source: str, expect: int = 0, batch_size: int = 2) -> Path:
    """`cache build OUT <source options>` in this process with the demo encoders; asserts its exit code.

    Builds compared bit for bit that group images differently (ranks against one process) take `batch_size=1`:
    a float result repeats only at the same shapes (CONTRIBUTING.md, "Floating-point comparisons").
    """
    args = [
        "build",
        str(out),
        *source,
        "--image-encoder",
        DEMO_SPECS[0]["class_path"],
        "--text-encoder",
        DEMO_SPECS[1]["class_path"],
        "--text-encoder.dim",
        "8",
        "--batch-size",
        str(batch_size),
        "--num-workers",
        "1",
        "--quiet",
        *RESIZE_ARGS,
    ]
    assert cache_main(args) == expect
    return out


def manifest(path: Path, samples: Sequence[tuple[str, str, Path, Sequence[Path]]], metadata: Any = None) -> Path:
    """A JSONL manifest of (id, prompt, target, contexts) with absolute file names, in the given order."""
    lines = []
    for i, (sample_id, prompt, target, contexts) in enumerate(samples):
        media = [{"role": "target", "file_name": str(target)}]
        media += [{"role": "context", "file_name": str(c)} for c in contexts]
        line: dict[str, Any] = {"id": sample_id, "prompt": prompt, "media": media}
        if metadata is not None:
            line["metadata"] = metadata[i]
        lines.append(line)
    return write_lines(path, lines)


def assert_same_cache(a: Path, b: Path, *, media: bool = True) -> None:
    """Both caches hold equal samples (tensors and metadata) in the same order; `media=False` leaves out the
    file names (a reference made of edited copies of the files names the copies)."""
    first, second = ImageEditDataset(a), ImageEditDataset(b)
    assert len(first) > 0
    if media:
        same_samples(first, second)
        return
    assert len(first) == len(second)
    for i in range(len(first)):
        x, y = first[i], second[i]
        for key in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
            assert torch.equal(x[key], y[key]), (i, key)
        assert all(torch.equal(p, q) for p, q in zip(x["context_latents"], y["context_latents"], strict=True)), i
        assert {k: v for k, v in x["metadata"].items() if k != "media"} == {
            k: v for k, v in y["metadata"].items() if k != "media"
        }
