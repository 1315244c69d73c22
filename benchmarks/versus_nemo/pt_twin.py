"""A `.pt` twin of a safetensors cache, for a loader that reads `.pt` payloads only (NeMo Automodel's).

The twin's index holds the cache's records in its order, each naming a `.pt` copy of its payload;
the copies are written only for the samples a measurement will read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from image_edit_data.bench.synthetic import write_index
from image_edit_data.index.index import CacheIndex
from image_edit_data.payload.payload import load_payload, save_payload


def pt_name(relative: str) -> str:
    """The twin's name for a payload: the same path ending in `.pt`."""
    return str(PurePosixPath(relative).with_suffix(".pt"))


def write_pt_twin_index(index: CacheIndex, twin: Path) -> None:
    """The records of `index`, in its order, naming `.pt` payloads under `twin` (written by `convert_payloads`)."""
    records = (
        {"cache_file": pt_name(index.relative_path(i)), "compound_bucket_signature": index.signature(i).to_json()}
        for i in range(len(index))
    )
    write_index(twin, records, {"pt_twin_of": str(index.root)})


def convert_payloads(index: CacheIndex, twin: Path, samples: Iterable[int]) -> None:
    """Write each sample's payload as `.pt` into the twin, unless it is there already."""
    for i in samples:
        relative = index.relative_path(i)
        target = twin / pt_name(relative)
        if not target.exists():
            save_payload(target, _owned(load_payload(index.payload_path(i), relative)))


def _owned(value: Any) -> Any:
    """`value` with every tensor copied out of the file it maps, so saving it writes only its own bytes."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _owned(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_owned(item) for item in value]
    return value
