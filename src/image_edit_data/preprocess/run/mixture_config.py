"""The mixture config (`data: sources:`) for the caches built from a trainer's config, weighted as it repeats them.

A trainer that repeats data set i `r_i` times per epoch shows `n_i * r_i` of its samples per epoch, a share
of `n_i r_i / sum(n r)`. The mixture gives source i the weight `n_i * r_i` and draws `sum(n r)` samples per
epoch (`samples_per_epoch`), so each source's share and the epoch's length are the trainer's
(docs/mixtures.md: source i draws `N * w_i / sum(w)` samples).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..._atomic import write_text_atomic


@dataclass(frozen=True)
class BuiltDataset:
    """A cache built from one data set of a trainer's config."""

    name: str
    cache_dir: Path
    samples: int  # samples in the cache (bad ones skipped are not among them)
    repeats: int
    why: str  # e.g. "num_repeats 2"


def mixture_yaml(datasets: Sequence[BuiltDataset], origin: str) -> str:
    """The text of a LightningCLI `data:` section training on `datasets` with the trainer's shares."""
    kept = [d for d in datasets if d.samples > 0]
    if not kept:
        raise ValueError(f"{origin}: every data set came out empty; there is nothing to train on")
    lines = [
        f"# Caches built from {origin}, one per data set, weighted as the trainer repeats them:",
        "# weight = samples x repeats; samples_per_epoch = their sum, the trainer's epoch (docs/building-caches.md).",
        "data:",
        "  sources:",
    ]
    for d in kept:
        lines += [
            f"    - cache_dir: {json.dumps(str(d.cache_dir))}",
            f"      name: {json.dumps(d.name)}",
            f"      weight: {d.samples * d.repeats}  # {d.samples} samples x {d.why}",
        ]
    lines += [f"    # {d.name}: no samples, left out" for d in datasets if d.samples == 0]
    lines.append(f"  samples_per_epoch: {sum(d.samples * d.repeats for d in kept)}")
    return "\n".join(lines) + "\n"


def write_mixture(path: Path, datasets: Sequence[BuiltDataset], origin: str) -> Path:
    """Write `mixture_yaml(datasets, origin)` to `path` atomically and return it."""
    write_text_atomic(path, mixture_yaml(datasets, origin))
    return path
