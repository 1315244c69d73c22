"""The reference loader for `image-edit-data bench --compare-reference`: NVIDIA NeMo Automodel's image-edit loader.

It is imported only when asked for and only if it is installed (or unpacked in `--reference-path`):
it is no dependency of this package, and nothing is downloaded. It reads NeMo's `.pt` payloads
only, so a safetensors cache reaches it as a `.pt` twin: the same records, naming `.pt` copies of
the payloads it is about to read.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import sys
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import torch

from ..index.index import CacheIndex
from ..payload.payload import load_payload, save_payload
from .synthetic import write_index

REFERENCE_MODULE = "nemo_automodel.components.datasets.diffusion.image_edit_dataset"
INSTALL = "pip install --no-deps nemo-automodel"


def import_reference(path: str | None) -> ModuleType:
    """The reference's image-edit dataset module, from sys.path or `path`; a sentence on how to get it if absent."""
    if path is not None:
        if not Path(path).is_dir():
            raise ValueError(f"--reference-path: {path} is not a directory")
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module(REFERENCE_MODULE)
    except ImportError as error:
        where = f" (sys.path and {path})" if path else ""
        raise ValueError(
            f"--compare-reference: cannot import the reference loader {REFERENCE_MODULE}{where}: {error}. "
            f"Install it with `{INSTALL}` (it needs only torch and torchdata, which are here already), "
            "or unpack its wheel into a directory and pass --reference-path DIR"
        ) from None


def reference_version() -> str:
    """The installed reference's version, as its distribution states it."""
    try:
        return importlib.metadata.version("nemo_automodel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_reference(
    module: ModuleType, cache_dir: Path, num_workers: int, prefetch_factor: int, batch_size: int
) -> Any:
    """The reference's loader as its users build it (a `DiffusionDataloaderBuild`), at epoch 0."""
    config = module.ImageEditDataloaderConfig(
        cache_dir=str(cache_dir), num_workers=num_workers, prefetch_factor=prefetch_factor
    )
    build = config.build(dp_rank=0, dp_world_size=1, batch_size=batch_size)
    build.sampler.set_epoch(0)
    return build


def reference_plan(sampler: Iterable[list[int]], count: int) -> list[list[int]]:
    """The first `count` batches the reference's sampler yields (it replans from scratch on each `iter`)."""
    return [list(batch) for batch in itertools.islice(iter(sampler), count)]


def reference_files(dataset: Any, samples: Iterable[int]) -> dict[int, Path]:
    """Payload file of each sample of the reference's dataset."""
    root = Path(dataset.cache_dir)
    return {i: root / str(dataset.metadata[i]["cache_file"]) for i in samples}


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
