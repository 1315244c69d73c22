"""Where a cache build reads raw edit examples: the source interface, a JSONL manifest, an HF data set, the demo.

The trainers' layouts (musubi-tuner, ai-toolkit, SimpleTuner, DiffSynth-Studio) open through their own modules.
"""

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
