"""Where a cache build reads raw edit examples: the source interface, a JSONL manifest, an HF data set, the demo."""

from .base import BadSampleError, EditSource, SequenceSource, SourceRecord
from .demo import DemoSource
from .hf import ColumnMap, HFDatasetSource
from .manifest import JsonlManifestSource
from .records import RawEditSample

__all__ = [
    "BadSampleError",
    "ColumnMap",
    "DemoSource",
    "EditSource",
    "HFDatasetSource",
    "JsonlManifestSource",
    "RawEditSample",
    "SequenceSource",
    "SourceRecord",
]
