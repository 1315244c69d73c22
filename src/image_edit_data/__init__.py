"""image-edit-data: cached instruction-based image-edit data for diffusion training in Lightning.

The data path: a cache (metadata.json + JSON shards + one payload per sample) is opened into a
compact columnar index (`index`); `ImageEditDataset` loads and validates payloads; a bucket
batch sampler plans each epoch so every batch holds one compound shape signature and every rank
gets the same number of batches; `collate_image_edit` stacks a batch; `ImageEditDataModule`
wires it all into Lightning with exact resume.
"""

from .batch.collate import collate_image_edit
from .dataset import ImageEditDataset, ImageEditDatasetConfig
from .errors import CacheFormatError
from .lightning.datamodule import ImageEditDataModule
from .lightning.monitor import ImageEditDataMonitor
from .loader import DiffusionDataloaderBuild, ImageEditDataloaderConfig
from .payload.corrupt import TooManyCorruptSamplesError
from .sampling.sampler import BucketBatchSampler, ResumeMismatchError

__all__ = [
    "BucketBatchSampler",
    "CacheFormatError",
    "DiffusionDataloaderBuild",
    "ImageEditDataModule",
    "ImageEditDataMonitor",
    "ImageEditDataloaderConfig",
    "ImageEditDataset",
    "ImageEditDatasetConfig",
    "ResumeMismatchError",
    "TooManyCorruptSamplesError",
    "collate_image_edit",
]
