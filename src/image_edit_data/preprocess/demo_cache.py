"""The procedural demo cache: demo edits through the weight-free demo encoders, no downloads, CPU only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..payload.payload import PayloadFormat
from .run.build_cache import BuildOptions, BuildReport, build_cache
from .run.resize import ResizePolicy
from .sources.base import SequenceSource
from .sources.demo import DemoSource

DEMO_IMAGE_ENCODER = {"class_path": "image_edit_data.preprocess.encoders.demo.DemoImageEncoder", "init_args": {}}
DEMO_TEXT_ENCODER = {"class_path": "image_edit_data.preprocess.encoders.demo.DemoTextEncoder", "init_args": {}}


def write_demo_cache(
    directory: str | Path,
    num_samples: int = 2000,
    seed: int = 0,
    payload_format: PayloadFormat = "pt",
    batch_size: int = 32,
    on_progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> BuildReport:
    """Write (or finish) a demo cache of `num_samples` edits at `directory`; the same seed gives the same cache."""
    source = SequenceSource(DemoSource(num_samples, seed), {"kind": "demo", "seed": seed})
    # Demo images are generated at multiples of 16 px, so they need no resizing.
    options = BuildOptions(
        payload_format=payload_format, resize=ResizePolicy("none", spatial_alignment=16), batch_size=batch_size
    )
    return build_cache(
        directory, source, DEMO_IMAGE_ENCODER, DEMO_TEXT_ENCODER, options, on_progress=on_progress, log=log
    )
