"""The raw record a cache source yields: one edit example before any encoder has touched it.

Sources (the demo generator, folder or dataset readers) produce these; the cache builder encodes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import PIL.Image


@dataclass(frozen=True)
class RawEditSample:
    """One raw image-edit example before encoding."""

    sample_id: str
    prompt: str
    target: PIL.Image.Image  # RGB
    contexts: tuple[PIL.Image.Image, ...]  # ordered, RGB; may differ in size from target; empty: a text-to-image row
    metadata: Mapping[str, Any] = field(default_factory=dict)  # JSON-serialisable provenance
    conditions: tuple[PIL.Image.Image, ...] = ()  # ordered RGB images a prompt encoder may look at; not VAE-encoded
    mask: PIL.Image.Image | None = None  # the edited region, white = edited, pixel for pixel over the target
