"""image-edit-data: cached instruction-based image-edit data for diffusion training in Lightning.

The data path: a cache (metadata.json + JSON shards + one payload per sample) is opened into a
compact columnar index (`index/`); `ImageEditDataset` loads and validates payloads (`payload/`,
`contract/`); a bucket batch sampler plans each epoch so every batch holds one compound shape
signature and every rank gets the same number of batches (`sampling/`); `collate_image_edit`
stacks a batch (`batch/`); `ImageEditDataModule` wires it all into Lightning with exact resume
(`lightning/`).

The Lightning-side names are imported on first use, so the data path loads without Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _moved
from .batch.collate import collate_image_edit
from .dataloader_config import DiffusionDataloaderBuild, ImageEditDataloaderConfig
from .dataset import ImageEditDataset, ImageEditDatasetConfig
from .errors import CacheFormatError, CacheReadError
from .mixture_dataset import CacheSource, MixtureDataset
from .payload.corrupt import TooManyCorruptSamplesError
from .sampling.sampler import BucketBatchSampler, ResumeMismatchError
from .storage.remote import RemoteError, RequestPolicy

_moved.install()

if TYPE_CHECKING:
    from .lightning.datamodule import ImageEditDataModule
    from .lightning.monitor import ImageEditDataMonitor

_LIGHTNING_NAMES = {
    "ImageEditDataModule": "image_edit_data.lightning.datamodule",
    "ImageEditDataMonitor": "image_edit_data.lightning.monitor",
}

__all__ = [
    "BucketBatchSampler",
    "CacheFormatError",
    "CacheReadError",
    "CacheSource",
    "DiffusionDataloaderBuild",
    "ImageEditDataModule",
    "ImageEditDataMonitor",
    "ImageEditDataloaderConfig",
    "ImageEditDataset",
    "ImageEditDatasetConfig",
    "MixtureDataset",
    "RemoteError",
    "RequestPolicy",
    "ResumeMismatchError",
    "TooManyCorruptSamplesError",
    "collate_image_edit",
]


def __getattr__(name: str) -> Any:
    """Import a Lightning-side name on first use (and keep it, so this runs once per name)."""
    module = _LIGHTNING_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
